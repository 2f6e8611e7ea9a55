"""Schedules as members of their family: `algorithm="msccl:PATH"` loads an MSCCL XML
file, proves it (commlab.schedule.check) and runs it over point-to-point transfers;
`msccl-shm:PATH` runs it natively over shared memory (CPU ranks of one host, no Python
per step). Either has the family's whole contract — validation, AVG, layouts, the call
check, async and errors live in the API and the transport as for every other
algorithm. A rank count other than the schedule's, or a collective other than its
family's, is refused on every rank alike."""
from __future__ import annotations

import importlib
import os

from commlab.core.collectives import KIND
from commlab.core.errors import UnsupportedError
from commlab.schedule import check, load
from commlab.schedule.execute import NativeRunner, Runner
from commlab.schedule.price import levels
from commlab.transports import shm

from .all_gather.base import AllGatherAlgorithm
from .all_to_all.base import AllToAllAlgorithm
from .base import Algorithm, Cost, Stage
from .broadcast.base import BroadcastAlgorithm
from .reduce_scatter.base import ReduceScatterAlgorithm
from .registry import MAKERS


class Scheduled:
    """What a schedule states as a family member; its cost is derived from its steps.
    This base runs it over point-to-point transfers."""

    order = 900
    level = "host"
    by = "ring"  # what a step costs in the two-level model: commlab's point-to-point steps, as ring's
    wins_when = "a schedule written or synthesized for this topology"

    def __init__(self, name: str, schedule, proof):
        self.name, self.schedule, self.proof = name, schedule, proof
        self.runner = self._runner(schedule, proof)
        # What serving the call kind the schedule is not proved for costs, said where it is listed.
        extra = [f"{'in-place' if k else 'out-of-place'} calls: {self.runner.copies(k)}" for k in (True, False)
                 if k not in self.runner.kinds]
        self.summary = (f"schedule {schedule.name or name} ({proof.ranks} ranks, {proof.chunks} chunks per loop)"
                        + "".join(f"; {e}" for e in extra))
        self.formula = f"{proof.hops}α + {proof.sent}/{proof.chunks}·nβ + {proof.reduced}/{proof.chunks}·nγ (derived)"

    def _runner(self, schedule, proof):
        return Runner(schedule, proof)

    def _via(self, ctx):
        return ctx.p2p

    def _op(self, op, ctx):
        return op

    def cost(self, p: int, nbytes: float) -> Cost:
        chunk = nbytes / self.proof.chunks
        return Cost(self.proof.hops, self.proof.sent * chunk, self.proof.reduced * chunk)

    def stages(self, hosts: int, per_host: int, nbytes: float) -> list[Stage] | None:
        """Priced from the steps (commlab.schedule.price), ranks host by host."""
        if hosts * per_host != self.schedule.size or hosts > 1 and self.level == "shm":
            return None
        lv = levels(self.schedule, next(o for _, o in self.proof.order), per_host)
        chunk = nbytes / self.proof.chunks
        out = [Stage(self.level, lv.steps_host, lv.host_chunks * chunk, lv.reduced * chunk, self.by)]
        if hosts > 1:
            out.append(Stage("link", lv.steps_link, lv.link_chunks * chunk, 0.0, self.by, lv.rank_link_chunks * chunk))
        return out

    def _refuses(self, info) -> str | None:
        if info.size != self.schedule.size:
            return f"{self.name} is a schedule for {self.schedule.size} ranks; the group has {info.size}"
        return None

    def _run(self, inp, out, rank, op, ctx, peer=int):
        self.runner.run(inp, out, rank, self._op(op, ctx), self._via(ctx), peer)


class Native(Scheduled):
    """Mixed in first: the same schedule run by the shared-memory executor, whose records
    the transport compares itself (AVG recorded as AVG)."""

    level = "shm"
    by = "shm"
    devices = ("cpu",)

    def _runner(self, schedule, proof):
        return NativeRunner(schedule, proof, KIND[schedule.collective])

    def _via(self, ctx):
        return lambda program: shm.run_schedule(ctx.info, self.name, program)

    def _op(self, op, ctx):
        return None if op is None else ctx.recorded(op)

    def _refuses(self, info) -> str | None:
        return super()._refuses(info) or shm.unsupported(info)

    def checks_calls(self, *call) -> bool:
        return True


