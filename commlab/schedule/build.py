"""Writing a schedule in Python: say what moves, the builder lays out the threadblocks.

    b = Builder("all_gather", ranks=4)             # one chunk per rank
    for r in range(4):
        b.copy(r, ("i", 0), ("o", r))
        for s in range(3):                         # a ring
            k = (r - s) % 4
            b.send(r, ("o", k), (r + 1) % 4, ("o", k))
    schedule = b.build()

Each rank gets one threadblock per (channel, peer, direction) and one for its local
steps. A step that touches a chunk another block of its rank wrote, or that overwrites
a chunk another block still reads, waits for that block's step (MSCCL's depid/deps;
several waits become the nops MSCCL chains them with), so what is written in program
order stays ordered on a GPU, where blocks run concurrently."""
from __future__ import annotations

from .ir import BLOCKED, Block, Rank, Schedule, Step, buffer_chunks


class Builder:
    def __init__(self, collective: str, ranks: int, per_rank: int = 1, name: str = "", inplace: bool = False,
                 root: int = 0, channels: int | None = None):
        """per_rank: chunks of each rank's block (all-gather's input, reduce-scatter's
        output, one peer's share of all-to-all); all-reduce and broadcast buffers are
        `per_rank` chunks in all. inplace: refs are written as the in-place call lays
        the buffers out (then the schedule declares in-place)."""
        self.collective, self.p, self.per_rank = collective, ranks, per_rank
        self.chunks = per_rank * ranks if collective in BLOCKED else per_rank
        self.name, self.inplace, self.root, self._channels = name, inplace, root, channels
        self.ranks = [Rank(r, 0, 0, 0) for r in range(ranks)]
        self._blocks: list[dict] = [{} for _ in range(ranks)]
        self._access: list[dict] = [{} for _ in range(ranks)]  # (buf, k) -> [last write, reads since]
        self._scratch = [0] * ranks

    def _block(self, r: int, key) -> Block:
        blocks = self._blocks[r]
        if key not in blocks:
            chan, send, recv = key
            blocks[key] = Block(len(blocks), send, recv, chan)
            self.ranks[r].blocks.append(blocks[key])
        return blocks[key]

    def _append(self, r: int, block: Block, step: Step, reads, writes) -> None:
        """Append `step`, preceded by the waits its chunks need on other blocks."""
        acc = self._access[r]
        waits = {}
        for key in reads:
            last = acc.get(key, [None, []])[0]
            if last is not None:
                waits[last[0]] = max(waits.get(last[0], -1), last[1])
        for key in writes:
            last, readers = acc.get(key, [None, []])
            for who in ([last] if last else []) + readers:
                waits[who[0]] = max(waits.get(who[0], -1), who[1])
        waits.pop(block.id, None)  # program order
        blocks = {b.id: b for b in self.ranks[r].blocks}
        waits = sorted(waits.items())
        for bid, k in waits:
            blocks[bid].steps[k].hasdep = True
        for bid, k in waits[:-1]:
            block.steps.append(Step("nop", "i", -1, "o", -1, 0, bid, k, False))
        if waits:
            step.depid, step.deps = waits[-1]
        block.steps.append(step)
        me = (block.id, len(block.steps) - 1)
        for key in reads:
            acc.setdefault(key, [None, []])[1].append(me)
        for key in writes:
            acc[key] = [me, []]
        for buf, off in list(reads) + list(writes):
            if buf == "s":
                self._scratch[r] = max(self._scratch[r], off + 1)

    @staticmethod
    def _span(ref, cnt):
        buf, off = ref
        return [(buf, off + x) for x in range(cnt)]

    def copy(self, rank: int, src, dst, cnt: int = 1) -> None:
        """dst = src on `rank` (refs: (buffer, chunk) with buffer "i", "o" or "s")."""
        self._append(rank, self._block(rank, (0, -1, -1)), Step("cpy", *src, *dst, cnt),
                     self._span(src, cnt), self._span(dst, cnt))

    def reduce(self, rank: int, src, dst, cnt: int = 1) -> None:
        """dst = src (op) dst on `rank`."""
        self._append(rank, self._block(rank, (0, -1, -1)), Step("re", *src, *dst, cnt),
                     self._span(src, cnt) + self._span(dst, cnt), self._span(dst, cnt))

    def send(self, rank: int, src, to: int, dst, cnt: int = 1, channel: int = 0, reduce: bool = False,
             fold_with=None) -> None:
        """src of `rank` lands in dst of rank `to`: copied there, folded into what dst
        holds (reduce=True), or dst = received (op) fold_with, a ref of rank `to`."""
        self._append(rank, self._block(rank, (channel, to, -1)), Step("s", *src, *dst, cnt),
                     self._span(src, cnt), [])
        here = self._span(dst, cnt)
        if reduce or fold_with is not None:
            local = dst if fold_with is None else fold_with
            step = Step("rrc", *local, *dst, cnt)
            self._append(to, self._block(to, (channel, -1, rank)), step, self._span(local, cnt), here)
        else:
            self._append(to, self._block(to, (channel, -1, rank)), Step("r", *src, *dst, cnt), [], here)

    def build(self) -> Schedule:
        c = self.collective
        i, o = buffer_chunks(c, self.chunks, self.p)
        if self.inplace:  # as MSCCL's in-place files: the aliased-away buffer has no chunks
            i, o = (0, o) if c == "all_gather" else (i, 0)
        for r, rank in enumerate(self.ranks):
            rank.i_chunks, rank.o_chunks, rank.s_chunks = i, o, self._scratch[r]
        chans = max((b.chan for r in self.ranks for b in r.blocks), default=0) + 1
        return Schedule(collective=c, ranks=self.ranks, chunks=self.chunks, name=self.name,
                        channels=self._channels or chans, inplace=self.inplace, outofplace=not self.inplace,
                        root=self.root)
