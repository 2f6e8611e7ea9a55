"""Where the members of a DDP hook state's group meet and make it (commlab.hooks'
CommState): through the job's store, among the members alone, with a crossed order of
states or a member that never comes named on every waiting rank."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref

import torch.distributed as dist

from commlab.core.errors import CollectiveMismatchError
from commlab.transports import p2p

bind_lock = threading.Lock()
_bound: dict[tuple, int] = {}  # states this process bound, per rank set: the meeting's key
# States with a running thread: closed at exit, while the interpreter still runs (a
# script that ends without close() otherwise had its thread and group torn down during
# interpreter shutdown, which aborted it 1 time in 6: "terminate called without an
# active exception").
live_states: weakref.WeakSet = weakref.WeakSet()  # CommStates
_SALT = 1 << 40  # above any count of groups a process makes: members-only names never meet torch's


def members_group_for(ranks: list[int] | None, algorithm: str):
    """The state's own group, among its members alone: they meet in the store under the
    rank set and this state's place among that set's states, then make the group, then
    every member waits until all have it (torch's new_group has no barrier after
    creation by default: a member could use and destroy the group while a peer is
    still connecting). A rank outside the group makes nothing and waits for nobody."""
    me = dist.get_rank()
    if ranks is None or me not in ranks:
        return ranks, dist.GroupMember.NON_GROUP_MEMBER
    k = _bound[tuple(ranks)] = _bound.get(tuple(ranks), 0) + 1
    meeting = _Meeting(ranks, k)
    meeting.wait("arrived", algorithm, f"the members of CommState #{k} for ranks {ranks} to create it")
    pg = _members_group(ranks, _SALT + k)
    meeting.wait("ready", "1", f"CommState #{k} for ranks {ranks} to have its group")
    return ranks, pg


def _members_group(ranks: list[int], salt: int):
    """dist.new_group(ranks) made by the members alone. torch names such a group after its
    ranks and the count of groups this process made so far, which only members advance:
    made under a salt every member knows instead, with the count left as it was, so the
    members name it alike and every rank of the job still names later groups alike."""
    world = dist.distributed_c10d._world
    count = world.group_count
    world.group_count = salt
    try:
        return dist.new_group(ranks, use_local_synchronization=True)
    finally:
        world.group_count = count


def setup_timeout() -> float:
    """Seconds a member waits for its peers to create the same CommState (COMMLAB_SETUP_TIMEOUT)."""
    return float(os.environ.get("COMMLAB_SETUP_TIMEOUT", "") or 300.0)


class _Meeting:
    """Where the members of one state meet in the job's store. While it waits, a member
    says where it waits (its own key), so a member that finds the peer it waits for
    waiting in another state that needs this member — which this member has not
    reached — knows neither can go on: both raise the same error at once, and the
    meeting's error key tells the other members of both states."""

    def __init__(self, ranks: list[int], k: int):
        self.ranks, self.k = ranks, k
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        self.key = f"commlab/commstate/{digest}/{k}"
        self.store = dist.distributed_c10d._get_default_store()
        self.me = dist.get_rank()

    def wait(self, step: str, value: str, what: str) -> None:
        store, me = self.store, self.me
        store.set(f"{self.key}/{step}/{me}", value)
        keys = [f"{self.key}/{step}/{r}" for r in self.ranks]
        where = f"commlab/commstate/waiting/{me}"
        store.set(where, json.dumps([self.key, self.ranks, step]))
        try:
            deadline = time.monotonic() + setup_timeout()
            pause = 1e-3
            while not store.check(keys):
                if store.check([f"{self.key}/error"]):
                    raise CollectiveMismatchError(store.get(f"{self.key}/error").decode())
                missing = [r for r, key in zip(self.ranks, keys) if not store.check([key])]
                self._crossed(missing, step)
                if time.monotonic() > deadline:
                    self._fail(f"commlab.hooks: rank {me} waited {setup_timeout():g} s (COMMLAB_SETUP_TIMEOUT) for "
                               f"{what}; rank(s) {missing} never got there. The members of a state's group create "
                               "it, in the same order among the states of the same ranks")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        finally:
            store.set(where, "")

    def _crossed(self, missing: list[int], step: str) -> None:
        """A missing member waiting in another state whose members include this rank,
        at a step this rank has not reached: a cycle of waits."""
        for q in missing:
            raw = self.store.get(f"commlab/commstate/waiting/{q}") if self.store.check(
                [f"commlab/commstate/waiting/{q}"]) else b""
            if not raw:
                continue
            key, ranks, their_step = json.loads(raw)
            if key == self.key or self.me not in ranks or self.store.check([f"{key}/{their_step}/{self.me}"]):
                continue
            # Both ranks of the crossing word it alike: the lower rank's wait first.
            waits = sorted([(self.me, q, self.ranks), (q, self.me, ranks)])
            text = ("commlab.hooks: CommStates created in different orders: " +
                    "; ".join(f"rank {a} waits for rank {b} in a CommState for ranks {rs}" for a, b, rs in waits) +
                    ". The members of a state's group create it, in the same order among the states of the same "
                    "ranks")
            self.store.set(f"{key}/error", text)
            self._fail(text)

    def _fail(self, text: str) -> None:
        error = CollectiveMismatchError(text)
        self.store.set(f"{self.key}/error", text)  # this state's other members raise it too
        # The peers are likely waiting on this rank in a state made earlier: they raise it too.
        for state in list(live_states):
            if state.process_group is not None:
                p2p.abandon(state.process_group, text)
        raise error
