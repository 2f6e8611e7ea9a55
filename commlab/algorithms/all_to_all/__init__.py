"""The all-to-all family (torch's all_to_all_single, uneven splits included): one module per algorithm,
registered at import like all-reduce's."""
from __future__ import annotations

from ..registry import Registry
from .base import AllToAllAlgorithm

REGISTRY = Registry("all_to_all", AllToAllAlgorithm, "all_to_all ")
register, names, get, for_device = REGISTRY.api()
REGISTRY.discover(__name__, __path__)

__all__ = ["AllToAllAlgorithm", "REGISTRY", "register", "names", "get", "for_device"]
