"""A collective as data: what MSCCL's XML carries, in commlab's names.

A schedule moves and reduces *chunks* (equal slices of the caller's buffers) between
`ranks` in ordered steps. Each rank runs `blocks` (MSCCL's threadblocks) concurrently;
a block's steps run in order, and a block talks to at most one peer each way on one
channel. A step may wait for a step of another block of its rank (`depid`/`deps`),
which publishes its progress only when it is marked `hasdep`.

Buffers: `i` the input, `o` the output, `s` a scratch the runtime owns (never zeroed).
Offsets and counts are in chunks. What each step type does (MSCCL's runtime,
rccl's msccl_kernel_impl.h) is the table `KINDS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# MSCCL's `coll` names <-> commlab's families.
COLLS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
         "alltoall": "all_to_all", "broadcast": "broadcast"}
MSCCL_COLL = {v: k for k, v in COLLS.items()}

BUFFERS = ("i", "o", "s")
PROTOCOLS = ("Simple", "LL128", "LL")


@dataclass(frozen=True)
class Kind:
    """What one step type does; `src`/`dst` are local buffers read or written (on a send
    the XML's dst names the receiver's buffer, on a receive its src the sender's: the
    runtime ignores those sides, and so does commlab)."""

    receives: bool
    sends: bool
    reduces: bool  # the result is received (op) local src, or for `re` dst (op) src
    reads_src: bool
    writes_dst: bool
    reads_dst: bool = False  # `re` folds into dst


KINDS = {
    "s": Kind(receives=False, sends=True, reduces=False, reads_src=True, writes_dst=False),
    "r": Kind(receives=True, sends=False, reduces=False, reads_src=False, writes_dst=True),
    "rcs": Kind(receives=True, sends=True, reduces=False, reads_src=False, writes_dst=True),
    "rrs": Kind(receives=True, sends=True, reduces=True, reads_src=True, writes_dst=False),
    "rrc": Kind(receives=True, sends=False, reduces=True, reads_src=True, writes_dst=True),
    "rrcs": Kind(receives=True, sends=True, reduces=True, reads_src=True, writes_dst=True),
    "cpy": Kind(receives=False, sends=False, reduces=False, reads_src=True, writes_dst=True),
    "re": Kind(receives=False, sends=False, reduces=True, reads_src=True, writes_dst=True, reads_dst=True),
    "nop": Kind(receives=False, sends=False, reduces=False, reads_src=False, writes_dst=False),
}


@dataclass
class Step:
    type: str
    srcbuf: str = "i"
    srcoff: int = -1
    dstbuf: str = "o"
    dstoff: int = -1
    cnt: int = 0
    depid: int = -1  # a block of the same rank this step waits for, or -1
    deps: int = -1  # ... until that block has finished its step of this index
    hasdep: bool = False  # another block waits for this step: publish progress after it

    @property
    def kind(self) -> Kind:
        return KINDS[self.type]


@dataclass
class Block:
    """One MSCCL threadblock: steps in order, one send peer and one receive peer (-1:
    none) on channel `chan`."""

    id: int
    send: int = -1
    recv: int = -1
    chan: int = 0
    steps: list[Step] = field(default_factory=list)


@dataclass
class Rank:
    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int = 0
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Schedule:
    """A whole collective on `len(ranks)` ranks; `chunks` is MSCCL's nchunksperloop: the
    caller's larger buffer is that many chunks (all-gather's output, reduce-scatter's
    input, all-to-all's either), each rank's share `chunks // ranks` of them."""

    collective: str  # commlab's family name
    ranks: list[Rank]
    chunks: int
    name: str = ""
    channels: int = 1
    proto: str = "Simple"
    inplace: bool = False
    outofplace: bool = True
    min_bytes: int = 0
    max_bytes: int = 0
    root: int = 0  # broadcast only: MSCCL's XML has no root, a file serves one root
    extra: dict = field(default_factory=dict)  # <algo> attributes MSCCL ignores, kept for the round trip
    # <algo> attributes the file lacked (msccl.COMPILER_OMITS), read as their defaults: a fact
    # of the file, not of the schedule
    absent: tuple = field(default=(), compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def per_rank(self) -> int:
        """Chunks per rank block (msccl-tools' chunk_factor): all-gather's input, reduce-
        scatter's output, one peer's block of all-to-all; all-reduce's and broadcast's
        buffers are one block of `chunks`."""
        return self.chunks // self.size if self.collective in BLOCKED else self.chunks

    def modes(self) -> list[bool]:
        """The call kinds this schedule serves: True in place, False out of place."""
        return [m for m, ok in ((True, self.inplace), (False, self.outofplace)) if ok]

    def steps(self):
        """(rank, block, index, step) of every step, in document order."""
        for r in self.ranks:
            for b in r.blocks:
                for k, st in enumerate(b.steps):
                    yield r, b, k, st


# Families whose larger buffer is p blocks, one per rank.
BLOCKED = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


def buffer_chunks(collective: str, chunks: int, ranks: int) -> tuple[int, int]:
    """(input, output) chunks as the caller's out-of-place call gives them: all-gather's
    input and reduce-scatter's output are one rank's block."""
    one = chunks // ranks if collective in BLOCKED else chunks
    return {"all_gather": (one, chunks), "reduce_scatter": (chunks, one)}.get(collective, (chunks, chunks))
