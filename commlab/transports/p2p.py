"""Point-to-point transfers for the pure torch.distributed algorithms.

Every step of an algorithm is one batch of sends and receives posted together
(batch_isend_irecv), which NCCL needs to avoid send/recv deadlocks and gloo simply
issues one by one. Every wait carries the group's timeout, and a failure names the
algorithm and the peer (as a global rank) it was waiting on.
"""
from __future__ import annotations

import functools
import zlib

import torch
import torch.distributed as dist

from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, CommlabError, PeerError
from commlab.core.groups import GroupInfo
from commlab.core.reduction import SUPPORTED_DTYPES, Op

# Per group: the first failed transfer, and how many calls agreed. Receives and sends of
# a failed step stay posted in the backend, so a retry on the same group could pair with
# that stale traffic: the group's point-to-point use ends there, with a clear error.
_failures = groups.PerGroup(lambda g: {"error": None, "calls": 0})

_DTYPES = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}


@functools.lru_cache(maxsize=None)  # a few names, asked on every agreed call
def _code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _decode(code: int, names) -> str:
    return next((n for n in names if _code(n) == code), f"#{code}")


class CallRecord:
    """What one call is, as every rank must agree on it before any of its bytes move."""

    def __init__(self, collective: str, elements: int, dtype: torch.dtype, op: Op, algorithm: str, root: int = -1):
        self.collective, self.elements, self.dtype, self.op = collective, elements, dtype, op
        self.algorithm, self.root = algorithm, root

    def row(self, call: int) -> list[int]:
        return [call, _code(self.collective), self.elements, _DTYPES.get(self.dtype, -1), int(self.op), self.root,
                _code(self.algorithm)]


def describe(row: list[int], algorithms) -> str:
    """One rank's gathered record, readable: '131072 float32 SUM ring (call 3)'."""
    call, collective, elements, dtype, op, root, algorithm = row
    dt = str(SUPPORTED_DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(SUPPORTED_DTYPES) else "?"
    where = f" root {root}" if root >= 0 else ""
    return (f"{_decode(collective, ('all_reduce',))} of {elements} {dt} {Op(op).name}{where} "
            f"by {_decode(algorithm, algorithms)} (call {call})")


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

    def agree(self, record: CallRecord, algorithms=tuple) -> None:
        """Before any byte of the call moves: every rank's record of it (call number,
        collective, elements, dtype, op, root, algorithm) gathered and compared, so ranks
        that call differently all raise the same CollectiveMismatchError instead of
        pairing mismatched messages (gloo lets a short one land in a long receive, and
        aborts the process on a long one). The record has a fixed size: the gather
        itself can never be the mismatched message. `algorithms()` names the registered
        algorithms, for the message only."""
        state = self._failure
        if state["error"] is not None:
            self.post([], [])  # raises the group's failure
        state["calls"] += 1
        mine = torch.tensor(record.row(state["calls"]), dtype=torch.int64)
        try:
            if state.get("gather") is None:
                state["gather"] = self._records_route()
            rows = state["gather"](self, mine)
        except PeerError as e:  # whatever it left posted could pair with a retry: the group's p2p use ends
            if state["error"] is None:
                state["error"] = str(e)
            raise
        if bool((rows == rows[0]).all()):
            return
        names = algorithms()
        detail = "; ".join(f"rank {self.info.global_rank(r)}: {describe(rows[r].tolist(), names)}"
                           for r in range(self.info.size))
        # Built from the gathered records alone: the same text on every rank.
        raise CollectiveMismatchError(f"commlab: ranks called differently (caught before any data moved): {detail}")

    def _records_route(self):
        """How this group gathers call records, decided once (collective): through shared
        memory when every rank is on one host (tens of µs), else to rank 0 and back over
        point-to-point (two steps). gloo's own all-gather took ~5 ms per call with 4 ranks
        on 2 cores: it wakes every rank p-1 times."""
        from commlab.transports import setup, shm

        hosts = setup.gather(self.info, setup.host_id(), self.algorithm, "choosing how calls are agreed")
        usable = shm.unsupported(self.info) is None and shm.state_of(self.info).failure is None  # refused before: not again
        if len(set(hosts)) == 1 and usable:
            return P2P._records_through_shm
        return P2P._records_through_root

    def _records_through_shm(self, mine: torch.Tensor) -> torch.Tensor:
        from commlab.transports import shm

        every = torch.empty(self.info.size * mine.numel(), dtype=torch.int64)
        shm.all_gather(every, mine, self.info, self.algorithm)
        return every.view(self.info.size, -1)

    def _records_through_root(self, mine: torch.Tensor) -> torch.Tensor:
        """Every record to rank 0, the table back to every rank: fixed sizes whatever the
        call, so no message of it can mismatch."""
        every = torch.empty(self.info.size, mine.numel(), dtype=torch.int64)
        peers = range(1, self.info.size)
        if self.info.rank == 0:
            every[0] = mine
            self.run([], [(every[q], q) for q in peers])
            self.run([(every, q) for q in peers], [])
        else:
            self.run([(mine, 0)], [])
            self.run([], [(every, 0)])
        return every

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
