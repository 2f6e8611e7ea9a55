"""Folding a group of any size onto a power of two (MPICH's approach for recursive
algorithms): with p = 2^k + rem, each of the first 2·rem ranks pairs up, the even
one hands its data to the odd one and sits out until the result comes back."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.core.reduction import combine_into

from .base import Context


@dataclass(frozen=True)
class Fold:
    pow2: int  # ranks that take part in the power-of-two phase
    rem: int
    newrank: int | None  # this rank's index in that phase; None while folded out

    def real(self, newrank: int) -> int:
        """Group rank of a power-of-two-phase index."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem


def plan(p: int, r: int) -> Fold:
    pow2 = 1 << (p.bit_length() - 1)
    rem = p - pow2
    if r < 2 * rem:
        return Fold(pow2, rem, None if r % 2 == 0 else r // 2)
    return Fold(pow2, rem, r - rem)


def fold_in(buf: torch.Tensor, op, ctx: Context, scratch: torch.Tensor) -> Fold:
    f = plan(ctx.size, ctx.rank)
    r = ctx.rank
    if r < 2 * f.rem:
        if f.newrank is None:
            ctx.p2p.run([(buf, r + 1)], [])
        else:
            ctx.p2p.run([], [(scratch, r - 1)])
            combine_into(buf, scratch, buf, op)  # lower rank's data on the left
    return f


def fold_out(buf: torch.Tensor, ctx: Context, f: Fold) -> None:
    r = ctx.rank
    if r < 2 * f.rem:
        if f.newrank is None:
            ctx.p2p.run([], [(buf, r + 1)])
        else:
            ctx.p2p.run([(buf, r - 1)], [])


def log2(n: int) -> int:
    return n.bit_length() - 1


def folded(p: int) -> tuple[int, int]:
    """(the power of two p is folded onto, 1 when folding adds its steps and bytes else 0)."""
    q = 1 << log2(p)
    return q, int(p != q)
