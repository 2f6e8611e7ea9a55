"""Recursive halving (Thakur, Rabenseifner & Gropp 2005; MPICH's reduce-scatter for
commutative ops): ⌈log2 p⌉ exchanges, the data halving each one. At distance d rank r
keeps the half of its current range of blocks that holds block r, sends its partner
r xor d the other half and folds the partner's copy of its own half in. Any other p is
folded first (MPICH's way): of the first 2·(p−p') ranks (p' the largest power of two
below p) each even one hands its whole input to the odd one after it and sits out; the
p' that remain halve over ranges of blocks, two blocks for a rank that stands for a
pair, and hand the sat-out rank its block at the end."""
import torch

from commlab.core.reduction import combine_into

from ..base import Cost
from .base import ReduceScatterAlgorithm


class RecursiveHalving(ReduceScatterAlgorithm):
    name = "rh"
    summary = "recursive halving: log2 p exchanges of halving size; any p folded onto a power of two"
    formula = "⌈log2 p⌉α + (p-1)/p·nβ + (p-1)/p·nγ (p a power of two; else +2α + n(1+1/p)β + nγ)"
    wins_when = "small and medium messages: log2 p steps instead of p-1"
    order = 20

    def cost(self, p, nbytes):
        if p <= 1:
            return Cost(0, 0.0, 0.0)
        q = 1 << (p.bit_length() - 1)
        if q == p:
            return Cost(q.bit_length() - 1, (p - 1) / p * nbytes, (p - 1) / p * nbytes)
        # Fold (the whole input), halving over q, hand-back (one block).
        return Cost(q.bit_length() + 1, nbytes + (q - 1) / q * nbytes + nbytes / p,
                    nbytes + (q - 1) / q * nbytes)

    def run(self, out, inp, op, ctx):
        p, r = ctx.size, ctx.rank
        q = 1 << (p.bit_length() - 1)
        rem = p - q
        n = out.numel()
        # Virtual ranks: a pair (2v, 2v+1), v < rem, is v, played by its odd rank.
        if r < 2 * rem and r % 2 == 0:
            ctx.p2p.run([(inp, r + 1)], [])
            ctx.p2p.run([], [(out, r + 1)])
            return
        v = r // 2 if r < 2 * rem else r - rem

        def first(u):  # the first block of virtual rank u (first(q) = p)
            return 2 * u if u < rem else u + rem

        acc = inp.clone().view(p, n)  # this rank's running reduction of every block it still holds
        if r < 2 * rem:
            got = torch.empty_like(inp)
            ctx.p2p.run([], [(got, r - 1)])
            combine_into(acc.view(-1), got, inp, op)  # the even rank's copy first, as rank order has it
        lo, hi = 0, q  # virtual ranks whose blocks this rank still holds
        d = q // 2
        while d >= 1:
            partner_v = v ^ d
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
            kb, gb = slice(first(keep[0]), first(keep[1])), slice(first(give[0]), first(give[1]))
            partner = 2 * partner_v + 1 if partner_v < rem else partner_v + rem
            landing = torch.empty_like(acc[kb])
            ctx.p2p.run([(acc[gb].reshape(-1), partner)], [(landing.view(-1), partner)])
            # The lower-ranked rank's copy is the left operand, so both sides fold alike.
            if partner_v < v:
                combine_into(acc[kb], landing, acc[kb], op)
            else:
                combine_into(acc[kb], acc[kb], landing, op)
            lo, hi = keep
            d //= 2
        mine = acc[r]
        if r < 2 * rem:  # this rank stands for the pair: its sat-out partner's block goes back
            ctx.p2p.run([(acc[r - 1], r - 1)], [])
        out.copy_(mine)


ALGORITHM = RecursiveHalving()
