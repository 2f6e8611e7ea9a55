"""The all-reduce family (torch's all_reduce, in place): one module per algorithm,
registered at import like every other family's."""
from __future__ import annotations

from ..base import Algorithm
from ..registry import Registry

REGISTRY = Registry("all_reduce", Algorithm)
register, names, get, for_device = REGISTRY.api()
REGISTRY.discover(__name__, __path__)

__all__ = ["Algorithm", "REGISTRY", "register", "names", "get", "for_device"]
