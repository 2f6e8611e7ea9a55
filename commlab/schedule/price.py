"""A schedule priced per level of the two-level cost model (measure/twolevel.py), from
its own steps: ranks numbered host by host, a message between ranks of one host moves
on the `host` level (or `shm`), one between hosts on the `link`.

The critical path is found as the checker finds it (a rank's sends one after another, a
receive no earlier than its send, one α each; of paths as long, the one with more steps
across hosts), and its steps and bytes are split by the level each message crosses. The
link carries at least what the host that sends the most across it sends (every rank of
it at once), and the busiest rank's own share is its socket copies' (they cost CPU);
reductions are the busiest rank's. A ring's path is its crossing pair's sends: its
hand-written formula; a phased schedule's is its phases' busiest sender's."""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from .ir import Schedule


@dataclass(frozen=True)
class Levels:
    """Per-level counts of one schedule on one host layout, in chunks."""

    steps_host: int  # α on the critical path between ranks of one host
    steps_link: int  # ... across hosts
    host_chunks: int  # chunks the critical path sends inside hosts
    link_chunks: int  # chunks across a link: the path's, or the busiest host's all together
    rank_link_chunks: int  # the busiest rank's chunks sent across
    reduced: int  # the busiest rank's chunks reduced


def levels(s: Schedule, order, per_host: int) -> Levels:
    """Counts for ranks placed `per_host` to a host, in order; `order`: one valid order
    of every (rank, block, step), the checker's. On one host, steps_host is the checker's
    critical path (Summary.hops)."""
    host = [r // per_host for r in range(s.size)]
    blocks = [{b.id: b for b in r.blocks} for r in s.ranks]
    # (total, link steps, host steps, link chunks, host chunks) of the longest path to here:
    # by the total, then the slower level, first.
    zero = (0, 0, 0, 0, 0)
    now: dict = defaultdict(lambda: zero)
    nic = [zero] * s.size
    published: dict = {}
    queues: dict = defaultdict(deque)
    sent_link, reduced = defaultdict(int), defaultdict(int)
    for r, bid, k in order:
        b = blocks[r][bid]
        st = b.steps[k]
        t = now[(r, bid)]
        if st.depid >= 0:
            t = max(t, published[(r, st.depid, st.deps)])
        if st.kind.receives:
            t = max(t, queues[(b.recv, r, b.chan)].popleft())
        if st.kind.reduces:
            reduced[r] += st.cnt
        if st.kind.sends:
            across = host[r] != host[b.send]
            start = max(t, nic[r])
            t = nic[r] = (start[0] + 1, start[1] + across, start[2] + (not across),
                          start[3] + st.cnt * across, start[4] + st.cnt * (not across))
            queues[(r, b.send, b.chan)].append(t)
            sent_link[r] += st.cnt * across
        if st.hasdep:
            published[(r, bid, k)] = t
        now[(r, bid)] = t
    critical = max(now.values(), default=zero)
    per_host_link = defaultdict(int)
    for r, c in sent_link.items():
        per_host_link[host[r]] += c
    return Levels(critical[2], critical[1], critical[4], max(critical[3], max(per_host_link.values(), default=0)),
                  max(sent_link.values(), default=0), max(reduced.values(), default=0))
