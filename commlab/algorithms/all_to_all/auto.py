"""The default all-to-all: decided once per group from facts every rank shares (its host
ids): shared memory when every CPU rank is on one host; across hosts, per call, Bruck
while the largest block is small and pairwise exchange above (MPICH's switch; the API
agreed on every rank's counts first, so every rank picks alike); the backend's own on
GPUs."""
from __future__ import annotations

from commlab.transports import shm
from commlab.transports.setup import host_ids

from .base import AllToAllAlgorithm

SHORT = 1 << 10  # bytes per block below which Bruck's fewer steps pay for its ~log2(p)/2 more bytes


class Auto(AllToAllAlgorithm):
    name = "auto"
    summary = "shm when every rank is on one host (CPU), else bruck (blocks < 1 KiB) or pairwise; GPU: builtin"
    formula = "that of the algorithm it picks (modelled as shm's)"
    wins_when = "you do not want to choose"
    order = 5

    def cost(self, p, nbytes):
        return _family().get("shm").cost(p, nbytes)

    def prepare(self, inp, ctx) -> None:
        self.pick(inp, ctx)

    def pick(self, inp, ctx):
        """Collective on a plan's first call: every rank gathers the same host ids. Its
        result: one algorithm, or auto itself for the per-call choice between two p2p ones."""
        if ctx.transport is None:
            if not inp.is_cpu:
                ctx.transport = _family().get("builtin")
            else:
                hosts = host_ids(ctx.info, "auto", "choosing an all_to_all algorithm")
                one_host = len(set(hosts)) == 1 and shm.unsupported(ctx.info) is None
                ctx.transport = _family().get("shm") if one_host else self
        return ctx.transport

    def checks_calls(self, ctx):
        return ctx.transport is not None and ctx.transport is not self and ctx.transport.checks_calls(ctx)

    def run(self, out, inp, counts, ctx):
        alg = self.pick(inp, ctx)
        if alg is self:
            alg = _family().get("bruck" if counts.biggest() * inp.element_size() < SHORT else "pairwise")
        alg.run(out, inp, counts, ctx)


def _family():
    from commlab.algorithms import all_to_all

    return all_to_all


ALGORITHM = Auto()
