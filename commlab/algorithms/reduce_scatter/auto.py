"""The default reduce-scatter: decided once per group from facts every rank shares (its
host ids): shared memory when every CPU rank is on one host, hier across hosts where
some host has several ranks, else the ring (bandwidth-optimal; the sizes FSDP reduces
are large); the backend's own on GPUs. One
pick per group, whatever the size, so a size mismatch can never straddle two algorithms."""
from __future__ import annotations

from commlab.core.reduction import SUPPORTED_DTYPES
from commlab.transports import shm
from commlab.transports.setup import host_ids

from .base import ReduceScatterAlgorithm


class Auto(ReduceScatterAlgorithm):
    name = "auto"
    summary = "shm when every rank is on one host (CPU), hier across hosts, ring with one rank per host; GPU: builtin"
    formula = "that of the algorithm it picks (modelled as shm's)"
    wins_when = "you do not want to choose"
    order = 5

    def cost(self, p, nbytes):
        return _family().get("shm").cost(p, nbytes)

    def prepare(self, inp, ctx) -> None:
        self.pick(inp, ctx)

    def pick(self, inp, ctx) -> ReduceScatterAlgorithm:
        """Collective on a plan's first call: every rank gathers the same host ids."""
        if ctx.transport is None:
            if not inp.is_cpu:
                name = "builtin"
            else:
                hosts = host_ids(ctx.info, "auto", "choosing a reduce_scatter algorithm")
                # A host with two or more ranks, whose shared memory reduces this dtype.
                shared = len(hosts) > len(set(hosts)) and shm.unsupported(ctx.info) is None \
                    and inp.dtype in SUPPORTED_DTYPES
                name = ("shm" if len(set(hosts)) == 1 else "hier") if shared else "ring"
            ctx.transport = _family().get(name)
        return ctx.transport

    def checks_calls(self, ctx):
        return ctx.transport is not None and ctx.transport.checks_calls(ctx)

    def run(self, out, inp, op, ctx):
        self.pick(inp, ctx).run(out, inp, op, ctx)


def _family():
    from commlab.algorithms import reduce_scatter

    return reduce_scatter


ALGORITHM = Auto()
