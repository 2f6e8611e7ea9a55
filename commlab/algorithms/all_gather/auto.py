"""The default all-gather: decided once per group from facts every rank shares (its
host ids): shared memory when every CPU rank is on one host, hier across hosts where
some host has several ranks, else the ring (bandwidth-optimal; the sizes FSDP gathers
are large); the backend's own on GPUs. One pick per group, whatever the size, so a
size mismatch can never straddle two algorithms."""
from __future__ import annotations

from ..family_auto import FamilyAuto
from .base import AllGatherAlgorithm


class Auto(FamilyAuto, AllGatherAlgorithm):
    family = "all_gather"
    summary = "shm when every rank is on one host (CPU), hier across hosts, ring with one rank per host; GPU: builtin"

    def choose(self, out, ctx, layout):
        name = ("shm" if layout.one_host else "hier") if layout.shared else "ring"
        return self.registry().get(name)

    def run(self, out, inp, ctx):
        self.pick(out, ctx).run(out, inp, ctx)


ALGORITHM = Auto()
