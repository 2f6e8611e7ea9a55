"""The default: picks an algorithm per group from facts every rank shares. In order:
COMMLAB_ALGORITHM=<name> forces one; a tuning file (COMMLAB_TUNING, written by the
bench's --tune) picks per message size for its layout; else, for CPU tensors, shared
memory when every rank is on one host, `hier` across hosts with several ranks on some
host, and the backend's own all-reduce otherwise."""
from __future__ import annotations

import copy
import hashlib
import os

# The package is mid-import when it registers this module: its names are read at call time.
from commlab import algorithms
from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, UnsupportedError
from commlab.transports.p2p import P2P
from commlab.transports.setup import by_host, gather, host_id

from .. import tuning
from ..base import Algorithm, Context


class Auto(Algorithm):
    name = "auto"
    summary = "a tuning file's measured pick per size, else shm on one host (CPU), hier across hosts, else builtin"
    formula = "that of the algorithm it picks (modelled as shm's one-shot/two-shot)"
    wins_when = "you do not want to choose: the measured winner for the layout"
    order = 5

    def cost(self, p, nbytes):
        return algorithms.get("shm").cost(p, nbytes)

    def memory_traffic(self, p, nbytes):
        return algorithms.get("shm").memory_traffic(p, nbytes)

    def unsupported(self, tensor, op, info):
        forced = _forced()
        if forced:
            alg = algorithms.get(forced)  # an unknown name raises, on every rank alike
            if alg is self:
                return "COMMLAB_ALGORITHM=auto would pick itself"
            if tensor.device.type not in alg.devices:
                return f"COMMLAB_ALGORITHM={forced} does not serve {tensor.device.type} tensors"
            return alg.unsupported(tensor, op, info)
        return None

    def decide(self, device_type: str, ctx: Context) -> "_Choice":
        """From facts every rank gathered alike (host ids, tuning-file digests), so every
        rank decides alike (or fails alike). The gather is the group's, on its first
        call by auto: a plan of its own (AVG after SUM, another dtype) decides from it
        locally, so no rank reaches a set-up step its peers have passed."""
        forced = _forced()
        if forced:
            return _Choice(self.name, ctx, fixed=algorithms.get(forced).name)
        file = tuning.path()
        facts = _group_facts(ctx.info, file)
        if len({f["tuning"] for f in facts}) > 1:
            raise CollectiveMismatchError(
                f"commlab[auto]: ranks have different tuning files ({tuning.ENV}): " +
                ", ".join(f"rank {ctx.info.global_rank(r)}: {f['tuning']}" for r, f in enumerate(facts)))
        hosts = len({f["host"] for f in facts})
        if file:
            table = tuning.load(file, device_type, ctx.info.size, hosts, algorithms.names())
            if table is not None:
                return _Choice(self.name, ctx, table=table)
        per_host = [len(m) for m in by_host([f["host"] for f in facts])]
        return _Choice(self.name, ctx, fixed=rule(device_type, per_host))

    def _choice(self, device_type: str, ctx: Context) -> "_Choice":
        if ctx.transport is None:  # the plan's (one device type per plan)
            ctx.transport = self.decide(device_type, ctx)
        return ctx.transport

    def prepare(self, first, ctx):
        self._choice(first.device.type, ctx)

    def checks_calls(self, ctx):
        # Only where every algorithm it may pick does: a tuning table that picks shm for
        # small sizes and builtin for large ones would let a size mismatch straddle them.
        return ctx.transport is not None and ctx.transport.checks_calls()

    def run(self, buf, op, ctx):
        alg, inner = self._choice(buf.device.type, ctx).algorithm(buf.numel() * buf.element_size(), buf, op)
        alg.run(buf, op, inner)


class _Choice:
    """What auto runs for one plan and device type: one algorithm, or a tuning table's
    pick per message size; each picked algorithm gets its own context once."""

    def __init__(self, label: str, ctx: Context, fixed: str | None = None, table: tuning.Table | None = None):
        self.label, self.ctx, self.fixed, self.table = label, ctx, fixed, table
        self.ready: dict[str, tuple[Algorithm, Context]] = {}

    def checks_calls(self) -> bool:

        names = [self.fixed] if self.fixed else sorted(set(self.table.names))
        return all(algorithms.get(n).checks_calls(Context(info=self.ctx.info, p2p=self.ctx.p2p)) for n in names)

    def algorithm(self, nbytes: int, buf, op) -> tuple[Algorithm, Context]:
        name = self.fixed or self.table.pick(nbytes)
        got = self.ready.get(name)
        if got is None:

            # Errors name what was asked for and what ran: commlab[auto->shm].
            alg = copy.copy(algorithms.get(name))
            alg.name = f"{self.label}->{name}"
            reason = alg.unsupported(buf, op, self.ctx.info)
            if reason:
                where = f" (picked by {self.table.source} for {nbytes} bytes)" if self.table else ""
                raise UnsupportedError(f"commlab[{alg.name}]: {reason}{where}")
            got = self.ready[name] = (alg, Context(info=self.ctx.info, p2p=P2P(self.ctx.info, alg.name), op=self.ctx.op))
        return got


_facts = groups.PerGroup(lambda g: [])  # every rank's host id and tuning digest, per group


def _group_facts(info, file: str) -> list[dict]:
    """Every rank's host id and tuning digest: gathered on the group's first ask, then
    remembered (collective the first time, a lookup after)."""
    known = _facts.get(info.group)
    if not known:
        known.extend(gather(info, {"host": host_id(), "tuning": _digest(file)}, "auto", "choosing an algorithm"))
    return known


def rule(device_type: str, per_host: list[int]) -> str:
    """The built-in pick without a tuning file, from measurements
    (docs/measurements.md#figures-behind-the-codes-choices): shm on one host; across hosts
    hier where some host has several ranks, else the backend's own; the backend's on GPUs."""
    if device_type != "cpu":
        return "builtin"
    return "shm" if len(per_host) == 1 else ("hier" if max(per_host) > 1 else "builtin")


def _digest(file: str) -> str:
    """What ranks compare: the tuning file's content (not its path)."""
    if not file:
        return "none"
    try:
        with open(file, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError as e:
        return f"unreadable ({e.strerror})"


def _forced() -> str:
    """COMMLAB_ALGORITHM, or "" when unset."""
    return os.environ.get("COMMLAB_ALGORITHM", "")


ALGORITHM = Auto()
