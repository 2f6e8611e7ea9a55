"""Recursive halving-doubling (Rabenseifner): reduce-scatter by recursive halving,
all-gather by recursive doubling. Ring's bandwidth with log2(p) latency; groups of
any size are folded onto a power of two first."""
import torch

from commlab.core import chunks
from commlab.core.reduction import combine_

from .. import pow2
from ..base import Algorithm, Cost, Stage


class HalvingDoubling(Algorithm):
    name = "rhd"
    summary = "Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather"
    formula = "2·log2(p)α + 2(p-1)/p·nβ + (p-1)/p·nγ  (p a power of two; else +2α, +nβ, +nγ for the fold)"
    wins_when = "medium to large messages when α matters: log steps at ring's bandwidth"
    order = 40

    def cost(self, p, nbytes):
        q, extra = pow2.folded(p)
        return Cost(
            2 * pow2.log2(q) + 2 * extra,
            2 * (q - 1) / q * nbytes + extra * nbytes,
            (q - 1) / q * nbytes + extra * nbytes,
        )

    def stages(self, hosts, per_host, nbytes):
        if hosts == 1:
            return super().stages(hosts, per_host, nbytes)
        if pow2.folded(hosts * per_host)[1]:
            return None  # folded groups: not derived
        # Halving starts with the nearest partner: log2(per_host) steps on the host with
        # pieces n/2 ... n/per_host, then log2(hosts) across with what is left, every rank
        # of a host at once: per_host · 2(hosts-1)/hosts · n/per_host on each link.
        near = 1 - 1 / per_host
        far = (1 - 1 / hosts) / per_host
        return [Stage("host", 2 * pow2.log2(per_host), 2 * near * nbytes, near * nbytes, self.name),
                Stage("link", 2 * pow2.log2(hosts), 2 * per_host * far * nbytes, far * nbytes, self.name,
                      rank_bytes=2 * far * nbytes)]

    def run(self, buf, op, ctx):
        scratch = torch.empty_like(buf)
        f = pow2.fold_in(buf, op, ctx, scratch)
        if f.newrank is not None and f.pow2 > 1:
            self._pow2(buf, op, ctx, f, scratch)
        pow2.fold_out(buf, ctx, f)

    @staticmethod
    def _pow2(buf, op, ctx, f, scratch):
        nr = f.newrank
        b = chunks.bounds(buf.numel(), f.pow2)

        def span(lo, hi):
            return buf[b[lo][0] : b[hi - 1][1]]

        lo, hi = 0, f.pow2
        given = []
        # Nearest partner first: with ranks numbered host by host, the halving's large
        # first pieces stay on the host and only the last log2(hosts) steps, with
        # pieces of n/(ranks per host) and less, cross host links (stages()).
        mask = 1
        while mask < f.pow2:
            partner = f.real(nr ^ mask)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if nr & mask else ((lo, mid), (mid, hi))
            mine = span(*keep)
            incoming = scratch[: mine.numel()]
            ctx.p2p.run([(span(*give), partner)], [(incoming, partner)])
            combine_(mine, incoming, op)
            given.append((give, partner))
            lo, hi = keep
            mask <<= 1
        # Now this rank owns the full reduction of chunk `nr`; double back out.
        for give, partner in reversed(given):
            ctx.p2p.run([(span(lo, hi), partner)], [(span(*give), partner)])
            lo, hi = min(lo, give[0]), max(hi, give[1])


ALGORITHM = HalvingDoubling()
