"""The default: picks an algorithm for the group once, from facts every rank shares —
shared memory when every rank is on one host (CPU tensors), else the backend's own
all-reduce. COMMLAB_ALGORITHM=<name> forces one algorithm instead."""
from __future__ import annotations

import copy
import os

from commlab.core.errors import UnsupportedError
from commlab.transports.p2p import P2P
from commlab.transports.setup import gather, host_id

from .base import Algorithm, Context


class Auto(Algorithm):
    name = "auto"
    summary = "shm when every rank is on one host (CPU), else builtin; COMMLAB_ALGORITHM forces one"
    formula = "that of the algorithm it picks (modelled as shm's one-shot/two-shot)"
    wins_when = "you do not want to choose: the measured winner for the layout"
    order = 5

    def cost(self, p, nbytes):
        return self._registry().get("shm").cost(p, nbytes)

    def memory_traffic(self, p, nbytes):
        return self._registry().get("shm").memory_traffic(p, nbytes)

    def unsupported(self, tensor, op, info):
        forced = _forced()
        if forced:
            alg = self._registry().get(forced)  # an unknown name raises, on every rank alike
            if alg is self:
                return "COMMLAB_ALGORITHM=auto would pick itself"
            if tensor.device.type not in alg.devices:
                return f"COMMLAB_ALGORITHM={forced} does not serve {tensor.device.type} tensors"
            return alg.unsupported(tensor, op, info)
        return None

    def choose(self, device_type: str, ctx: Context) -> Algorithm:
        """Collective on first use per group and device type (every rank gathers the
        same host ids, so every rank picks the same algorithm)."""
        registry = self._registry()
        forced = _forced()
        if forced:
            return registry.get(forced)
        if device_type == "cpu":
            hosts = gather(ctx.info, host_id(), "auto", "choosing an algorithm")
            if len(set(hosts)) == 1:
                return registry.get("shm")
        return registry.get("builtin")

    def run(self, buf, op, ctx):
        picked = ctx.transport  # {device type: (algorithm, its context)}, per plan
        if picked is None:
            picked = ctx.transport = {}
        key = buf.device.type
        if key not in picked:
            chosen = self.choose(key, ctx)
            # Errors name what was asked for and what ran: commlab[auto->shm].
            alg = copy.copy(chosen)
            alg.name = f"{self.name}->{chosen.name}"
            reason = alg.unsupported(buf, op, ctx.info)
            if reason:
                raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
            picked[key] = (alg, Context(info=ctx.info, p2p=P2P(ctx.info, alg.name)))
        alg, inner = picked[key]
        alg.run(buf, op, inner)

    @staticmethod
    def _registry():
        from commlab import algorithms  # the package imports this module while it registers

        return algorithms


def _forced() -> str:
    """COMMLAB_ALGORITHM, or "" when unset."""
    return os.environ.get("COMMLAB_ALGORITHM", "")


ALGORITHM = Auto()
