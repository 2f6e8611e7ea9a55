"""Recursive doubling: log2(p) exchanges of the whole tensor. Latency-optimal, so it
wins for small messages; bytes grow as n·log2(p), so it loses for large ones."""
import torch

from commlab.core.reduction import combine_into

from .. import pow2
from ..base import Algorithm, Cost


class RecursiveDoubling(Algorithm):
    name = "rd"
    summary = "recursive doubling: exchange the whole tensor with partner r^2^k, log2(p) rounds"
    formula = "log2(p)α + log2(p)·nβ + log2(p)·nγ  (p a power of two; else +2α, +nβ, +nγ for the fold)"
    wins_when = "small messages: log2(p) steps, each sending the whole tensor"
    order = 50

    def cost(self, p, nbytes):
        q, extra = pow2.folded(p)
        k = pow2.log2(q)
        return Cost(k + 2 * extra, (k + extra) * nbytes, (k + extra) * nbytes)

    def run(self, buf, op, ctx):
        scratch = torch.empty_like(buf)
        f = pow2.fold_in(buf, op, ctx, scratch)
        if f.newrank is not None:
            mask = 1
            while mask < f.pow2:
                partner_new = f.newrank ^ mask
                ctx.p2p.run([(buf, f.real(partner_new))], [(scratch, f.real(partner_new))])
                # Both partners compute lower (op) higher: the same bits on both sides.
                if f.newrank < partner_new:
                    combine_into(buf, buf, scratch, op)
                else:
                    combine_into(buf, scratch, buf, op)
                mask <<= 1
        pow2.fold_out(buf, ctx, f)


ALGORITHM = RecursiveDoubling()
