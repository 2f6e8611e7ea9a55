"""The default broadcast: decided once per group from facts every rank shares (its host
ids): shared memory when every CPU rank is on one host; across hosts, per call, the
binomial tree below 512 KiB and scatter + all-gather above (MPICH's switch; the API
agreed on the call's size first, so every rank picks alike); the backend's own on GPUs."""
from __future__ import annotations

from ..family_auto import FamilyAuto
from .base import BroadcastAlgorithm

LONG = 512 << 10


class Auto(FamilyAuto, BroadcastAlgorithm):
    family = "broadcast"
    summary = "shm when every rank is on one host (CPU), else binomial (< 512 KiB) or scatter_allgather; GPU: builtin"

    def choose(self, buf, ctx, layout):
        return self.registry().get("shm") if layout.one_host else self

    def run(self, buf, root, ctx):
        alg = self.pick(buf, ctx)
        if alg is self:
            alg = self.registry().get("binomial" if buf.numel() * buf.element_size() < LONG else "scatter_allgather")
        alg.run(buf, root, ctx)


ALGORITHM = Auto()
