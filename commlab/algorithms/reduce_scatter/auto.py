"""The default reduce-scatter: decided once per group from facts every rank shares (its
host ids): shared memory when every CPU rank is on one host, hier across hosts where
some host has several ranks, else the ring (bandwidth-optimal; the sizes FSDP reduces
are large); the backend's own on GPUs. One pick per group, whatever the size, so a size
mismatch can never straddle two algorithms."""
from __future__ import annotations

from commlab.core.reduction import SUPPORTED_DTYPES

from ..family_auto import FamilyAuto
from .base import ReduceScatterAlgorithm


class Auto(FamilyAuto, ReduceScatterAlgorithm):
    family = "reduce_scatter"
    summary = "shm when every rank is on one host (CPU), hier across hosts, ring with one rank per host; GPU: builtin"

    def choose(self, inp, ctx, layout):
        shared = layout.shared and inp.dtype in SUPPORTED_DTYPES  # shared memory reduces these
        name = ("shm" if layout.one_host else "hier") if shared else "ring"
        return self.registry().get(name)

    def run(self, out, inp, op, ctx):
        self.pick(inp, ctx).run(out, inp, op, ctx)


ALGORITHM = Auto()
