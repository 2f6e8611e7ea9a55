"""The algorithm registries, one per collective. The all-reduce family is this
package's own modules; every other collective is a sub-package with its own registry
(all_gather/, reduce_scatter/, broadcast/, ...). Every module that defines ALGORITHM is registered at import, and
the API, hooks, CLI, benches and tests all iterate the registries."""
from __future__ import annotations

import importlib

from commlab.core.collectives import COLLECTIVES
from commlab.core.errors import UnsupportedError

from .base import Algorithm, Context, Cost, Traffic
from .registry import Registry

REGISTRY = Registry("all_reduce", Algorithm)
register, names, get, for_device = REGISTRY.api()

REGISTRY.discover(__name__, __path__)


def registry(collective: str) -> Registry:
    """The registry of a collective's family."""
    if collective == "all_reduce":
        return REGISTRY
    if collective not in COLLECTIVES:
        raise UnsupportedError(f"commlab: unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    return importlib.import_module(f"{__name__}.{collective}").REGISTRY

__all__ = ["Algorithm", "Context", "Cost", "Traffic", "Registry", "REGISTRY", "register", "names", "get",
           "for_device", "COLLECTIVES", "registry"]
