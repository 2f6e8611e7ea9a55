"""Recursive doubling (Thakur, Rabenseifner & Gropp 2005): ⌈log2 p⌉ steps, the data
exchanged doubling each step. A power-of-two group exchanges in place with partner
r xor 2^k; any other p runs Bruck's concatenation (MPICH's allgather Bruck): in step k
rank r sends the first min(2^k, p-2^k) blocks it holds to r-2^k, then rotates once."""
import torch

from ..base import Cost, Stage
from .base import AllGatherAlgorithm, as_bytes, blocks, place_own


class RecursiveDoubling(AllGatherAlgorithm):
    name = "rd"
    summary = "recursive doubling (in place) for powers of two, Bruck for any p: ⌈log2 p⌉ steps"
    formula = "⌈log2 p⌉α + (p-1)/p·nβ"
    wins_when = "small messages: log2 p steps instead of p-1"
    order = 20

    def cost(self, p, nbytes):
        return Cost((p - 1).bit_length() if p > 1 else 0, (p - 1) / p * nbytes, 0.0)

    def stages(self, hosts, per_host, nbytes):
        if hosts == 1:
            return super().stages(hosts, per_host, nbytes)
        p = hosts * per_host
        if p & (p - 1) or per_host & (per_host - 1):
            return None  # Bruck's shifts cross hosts at every distance: not modelled
        # Partners closer than per_host share a host; the others cross, every rank of a host at once.
        steps_host, steps_link, b_host, b_link = 0, 0, 0.0, 0.0
        d = 1
        while d < p:
            moved = min(d, p - d) * nbytes / p
            if d < per_host:
                steps_host, b_host = steps_host + 1, b_host + moved
            else:
                steps_link, b_link = steps_link + 1, b_link + moved * per_host
            d *= 2
        return [Stage("host", steps_host, b_host, 0.0, self.name),
                Stage("link", steps_link, b_link, 0.0, self.name, rank_bytes=b_link / per_host)]

    def run(self, out, inp, ctx):
        p, r = ctx.size, ctx.rank
        b = blocks(out, p)
        if p & (p - 1) == 0:
            place_own(b, inp, r)
            whole = as_bytes(out).view(p, -1)
            d = 1
            while d < p:
                partner = r ^ d
                mine, theirs = (r // d) * d, (partner // d) * d
                ctx.p2p.run([(whole[mine:mine + d].view(-1), partner)], [(whole[theirs:theirs + d].view(-1), partner)])
                d *= 2
            return
        # Bruck: tmp block j ends as rank (r + j) mod p's.
        n = b[0].numel()
        tmp = torch.empty(p, n, dtype=torch.uint8, device=out.device)
        tmp[0].copy_(as_bytes(inp))
        d = 1
        while d < p:
            k = min(d, p - d)
            ctx.p2p.run([(tmp[:k].view(-1), (r - d) % p)], [(tmp[d:d + k].view(-1), (r + d) % p)])
            d *= 2
        whole = as_bytes(out).view(p, -1)
        whole[r:].copy_(tmp[:p - r])
        if r:
            whole[:r].copy_(tmp[p - r:])


ALGORITHM = RecursiveDoubling()
