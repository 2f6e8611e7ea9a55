"""The one shape every reduce-scatter algorithm has: `run(out, inp, op, ctx)` leaves in
the flat contiguous `out` (n elements) the reduction over every rank of block `rank` of
its flat contiguous `inp` (p blocks of n, rank order); `inp` is left as it was.
Validation, AVG, strided layouts, agreement, async and errors live once, in
commlab/api/reduce_scatter.py."""
from __future__ import annotations

import torch

from commlab.core.reduction import Op

from ..base import Context, FamilyMember


class ReduceScatterAlgorithm(FamilyMember):
    collective = "reduce_scatter"

    @staticmethod
    def busbw_factor(p: int) -> float:
        """nccl-tests' reduce-scatter factor (p-1)/p of the input's size."""
        return (p - 1) / p if p > 1 else 0.0

    def unsupported(self, inp: torch.Tensor, op: Op, info) -> str | None:
        """Why this algorithm cannot serve the call, from facts every rank shares."""
        return None


    def run(self, out: torch.Tensor, inp: torch.Tensor, op: Op, ctx: Context) -> None:
        """out (n > 0 elements, contiguous) = op over ranks of their inp block ctx.rank
        (inp: p·n elements, contiguous, not modified); op is SUM, PRODUCT, MIN or MAX;
        ctx.size > 1. Every block is reduced in a fixed order, whatever the timing."""
        raise NotImplementedError


def slices(inp: torch.Tensor, p: int) -> list[torch.Tensor]:
    """inp's p blocks (views)."""
    return list(inp.view(p, -1).unbind(0))
