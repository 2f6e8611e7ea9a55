"""Hierarchical all-reduce (Horovod's hierarchical allreduce, NCCL's two levels):
reduce-scatter inside each host through shared memory, all-reduce of each shard across
hosts among the ranks with the same local index (Rabenseifner, or ring for large shards
on a host count that is not a power of two), all-gather inside each host.

Any layout: with k = the fewest ranks on any host, the tensor is cut into k shards; a
host with more ranks reduces the whole tensor in shared memory instead of scattering it
and its ranks past index k only take part in the final all-gather. One host: it is
`shm`. One rank per host: it is the inter-host algorithm on the whole tensor.
"""
from __future__ import annotations

import copy
import os
from dataclasses import replace

import torch

from commlab import algorithms
from commlab.transports import shm

from ..base import Algorithm, Cost, Stage
from ..layouts import host_layouts

RING_MIN_SHARD = 1 << 20  # below, Rabenseifner's log2 steps win; at and above, ring's neighbour pattern
# The inter-host stage: the backend's own all-reduce on the shard's group by default. On
# an emulated 1 Gbit/s link commlab's point-to-point steps moved data one direction at a
# time (rhd between 2 hosts: 2n/link-rate, gloo's ring n/link-rate), docs/measurements.md.
# COMMLAB_HIER_INTER=rhd|ring|size (rhd or ring by shard size and host count) picks another.
INTER = "builtin"


class Hierarchical(Algorithm):
    name = "hier"
    summary = "two levels: shm reduce-scatter on each host, all-reduce of each shard across hosts, shm all-gather"
    formula = ("intra: shm reduce-scatter + all-gather (memory traffic ~3n);  inter: the inter-host all-reduce "
               "(COMMLAB_HIER_INTER, default the backend's, a ring: 2(H-1)α + 2(H-1)/H·(n/k)β) of n/k among H hosts "
               "per rank, k ranks per host sharing the link")
    wins_when = "several ranks per host and a slow host link: each host sends its data over the link once"
    devices = ("cpu",)
    order = 65
    level = "shm"

    def cost(self, p, nbytes):
        # On one host it is shm; across hosts see stages().
        return Cost(2, 2 * nbytes, (p - 1) / p * nbytes)

    def stages(self, hosts, per_host, nbytes):
        k = per_host
        # Reduce-scatter + all-gather in shared memory: shm's two-shot all-reduce in two calls.
        intra = [Stage("shm", 2, 2 * nbytes, (k - 1) / k * nbytes, "shm")] if k > 1 else []
        if hosts == 1:
            return intra

        inter = algorithms.get(_inter_name(hosts, int(nbytes / k))).stages(hosts, 1, nbytes / k)
        if inter is None:
            return None
        # The k shards cross each host's link at once, one per local index.
        return intra + [replace(s, bytes=s.bytes * k, rank_bytes=s.bytes) if s.level == "link" else s for s in inter]

    def unsupported(self, tensor, op, info):
        return shm.unsupported(info)

    def checks_calls(self, ctx):
        # One host is shm's; across hosts the link stage is point-to-point, and a size
        # that differs between hosts would only show there, after shm moved bytes.
        return self._layout(ctx).hosts == 1

    @staticmethod
    def _layout(ctx):
        if ctx.transport is None:  # collective, on the first call of each plan (every rank's first alike)
            ctx.transport = host_layouts.get(ctx.info.group)
        return ctx.transport

    def run(self, buf, op, ctx):
        layout = self._layout(ctx)
        if layout.hosts == 1:
            shm.all_reduce(buf, ctx.recorded(op), shm.Mode.AUTO, ctx.info, self.name)
            return
        k, n = layout.shards, buf.numel()
        s = -(-n // k)  # shard elements; the last shard is padded
        if k * s == n:
            padded = buf
        else:
            padded = torch.empty(k * s, dtype=buf.dtype)
            padded[:n].copy_(buf)
            padded[n:].zero_()  # reduced and dropped: any value would do, zeros stay finite
        intra = layout.intra
        mine = padded[layout.local * s:(layout.local + 1) * s] if layout.local < k else None
        # 1. Inside the host: each of the first k ranks ends with its shard summed over the host.
        if intra is not None:
            try:
                if layout.local_size == k:
                    shm.reduce_scatter(mine, padded, int(op), intra, self.name)
                else:
                    shm.all_reduce(padded, op, shm.Mode.AUTO, intra, self.name)
            except BaseException as e:
                if layout.inter is not None:  # the other hosts wait on us in step 2: they fail now, not at the timeout
                    layout.inter.p2p.give_up(e)
                raise
        # 2. Across hosts: every shard among the ranks that hold it.
        if layout.inter is not None:
            inter = layout.inter
            alg = _inter_algorithm(layout.hosts, s * buf.element_size())
            try:
                alg.run(mine, op, inter)
            except BaseException as e:
                if intra is not None:  # this host's ranks wait on us in step 3: they fail now, not at the timeout
                    shm.abort(intra, self.name, f"commlab[{self.name}]: rank {ctx.info.global_rank(ctx.rank)}'s "
                                                f"inter-host stage failed: {e}"[:900])
                raise
        # 3. Inside the host: everyone gets every shard.
        if intra is not None and layout.local_size == k:
            shm.all_gather(padded, mine, intra, self.name)  # in place: `mine` is this rank's slice of it
        elif intra is not None:
            out = torch.empty(layout.local_size * s, dtype=buf.dtype)
            shm.all_gather(out, mine if mine is not None else out[:s], intra, self.name)  # past k: a placeholder
            padded = out
        if padded is not buf:
            buf.copy_(padded[:n])


def _inter_name(hosts: int, shard_bytes: int) -> str:
    name = os.environ.get("COMMLAB_HIER_INTER", "") or INTER
    if name == "size":
        name = "rhd" if hosts & (hosts - 1) == 0 or shard_bytes < RING_MIN_SHARD else "ring"
    return name


def _inter_algorithm(hosts: int, shard_bytes: int) -> Algorithm:

    name = _inter_name(hosts, shard_bytes)
    alg = _named.get(name)
    if alg is None:  # its errors say what was asked for and what ran: commlab[hier->builtin]
        alg = _named[name] = copy.copy(algorithms.get(name))
        alg.name = f"hier->{name}"
    return alg


_named: dict[str, Algorithm] = {}



ALGORITHM = Hierarchical()
