"""Makes a ``"smartinf"`` block in a DeepSpeed config take effect wherever
``deepspeed.initialize`` is called: by the transformers ``Trainer``, by Accelerate, or by
a script, with no smartinf code but the package being installed.

``deepspeed.initialize`` is wrapped once, when DeepSpeed is imported (``install`` runs
from ``import smartinf`` and, through the ``_smartinf_autoload.pth`` file the wheel puts
in site-packages, at interpreter start, so the block is never silently ignored). The
wrapper hands calls whose config holds the block, or whose optimizer is a
``smartinf.optim`` one, to :func:`smartinf.integrations.deepspeed.initialize`, which calls
the original function; every other call goes straight to DeepSpeed.

Accelerate (under the transformers ``Trainer`` too) reads every ``"auto"`` in a DeepSpeed
config as a placeholder for one of its own arguments and refuses those it has none for,
so ``"state_dtype": "auto"`` in the block would stop a Trainer run before it starts. When
``accelerate.utils.dataclasses`` is imported, its ``DeepSpeedPlugin.fill_match`` is
wrapped to leave the block's keys to smartinf. Nothing here imports DeepSpeed or
Accelerate.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Any

CONFIG_KEY = "smartinf"
#: named, not imported: this module runs at interpreter start (the .pth) and imports neither
#: DeepSpeed nor the integration, which imports both (and this module, for CONFIG_KEY)
INTEGRATION = "smartinf.integrations.deepspeed"


def install() -> None:
    """Patches each module of ``PATCHES`` now if it is imported, else when it is."""
    for name, patch_module in PATCHES.items():
        if name in sys.modules:
            patch_module(sys.modules[name])
    waiting = any(name not in sys.modules for name in PATCHES)
    if waiting and not any(getattr(f, "smartinf_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())


def patch_accelerate(dataclasses: Any) -> None:
    """Accelerate's placeholder filling leaves the ``"smartinf"`` block alone."""
    plugin = getattr(dataclasses, "DeepSpeedPlugin", None)
    original = getattr(plugin, "fill_match", None)
    if original is None or hasattr(original, "__wrapped__"):
        return

    @functools.wraps(original)
    def fill_match(self: Any, ds_key_long: str, *args: Any, **kwargs: Any) -> Any:
        if ds_key_long.startswith(CONFIG_KEY + "."):
            return None  # smartinf's own "auto"s: not Accelerate's arguments
        return original(self, ds_key_long, *args, **kwargs)

    plugin.fill_match = fill_match


def patch(deepspeed: Any) -> None:
    original = getattr(deepspeed, "initialize", None)
    if original is None or hasattr(original, "__wrapped__"):
        return  # partially imported, or wrapped already

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if _wants_smartinf(args, kwargs):  # (DeepSpeed is loaded: the integration may be)
            return importlib.import_module(INTEGRATION).initialize(*args, **kwargs)
        return original(*args, **kwargs)

    deepspeed.initialize = initialize


def original_initialize(deepspeed: Any) -> Any:
    """DeepSpeed's own ``initialize``, whether wrapped here or not."""
    return getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)


def config_of(args: Any, kwargs: dict) -> Any:
    """The config of a ``deepspeed.initialize`` call, as DeepSpeed finds it: ``config``,
    ``config_params`` or ``args.deepspeed_config`` (a dict, or a path to JSON)."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    given = kwargs.get("args", args[0] if args else None)
    return getattr(given, "deepspeed_config", None) or getattr(given, "deepscale_config", None)


def _wants_smartinf(args: Any, kwargs: dict) -> bool:
    optimizer = kwargs.get("optimizer")
    if type(optimizer).__module__.startswith("smartinf.optim"):
        return True  # refused there with what to do instead
    config = config_of(args, kwargs)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            try:
                config = json.load(f)
            except ValueError:
                return False  # DeepSpeed reports it
    return isinstance(config, dict) and CONFIG_KEY in config


_finding = False  # inside find_and_patch: the other finders answer


def find_and_patch(name: str) -> Any:
    """The import spec of module ``name`` (one of ``PATCHES``) from the other finders, made
    to patch the module once it is executed (a post-import hook). A spec asked for without
    an import (an availability probe) is dropped, and the next one asked for is made the
    same way."""
    global _finding
    if _finding or name not in PATCHES:
        return None
    _finding = True
    try:
        spec = importlib.util.find_spec(name)
    finally:
        _finding = False
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    execute = spec.loader.exec_module

    def exec_module(module: Any) -> None:
        execute(module)
        if all(n in sys.modules for n in PATCHES):  # every one patched: the finders go
            sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "smartinf_hook", False)]
        PATCHES[name](module)

    spec.loader.exec_module = exec_module
    return spec


PATCHES = {"deepspeed": patch, "accelerate.utils.dataclasses": patch_accelerate}


class _OnImport(importlib.abc.MetaPathFinder):
    smartinf_hook = True

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        return find_and_patch(name)
