"""The algorithm registries, one per collective: each collective is a sub-package
(all_reduce/, all_gather/, reduce_scatter/, broadcast/, all_to_all/) with one module
per algorithm, registered at import; what the families share (the base classes, the
registry, folding onto a power of two, host layouts, the tuning file, the shared-memory
and auto members) sits here beside them. The API, hooks, CLI, benches and tests all
iterate the registries; all-reduce's is also this package's own (names, get, ...)."""
from __future__ import annotations

import importlib

from commlab.core.collectives import COLLECTIVES
from commlab.core.errors import UnsupportedError

from . import scheduled  # noqa: F401  (makes "msccl:PATH" members of every family)
from .all_reduce import REGISTRY, for_device, get, names, register
from .base import Algorithm, Context, Cost, Traffic
from .registry import Registry


def registry(collective: str) -> Registry:
    """The registry of a collective's family."""
    if collective not in COLLECTIVES:
        raise UnsupportedError(f"commlab: unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    return importlib.import_module(f"{__name__}.{collective}").REGISTRY


__all__ = ["Algorithm", "Context", "Cost", "Traffic", "Registry", "REGISTRY", "register", "names", "get",
           "for_device", "COLLECTIVES", "registry"]
