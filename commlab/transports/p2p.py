"""Point-to-point transfers for the pure torch.distributed algorithms.

Every step of an algorithm is one batch of sends and receives posted together. CPU
tensors go over the group's own gloo connection (transports/link.py), which any rank
that gives up closes, so every peer raises the same error within a second instead of
waiting out the group's timeout; GPU tensors go over the group's backend in one batch
(batch_isend_irecv), which NCCL needs to avoid send/recv deadlocks, when that backend
moves GPU memory itself, and through host copies over the connection when it does not
(gloo's send and receive take host pointers: a CUDA tensor ended the process with
"writev: Bad address" on an H200). Every wait carries
the group's timeout, and a failure names the algorithm and the rank that failed.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from commlab.core import groups
from commlab.core.collectives import EVERY_INPUT_NEEDED, KIND
from commlab.core.errors import (
    MISMATCH_MARKS,
    CollectiveMismatchError,
    CommlabError,
    PeerError,
    raised_for,
)
from commlab.core.groups import GroupInfo
from commlab.core.reduction import Op
from commlab.transports import setup, shm
from commlab.transports.link import Link, first_text
from commlab.transports.records import (
    CallRecord,
    describe,
    described,
    disagreeing_splits,
    name_code,
    scalar_code,
)

# Per group: its connection, the first failure, how many calls agreed. Receives and sends
# of a failed step stay posted, so a retry on the same group could pair with that stale
# traffic: the group's point-to-point use ends there, with a clear error.
_links = groups.PerGroup(lambda g: Link(), Link.close)


def _moves_cuda(group: dist.ProcessGroup) -> bool:
    """Whether the group's backend for CUDA tensors sends GPU memory itself (NCCL and the
    like); gloo's point-to-point takes host pointers only, and a group without a CUDA
    backend has none."""
    try:
        config = str(dist.get_backend_config(group))
    except (RuntimeError, ValueError, AttributeError):
        return False
    for part in config.split(","):
        device, _, name = part.strip().partition(":")
        if device == "cuda":
            return name not in ("gloo", "")
    return False


moves_cuda = groups.PerGroup(_moves_cuda).get  # asked on every GPU step

# UNSAFE, for measuring the agreement's price only (docs/measurements.md): ranks that call
# differently then pair mismatched messages (wrong data, or gloo aborting the process).
UNAGREED = os.environ.get("COMMLAB_UNSAFE_SKIP_AGREEMENT", "") == "1"


def abandon(group: dist.ProcessGroup, text: str) -> None:
    """This rank leaves the group for good (a rule was broken elsewhere): peers waiting in
    its set-up steps or on its connection raise `text` now."""

    setup.mark_abort(group, text)
    link = _links.get(group)
    if link.backend is not None:
        link.give_up(text)


class Step:
    """The posted transfers of one step; receives can be awaited one at a time so a
    caller can reduce segment k while segment k+1 is still on the wire."""

    def __init__(self, p2p: "P2P", ops: list[tuple[str, int]], works: list, recv_pos: list,
                 landing: dict | None = None):
        self._p2p = p2p
        self._landing = landing or {}  # posted index -> (GPU tensor, its host copy received)
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
        if i in self._landing:
            device, host = self._landing.pop(i)
            device.copy_(host)

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
        self.link = _links.get(info.group)

    def _refuse_if_failed(self) -> None:
        """After a failure every call on the group raises it again, the same text on every
        rank whichever call a rank was in: a retry could pair with the failed step's
        stale messages (create a new group to go on)."""
        if self.link.error is not None:
            raise raised_for(self.link.error, self.algorithm)

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Step:
        """Post receives, then sends (peers are group ranks): posted the other way round,
        gloo moved an exchange's two directions one after the other (twice the time on
        an emulated link: docs/measurements.md#figures-behind-the-codes-choices). Empty tensors are skipped on both sides,
        which both sides know from the sizes alone. An entry may carry a third item, its
        tag: messages of one tag pair in order, apart from other tags' (a schedule's
        channels)."""
        self._refuse_if_failed()
        meta, recv_pos, tensors, tags = [], [], [], []
        for t, peer, *tag in recvs:
            recv_pos.append(len(meta) if t.numel() else None)
            if t.numel():
                tensors.append(t)
                tags.append(tag[0] if tag else 0)
                meta.append(("receive from", peer))
        for t, peer, *tag in sends:
            if t.numel():
                tensors.append(t)
                tags.append(tag[0] if tag else 0)
                meta.append(("send to", peer))
        if not meta:
            return Step(self, [], [], recv_pos)
        landing = {}
        try:
            if tensors[0].is_cpu or not moves_cuda(self.info.group):
                if not tensors[0].is_cpu:  # through host memory: sends copied out, receives copied in once done
                    for i, (t, (kind, _)) in enumerate(zip(tensors, meta)):
                        if kind == "receive from":
                            landing[i] = (t, torch.empty(t.shape, dtype=t.dtype))
                            tensors[i] = landing[i][1]
                        else:
                            tensors[i] = t.cpu()
                backend = self.link.connect(self.info, self.algorithm)
                works = [backend.recv([t], peer, tag) if kind == "receive from" else backend.send([t], peer, tag)
                         for t, tag, (kind, peer) in zip(tensors, tags, meta)]
            else:
                g = self.info.group
                works = dist.batch_isend_irecv([
                    dist.P2POp(dist.irecv if kind == "receive from" else dist.isend, t, group=g, group_peer=peer,
                               tag=tag)
                    for t, tag, (kind, peer) in zip(tensors, tags, meta)])
        except CollectiveMismatchError as e:  # met while connecting: a peer is in another transport's call
            if self.link.error is None:
                self.link.give_up(str(e))
            raise
        except CommlabError:
            raise
        except RuntimeError as e:
            raise self._error(meta, e) from e
        return Step(self, meta, list(works or []), recv_pos, landing)

    def collective(self, start, what: str) -> None:
        """Run one of gloo's own collectives on the group's connection: start(backend)
        returns its work (builtin's all-reduce), interrupted like the steps are."""
        self._refuse_if_failed()
        try:
            work = start(self.link.connect(self.info, self.algorithm))
        except CommlabError:
            raise
        except RuntimeError as e:
            raise self._error([(what, -1)], e) from e
        self._wait(work, [(what, -1)], sliced=True)

    def give_up(self, error: BaseException) -> None:
        """This rank leaves a call in the middle (an exception, Ctrl-C, a failure in a
        sub-group of the call): its peers, who wait on its next step, raise at once
        instead of at the group's timeout."""
        link = self.link
        if link.error is None:
            me = self.info.global_rank(self.info.rank)
            if isinstance(error, PeerError):  # already worded for every rank (a sub-group's failure)
                text = str(error)
            elif isinstance(error, KeyboardInterrupt):
                text = f"commlab[{self.algorithm}]: rank {me} was interrupted (Ctrl-C)"
            else:
                text = f"commlab[{self.algorithm}]: rank {me} left the call on {type(error).__name__}: {error}"[:600]
            link.give_up(text)  # unconnected: it only records the text
            if link.backend is None:
                # Peers may wait in the group's set-up (the first call's gathers): they raise it there.
                setup.mark_abort(self.info.group, text)
        self._spread(link.error)  # also when the watcher gave up first (Ctrl-C in a wait)

    def _spread(self, text: str) -> None:
        """Everything else this rank's peers may wait on for the group gives up too: its
        shared memory (a peer that finished this call waits there in the next call's
        agreement: ps's rank 2 for rank 0, 60 s before this) and the sub-groups made
        from it (hier's, whose stages other ranks may be in)."""

        if shm.state_of(self.info).comm is not None:  # a mismatch stays one for its ranks too
            shm.abort(self.info, self.algorithm, text, mismatch=text.startswith(MISMATCH_MARKS))
        for sub in self.link.dependents:
            try:
                p2p = P2P(sub, self.algorithm)
            except CommlabError:  # the sub-group is gone already
                continue
            if p2p.link.error is None:
                p2p.link.give_up(text)
                p2p._spread(text)

    @staticmethod
    def derive(parent: GroupInfo, sub: GroupInfo) -> None:
        """`sub` was made from `parent` for the same calls (hier's host and link groups):
        when this rank gives up on the parent, it gives up on `sub` too."""
        _links.get(parent.group).dependents.append(sub)

    def run(self, sends, recvs) -> None:
        self.post(sends, recvs).wait_all()

    def agree(self, record: CallRecord, algorithms=tuple) -> torch.Tensor | None:
        """Before any byte of the call moves: every rank's record of it (call number,
        collective, elements, dtype, op, root, algorithm; all_to_all's counts per peer)
        gathered and compared, so ranks that call differently all raise the same
        CollectiveMismatchError instead of pairing mismatched messages (gloo lets a short
        one land in a long receive, and aborts the process on a long one). The record has a
        fixed size: the gather itself can never be the mismatched message. `algorithms()`
        names the registered algorithms, for the message only. Returns all_to_all's agreed
        matrix (elements rank j sends rank q), else None."""
        link = self.link
        self._refuse_if_failed()
        if UNAGREED and record.splits is None:  # all_to_all's counts are the algorithm's input: always agreed
            return None
        link.calls += 1
        p = self.info.size
        try:
            if link.route is None:
                link.route = self._records_route()
            if link.route is P2P._records_through_shm and record.splits is None:
                kind = (self.algorithm, record.collective, record.dtype, record.op, record.algorithm, record.root,
                        record.cuda)
                check = link.checks.get(kind)
                if check is None:  # bound once per kind of call, as an all-reduce plan binds its own
                    check = link.checks[kind] = self.checker(record.collective, record.dtype, record.op,
                                                             record.algorithm, algorithms, record.root, record.cuda)
                return check(record.elements)
            rows = link.route(self, torch.tensor(record.row(link.calls, p), dtype=torch.int64))
        except CollectiveMismatchError:
            raise
        except CommlabError as e:
            # What it left posted could pair with a retry: the group's p2p use ends. The
            # text is the one every rank raises: a peer may have seen the failure first,
            # in a point-to-point wait where this rank saw it in shared memory.
            text = link.give_up(str(e)) if link.error is None else link.error
            self._spread(text)
            raise raised_for(text, self.algorithm, getattr(e, "peer", None)) from None
        head = rows[:, :CallRecord.HEAD]
        if not bool((head == head[0]).all()):
            names = algorithms()
            detail = "; ".join(f"rank {self.info.global_rank(r)}: {describe(rows[r].tolist(), names)}"
                               for r in range(p))
            # Built from the gathered records alone: the same text on every rank.
            raise CollectiveMismatchError(
                f"commlab: ranks called differently (caught before any data moved): {detail}")
        if record.splits is None:
            return None
        send, recv = rows[:, CallRecord.HEAD:CallRecord.HEAD + p], rows[:, CallRecord.HEAD + p:]
        bad = disagreeing_splits(send, recv)
        if bad is not None:
            j, q = bad
            raise CollectiveMismatchError(
                f"commlab: ranks called all_to_all with splits that disagree (caught before any data moved): "
                f"rank {self.info.global_rank(j)} sends {int(send[j, q])} elements to rank "
                f"{self.info.global_rank(q)}, which expects {int(recv[q, j])} from it")
        return send

    def checker(self, collective: str, dtype: torch.dtype, op: Op | None, algorithm: str, algorithms, root: int = -1,
                cuda: bool = False):
        """The check of every call of one kind (its size aside), bound once (collective:
        every rank's first call of the kind asks here): check(elements) raises the same
        CollectiveMismatchError on every rank where ranks called differently.

        On one host it is a record in shared memory, without a rendezvous: each rank
        publishes its call's record and compares it with every peer's already there; a
        peer not there yet compares it when it arrives, before it sends or receives a byte
        (ShmComm's records.cpp). Of ranks whose records differ no two exchange a message,
        so where every rank's result needs every rank's input no rank can finish, and the
        rank that finds the difference ends the group for all. Where a rank's result does
        not need every peer (a broadcast, a call of no elements) it waits for every
        record, as the agreement does, and so does a call whose steps go through the
        group's own CUDA backend (`cuda`: NCCL's posted transfers cannot be taken back the
        way a closed gloo connection takes them). Across hosts, the agreement (agree)."""

        link = self.link
        self._refuse_if_failed()
        if UNAGREED:
            return lambda elements: None
        if link.route is None:
            link.route = self._records_route()
        if link.route is not P2P._records_through_shm:
            return lambda elements: self.agree(CallRecord(collective, elements, dtype, op, algorithm, root, cuda=cuda),
                                               algorithms)
        if link.guard is None:
            info = self.info
            link.guard = lambda: shm.mismatch_seen(info)
        post = shm.record_poster(self.info, self.algorithm, KIND[collective], scalar_code(dtype),
                                 -1 if op is None else int(op), name_code(algorithm), root,
                                 collective not in EVERY_INPUT_NEEDED or (cuda and moves_cuda(self.info.group)))

        def check(elements: int) -> None:
            if link.error is not None:
                raise raised_for(link.error, self.algorithm)
            try:
                if not post(elements):
                    return
                rows = shm.records(self.info, self.algorithm)
            except CollectiveMismatchError as e:
                # Another rank found the records differ first, or a peer is in a shared-memory
                # call: its text ends the group here too.
                self._mismatch(str(e))
            names = algorithms()
            detail = "; ".join(f"rank {self.info.global_rank(r)}: {described(row, names)}"
                               for r, row in enumerate(rows))
            # Built from the records alone: every rank that finds the difference words it alike.
            self._mismatch(f"{MISMATCH_MARKS[0]} (caught before any data moved between them): {detail}")

        return check

    def _mismatch(self, text: str) -> None:
        """Ranks called differently and some may have posted their first transfers: the
        group ends on every rank, with `text` (the first published, where ranks found it
        at once)."""

        link = self.link
        if link.error is None:
            # Ranks that found it at once raise the first one's: give_up asks the group's store
            # once connected, before that first_text does.
            text = link.give_up(text if link.store is not None else first_text(self.info.group, text))
            if link.backend is None:  # peers may wait in the connection's set-up
                setup.mark_abort(self.info.group, text)
        else:
            text = link.error
        shm.abort(self.info, self.algorithm, text, mismatch=True)
        self._spread(text)
        raise CollectiveMismatchError(text)

    def _records_route(self):
        """How this group gathers call records, decided once (collective): through shared
        memory when every rank is on one host, else to rank 0 and back over
        point-to-point (two steps). Not gloo's own all-gather: it wakes every rank p-1
        times (docs/measurements.md#figures-behind-the-codes-choices)."""
        hosts = setup.host_ids(self.info, self.algorithm, "choosing how calls are agreed")
        usable = shm.unsupported(self.info) is None and shm.state_of(self.info).failure is None  # refused before: not again
        if len(set(hosts)) == 1 and usable:
            return P2P._records_through_shm
        return P2P._records_through_root

    def _records_through_shm(self, mine: torch.Tensor) -> torch.Tensor:

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

    def _wait(self, work, meta: list[tuple[str, int]], sliced: bool = False) -> None:
        try:
            ok = self.link.wait(work, self.info.timeout, self.algorithm, sliced)
        except RuntimeError as e:
            raise self._error(meta, e) from e
        if ok is False:
            raise self._error(meta, TimeoutError(f"no completion within {self.info.timeout}"))

    def _error(self, meta: list[tuple[str, int]], cause: BaseException) -> CommlabError:
        """The error of a failed wait, the same on every rank: the reason a peer published
        if it gave up first, else this rank's own observation, published for the others."""
        peer = meta[0][1] if len({p for _, p in meta}) == 1 and meta[0][1] >= 0 else None
        gpeer = self.info.global_rank(peer) if peer is not None else None
        text = self.link.error or self.link.published()
        if text is None:
            text = self.link.give_up(self._observed(meta, cause))
        elif self.link.error is None:
            self.link.trip(text)
        self._spread(text)
        return raised_for(text, self.algorithm, gpeer)

    def _observed(self, meta: list[tuple[str, int]], cause: BaseException) -> str:
        me = self.info.global_rank(self.info.rank)
        what = ", ".join(f"{kind} rank {self.info.global_rank(p)}" if p >= 0 else kind for kind, p in meta[:4])
        msg = str(cause)
        peers = sorted({p for _, p in meta if p >= 0})
        if any(s in msg for s in ("closed by peer", "reset by peer", "Broken pipe")):
            gone = peers[0] if len(peers) == 1 else self.link.rank_at(msg)
            if gone is not None:
                return (f"commlab[{self.algorithm}]: rank {self.info.global_rank(gone)} is gone: its connection to "
                        f"rank {me} closed during {what} (its process was killed or exited)")
        return f"commlab[{self.algorithm}] rank {me}: {what} failed (group timeout {self.info.timeout}): {msg}"[:900]
