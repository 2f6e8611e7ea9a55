"""The one shape every all-gather algorithm has: `run(out, inp, ctx)` fills the flat
contiguous `out` (p blocks of inp.numel() elements, rank order) with every rank's
`inp`. Validation, strided layouts, agreement, async and errors live once, in
commlab/api/all_gather.py."""
from __future__ import annotations

import torch

from ..base import Context, FamilyMember, as_bytes


class AllGatherAlgorithm(FamilyMember):
    collective = "all_gather"

    @staticmethod
    def busbw_factor(p: int) -> float:
        """nccl-tests' all-gather factor (p-1)/p of the output's size."""
        return (p - 1) / p if p > 1 else 0.0

    def unsupported(self, out: torch.Tensor, info) -> str | None:
        """Why this algorithm cannot serve the call, from facts every rank shares."""
        return None


    def run(self, out: torch.Tensor, inp: torch.Tensor, ctx: Context) -> None:
        """out (p·n elements, contiguous) = every rank's inp (n > 0 elements, contiguous;
        it may be a view of this rank's block of out), in rank order; ctx.size > 1.
        Every rank ends bitwise identical."""
        raise NotImplementedError


def blocks(out: torch.Tensor, p: int) -> list[torch.Tensor]:
    """out's p blocks, as bytes."""
    return list(as_bytes(out).view(p, -1).unbind(0))


def place_own(out_blocks: list[torch.Tensor], inp: torch.Tensor, rank: int) -> None:
    """This rank's input into its own block, unless it is that block already."""
    own, src = out_blocks[rank], as_bytes(inp)
    if own.data_ptr() != src.data_ptr():
        own.copy_(src)
