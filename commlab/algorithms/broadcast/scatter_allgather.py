"""Scatter then all-gather (van de Geijn; MPICH's broadcast for long messages): the root
scatters p pieces down a binomial tree (relative rank v ends with piece v), then a ring
all-gather gives every rank every piece; each rank sends about 2n instead of log2 p·n."""
from ..base import Cost
from .base import BroadcastAlgorithm, as_bytes, spans


class ScatterAllgather(BroadcastAlgorithm):
    name = "scatter_allgather"
    summary = "binomial scatter of p pieces, then a ring all-gather (van de Geijn)"
    formula = "(⌈log2 p⌉ + p - 1)α + 2(p-1)/p·nβ"
    wins_when = "long messages: bytes per rank independent of p"
    order = 20

    def cost(self, p, nbytes):
        steps = ((p - 1).bit_length() + p - 1) if p > 1 else 0
        return Cost(steps, 2 * (p - 1) / p * nbytes, 0.0)

    def run(self, buf, root, ctx):
        p, r = ctx.size, ctx.rank
        data = as_bytes(buf)
        cut = spans(data.numel(), p)  # piece j belongs to relative rank j

        def pieces(lo, hi):  # the bytes of pieces lo..hi-1 (relative ranks), one span
            return data[cut[lo][0]:cut[min(hi, p) - 1][1]]

        v = (r - root) % p
        # Scatter: v receives the pieces of its subtree [v, v + lowbit(v)) from its parent,
        # then hands each child v + m the pieces of the child's subtree [v + m, v + 2m).
        mask = 1
        while mask < p:
            if v & mask:
                ctx.p2p.run([], [(pieces(v, v + mask), (r - mask) % p)])
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if v + mask < p:
                ctx.p2p.run([(pieces(v + mask, v + 2 * mask), (r + mask) % p)], [])
            mask >>= 1
        # Ring all-gather over relative ranks: step s passes on piece v - s.
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):
            ctx.p2p.run([(pieces((v - s) % p, (v - s) % p + 1), right)],
                        [(pieces((v - s - 1) % p, (v - s - 1) % p + 1), left)])


ALGORITHM = ScatterAllgather()
