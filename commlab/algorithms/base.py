"""The one shape every algorithm has (Member), and every all-reduce algorithm (Algorithm).

An algorithm holds its own facts (cost model, what it supports) and one `run` that
reduces a flat contiguous buffer in place. Validation, AVG, non-contiguous inputs,
async execution, timing and reporting live once, outside the algorithms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.core.errors import PeerError
from commlab.core.groups import GroupInfo
from commlab.core.reduction import Op
from commlab.transports.p2p import P2P, moves_cuda


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor's bytes: moving bytes needs no dtype (gloo refuses complex)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@dataclass(frozen=True)
class Cost:
    """α-β-γ terms of one all-reduce of n bytes on p ranks, on the critical path:
    time ≈ steps·α + bytes_sent·β + bytes_reduced·γ."""

    steps: float
    bytes_sent: float  # per rank, the busiest rank
    bytes_reduced: float  # bytes of input folded by the busiest rank

    def time(self, alpha: float, beta: float, gamma: float = 0.0) -> float:
        return self.steps * alpha + self.bytes_sent * beta + self.bytes_reduced * gamma


@dataclass(frozen=True)
class Stage:
    """One level's share of an all-reduce's critical path across hosts (the two-level
    cost model): time ≈ Σ steps·α[level] + bytes·β[level] + reduced·γ. Levels: `shm`
    (shared memory on a host), `host` (point-to-point between ranks of one host) and
    `link` (the host link; `bytes` are those crossing one host's link in one direction,
    every rank of the host that sends across at once counted). `by`: the implementation
    that runs it (its per-step software cost is its own; bytes cost the level's).
    `rank_bytes`: what one rank sends in the stage, when not `bytes` (a link stage that
    several ranks of a host cross at once): each rank's own socket copies cost CPU."""

    level: str
    steps: float
    bytes: float
    reduced: float
    by: str
    rank_bytes: float | None = None


@dataclass(frozen=True)
class Traffic:
    """Memory traffic of one rank in one all-reduce, read + written: `tensor` is the
    caller's tensor (it streams from DRAM once the ranks' tensors outgrow the last-level
    cache), `staging` the transport's own buffers (small, reused: they stay in cache)."""

    tensor: float
    staging: float


@dataclass
class Context:
    """What `run` gets besides the buffer: the group and a transport bound to it."""

    info: GroupInfo
    p2p: P2P
    transport: object = None  # an algorithm's per-group transport state, cached by the algorithm itself
    op: Op | None = None  # the caller's op, AVG included (run() is given SUM for it)

    def recorded(self, op: Op) -> int:
        """The op code a transport that compares call records must record for a run
        given `op`: the caller's AVG as AVG (4), which the transport reduces as SUM, so
        that a rank averaging and a rank summing never pair."""
        return int(Op.AVG if self.op is Op.AVG else op)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.size


class Member:
    """What every algorithm of every collective states about itself: the registry,
    CLI, README and cost model read these; each family's base adds its `run`."""

    collective: str = ""
    name: str = ""
    summary: str = ""
    formula: str = ""  # the α-β-γ cost, human-readable (README, CLI)
    wins_when: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    order: int = 100  # position in the registry's names()
    level: str = "host"  # what its bytes move over on one host (Stage.level)

    def cost(self, p: int, nbytes: float) -> Cost:
        """The critical path of one call of `nbytes` (nccl-tests' size: the all-reduced
        buffer, the gathered output, the scattered input, the broadcast tensor)."""
        raise NotImplementedError

    def stages(self, hosts: int, per_host: int, nbytes: float) -> list[Stage] | None:
        """The critical path of one call of nbytes on `hosts` hosts of `per_host`
        ranks each (ranks numbered host by host, as torchrun does), per level. On one
        host that is cost() on this algorithm's level; across hosts None unless the
        algorithm derives its schedule (the cost model then leaves it out)."""
        if hosts == 1:
            c = self.cost(per_host, nbytes)
            return [Stage(self.level, c.steps, c.bytes_sent, c.bytes_reduced, self.name)]
        return None

    def memory_traffic(self, p: int, nbytes: float) -> Traffic | None:
        """Bytes the busiest rank reads plus writes, for transports bound by memory
        bandwidth (shared memory); None for network algorithms."""
        return None

    def fast_call(self, like, op, ctx):
        """For transports that run a whole blocking call below Python: a callable taking
        the family's call (all-reduce: tensor; all-gather, reduce-scatter, all-to-all:
        out, input; broadcast: tensor, root) that runs it and returns True when its
        tensors are like `like` (dtype, device, contiguous; op: the reduction, or None),
        else returns False having touched nothing. None (the default): no such path, the
        API always takes `run`."""
        return None

    def schedule(self, p: int):
        """This algorithm on p ranks as a schedule (commlab.schedule: checked, priced from
        its steps, exported as MSCCL XML), where its steps do not depend on the data's
        size; None where it is no fixed schedule."""
        return None

    def __repr__(self) -> str:
        return f"<commlab {self.collective} algorithm {self.name!r}: {self.summary}>"


class FamilyMember(Member):
    """What every family's API asks of its algorithms on a plan's first call, besides
    the family's own `unsupported` and `run`."""

    def prepare(self, first: torch.Tensor, ctx: Context) -> None:
        """Collective, on every rank's first call of a plan, before checks_calls: what an
        algorithm decides with its peers (auto's pick). `first`: the call's input."""

    def checks_calls(self, ctx: Context) -> bool:
        """Whether this algorithm's transport itself makes ranks that call differently
        fail alike before any wrong byte lands (shared memory and CUDA IPC compare call
        records, all-to-all's counts included). When it does not — point-to-point steps,
        the backend's own collective — the API checks every call first (P2P.agree:
        all-to-all's algorithm then gets every rank's counts). Collective: every rank
        asks at the same point of its first call of a plan."""
        return False


class Algorithm(FamilyMember):
    """An all-reduce algorithm."""

    collective = "all_reduce"

    @staticmethod
    def busbw_factor(p: int) -> float:
        """nccl-tests' all-reduce bus-bandwidth factor 2(p-1)/p: busbw = algbw·factor
        is comparable with link bandwidth whatever the algorithm."""
        return 2.0 * (p - 1) / p if p > 1 else 0.0

    def unsupported(self, tensor: torch.Tensor, op: Op, info: GroupInfo) -> str | None:
        """Why this algorithm cannot serve the call, from facts every rank shares;
        None when it can. The API has already checked dtype, op and device type."""
        return None

    def run(self, buf: torch.Tensor, op: Op, ctx: Context) -> None:
        """Reduce the flat contiguous `buf` in place across the group (op is never AVG;
        ctx.size > 1). Every rank must end bitwise identical. `buf` is never empty,
        except for an algorithm whose transport compares call records (checks_calls):
        an empty call must take part in that comparison, its peers may have data."""
        raise NotImplementedError


def ring_stages(c: Cost, hosts: int, by: str) -> list[Stage]:
    """A ring over ranks numbered host by host: one pair per host link, each way, every
    step, and every step waits for its slowest pair, the one that crosses."""
    return [Stage("link" if hosts > 1 else "host", c.steps, c.bytes_sent, c.bytes_reduced, by)]


def by_the_backend(ctx: Context, name: str, what: str, out: torch.Tensor, inp: torch.Tensor | None, gloo, group_call):
    """One call of the backend's own collective, as every family's `builtin` makes it.
    Host tensors, and GPU tensors of a group that does not move them (through host
    copies: gloo takes host memory), go through gloo on the group's commlab connection,
    `gloo(backend, out, inp)` starting its work: a peer that gives up fails it at once.
    Otherwise `group_call()` starts the group's own (NCCL's) work. `inp` None: `out` is
    read and written in place."""
    if out.is_cpu or not moves_cuda(ctx.info.group):
        host_out = out if out.is_cpu else (out.cpu() if inp is None else torch.empty(out.shape, dtype=out.dtype))
        host_inp = None if inp is None else inp if inp.is_cpu else inp.cpu()
        ctx.p2p.collective(lambda backend: gloo(backend, host_out, host_inp), f"gloo's {what}")
        if host_out is not out:
            out.copy_(host_out)
        return
    try:
        group_call().wait(ctx.info.timeout)
    except RuntimeError as e:
        raise PeerError(f"commlab[{name}] rank {ctx.info.global_rank(ctx.rank)}: backend {what} failed: {e}",
                        algorithm=name, peer=None) from e
