"""Running a checked schedule on one rank over point-to-point transfers.

The checker's run gives one valid global order of every step; each rank runs its own
steps in that order. Every receive is posted at the start (a channel is a tag, and
messages of one tag pair in order), a send is posted when its step runs and waited for
only before a step that rewrites what it reads (its receive is already posted: the wait
needs nothing of the peer but its call begun): a rank that otherwise blocks only on
receives, in an order consistent with one where every receive follows its send, cannot
deadlock.

Sizes: a block of n elements (the whole buffer for all-reduce and broadcast, one rank's
block otherwise) is `per_rank` chunks of n // per_rank elements; the n % per_rank left
over run the schedule once more, one element a chunk, on padded copies of the tails.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.core.reduction import Op, combine_into

from .check import Summary
from .ir import BLOCKED, Schedule
from .native import compile_schedule
from .rules import alias


@dataclass(frozen=True)
class Layout:
    """Where chunk k of a buffer lies: blocks of `stride` elements, `per_block` chunks of
    `elems` each at the front of every block."""

    tensor: torch.Tensor
    per_block: int
    elems: int
    stride: int

    def view(self, k: int, cnt: int = 1) -> torch.Tensor | None:
        """Chunks k..k+cnt as one view, or None when they are not contiguous."""
        j, c = divmod(k, self.per_block)
        if cnt > 1 and (c + cnt > self.per_block and self.stride != self.per_block * self.elems):
            return None
        start = j * self.stride + c * self.elems
        return self.tensor[start:start + cnt * self.elems]


class Program:
    """One rank's steps of a schedule, for one call kind, in the checker's order."""

    def __init__(self, s: Schedule, summary: Summary, rank: int, inplace: bool):
        order = dict(summary.order)[inplace]
        blocks = {b.id: b for b in s.ranks[rank].blocks}
        self.steps = [(blocks[b], blocks[b].steps[k]) for r, b, k in order if r == rank]
        self.alias = alias(s, rank, inplace)
        self.s_chunks = s.ranks[rank].s_chunks
        # A send whose chunks a later step of this rank rewrites is waited for before that
        # step (a posted send reads its memory until it completes; every receive is posted
        # at its rank's call start, so waiting for a send needs nothing more of its peer).
        writes = [set() for _ in self.steps]
        for n, (b, st) in enumerate(self.steps):
            if st.kind.writes_dst:
                writes[n] = {self.alias(st.dstbuf, st.dstoff + x) for x in range(st.cnt)}
        self.writes_input = any(k[0] == "i" for w in writes for k in w)
        self.rewrites = [None] * len(self.steps)  # send n -> the first later step that writes its chunks
        for n, (b, st) in enumerate(self.steps):
            if st.type == "s":
                mine = {self.alias(st.srcbuf, st.srcoff + x) for x in range(st.cnt)}
                self.rewrites[n] = next((m for m in range(n + 1, len(self.steps)) if writes[m] & mine), None)
        self.receives = [(b, st) for b, st in self.steps if st.kind.receives]
        # A plain receive whose chunks no earlier step of this rank touches lands in place:
        # posted at the call's start, it may land any time before its step.
        touched, self.lands_in_place = set(), []
        for b, st in self.steps:
            mine = [self.alias(st.dstbuf, st.dstoff + x) for x in range(st.cnt)] if st.kind.writes_dst else []
            if st.kind.receives:
                self.lands_in_place.append(st.type == "r" and not touched & set(mine))
            touched |= set(mine)
            if st.kind.reads_src:
                touched |= {self.alias(st.srcbuf, st.srcoff + x) for x in range(st.cnt)}

    def run(self, bufs: dict, elems: int, op: Op, p2p, peer) -> None:
        """bufs: 'i', 'o' (as memory: an aliased one absent) and 's' Layouts, chunks of
        `elems` elements; peer(v) the group rank playing schedule rank v."""
        some = next(iter(bufs.values())).tensor

        def chunks(buf, off, cnt):
            out = []
            for x in range(cnt):
                b, k = self.alias(buf, off + x)
                out.append(bufs[b].view(k))
            return out

        def whole(buf, off, cnt):
            b, k = self.alias(buf, off)
            if cnt > 1 and self.alias(buf, off + cnt - 1) != (b, k + cnt - 1):
                return None
            return bufs[b].view(k, cnt)

        def views(buf, off, cnt):
            """Chunks that lie back to back as one view, which one call moves or folds (a
            step of many chunks costs what a step of one does); else chunk by chunk."""
            span = whole(buf, off, cnt)
            return [span] if span is not None else chunks(buf, off, cnt)

        landing = []
        for (b, st), direct in zip(self.receives, self.lands_in_place):
            view = whole(st.dstbuf, st.dstoff, st.cnt) if direct else None
            landing.append(view if view is not None else
                           torch.empty(st.cnt * elems, dtype=some.dtype, device=some.device))
        posted = p2p.post([], [(t, peer(b.recv), b.chan) for t, (b, _) in zip(landing, self.receives)])
        sends, got_n = [], 0
        held: dict = {}  # step -> sends reading what it writes

        for n, (b, st) in enumerate(self.steps):
            kind = st.kind
            if st.type == "nop":
                continue
            for work in held.pop(n, ()):
                work.wait_all()
            got = None
            if kind.receives:
                posted.wait_recv(got_n)
                got = landing[got_n]
                got_n += 1
            src = views(st.srcbuf, st.srcoff, st.cnt) if kind.reads_src else None
            dst = views(st.dstbuf, st.dstoff, st.cnt) if kind.writes_dst else None
            span = src[0] if src is not None and len(src) == 1 else None  # the source as one view
            if st.type == "re":
                for d, x in _pieces(dst, src):
                    combine_into(d, x, d, op)  # the runtime's order: src (op) dst
                continue
            if kind.reduces:  # received (op) local, as the runtime folds
                if not kind.sends:  # rrc: straight into dst
                    for (d, mine), part in zip(_pieces(dst, src), _slices(got, dst, src)):
                        combine_into(d, part, mine, op)
                    continue
                for mine, part in zip(src, _slices(got, src)):
                    combine_into(part, part, mine, op)
            if kind.writes_dst:
                pairs = zip(dst, _slices(got, dst)) if got is not None else _pieces(dst, src)
                for d, piece in pairs:
                    if piece.data_ptr() != d.data_ptr():
                        d.copy_(piece)
            if kind.sends:
                if got is not None:
                    payload = got
                else:
                    payload = span if span is not None else torch.cat(src)
                sends.append(p2p.post([(payload, peer(b.send), b.chan)], []))
                if self.rewrites[n] is not None and payload is span:
                    held.setdefault(self.rewrites[n], []).append(sends[-1])
        for step in sends:
            step.wait_all()
        posted.wait_all()


def _pieces(a: list, b: list):
    """(a piece, b piece) pairs over the same elements: whole spans, or chunk by chunk
    where either side is split (a span is then cut into chunk views)."""
    if len(a) == len(b):
        return zip(a, b)
    n = max(len(a), len(b))
    return zip(_cut(a, n), _cut(b, n))


def _cut(views: list, n: int) -> list:
    return views if len(views) == n else list(views[0].chunk(n))


def _slices(got, *sides):
    """The received buffer cut as the finest of `sides` is."""
    n = max(len(x) for x in sides)
    return [got] if n == 1 else list(got.chunk(n))


class Runner:
    """A schedule served to one family's calls: the programs per rank and call kind,
    built on first use (each rank builds only its own)."""

    def __init__(self, s: Schedule, summary: Summary):
        self.s, self.summary = s, summary
        self.kinds = dict(summary.order)
        self._programs: dict = {}
        c = s.collective
        self.memory = "o" if c == "all_gather" else "i"  # the one buffer of an in-place call
        self.per_rank_blocks = {"i": s.size if c in ("reduce_scatter", "all_to_all") else 1,
                                "o": s.size if c in ("all_gather", "all_to_all") else 1}

    def program(self, rank: int, inplace: bool):
        key = (rank, inplace)
        if key not in self._programs:
            self._programs[key] = self._build(rank, inplace)
        return self._programs[key]

    def _build(self, rank: int, inplace: bool):
        return Program(self.s, self.summary, rank, inplace)

    def copies(self, inplace: bool) -> str:
        """What serving this call kind costs beyond the schedule's own steps."""
        if inplace in self.kinds:
            return "none"
        return ("the input copied aside first (the schedule is proved out of place only)" if inplace
                else "the input copied into place first (the schedule is proved in place only)")

    def run(self, inp: torch.Tensor | None, out: torch.Tensor, rank: int, op: Op, p2p, peer) -> None:
        """out = the collective of every rank's inp; inp None for an in-place call (out
        holds the input where that call has it: all-gather's in this rank's block).
        `rank`: the schedule rank this one plays; peer(v): the group rank playing v."""
        s = self.s
        inplace = inp is None
        if inplace and True not in self.kinds:
            inp = out.view(s.size, -1)[rank].clone() if s.collective == "all_gather" else out.clone()
            inplace = False
        if not inplace and False not in self.kinds:
            if s.collective == "all_gather":
                own = out.view(s.size, -1)[rank]
                if own.data_ptr() != inp.data_ptr():
                    own.copy_(inp.view(-1))
                self._execute(self.program(rank, True), {"o": out}, op, p2p, peer)
            elif s.collective == "reduce_scatter":
                whole = inp.clone()
                self._execute(self.program(rank, True), {"i": whole}, op, p2p, peer)
                out.copy_(whole.view(s.size, -1)[rank])
            else:
                out.copy_(inp)
                self._execute(self.program(rank, True), {"i": out}, op, p2p, peer)
            return
        program = self.program(rank, inplace)
        if inplace:
            self._execute(program, {self.memory: out}, op, p2p, peer)
            return
        if program.writes_input:  # the caller's input is never modified
            inp = inp.clone()
        self._execute(program, {"i": inp, "o": out}, op, p2p, peer)

    def _execute(self, program: Program, buffers: dict, op: Op, p2p, peer) -> None:
        """buffers: the flat tensors in memory ('i', 'o'); prefix chunks then the tails."""
        s = self.s
        per = s.per_rank
        some = next(iter(buffers))
        n = buffers[some].numel() // self.per_rank_blocks[some]
        elems, tail = divmod(n, per)
        if elems:
            program.run(self._layouts(buffers, per, elems, n, program.s_chunks), elems, op, p2p, peer)
        if tail:
            staged = {k: _tails(v, self.per_rank_blocks[k], n, per, elems) for k, v in buffers.items()}
            program.run(self._layouts(staged, per, 1, per, program.s_chunks), 1, op, p2p, peer)
            result = "o" if "o" in buffers else "i"
            _untail(buffers[result], staged[result], self.per_rank_blocks[result], n, per, elems, tail)

    @staticmethod
    def _layouts(buffers: dict, per: int, elems: int, stride: int, s_chunks: int) -> dict:
        some = next(iter(buffers.values()))
        out = {k: Layout(v.view(-1), per, elems, stride) for k, v in buffers.items()}
        out["s"] = Layout(torch.empty(s_chunks * elems, dtype=some.dtype, device=some.device), max(s_chunks, 1),
                          elems, max(s_chunks, 1) * elems)
        return out


