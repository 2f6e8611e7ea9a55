"""The default all-gather: decided once per group from facts every rank shares (its
host ids): shared memory when every CPU rank is on one host, hier across hosts where
some host has several ranks, else the ring (bandwidth-optimal; the sizes FSDP gathers
are large); the backend's own on GPUs. One pick per group, whatever the size, so a
size mismatch can never straddle two algorithms."""
from __future__ import annotations

from commlab.transports import shm
from commlab.transports.setup import host_ids

from .base import AllGatherAlgorithm


class Auto(AllGatherAlgorithm):
    name = "auto"
    summary = "shm when every rank is on one host (CPU), hier across hosts, ring with one rank per host; GPU: builtin"
    formula = "that of the algorithm it picks (modelled as shm's)"
    wins_when = "you do not want to choose"
    order = 5

    def cost(self, p, nbytes):
        return _family().get("shm").cost(p, nbytes)

    def prepare(self, out, ctx) -> None:
        self.pick(out, ctx)

    def pick(self, out, ctx) -> AllGatherAlgorithm:
        """Collective on a plan's first call: every rank gathers the same host ids."""
        if ctx.transport is None:
            if not out.is_cpu:
                name = "builtin"
            else:
                hosts = host_ids(ctx.info, "auto", "choosing an all_gather algorithm")
                shared = len(hosts) > len(set(hosts)) and shm.unsupported(ctx.info) is None  # a host with 2+ ranks
                name = ("shm" if len(set(hosts)) == 1 else "hier") if shared else "ring"
            ctx.transport = _family().get(name)
        return ctx.transport

    def checks_calls(self, ctx):
        return ctx.transport is not None and ctx.transport.checks_calls(ctx)

    def run(self, out, inp, ctx):
        self.pick(out, ctx).run(out, inp, ctx)


def _family():
    from commlab.algorithms import all_gather

    return all_gather


ALGORITHM = Auto()
