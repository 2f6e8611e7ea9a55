"""A group's hosts as every family's two-level algorithm sees them (the all-reduce's,
all-gather's and reduce-scatter's `hier`): which ranks share a host, this rank's index on
it, and the two sub-groups (this host's ranks; the ranks of this local index on every
host), made once per group by one gather and released with the group."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from commlab.core import groups
from commlab.transports.p2p import P2P
from commlab.transports.setup import by_host, host_ids

from .base import Context


@dataclass
class Layout:
    """Every rank's view of the group's hosts, agreed by one gather."""

    members: list[list[int]]  # group ranks on each host, hosts in order of their lowest rank
    local: int  # this rank's index on its host
    local_size: int
    shards: int  # k: the fewest ranks on any host
    intra: groups.GroupInfo | None  # this host's ranks (None when alone on it)
    inter: Context | None  # the ranks with this local index on every host (None past k, or one host)

    @property
    def hosts(self) -> int:
        return len(self.members)

    @property
    def per_host(self) -> list[int]:
        return [len(m) for m in self.members]


def _make_layout(group: dist.ProcessGroup) -> Layout:
    info = groups.resolve(group)
    members = by_host(host_ids(info, "hier"))
    mine = next(m for m in members if info.rank in m)
    k = min(len(m) for m in members)
    local = mine.index(info.rank)
    backend = dist.get_backend(group)
    intra = inter = None
    if len(members) > 1:
        # torch salts a sub-group's name with its count of groups made so far, which a
        # rank advances only for groups it is a member of: every rank makes exactly two
        # here, in one order (its host's ranks, then the ranks of its local index on every
        # host, single-rank groups included), so every rank's count moves alike.
        def make(ranks: list[int]) -> groups.GroupInfo | None:
            g = dist.new_group([info.global_rank(r) for r in ranks], timeout=info.timeout, backend=backend,
                               use_local_synchronization=True)
            return groups.resolve(g) if len(ranks) > 1 else None

        intra = make(mine)
        peers = make([m[local] for m in members if local < len(m)])
        for sub in (intra, peers):  # a rank that gives up on the group gives up on these: peers may wait there
            if sub is not None:
                P2P.derive(info, sub)
        if local < k:
            inter = Context(info=peers, p2p=P2P(peers, "hier"))
    return Layout(members=members, local=local, local_size=len(mine),
                  shards=k, intra=intra, inter=inter)


def _release_layout(layout: Layout) -> None:
    """The group is gone: its two sub-groups are hier's alone, so they go too (torch
    would keep them registered until the process ends, gloo's threads with them)."""
    # .ref(), not .group: a sub-group destroyed first (destroy_process_group() of all) is
    # None here, where .group raised from the finalizer ("Exception ignored in ...").
    subs = [layout.intra.ref() if layout.intra else None, layout.inter.info.ref() if layout.inter else None]
    for g in subs:
        if g is not None and g in dist.distributed_c10d._world.pg_map:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a finalizer: a sub-group left registered is a leak, not a wrong result
                pass


host_layouts = groups.PerGroup(_make_layout, _release_layout)
