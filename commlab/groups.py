"""What an algorithm needs to know about a process group, looked up once per call."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import CommlabError

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class GroupInfo:
    group: dist.ProcessGroup
    rank: int  # rank inside the group
    size: int
    global_ranks: tuple[int, ...]  # group rank -> global rank, for error messages
    timeout: datetime.timedelta

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]


_cache: dict[int, GroupInfo] = {}


def resolve(group: dist.ProcessGroup | None) -> GroupInfo:
    """The group's facts, cached per live group: this runs on every collective, and the
    lookups behind it cost more than a small shared-memory all-reduce."""
    if not dist.is_available() or not dist.is_initialized():
        raise CommlabError("commlab: torch.distributed is not initialized (call dist.init_process_group first)")
    g = group if group is not None else dist.group.WORLD
    info = _cache.get(id(g))
    if info is not None and info.group is g and g in dist.distributed_c10d._world.pg_map:
        return info
    info = _lookup(g)
    _cache[id(g)] = info
    return info


def _lookup(g) -> GroupInfo:
    if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
        raise CommlabError("commlab: this process is not a member of the given group")
    try:
        rank = dist.get_rank(g)
        size = dist.get_world_size(g)
        ranks = tuple(dist.get_process_group_ranks(g))
    except (RuntimeError, ValueError) as e:  # destroyed or foreign group
        # No repr of the group in the message: it must read the same on every rank.
        raise CommlabError("commlab: the process group is not registered (destroyed, or not created "
                           "with torch.distributed.new_group)") from e
    return GroupInfo(group=g, rank=rank, size=size, global_ranks=ranks, timeout=timeout_of(g))


def timeout_of(group: dist.ProcessGroup) -> datetime.timedelta:
    """The group's own timeout (what its backend enforces), so our waits agree with it."""
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            return backend.options._timeout
        except Exception:  # no backend for that device, or no options exposed
            continue
    return _DEFAULT_TIMEOUT
