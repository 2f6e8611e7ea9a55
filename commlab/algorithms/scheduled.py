"""Schedules as members of their family: `algorithm="msccl:PATH"` loads an MSCCL XML
file, proves it (commlab.schedule.check) and runs it over point-to-point transfers with
the family's whole contract — validation, AVG, layouts, the call check, async and
errors live in the API as for every other algorithm. A rank count other than the
schedule's, or a collective other than its family's, is refused on every rank alike."""
from __future__ import annotations

import os

from commlab.core.errors import UnsupportedError
from commlab.core.reduction import Op
from commlab.schedule import check, load
from commlab.schedule.execute import Runner

from .all_gather.base import AllGatherAlgorithm
from .all_to_all.base import AllToAllAlgorithm
from .base import Algorithm, Cost
from .broadcast.base import BroadcastAlgorithm
from .reduce_scatter.base import ReduceScatterAlgorithm
from .registry import MAKERS


class Scheduled:
    """What a schedule states as a family member; its cost is derived from its steps."""

    order = 900
    level = "host"
    wins_when = "a schedule written or synthesized for this topology"

    def __init__(self, name: str, schedule, proof):
        self.name, self.schedule, self.proof = name, schedule, proof
        self.runner = Runner(schedule, proof)
        self.summary = f"schedule {schedule.name or name} ({proof.ranks} ranks, {proof.chunks} chunks per loop)"
        self.formula = f"{proof.hops}α + {proof.sent}/{proof.chunks}·nβ + {proof.reduced}/{proof.chunks}·nγ (derived)"

    def cost(self, p: int, nbytes: float) -> Cost:
        chunk = nbytes / self.proof.chunks
        return Cost(self.proof.hops, self.proof.sent * chunk, self.proof.reduced * chunk)

    def _refuses(self, info) -> str | None:
        if info.size != self.schedule.size:
            return f"{self.name} is a schedule for {self.schedule.size} ranks; the group has {info.size}"
        return None


class AllReduceScheduled(Scheduled, Algorithm):
    def unsupported(self, tensor, op, info):
        return self._refuses(info)

    def run(self, buf, op, ctx):
        self.runner.run(None, buf, ctx.rank, op, ctx.p2p, int)


class AllGatherScheduled(Scheduled, AllGatherAlgorithm):
    def unsupported(self, out, info):
        return self._refuses(info)

    def run(self, out, inp, ctx):
        own = out.view(ctx.size, -1)[ctx.rank]
        self.runner.run(None if own.data_ptr() == inp.data_ptr() else inp, out, ctx.rank, Op.SUM, ctx.p2p, int)


class ReduceScatterScheduled(Scheduled, ReduceScatterAlgorithm):
    def unsupported(self, inp, op, info):
        return self._refuses(info)

    def run(self, out, inp, op, ctx):
        self.runner.run(inp, out, ctx.rank, op, ctx.p2p, int)


class AllToAllScheduled(Scheduled, AllToAllAlgorithm):
    def unsupported(self, inp, info):
        return self._refuses(info)

    def run(self, out, inp, counts, ctx):
        if counts.matrix is not None and int(counts.matrix.min()) != int(counts.matrix.max()):
            raise UnsupportedError(f"commlab: {self.name} moves equal blocks; this all_to_all's splits differ")
        self.runner.run(inp, out, ctx.rank, Op.SUM, ctx.p2p, int)


class BroadcastScheduled(Scheduled, BroadcastAlgorithm):
    def unsupported(self, buf, info):
        return self._refuses(info)

    def run(self, buf, root, ctx):
        # The file serves one root; any other is the same schedule with the ranks turned.
        p, turn = ctx.size, self.schedule.root - root
        self.runner.run(None, buf, (ctx.rank + turn) % p, Op.SUM, ctx.p2p, lambda v: (v - turn) % p)


FAMILY = {"all_reduce": AllReduceScheduled, "all_gather": AllGatherScheduled,
          "reduce_scatter": ReduceScatterScheduled, "all_to_all": AllToAllScheduled,
          "broadcast": BroadcastScheduled}

_made: dict = {}  # (collective, path, mtime) -> the member: a file is read and proved once per process


def from_file(registry, path: str):
    """The member of `registry`'s family for the MSCCL XML file at `path`."""
    name = f"msccl:{path}"
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError as e:
        raise UnsupportedError(f"commlab: {name}: cannot read the schedule ({e.strerror})") from None
    key = (registry.collective, os.path.abspath(path), stamp)
    if key not in _made:
        schedule = load(path)
        if schedule.collective != registry.collective:
            raise UnsupportedError(f"commlab: {name} is a {schedule.collective} schedule, not {registry.collective}")
        _made[key] = FAMILY[schedule.collective](name, schedule, check(schedule, path))
    return _made[key]


MAKERS["msccl"] = from_file
