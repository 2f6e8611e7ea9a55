"""A schedule compiled for the shared-memory executor (csrc/cpu/shm/schedule.cpp): every
rank's steps, in the checker's order, as ops with their message slots and sequence
values fixed, so a call runs in C++ without Python per step.

Each rank's sequence advances by one for each message it sends or receives (its
`ticks`). A connection (sender, receiver, channel) gets as many slots in the sender's
segment as the order ever has messages in flight on it, each as large as its largest
message: message m takes slot m mod depth, once the receive of message m - depth has
ticked (the order proves it has by then); a call runs the ops once per pass over part
of every chunk, each pass's sequence values following the last's, so the first messages
of a pass wait for the reads of the last pass's final ones. MSCCL's fused steps are two ops of one rank
back to back: rcs receives into dst and sends dst; rrs folds into a private hold buffer
and sends that; rrcs folds into dst and sends dst."""
from __future__ import annotations

import zlib
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from .check import Summary
from .ir import Schedule
from .msccl import dumps
from .rules import alias

SEND, RECV, RECV_REDUCE, COPY, REDUCE = range(5)
BUF = {"i": 0, "o": 1, "s": 2, "h": 3}
NO_WAIT = -(1 << 63)
FIELDS = 10  # code, src buffer, src chunk, dst buffer, dst chunk, chunks, peer, slot, wait, tick


@dataclass
class Compiled:
    ops: list  # per rank: an (n, 10) int64 tensor
    region: int  # chunks of slots the busiest sender needs in its segment
    hold: int  # chunks of the hold buffer (rrs)
    ticks: int  # the most messages any rank sends and receives
    fingerprint: int  # the schedule's, in every call's record

    def writes_input(self, rank: int) -> bool:
        """Whether rank's ops write its input buffer (then an out-of-place call's input,
        which is never modified, is copied first)."""
        o = self.ops[rank]
        return bool(((o[:, 0] != SEND) & (o[:, 3] == BUF["i"])).any()) if len(o) else False


def compile_schedule(s: Schedule, summary: Summary, inplace: bool) -> Compiled:
    order = dict(summary.order)[inplace]
    aliases = [alias(s, r, inplace) for r in range(s.size)]
    blocks = [{b.id: b for b in r.blocks} for r in s.ranks]
    steps = [(r, blocks[r][b], blocks[r][b].steps[k]) for r, b, k in order]
    steps = [(r, b, st) for r, b, st in steps if st.type != "nop"]
    # Pass 1: how many messages each connection has in flight at most, and its largest.
    depth, size, flying = defaultdict(int), defaultdict(int), defaultdict(int)
    for r, b, st in steps:
        if st.kind.receives:
            flying[(b.recv, r, b.chan)] -= 1
        if st.kind.sends:
            key = (r, b.send, b.chan)
            flying[key] += 1
            depth[key] = max(depth[key], flying[key])
            size[key] = max(size[key], st.cnt)
    base, region = {}, defaultdict(int)
    for key in sorted(depth):
        base[key] = region[key[0]]
        region[key[0]] += depth[key] * size[key]
    # Pass 2: the ops.
    ops = [[] for _ in range(s.size)]
    tick = [0] * s.size
    sent = defaultdict(int)  # messages sent so far per connection
    inflight = defaultdict(deque)  # connection -> (slot, send tick)
    read_at = defaultdict(dict)  # connection -> message number -> the receive's tick
    received = defaultdict(int)
    hold = 1
    later = []

    def ref(r, buf, off):
        b, k = aliases[r](buf, off)
        return BUF[b], k

    for r, b, st in steps:
        t, cnt = st.type, st.cnt
        value = None  # what a fused step sends: (buffer, chunk)
        if st.kind.receives:
            key = (b.recv, r, b.chan)
            slot, wait = inflight[key].popleft()
            tick[r] += 1
            read_at[key][received[key]] = tick[r]
            received[key] += 1
            src = ref(r, st.srcbuf, st.srcoff) if st.kind.reduces else (-1, 0)
            if t == "rrs":
                dst, hold = (BUF["h"], 0), max(hold, cnt)
            else:
                dst = ref(r, st.dstbuf, st.dstoff)
            ops[r].append([RECV_REDUCE if st.kind.reduces else RECV, *src, *dst, cnt, b.recv, slot, wait, tick[r]])
            value = dst
        elif t in ("cpy", "re"):
            ops[r].append([COPY if t == "cpy" else REDUCE, *ref(r, st.srcbuf, st.srcoff),
                           *ref(r, st.dstbuf, st.dstoff), cnt, -1, 0, -1, 0])
        if st.kind.sends:
            key = (r, b.send, b.chan)
            m = sent[key]
            sent[key] += 1
            slot = base[key] + (m % depth[key]) * size[key]
            tick[r] += 1
            if m < depth[key]:  # the slot's last message was the last pass's: its read tick, once all are known
                later.append((r, len(ops[r]), key, m))
            src = value if value is not None else ref(r, st.srcbuf, st.srcoff)
            ops[r].append([SEND, *src, -1, 0, cnt, b.send, slot,
                           read_at[key][m - depth[key]] if m >= depth[key] else NO_WAIT, tick[r]])
            inflight[key].append((slot, tick[r]))
    ticks = max(tick, default=0)
    for r, x, key, m in later:  # a pass's tick values follow the last pass's: the read's, less `ticks`
        ops[r][x][8] = read_at[key][sent[key] - depth[key] + m] - ticks
    fingerprint = zlib.crc32(dumps(s).encode()) & 0x7FFFFFFF
    return Compiled([torch.tensor(o, dtype=torch.long).reshape(-1, FIELDS) for o in ops],
                    max(region.values(), default=0), hold, ticks, fingerprint)
