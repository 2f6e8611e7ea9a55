"""The checker: a schedule is proved before any byte moves, and the first violation is
named by rank, threadblock and step.

Two passes. The rules of the format (peers, channels, offsets and counts inside their
buffers, dependencies that point at a step that publishes) are read off the schedule
(rules.py).
Then it runs symbolically, once per call kind it declares (in place, out of place):
each chunk holds the multiset of (rank, input chunk) contributions folded into it; a
receive waits for its channel's next message, a step for its dependency. The waits are
monotone (once ready, ready for good), so if this one run finishes every run does, and
if it sticks the stuck blocks are a deadlock or a receive with no send. Steps of one
rank's different blocks run concurrently on a GPU: vector clocks (program order,
dependencies, send → receive) tell which are ordered, and two unordered steps touching
one chunk, one of them writing, are a race. At the end every output chunk must hold
exactly what the collective promises, every contribution once.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from commlab.core.errors import CommlabError

from .ir import Schedule
from .price import levels
from .rules import Violation, alias, buffer_sizes, rules

UNDEF = None  # a chunk never written: scratch and output start so, and the runtime never zeroes them


class ScheduleError(CommlabError, ValueError):
    """A schedule that breaks a rule; `violation` is the first one found."""

    def __init__(self, violation: Violation, source: str = ""):
        self.violation = violation
        super().__init__(f"commlab: schedule {source + ' ' if source else ''}is invalid: {violation}")


@dataclass(frozen=True)
class Summary:
    collective: str
    ranks: int
    chunks: int
    modes: tuple[str, ...]
    channels: int
    blocks: int  # the most on one rank
    steps: int  # the most on one rank (nops left out)
    sent: int  # chunks the busiest rank sends
    reduced: int  # chunks the busiest rank folds
    messages: int  # sends of the busiest rank
    hops: int  # α on the critical path: a rank's sends one after another, a receive after its send
    order: tuple  # (in place?, ((rank, block, step), ...)) for each call kind proved, declared or not

    def lines(self) -> list[str]:
        return [
            f"collective: {self.collective} on {self.ranks} ranks, {self.chunks} chunks per loop",
            f"call kinds: {', '.join(self.modes)}",
            f"channels: {self.channels}; threadblocks per rank: up to {self.blocks}",
            f"per rank (the busiest): {self.steps} steps, {self.messages} sends of {self.sent} chunks,"
            f" {self.reduced} chunks reduced; critical path {self.hops}α",
        ]


def expected(s: Schedule, r: int, k: int) -> tuple:
    """What output chunk k of rank r must hold: its (rank, input chunk) contributions."""
    p, cf = s.size, s.per_rank
    if s.collective == "all_reduce":
        return tuple((q, k) for q in range(p))
    if s.collective == "broadcast":
        return ((s.root, k),)
    if s.collective == "all_gather":
        return ((k // cf, k % cf),)
    if s.collective == "reduce_scatter":
        return tuple((q, r * cf + k) for q in range(p))
    return ((k // cf, r * cf + k % cf),)  # all-to-all: block j of the output is rank j's block r


def _initial(s: Schedule, r: int, buf: str, k: int):
    if buf != "i" or s.collective == "broadcast" and r != s.root:
        return UNDEF
    return ((r, k),)


class _Sim:
    """One symbolic run of the schedule for one call kind."""

    def __init__(self, s: Schedule, inplace: bool):
        self.s, self.inplace = s, inplace
        self.alias = [alias(s, r.id, inplace) for r in s.ranks]
        self.mem = []
        for r in s.ranks:
            sizes = buffer_sizes(s, r, inplace)
            bufs = {b: [_initial(s, r.id, b, k) for k in range(n)] for b, n in sizes.items()}
            if inplace:  # the aliased-away buffer does not exist; the caller's data is where the alias puts it
                gone = "o" if s.collective != "all_gather" else "i"
                if s.collective == "all_gather":
                    for k in range(s.per_rank):
                        bufs["o"][r.id * s.per_rank + k] = ((r.id, k),)
                del bufs[gone]
            self.mem.append(bufs)
        self.blocks = [(r, b) for r in s.ranks for b in r.blocks]
        self.comp = {(r.id, b.id): n for n, (r, b) in enumerate(self.blocks)}
        self.clock = [np.zeros(len(self.blocks), dtype=np.int64) for _ in self.blocks]
        self.published = {}  # (rank, block) -> (last published step, {step: clock})
        self.pc = [0] * len(self.blocks)
        self.fifo: dict = {}  # (src, dst, chan) -> deque of messages
        self.access = {}  # (rank, buf, k) -> [last write, reads since]
        self.writer = {}  # (rank, buf, k) -> (block, step) that last wrote it
        self.order = []
        self.first_undef = None
        self.sent = Counter()
        self.sends = Counter()
        self.reduced = Counter()

    def _chunks(self, r: int, buf: str, off: int, cnt: int):
        return [self.alias[r](buf, off + j) for j in range(cnt)]

    def _touch(self, n: int, key, write: bool, at):
        """Record an access; a race when an unordered access of another block precedes it."""
        me = self.clock[n]
        last = self.access.setdefault(key, [None, []])
        prior = ([last[0]] if last[0] else []) + (last[1] if write else [])
        for other_n, tick, other_at in prior:
            if other_n != n and me[other_n] < tick:
                a = "writes" if write else "reads"
                b = "wrote" if other_at[3] == "write" else "reads"
                return Violation(f"{a} {key[1]}[{key[2]}] while threadblock {other_at[1]} step {other_at[2]}"
                                 f" ({b} it) is not ordered before it: no dependency or message orders them", *at)
        entry = (n, int(me[n]), (key[0], at[1], at[2], "write" if write else "read"))
        if write:
            last[0], last[1] = entry, []
        else:
            last[1].append(entry)
        return None

    def _step(self, n: int) -> Violation | None | bool:
        """Run block n's next step if it is ready: False when it waits, a Violation, else None."""
        r, b = self.blocks[n]
        k = self.pc[n]
        st = b.steps[k]
        kind = st.kind
        at = (r.id, b.id, k, st.type)
        if st.depid >= 0:
            dn = self.comp[(r.id, st.depid)]
            pub = self.published.get(dn)
            if pub is None or pub[0] < st.deps:
                return False
        msg = None
        if kind.receives:
            q = self.fifo.get((b.recv, r.id, b.chan))
            if not q:
                return False
            msg = q[0]
            if msg[0] != st.cnt:
                return Violation(f"receives {st.cnt} chunks where rank {b.recv} threadblock {msg[2][1]} step"
                                 f" {msg[2][2]} sends {msg[0]} on channel {b.chan}", *at)
            q.popleft()
        clock = self.clock[n]  # stored only as copies (messages, published steps)
        clock[n] += 1
        if st.depid >= 0:
            pub = self.published[self.comp[(r.id, st.depid)]]
            np.maximum(clock, pub[1][st.deps], out=clock)
        if msg is not None:
            np.maximum(clock, msg[3], out=clock)
        mem = self.mem[r.id]
        src = self._chunks(r.id, st.srcbuf, st.srcoff, st.cnt) if kind.reads_src else []
        dst = self._chunks(r.id, st.dstbuf, st.dstoff, st.cnt) if kind.writes_dst or kind.reads_dst else []
        for key in src:
            v = self._touch(n, (r.id,) + key, False, at)
            if v:
                return v
        if kind.reads_dst:
            for key in dst:
                v = self._touch(n, (r.id,) + key, False, at)
                if v:
                    return v
        local = [mem[bf][c] for bf, c in src]
        if self.first_undef is None and any(x is UNDEF for x in local):
            self.first_undef = at
        if st.type == "re":
            value = [_fold(mem[bf][c], x) for (bf, c), x in zip(dst, local)]
        elif kind.reduces:
            value = [_fold(a, x) for a, x in zip(msg[1], local)]
        elif kind.receives:
            value = list(msg[1])
        else:
            value = local
        if kind.reduces:
            self.reduced[r.id] += st.cnt
        if kind.writes_dst:
            for key, x in zip(dst, value):
                v = self._touch(n, (r.id,) + key, True, at)
                if v:
                    return v
                mem[key[0]][key[1]] = x
                self.writer[(r.id,) + key] = at
        if kind.sends:
            self.fifo.setdefault((r.id, b.send, b.chan), deque()).append((st.cnt, value, at, clock.copy()))
            self.sent[r.id] += st.cnt
            self.sends[r.id] += 1
        if st.hasdep:
            pub = self.published.setdefault(n, [-1, {}])
            pub[0] = k
            pub[1][k] = clock.copy()
        self.order.append((r.id, b.id, k))
        self.pc[n] += 1
        return None

    def run(self) -> Violation | None:
        # Steps that receive run only when nothing else can: the order is the executors'
        # (each rank runs its steps in it), and a rank that sends what it can before it
        # waits keeps its peers busy.
        moved = True
        while moved:
            moved = False
            for receiving in (False, True):
                for n, (r, b) in enumerate(self.blocks):
                    while self.pc[n] < len(b.steps):
                        if not receiving and b.steps[self.pc[n]].kind.receives:
                            break
                        v = self._step(n)
                        if v is False:
                            break
                        if v is not None:
                            return v
                        moved = True
                        if receiving:
                            break
                if moved:
                    break
        stuck = [n for n, (r, b) in enumerate(self.blocks) if self.pc[n] < len(b.steps)]
        if stuck:
            return self._stuck(stuck[0])
        for (src, dst, chan), q in self.fifo.items():
            if q:
                at = q[0][2]
                return Violation(f"sends {q[0][0]} chunks to rank {dst} on channel {chan} that no step receives", *at)
        return self._postcondition()

    def _waits_for(self, n: int):
        """(block it waits for, why) of a stuck block n."""
        r, b = self.blocks[n]
        st = b.steps[self.pc[n]]
        if st.depid >= 0:
            dn = self.comp[(r.id, st.depid)]
            pub = self.published.get(dn)
            if pub is None or pub[0] < st.deps:
                return dn, f"threadblock {st.depid} of its rank to finish step {st.deps}"
        sender = next((self.comp[(b.recv, x.id)] for x in self.s.ranks[b.recv].blocks
                       if x.send == r.id and x.chan == b.chan), None)
        return sender, f"{st.cnt} chunks from rank {b.recv} on channel {b.chan}"

    def _at(self, n: int) -> tuple:
        r, b = self.blocks[n]
        return r.id, b.id, self.pc[n], b.steps[self.pc[n]].type

    def _stuck(self, n: int) -> Violation:
        """The cause, followed from stuck block n: a receive nobody sends, a wait on a
        block that finished without what it waits for, or a cycle of waits."""
        chain = [n]
        while True:
            cur = chain[-1]
            target, why = self._waits_for(cur)
            if target is None:
                r, b = self.blocks[cur]
                return Violation(f"waits for {why}: no threadblock of rank {b.recv} sends to rank {r.id} on"
                                 f" channel {b.chan}", *self._at(cur))
            tr, tb = self.blocks[target]
            if self.pc[target] >= len(tb.steps):
                return Violation(f"waits for {why}, which never come (rank {tr.id} threadblock {tb.id}"
                                 " finished without them)", *self._at(cur))
            if target in chain:
                loop = chain[chain.index(target):] + [target]
                text = " -> ".join(f"rank {self.blocks[x][0].id} threadblock {self.blocks[x][1].id} step {self.pc[x]}"
                                   for x in loop)
                return Violation(f"deadlock: waits for {why}; the waits form a cycle: {text}", *self._at(cur))
            chain.append(target)

    def _postcondition(self) -> Violation | None:
        s = self.s
        for r in s.ranks:
            sizes = buffer_sizes(s, r, self.inplace)
            for k in range(sizes["o"]):
                key = self.alias[r.id]("o", k)
                got = self.mem[r.id][key[0]][key[1]]
                want = expected(s, r.id, k)
                if got is not UNDEF and Counter(got) == Counter(want):
                    continue
                mode = "in place" if self.inplace else "out of place"
                wrote = self.writer.get((r.id,) + key)
                if got is UNDEF:
                    text = f"output chunk {k} is never written ({mode})"
                    if self.first_undef:
                        u = self.first_undef
                        text += f"; the first read of an unwritten chunk: rank {u[0]} threadblock {u[1]} step {u[2]}"
                    return Violation(text, r.id)
                return Violation(f"output chunk {k} holds {_describe(got)} where {s.collective} needs "
                                 f"{_describe(want)} ({mode})" + _diff(got, want)
                                 + (f"; last written by threadblock {wrote[1]} step {wrote[2]} ({wrote[3]})"
                                    if wrote else ""), r.id)
        return None