class AllReduceScheduled(Scheduled, Algorithm):
    def unsupported(self, tensor, op, info):
        return self._refuses(info)

    def run(self, buf, op, ctx):
        self._run(None, buf, ctx.rank, op, ctx)


class AllGatherScheduled(Scheduled, AllGatherAlgorithm):
    def unsupported(self, out, info):
        return self._refuses(info)

    def run(self, out, inp, ctx):
        own = out.view(ctx.size, -1)[ctx.rank]
        self._run(None if own.data_ptr() == inp.data_ptr() else inp, out, ctx.rank, None, ctx)


class ReduceScatterScheduled(Scheduled, ReduceScatterAlgorithm):
    def unsupported(self, inp, op, info):
        return self._refuses(info)

    def run(self, out, inp, op, ctx):
        self._run(inp, out, ctx.rank, op, ctx)


class AllToAllScheduled(Scheduled, AllToAllAlgorithm):
    def unsupported(self, inp, info):
        return self._refuses(info)

    def run(self, out, inp, counts, ctx):
        if counts.matrix is not None and int(counts.matrix.min()) != int(counts.matrix.max()):
            raise UnsupportedError(f"commlab: {self.name} moves equal blocks; this all_to_all's splits differ")
        self._run(inp, out, ctx.rank, None, ctx)


class BroadcastScheduled(Scheduled, BroadcastAlgorithm):
    def unsupported(self, buf, info):
        return self._refuses(info)

    def run(self, buf, root, ctx):
        # The file serves one root; any other is the same schedule with the ranks turned.
        p, turn = ctx.size, self.schedule.root - root
        self._run(None, buf, (ctx.rank + turn) % p, None, ctx, lambda v: (v - turn) % p)


FAMILY = {"all_reduce": AllReduceScheduled, "all_gather": AllGatherScheduled,
          "reduce_scatter": ReduceScatterScheduled, "all_to_all": AllToAllScheduled,
          "broadcast": BroadcastScheduled}
NATIVE = {c: type(f"Native{cls.__name__}", (Native, cls), {}) for c, cls in FAMILY.items()}

_made: dict = {}  # (prefix, collective, path, mtime) -> the member: a file is read and proved once per process


def _maker(prefix: str, classes: dict):
    def make(registry, path: str):
        """The member of `registry`'s family for the MSCCL XML file at `path`."""
        name = f"{prefix}:{path}"
        try:
            stamp = os.stat(path).st_mtime_ns
        except OSError as e:
            raise UnsupportedError(f"commlab: {name}: cannot read the schedule ({e.strerror})") from None
        key = (prefix, registry.collective, os.path.abspath(path), stamp)
        if key not in _made:
            schedule = load(path)
            if schedule.collective != registry.collective:
                raise UnsupportedError(f"commlab: {name} is a {schedule.collective} schedule, not {registry.collective}")
            _made[key] = classes[schedule.collective](name, schedule, check(schedule, path))
        return _made[key]

    return make


MAKERS["msccl"] = _maker("msccl", FAMILY)
MAKERS["msccl-shm"] = _maker("msccl-shm", NATIVE)


def register(path: str, name: str, native: bool = False):
    """The schedule at `path` registered in its family under `name`, as any algorithm:
    listed by names(), run by the sweeps, the bench's `--algorithms all`, doctor and the
    backend's settings. Every rank registers it alike (a name one rank lacks is a
    mismatch). Returns the member."""
    schedule = load(path)
    member = (NATIVE if native else FAMILY)[schedule.collective](name, schedule, check(schedule, path))
    # The family's package, as algorithms.registry() finds it (that package imports this module).
    return importlib.import_module(f"{__package__}.{schedule.collective}").REGISTRY.register(member)
