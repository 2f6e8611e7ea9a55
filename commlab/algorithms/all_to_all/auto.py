"""The default all-to-all: decided once per group from facts every rank shares (its host
ids): shared memory when every CPU rank is on one host; across hosts, per call, Bruck
while the largest block is small and pairwise exchange above (MPICH's switch; the API
agreed on every rank's counts first, so every rank picks alike); the backend's own on
GPUs."""
from __future__ import annotations

from ..family_auto import FamilyAuto
from .base import AllToAllAlgorithm

SHORT = 1 << 10  # bytes per block below which Bruck's fewer steps pay for its ~log2(p)/2 more bytes


class Auto(FamilyAuto, AllToAllAlgorithm):
    family = "all_to_all"
    summary = "shm when every rank is on one host (CPU), else bruck (blocks < 1 KiB) or pairwise; GPU: builtin"

    def choose(self, inp, ctx, layout):
        return self.registry().get("shm") if layout.one_host else self

    def run(self, out, inp, counts, ctx):
        alg = self.pick(inp, ctx)
        if alg is self:
            alg = self.registry().get("bruck" if counts.biggest() * inp.element_size() < SHORT else "pairwise")
        alg.run(out, inp, counts, ctx)


ALGORITHM = Auto()
