"""The broadcast family (torch's broadcast): one module per algorithm, registered at
import like all-reduce's."""
from __future__ import annotations

from ..registry import Registry
from .base import BroadcastAlgorithm

REGISTRY = Registry("broadcast", BroadcastAlgorithm, "broadcast ")
register, names, get, for_device = REGISTRY.api()
REGISTRY.discover(__name__, __path__)

__all__ = ["BroadcastAlgorithm", "REGISTRY", "register", "names", "get", "for_device"]
