"""The default broadcast: decided once per group from facts every rank shares (its host
ids): shared memory when every CPU rank is on one host; across hosts, per call, the
binomial tree below 512 KiB and scatter + all-gather above (MPICH's switch; the API
agreed on the call's size first, so every rank picks alike); the backend's own on GPUs."""
from __future__ import annotations

from commlab.transports import shm
from commlab.transports.setup import host_ids

from .base import BroadcastAlgorithm

LONG = 512 << 10


class Auto(BroadcastAlgorithm):
    name = "auto"
    summary = "shm when every rank is on one host (CPU), else binomial (< 512 KiB) or scatter_allgather; GPU: builtin"
    formula = "that of the algorithm it picks (modelled as shm's)"
    wins_when = "you do not want to choose"
    order = 5

    def cost(self, p, nbytes):
        return _family().get("shm").cost(p, nbytes)

    def prepare(self, buf, ctx) -> None:
        self.pick(buf, ctx)

    def pick(self, buf, ctx):
        """Collective on a plan's first call: every rank gathers the same host ids. Its
        result: one algorithm, or auto itself for the per-call choice between two p2p ones."""
        if ctx.transport is None:
            if not buf.is_cpu:
                ctx.transport = _family().get("builtin")
            else:
                hosts = host_ids(ctx.info, "auto", "choosing a broadcast algorithm")
                one_host = len(set(hosts)) == 1 and shm.unsupported(ctx.info) is None
                ctx.transport = _family().get("shm") if one_host else self
        return ctx.transport

    def checks_calls(self, ctx):
        return ctx.transport is not None and ctx.transport is not self and ctx.transport.checks_calls(ctx)

    def run(self, buf, root, ctx):
        alg = self.pick(buf, ctx)
        if alg is self:
            alg = _family().get("binomial" if buf.numel() * buf.element_size() < LONG else "scatter_allgather")
        alg.run(buf, root, ctx)


def _family():
    from commlab.algorithms import broadcast

    return broadcast


ALGORITHM = Auto()
