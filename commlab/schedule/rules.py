"""The format's rules, read off a schedule without running it: peers and channels that
exist, one threadblock per connection, offsets and counts inside the caller's buffers
(aliased as the call kind lays them out) and the scratch, dependencies on a step that
publishes, RCCL's nop chains. The first violation, named by rank, threadblock and step."""
from __future__ import annotations

from dataclasses import dataclass

from .ir import BLOCKED, Schedule, Step, buffer_chunks


@dataclass(frozen=True)
class Violation:
    text: str
    rank: int | None = None
    block: int | None = None
    step: int | None = None
    type: str = ""

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.block is not None:
            where.append(f"threadblock {self.block}")
        if self.step is not None:
            where.append(f"step {self.step}" + (f" ({self.type})" if self.type else ""))
        return (", ".join(where) + ": " if where else "") + self.text


def buffer_sizes(s: Schedule, rank, inplace: bool) -> dict:
    """Chunks of each buffer as the caller's call gives them (not as the file declares)."""
    i, o = buffer_chunks(s.collective, s.chunks, s.size)
    return {"i": i, "o": o, "s": rank.s_chunks}


def alias(s: Schedule, r: int, inplace: bool):
    """(buf, k) as written -> (buf, k) in memory: in place, MSCCL's input and output are
    one buffer (all-gather's input is the rank's block of the output, reduce-scatter's
    output its block of the input)."""
    cf = s.per_rank
    if not inplace:
        return lambda b, k: (b, k)
    if s.collective == "all_gather":
        return lambda b, k: ("o", r * cf + k) if b == "i" else (b, k)
    if s.collective == "reduce_scatter":
        return lambda b, k: ("i", r * cf + k) if b == "o" else (b, k)
    return lambda b, k: ("i", k) if b == "o" else (b, k)


def rules(s: Schedule):
    """The format's rules, read off the schedule: the first violation, or None."""
    p = s.size
    if p < 1 or s.chunks < 1 or s.channels < 1:
        return Violation(f"ranks {p}, chunks {s.chunks}, channels {s.channels}: each must be at least 1")
    if s.collective in BLOCKED and s.chunks % p:
        return Violation(f"{s.collective} needs chunks per loop ({s.chunks}) to be a multiple of the ranks ({p})")
    if not s.modes():
        return Violation("neither inplace nor outofplace: the schedule serves no call")
    if s.collective == "broadcast" and not 0 <= s.root < p:
        return Violation(f"root {s.root} is not a rank of {p}")
    for rank in s.ranks:
        ids = sorted(b.id for b in rank.blocks)
        if ids != list(range(len(ids))):
            return Violation(f"threadblock ids {ids} are not 0..{len(ids) - 1} (MSCCL requires them contiguous)", rank.id)
        if min(rank.i_chunks, rank.o_chunks, rank.s_chunks) < 0:
            return Violation("a buffer of negative size", rank.id)
        ends = {}
        for b in rank.blocks:
            for peer, role in ((b.send, "send"), (b.recv, "recv")):
                if peer != -1 and not 0 <= peer < p or peer == rank.id:
                    return Violation(f"{role} peer {peer} is not another rank of {p}", rank.id, b.id)
                if peer >= 0:
                    other = ends.setdefault((role, peer, b.chan), b.id)
                    if other != b.id:
                        return Violation(f"threadblocks {other} and {b.id} both {role} rank {peer} on channel {b.chan}"
                                         " (one connection, one threadblock)", rank.id, b.id)
            if not 0 <= b.chan < s.channels:
                return Violation(f"channel {b.chan} outside 0..{s.channels - 1}", rank.id, b.id)
            blocks = {x.id: x for x in rank.blocks}
            for k, st in enumerate(b.steps):
                v = _step_rule(s, rank, b, k, st, blocks)
                if v is not None:
                    return v
    return None


def _step_rule(s, rank, b, k, st: Step, blocks):
    at = dict(rank=rank.id, block=b.id, step=k, type=st.type)
    kind = st.kind
    if st.cnt < 0:
        return Violation(f"cnt {st.cnt} is negative", **at)
    if kind.sends and b.send < 0:
        return Violation("sends, but its threadblock has no send peer", **at)
    if kind.receives and b.recv < 0:
        return Violation("receives, but its threadblock has no receive peer", **at)
    for inplace in s.modes():
        sizes = buffer_sizes(s, rank, inplace)  # an aliased buffer as written spans the caller's: the same sizes
        for side, used in (("src", kind.reads_src), ("dst", kind.writes_dst or kind.reads_dst)):
            if not used:
                continue
            buf, off = getattr(st, side + "buf"), getattr(st, side + "off")
            if off < 0 or off + st.cnt > sizes[buf]:
                return Violation(f"{side} {buf}[{off}:{off + st.cnt}] outside its buffer of {sizes[buf]} chunks"
                                 f" ({'in place' if inplace else 'out of place'})", **at)
    if st.depid != -1:
        dep = blocks.get(st.depid)
        if dep is None or st.depid == b.id:
            return Violation(f"depends on threadblock {st.depid}, not another block of this rank", **at)
        if not 0 <= st.deps < len(dep.steps):
            return Violation(f"depends on step {st.deps} of threadblock {st.depid}, which has {len(dep.steps)}", **at)
        if not dep.steps[st.deps].hasdep:
            return Violation(f"depends on threadblock {st.depid} step {st.deps}, which does not publish (hasdep=0):"
                             " the wait would outlast it", **at)
        if st.type == "nop":  # rccl attaches a chain of nops' dependencies to the next real step
            nxt = next((x for x in b.steps[k + 1:] if x.type != "nop"), None)
            if nxt is not None and nxt.depid < 0:
                return Violation("its dependency attaches to the next real step, which has none of its own"
                                 " (rccl refuses such a chain)", **at)
    return None
