"""The algorithm registry: every module in this package that defines ALGORITHM is
registered at import, and the API, hooks, CLI, benches and tests all iterate it."""
from __future__ import annotations

import importlib
import pkgutil

from commlab.core.errors import UnsupportedError

from .base import Algorithm, Context, Cost, Traffic

_REGISTRY: dict[str, Algorithm] = {}


def register(alg: Algorithm) -> Algorithm:
    if not alg.name or alg.name in _REGISTRY:
        raise ValueError(f"commlab: cannot register algorithm {alg.name!r} (empty or taken)")
    _REGISTRY[alg.name] = alg
    return alg


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        alg = getattr(module, "ALGORITHM", None)
        if alg is not None:
            register(alg)


def names() -> list[str]:
    return [a.name for a in sorted(_REGISTRY.values(), key=lambda a: (a.order, a.name))]


def get(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnsupportedError(
            f"commlab: unknown algorithm {name!r}; registered: {', '.join(names())}"
        ) from None


def for_device(device_type: str) -> list[str]:
    return [n for n in names() if device_type in _REGISTRY[n].devices]


_discover()

__all__ = ["Algorithm", "Context", "Cost", "Traffic", "register", "names", "get", "for_device"]
