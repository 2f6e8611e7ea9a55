"""What an algorithm needs to know about a process group, looked up once per call.

commlab never keeps a process group alive: everything cached per group holds it
weakly. A group that outlived destroy_process_group() in one of our caches would be
torn down during interpreter shutdown instead, while gloo's worker threads still
release tensors that need the GIL: the process aborts ("terminate called without an
active exception", seen in CI). PerGroup is that cache; state that must be freed
with its group (shared-memory segments, lane threads) gets a release callback.
"""
from __future__ import annotations

import datetime
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from commlab.core.errors import CommlabError

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
        # torch's registry of live groups: one dict, only ever mutated (clear, del),
        # so holding it saves a property call on every collective.
        return g is not None and g in _LIVE_GROUPS

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]


class PerGroup:
    """State kept per live process group, holding the group weakly: make(group) builds
    it on first use; release(state), when given, runs once the group object is gone."""

    def __init__(self, make: Callable[[dist.ProcessGroup], object], release: Callable[[object], None] | None = None):
        self._make, self._release = make, release
        self._items: dict[int, tuple[weakref.ref, object]] = {}
        # Reentrant: make() may allocate, the allocation may run the garbage collector,
        # and the collector may run _drop for a dead group on this very thread.
        self._lock = threading.RLock()

    def get(self, group: dist.ProcessGroup):
        key = id(group)
        # Hit without the lock (a dict read is atomic under the GIL): this runs on every
        # call of a shared-memory all-reduce, where the lock was a visible share.
        item = self._items.get(key)
        if item is not None and item[0]() is group:
            return item[1]
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0]() is group:
                return item[1]
            item = (weakref.ref(group), self._make(group))
            self._items[key] = item
        weakref.finalize(group, self._drop, key, item)
        return item[1]

    def free(self, group: dist.ProcessGroup | None = None) -> None:
        """Forget the state of `group` (default: every group) now, and release it."""
        with self._lock:
            if group is None:
                items, self._items = list(self._items.values()), {}
            else:
                item = self._items.pop(id(group), None)
                items = [] if item is None or item[0]() is not group else [item]
        if self._release is not None:
            for _, state in items:
                self._release(state)

    def _drop(self, key: int, item) -> None:
        with self._lock:
            if self._items.get(key) is not item:
                return
            del self._items[key]
        if self._release is not None:
            self._release(item[1])


_LIVE_GROUPS = dist.distributed_c10d._world.pg_map if dist.is_available() else {}
_infos = PerGroup(lambda g: _lookup(g))


def resolve(group: dist.ProcessGroup | None) -> GroupInfo:
    """The group's facts, cached per live group: this runs on every collective, and the
    lookups behind it cost more than a small shared-memory all-reduce."""
    if not dist.is_available() or not dist.is_initialized():
        raise CommlabError("commlab: torch.distributed is not initialized (call dist.init_process_group first)")
    g = group if group is not None else dist.group.WORLD
    if g not in dist.distributed_c10d._world.pg_map:
        return _lookup(g)  # not a member, destroyed or foreign: it explains
    return _infos.get(g)


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
            if hasattr(backend, "commlab_timeout"):  # commlab's own backend (api.backend)
                return backend.commlab_timeout
            return backend.options._timeout
        except Exception:  # no backend for that device, or no options exposed
            continue
    return _DEFAULT_TIMEOUT
