"""Run at interpreter start by ``_smartinf_autoload.pth``: a ``"smartinf"`` block in a
DeepSpeed config takes effect even where the script never imports smartinf. It only
registers a hook on the import of ``deepspeed`` and of ``accelerate.utils.dataclasses``
(see smartinf.integrations.deepspeed_hook);
``SMARTINF_AUTOLOAD=0`` turns it off."""
import os
import sys


def _install() -> None:
    if os.environ.get("SMARTINF_AUTOLOAD", "1") == "0":
        return
    import importlib.abc  # noqa: PLC0415

    class _Deferred(importlib.abc.MetaPathFinder):
        """Imports the real hook only when a module it patches is looked for."""

        smartinf_hook = True

        def find_spec(self, name, path, target=None):
            if name not in ("deepspeed", "accelerate.utils.dataclasses"):  # deepspeed_hook.PATCHES
                return None
            try:
                from smartinf.integrations import deepspeed_hook  # noqa: PLC0415
            except Exception as e:  # a broken smartinf must not break DeepSpeed: say so
                sys.meta_path.remove(self)
                import warnings  # noqa: PLC0415
                warnings.warn(f"smartinf is installed but cannot be imported ({e!r}): a "
                              f'"smartinf" block in a DeepSpeed config will be ignored')
                return None
            return deepspeed_hook.find_and_patch(name)

    sys.meta_path.insert(0, _Deferred())


_install()
