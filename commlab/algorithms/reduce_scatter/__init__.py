"""The reduce-scatter family (torch's reduce_scatter_tensor): one module per algorithm,
registered at import like all-reduce's."""
from __future__ import annotations

from ..registry import Registry
from .base import ReduceScatterAlgorithm

REGISTRY = Registry("reduce_scatter", ReduceScatterAlgorithm, "reduce_scatter ")
register, names, get, for_device = REGISTRY.api()
REGISTRY.discover(__name__, __path__)

__all__ = ["ReduceScatterAlgorithm", "REGISTRY", "register", "names", "get", "for_device"]