def _fold(a, b):
    if a is UNDEF or b is UNDEF:
        return UNDEF
    return tuple(sorted(a + b))


def _describe(c) -> str:
    items = Counter(c)
    if len(items) > 4:
        return f"{len(c)} contributions"
    return "{" + ", ".join(f"rank {q} chunk {k}" + (f" x{m}" if m > 1 else "") for (q, k), m in sorted(items.items())) + "}"


def _diff(got, want) -> str:
    g, w = Counter(got), Counter(want)
    twice = [x for x in g if g[x] > w.get(x, 0) and x in w]
    missing = [x for x in w if g.get(x, 0) < w[x]]
    extra = [x for x in g if x not in w]
    parts = []
    if twice:
        parts.append("reduced more than once: " + ", ".join(f"rank {q} chunk {k}" for q, k in twice[:3]))
    if missing:
        parts.append("missing: " + ", ".join(f"rank {q} chunk {k}" for q, k in missing[:3]))
    if extra:
        parts.append("not its own: " + ", ".join(f"rank {q} chunk {k}" for q, k in extra[:3]))
    return " — " + "; ".join(parts) if parts else ""


def violations(s: Schedule) -> Violation | None:
    """The first violation of the schedule, or None."""
    return _verify(s)[0]


def _verify(s: Schedule):
    v = rules(s)
    if v is not None:
        return v, None
    orders = {}
    sims = []
    for inplace in s.modes():
        sim = _Sim(s, inplace)
        v = sim.run()
        if v is not None:
            return v, None
        orders[inplace] = tuple(sim.order)
        sims.append(sim)
    for inplace in {True, False} - set(s.modes()):  # a call kind not declared may still be provable: no copy needed
        sim = _Sim(s, inplace)
        if sim.run() is None:
            orders[inplace] = tuple(sim.order)
    sim = sims[0]
    steps = max(sum(1 for b in r.blocks for st in b.steps if st.type != "nop") for r in s.ranks)
    summary = Summary(
        collective=s.collective, ranks=s.size, chunks=s.chunks,
        modes=tuple("in place" if m else "out of place" for m in s.modes()), channels=s.channels,
        blocks=max(len(r.blocks) for r in s.ranks), steps=steps,
        sent=max(sim.sent.values(), default=0), reduced=max(sim.reduced.values(), default=0),
        messages=max(sim.sends.values(), default=0), hops=levels(s, orders[s.modes()[0]], s.size).steps_host,
        order=tuple(orders.items()),
    )
    return None, summary


def check(s: Schedule, source: str = "") -> Summary:
    """Prove the schedule (ScheduleError naming the first violation) and summarise it;
    the summary carries one valid order of its steps for each call kind (the executor's)."""
    v, summary = _verify(s)
    if v is not None:
        raise ScheduleError(v, source)
    return summary
