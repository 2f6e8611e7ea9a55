"""The one shape every all-to-all algorithm has: `run(out, inp, counts, ctx)` sends block q
of the flat contiguous `inp` (counts.send[q] elements, rank order) to rank q and leaves
the block from each rank j (counts.recv[j] elements) in the flat contiguous `out`, in
rank order. Validation, splits along dim 0, strided layouts, agreement, async and errors
live once, in commlab/api/all_to_all.py."""
from __future__ import annotations

import torch

from ..base import Context, FamilyMember, as_bytes  # noqa: F401 - as_bytes: the family's modules import it from here


class Counts:
    """One rank's all_to_all: the elements it sends each group rank and receives from
    each; once the call is agreed, `matrix[j][q]` the elements rank j sends rank q, as
    every rank gathered it (None where the transport checks the counts itself)."""

    def __init__(self, send: list[int], recv: list[int], matrix: torch.Tensor | None = None):
        self.send, self.recv, self.matrix = send, recv, matrix

    def agreed(self, matrix: torch.Tensor) -> "Counts":
        return Counts(self.send, self.recv, matrix)

    @property
    def even(self) -> bool:
        return len(set(self.send)) == 1 and len(set(self.recv)) == 1

    def biggest(self) -> int:
        """The largest block any rank sends any other (the agreed matrix's maximum)."""
        if self.matrix is None:
            raise ValueError("the counts of every rank are known only once the call is agreed")
        return int(self.matrix.max())


def split(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """A flat tensor's blocks of `counts` elements (views, rank order)."""
    return list(t.split(counts))


class AllToAllAlgorithm(FamilyMember):
    collective = "all_to_all"

    @staticmethod
    def busbw_factor(p: int) -> float:
        """nccl-tests' alltoall factor (p-1)/p of each rank's input."""
        return (p - 1) / p if p > 1 else 0.0

    def unsupported(self, inp: torch.Tensor, info) -> str | None:
        """Why this algorithm cannot serve the call, from facts every rank shares."""
        return None


    def run(self, out: torch.Tensor, inp: torch.Tensor, counts: Counts, ctx: Context) -> None:
        """out (sum(counts.recv) elements, contiguous) = the blocks every rank sends this
        one, in rank order; inp (sum(counts.send), contiguous, not modified, never
        overlapping out); ctx.size > 1; counts.matrix set unless checks_calls."""
        raise NotImplementedError