def _tails(t: torch.Tensor, blocks: int, n: int, per: int, elems: int) -> torch.Tensor:
    """Each block's last n - per·elems elements, padded to `per` (zeros: never a result)."""
    staged = torch.zeros(blocks * per, dtype=t.dtype, device=t.device)
    tail = n - per * elems
    staged.view(blocks, per)[:, :tail].copy_(t.view(blocks, n)[:, per * elems:])
    return staged


def _untail(out: torch.Tensor, staged: torch.Tensor, blocks: int, n: int, per: int, elems: int, tail: int) -> None:
    out.view(blocks, n)[:, per * elems:].copy_(staged.view(blocks, per)[:, :tail])


_NONE = torch.empty(0)  # a buffer the schedule does not have


@dataclass(frozen=True)
class _Native:
    compiled: object
    rank: int
    writes_input: bool


class NativeRunner(Runner):
    """The same calls run by the shared-memory executor: `p2p` is then run(program), which
    hands program(comm) the group's communicator (transports/shm.run_schedule)."""

    def __init__(self, s: Schedule, summary: Summary, kind: int):
        super().__init__(s, summary)
        self.kind = kind
        self._compiled: dict = {}
        self._turned: dict = {}  # (compiled, rank, peer(0)) -> its ops with the peers turned, once per root
        self._capacity = None
        # One call kind for every rank (the ops of the two kinds need not pair): out of
        # place where proved, the other kind served by copying, as for an unproved one.
        canonical = False if False in self.kinds else True
        self.kinds = {canonical: self.kinds[canonical]}

    def _build(self, rank: int, inplace: bool):
        if inplace not in self._compiled:
            self._compiled[inplace] = compile_schedule(self.s, self.summary, inplace)
        compiled = self._compiled[inplace]
        return _Native(compiled, rank, compiled.writes_input(rank))

    def _execute(self, program, buffers: dict, op: Op, run, peer) -> None:
        compiled, rank = program.compiled, program.rank
        s = self.s
        per = s.per_rank
        ops = compiled.ops[rank]
        if peer(0) != 0:  # the ranks turned (broadcast's root, a rotation peer(0) names): peers as group ranks
            key = (id(compiled), rank, peer(0))
            turned = self._turned.get(key)
            if turned is None:
                turned = self._turned[key] = ops.clone()
                turned[:, 6] = torch.tensor([peer(int(v)) if v >= 0 else -1 for v in ops[:, 6].tolist()],
                                            dtype=torch.long)
            ops = turned
        some = next(iter(buffers.values()))
        n = some.numel() // self.per_rank_blocks[next(iter(buffers))]
        elsize = some.element_size()
        code = -1 if op is None else int(op)
        total = n * (s.size if s.collective in BLOCKED else 1) * elsize  # the larger buffer: alike on every rank

        def call(tensors: dict, stride: int, cstride: int, passes: list, elems: int):
            bufs, shape = [], []
            for name in ("i", "o"):
                t = tensors.get(name)
                bufs.append(t.view(-1) if t is not None else _NONE)
                shape += [per, stride, cstride, 0]
            s_chunks = s.ranks[rank].s_chunks
            bufs += [torch.empty(s_chunks * elems, dtype=some.dtype) if s_chunks else _NONE,
                     torch.empty(compiled.hold * elems, dtype=some.dtype)]
            shape += [0, 0, 0, 0] * 2
            flat = [x for pass_ in passes for x in pass_]
            run(lambda comm: comm.run_schedule(bufs, shape, ops, flat, code, self.kind, total,
                                               compiled.fingerprint, compiled.ticks))

        whole, tail = divmod(n, per)
        if n == 0:  # still checked against every peer's call: a call with nothing to move
            call({"i": torch.empty(1, dtype=some.dtype)}, 1, 1, [], 1)
            return
        if self._capacity is None:
            self._capacity = run(lambda comm: comm.capacity)
        room = max(1, self._capacity * 2 // max(1, compiled.region * elsize))
        if whole:  # passes over part of every chunk, each pass's slots fitting the segment
            call(buffers, n, whole, [(start, min(room, whole - start)) for start in range(0, whole, room)],
                 min(room, whole))
        if tail:
            staged = {k: _tails(v, self.per_rank_blocks[k], n, per, whole) for k, v in buffers.items()}
            call(staged, per, 1, [(0, 1)], 1)
            result = "o" if "o" in buffers else "i"
            _untail(buffers[result], staged[result], self.per_rank_blocks[result], n, per, whole, tail)
