"""What an algorithm needs to know about a process group, looked up once per call.

commlab never keeps a process group alive: everything cached per group holds it
weakly. A group that outlived destroy_process_group() in one of our caches would be
torn down during interpreter shutdown instead, while gloo's worker threads still
release tensors that need the GIL: the process aborts ("terminate called without an
active exception", seen in CI). Cached state that must be freed with its group
(shared-memory segments) registers a callback with on_release().
"""
from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .errors import CommlabError

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class GroupInfo:
    ref: weakref.ref = field(repr=False)  # the group, held weakly
    rank: int  # rank inside the group
    size: int
    global_ranks: tuple[int, ...]  # group rank -> global rank, for error messages
    timeout: datetime.timedelta

    @property
    def group(self) -> dist.ProcessGroup:
        g = self.ref()
        if g is None:
            raise CommlabError("commlab: the process group was destroyed")
        return g

    def alive(self) -> bool:
        g = self.ref()
        return g is not None and g in dist.distributed_c10d._world.pg_map

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
    if info is not None and info.ref() is g and g in dist.distributed_c10d._world.pg_map:
        return info
    info = _lookup(g)
    _cache[id(g)] = info
    on_release(g, lambda key=id(g), info=info: _cache.pop(key, None) if _cache.get(key) is info else None)
    return info


def on_release(group: dist.ProcessGroup, callback: Callable[[], None]) -> None:
    """Call callback() once the group object is gone (destroyed and unreferenced)."""
    weakref.finalize(group, callback)


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
    return GroupInfo(ref=weakref.ref(g), rank=rank, size=size, global_ranks=ranks, timeout=timeout_of(g))


def timeout_of(group: dist.ProcessGroup) -> datetime.timedelta:
    """The group's own timeout (what its backend enforces), so our waits agree with it."""
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            return backend.options._timeout
        except Exception:  # no backend for that device, or no options exposed
            continue
    return _DEFAULT_TIMEOUT
