"""A schedule without MSCCL's fused steps, for runtimes that refuse them: RCCL's build
(at 0cbce2a) stops at launch any file with rcs, rrs, rrc or rrcs; it runs s, r, cpy, re
and nop. Each fused step becomes plain ones in its own threadblock, in place:

    rcs   r -> dst; s dst
    rrc   r -> fresh scratch; (cpy src -> dst, when they differ); re scratch into dst
    rrs   r -> fresh scratch; re src into scratch; s scratch
    rrcs  rrc as above; s dst

A received chunk lands in scratch of its own (the rank's s grows by it), so nothing a
later step reads is overwritten. Dependencies on a lowered step point at its last part.
The result must pass the checker like any schedule."""
from __future__ import annotations

import copy

from .ir import Schedule, Step

FUSED = frozenset({"rcs", "rrs", "rrc", "rrcs"})


def _parts(st: Step, scratch: int) -> list[Step]:
    """The plain steps one fused step becomes; scratch: the first free scratch chunk."""
    cnt = st.cnt
    if st.type == "rcs":
        return [Step("r", st.srcbuf, st.srcoff, st.dstbuf, st.dstoff, cnt),
                Step("s", st.dstbuf, st.dstoff, st.dstbuf, st.dstoff, cnt)]
    land = [Step("r", st.srcbuf, st.srcoff, "s", scratch, cnt)]
    if st.type == "rrs":
        return land + [Step("re", st.srcbuf, st.srcoff, "s", scratch, cnt),
                       Step("s", "s", scratch, st.dstbuf, st.dstoff, cnt)]
    copy_ = [] if (st.srcbuf, st.srcoff) == (st.dstbuf, st.dstoff) else [
        Step("cpy", st.srcbuf, st.srcoff, st.dstbuf, st.dstoff, cnt)]
    fold = [Step("re", "s", scratch, st.dstbuf, st.dstoff, cnt)]
    send = [Step("s", st.dstbuf, st.dstoff, st.dstbuf, st.dstoff, cnt)] if st.type == "rrcs" else []
    return land + copy_ + fold + send


def unfused(s: Schedule) -> Schedule:
    """`s` with every fused step made of plain ones (a new schedule; `s` is untouched)."""
    out = copy.deepcopy(s)
    for rank in out.ranks:
        index: dict = {}  # (block, old step) -> new step index of its last part
        for b in rank.blocks:
            steps = []
            for k, st in enumerate(b.steps):
                if st.type in FUSED:
                    parts = _parts(st, rank.s_chunks)
                    if st.type != "rcs":
                        rank.s_chunks += st.cnt
                    parts[0].depid, parts[0].deps = st.depid, st.deps
                    parts[-1].hasdep = st.hasdep
                else:
                    parts = [st]
                steps += parts
                index[(b.id, k)] = len(steps) - 1
            b.steps = steps
        for b in rank.blocks:
            for st in b.steps:
                if st.depid >= 0:
                    st.deps = index[(st.depid, st.deps)]
    return out
