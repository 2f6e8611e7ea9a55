"""Point-to-point transfers for the pure torch.distributed algorithms.

Every step of an algorithm is one batch of sends and receives posted together
(batch_isend_irecv), which NCCL needs to avoid send/recv deadlocks and gloo simply
issues one by one. Every wait carries the group's timeout, and a failure names the
algorithm and the peer (as a global rank) it was waiting on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.core import groups
from commlab.core.errors import CommlabError, PeerError
from commlab.core.groups import GroupInfo

# Per group: the first failed transfer. Receives and sends of a failed step stay posted
# in the backend, so a retry on the same group could pair with that stale traffic:
# the group's point-to-point use ends there, with a clear error.
_failures = groups.PerGroup(lambda g: {"error": None})


class Step:
    """The posted transfers of one step; receives can be awaited one at a time so a
    caller can reduce segment k while segment k+1 is still on the wire."""

    def __init__(self, p2p: "P2P", ops: list[tuple[str, int]], works: list, recv_pos: list):
        self._p2p = p2p
        self._recv_pos = recv_pos  # j-th receive given -> its posted index (None: empty, skipped)
        self._ops = ops  # (kind, peer) per posted op, in posting order
        self._works = works
        self._done = [False] * len(ops)
        # NCCL coalesces a batch into one work; gloo returns one work per op.
        self._coalesced = len(works) != len(ops)

    def _wait(self, i: int) -> None:
        if self._done[i]:
            return
        if self._coalesced:
            self._p2p._wait(self._works[0], self._ops)
            self._done = [True] * len(self._ops)
            return
        self._p2p._wait(self._works[i], [self._ops[i]])
        self._done[i] = True

    def wait_recv(self, j: int) -> None:
        """Wait for the j-th receive in the order post() was given them."""
        pos = self._recv_pos[j]
        if pos is not None:
            self._wait(pos)

    def wait_all(self) -> None:
        for i in range(len(self._ops)):
            self._wait(i)


class P2P:
    def __init__(self, info: GroupInfo, algorithm: str):
        self.info = info
        self.algorithm = algorithm
        self._failure = _failures.get(info.group)

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Step:
        """Post receives, then sends (peers are group ranks): posted the other way round,
        gloo moved an exchange's two directions one after the other (two emulated hosts
        at 1 Gbit/s, rhd of 16 MiB: 266-274 ms, now 147; gloo's ring 141). Empty tensors
        are skipped on both sides, which both sides know from the sizes alone."""
        if self._failure["error"] is not None:
            raise CommlabError(f"commlab[{self.algorithm}]: this group's point-to-point traffic is unusable after a "
                               f"failed transfer (a retry could pair with its stale messages; create a new group): "
                               f"{self._failure['error']}")
        ops, meta, recv_pos = [], [], []
        g = self.info.group
        for t, peer in recvs:
            recv_pos.append(len(ops) if t.numel() else None)
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, group=g, group_peer=peer))
                meta.append(("receive from", peer))
        for t, peer in sends:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, group=g, group_peer=peer))
                meta.append(("send to", peer))
        if not ops:
            return Step(self, [], [], recv_pos)
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._error(meta, e) from e
        return Step(self, meta, list(works or []), recv_pos)

    def run(self, sends, recvs) -> None:
        self.post(sends, recvs).wait_all()

    def _wait(self, work, meta: list[tuple[str, int]]) -> None:
        try:
            ok = work.wait(self.info.timeout)
        except RuntimeError as e:
            raise self._error(meta, e) from e
        if ok is False:
            raise self._error(meta, TimeoutError(f"no completion within {self.info.timeout}"))

    def _error(self, meta: list[tuple[str, int]], cause: BaseException) -> PeerError:
        error = self._describe(meta, cause)
        if self._failure["error"] is None:
            self._failure["error"] = str(error)
        return error

    def _describe(self, meta: list[tuple[str, int]], cause: BaseException) -> PeerError:
        peers = sorted({p for _, p in meta})
        what = ", ".join(f"{kind} rank {self.info.global_rank(p)}" for kind, p in meta[:4])
        peer = self.info.global_rank(peers[0]) if len(peers) == 1 else None
        return PeerError(
            f"commlab[{self.algorithm}] rank {self.info.global_rank(self.info.rank)}: "
            f"{what} failed (group timeout {self.info.timeout}): {cause}",
            algorithm=self.algorithm,
            peer=peer,
        )
