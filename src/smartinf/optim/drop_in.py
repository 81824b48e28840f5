"""``smartinf.optim``'s class for a rule row that names a torch optimizer (``torch_name``)
and has none written in optim/__init__.py: torch's signature and defaults, the states on the
devices. A new rule's Python is then its row in update_rules.py."""
from __future__ import annotations

import inspect
from typing import Any, Iterable, Optional, Sequence


def drop_in(rule_class: type, base: type) -> type:
    """A subclass of ``base`` (optim's ``_StorageOptimizer``) taking ``torch.optim.<torch_name>``'s
    hyper-parameters, positional ones by position (the keyword-only ones, such as
    ``maximize``, pass through as for the classes written out), ``devices`` and the storage
    options by keyword."""
    import torch

    torch_class = getattr(torch.optim, rule_class.torch_name)
    given = inspect.signature(torch_class.__init__).parameters
    names = [p.name for p in list(given.values())[2:] if p.kind is p.POSITIONAL_OR_KEYWORD]

    def __init__(self: Any, params: Iterable, *args: Any,
                 devices: Optional[Sequence[Any]] = None, **options: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes {len(names)} hyper-parameters by "
                            f"position ({', '.join(names)}), got {len(args)}")
        hyper = dict(zip(names, args))
        hyper.update({k: options.pop(k) for k in names if k in options})
        base.__init__(self, params, hyper, devices=devices, **options)

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         *[p for p in given.values() if p.name != "self" and p.kind is not p.VAR_KEYWORD],
         inspect.Parameter("devices", inspect.Parameter.KEYWORD_ONLY, default=None),
         inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)])
    return type(rule_class.__name__, (base,), {
        "__init__": __init__, "__module__": base.__module__, "torch_class": torch_class,
        "rule_class": rule_class,
        "__doc__": f"``torch.optim.{rule_class.torch_name}`` with its states on near-storage "
                   f"devices. {' '.join((rule_class.__doc__ or '').split())}"})
