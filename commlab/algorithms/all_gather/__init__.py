"""The all-gather family (torch's all_gather_into_tensor): one module per algorithm,
registered at import like all-reduce's."""
from __future__ import annotations

from ..registry import Registry
from .base import AllGatherAlgorithm

REGISTRY = Registry("all_gather", AllGatherAlgorithm, "all_gather ")
register, names, get, for_device = REGISTRY.api()
REGISTRY.discover(__name__, __path__)

__all__ = ["AllGatherAlgorithm", "REGISTRY", "register", "names", "get", "for_device"]
