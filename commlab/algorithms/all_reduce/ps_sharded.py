"""BytePS-style sharded parameter server: rank k serves the k-th 1/p of the tensor.
Same bytes per rank as the ring, in two all-to-all phases: the central server, not
the parameter-server idea, is what does not scale."""
import torch

from commlab.core import chunks
from commlab.core.reduction import reduce_into

from ..base import Algorithm, Cost


class ShardedParameterServer(Algorithm):
    name = "ps_sharded"
    summary = "every rank serves 1/p of the tensor: push shards, reduce in rank order, pull shards"
    formula = "2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ  (p-1 concurrent messages per phase)"
    wins_when = "medium messages on full-bisection networks: 2 phases instead of 2(p-1) ring steps"
    order = 30

    def cost(self, p, nbytes):
        return Cost(2 * (p - 1), 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def run(self, buf, op, ctx):
        p, r = ctx.size, ctx.rank
        parts = chunks.views(buf, p)
        mine = parts[r]
        peers = [k for k in range(p) if k != r]
        inputs = [mine.clone() if k == r else torch.empty_like(mine) for k in range(p)]
        ctx.p2p.run([(parts[k], k) for k in peers], [(inputs[k], k) for k in peers])
        reduce_into(mine, inputs, op)
        del inputs
        ctx.p2p.run([(mine, k) for k in peers], [(parts[k], k) for k in peers])


ALGORITHM = ShardedParameterServer()
