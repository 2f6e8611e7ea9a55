"""Hierarchical all-gather for ranks spread over hosts (MPICH's and Horovod's two
levels): each host's ranks gather their blocks through shared memory, the hosts'
leaders (the lowest rank of each) exchange their hosts' chunks over the host links, and
each leader broadcasts the whole output to its host through shared memory. Every host's
data crosses each link once; any layout (hosts of unequal size too). One host: `shm`."""
from __future__ import annotations

import torch

from commlab.transports import shm

from ..base import Stage
from ..family_shm import HierarchicalMember
from ..layouts import host_layouts
from .base import AllGatherAlgorithm, as_bytes


class Hierarchical(HierarchicalMember, AllGatherAlgorithm):
    summary = "two levels: shm gather on each host, leaders exchange host chunks, shm broadcast on each host"
    formula = "intra: shm gather + broadcast (memory ~2n);  inter: (H-1) messages per leader, (H-1)/H·n each way"

    def stages(self, hosts, per_host, nbytes):
        if hosts == 1:
            return super().stages(hosts, per_host, nbytes)
        return [Stage("shm", 3, 2 * nbytes, 0.0, "shm"),
                Stage("link", hosts - 1, (hosts - 1) / hosts * nbytes, 0.0, self.name)]

    def unsupported(self, out, info):
        return shm.unsupported(info)

    def run(self, out, inp, ctx):
        info = ctx.info
        layout = host_layouts.get(info.group)
        if layout.hosts == 1:
            shm.all_gather(out, inp, info, self.name)
            return
        members = layout.members
        mine = next(m for m in members if info.rank in m)
        whole = as_bytes(out).view(info.size, -1)
        n = whole.shape[1]
        # 1. This host's blocks, in its ranks' order, through shared memory.
        if layout.intra is not None:
            chunk = torch.empty(len(mine), n, dtype=torch.uint8)
            shm.all_gather(chunk.view(-1), as_bytes(inp), layout.intra, self.name)
        else:
            chunk = as_bytes(inp).view(1, n)
        if layout.local == 0:
            # 2. Leaders (group rank = host index: new_group sorts, hosts go by lowest rank).
            whole[mine] = chunk
            link = layout.inter
            others = [h for h in range(layout.hosts) if h != link.rank]
            got = {h: torch.empty(len(members[h]), n, dtype=torch.uint8) for h in others}
            link.p2p.run([(chunk.view(-1), h) for h in others], [(got[h].view(-1), h) for h in others])
            for h in others:
                whole[members[h]] = got[h]
        # 3. Each leader's whole output to its host.
        if layout.intra is not None:
            shm.broadcast(whole.view(-1), 0, layout.intra, self.name)



ALGORITHM = Hierarchical()
