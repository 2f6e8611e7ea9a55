"""BytePS-style sharded parameter server: rank k serves the k-th 1/p of the tensor.
Same bytes per rank as the ring, in two all-to-all phases: the central server, not
the parameter-server idea, is what does not scale."""
import torch

from commlab.core import chunks
from commlab.core.reduction import reduce_into
from commlab.schedule.build import Builder

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

    def schedule(self, p):
        b = Builder("all_reduce", p, per_rank=p, name="ps_sharded", inplace=True)
        for r in range(1, p):  # push: rank 0's share of chunk r starts its owner's fold
            b.send(0, ("i", r), r, ("s", 0))
        for r in range(p):  # every owner folds in rank order, as run() does, straight from the messages
            acc = ("i", 0) if r == 0 else ("s", 0)
            for k in range(1, p):
                if k == r:
                    b.reduce(r, ("i", r), acc)
                else:
                    b.send(k, ("i", r), r, acc, fold_with=acc)
            if r != 0:
                b.copy(r, acc, ("i", r))
        for r in range(p):  # pull: every owner's chunk to every rank
            for k in range(1, p):
                b.send(r, ("i", r), (r + k) % p, ("i", r))
        return b.build()

ALGORITHM = ShardedParameterServer()
