"""Hierarchical reduce-scatter for ranks spread over hosts (the mirror of all-gather's
hier): each host reduces its ranks' inputs through shared memory, the hosts' leaders (the
lowest rank of each) send each other host its blocks reduced over their host and fold
what arrives in host order, and each leader hands its host's ranks their blocks through
shared memory. Every host's data crosses each link once; any layout (hosts of unequal
size too). One host: `shm`."""
from __future__ import annotations

import torch

from commlab.core.reduction import SUPPORTED_DTYPES, reduce_into
from commlab.transports import shm

from ..base import Stage
from ..family_shm import HierarchicalMember
from ..layouts import host_layouts
from .base import ReduceScatterAlgorithm


class Hierarchical(HierarchicalMember, ReduceScatterAlgorithm):
    summary = "two levels: shm all-reduce on each host, leaders swap host-reduced blocks, shm broadcast on each host"
    formula = "intra: shm all-reduce + broadcast (memory ~4n);  inter: (H-1) messages per leader, (H-1)/H·n each way"

    def stages(self, hosts, per_host, nbytes):
        if hosts == 1:
            return super().stages(hosts, per_host, nbytes)
        return [Stage("shm", 3, 4 * nbytes, nbytes, "shm"),
                Stage("link", hosts - 1, (hosts - 1) / hosts * nbytes, (hosts - 1) / hosts * nbytes, self.name)]

    def unsupported(self, inp, op, info):
        if inp.dtype not in SUPPORTED_DTYPES:
            return f"dtype {inp.dtype} is not reduced in shared memory"
        return shm.unsupported(info)

    def checks_calls(self, ctx):
        # One host is shm's; across hosts the link stage is point-to-point, and a size
        # that differs between hosts would only show there, after shm moved bytes.
        return host_layouts.get(ctx.info.group).hosts == 1  # collective on the group's first ask: every rank alike

    def run(self, out, inp, op, ctx):
        info = ctx.info
        layout = host_layouts.get(info.group)
        if layout.hosts == 1:
            shm.reduce_scatter(out, inp, ctx.recorded(op), info, self.name)
            return
        members, intra, link = layout.members, layout.intra, layout.inter if layout.local == 0 else None
        mine = next(m for m in members if info.rank in m)
        n = out.numel()
        # 1. The host's inputs reduced, on every rank of it (the input stays as it was).
        summed = inp
        if intra is not None:
            summed = inp.clone()
            try:
                shm.all_reduce(summed, int(op), shm.Mode.AUTO, intra, self.name)
            except BaseException as e:
                if link is not None:  # the other leaders wait on this one in step 2: they fail now
                    link.p2p.give_up(e)
                raise
        blocks = summed.view(info.size, n)
        chunk = torch.empty(len(mine), n, dtype=out.dtype)
        if link is not None:
            # 2. Leaders (group rank = host index): each host's blocks to its leader, folded in host order.
            h = link.rank
            others = [g for g in range(layout.hosts) if g != h]
            got = {g: torch.empty(len(mine), n, dtype=out.dtype) for g in others}
            try:
                sends = [(blocks[members[g]].reshape(-1), g) for g in others]
                link.p2p.run(sends, [(got[g].view(-1), g) for g in others])
            except BaseException as e:
                if intra is not None:  # this host's ranks wait on us in step 3: they fail now
                    shm.abort(intra, self.name, f"commlab[{self.name}]: rank {info.global_rank(info.rank)}'s "
                                                f"inter-host stage failed: {e}"[:900])
                raise
            parts = [got[g] if g != h else blocks[mine] for g in range(layout.hosts)]
            reduce_into(chunk, parts, op)
        # 3. Each leader's blocks to its host's ranks.
        if intra is not None:
            shm.broadcast(chunk.view(-1), 0, intra, self.name)
        out.copy_(chunk[layout.local])



ALGORITHM = Hierarchical()
