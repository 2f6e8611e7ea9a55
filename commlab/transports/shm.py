"""Shared-memory communicators (commlab._C.ShmComm), one per process group, set up on
first use and cached: all_reduce for the algorithms, and all-gather, reduce-scatter,
broadcast and barrier for the torch.distributed backend.

Setup is itself collective and agreed: host ids are gathered (a group spanning hosts
is refused identically on every rank), rank 0 draws a 128-bit token that names the
segments, every rank creates its own segment, all ranks report success before anyone
attaches, and every segment is unlinked as soon as all ranks mapped it, so a crash
afterwards leaves nothing in /dev/shm.
"""
from __future__ import annotations

import atexit
import enum
import os

import torch
import torch.distributed as dist

from commlab.core import ext, groups
from commlab.core.errors import (
    CollectiveMismatchError,
    CommlabError,
    PeerError,
    UnsupportedError,
)
from commlab.core.groups import GroupInfo
from commlab.transports.link import first_text, peer_timeout
from commlab.transports.setup import Entry, agree, differing, gather, host_id, translate

# The defaults below were chosen by measurement: docs/measurements.md#shared-memory-defaults
# has the runs and the commands that reproduce them.

# Bytes per data buffer (each rank's segment holds two, by piece parity); larger tensors
# go in pieces. 1 MiB: a piece every rank copied in stays in cache for the reduction.
CAPACITY = int(os.environ.get("COMMLAB_SHM_CAPACITY", str(1 << 20)))
# Up to this many bytes every rank reduces everything (one synchronisation); above,
# two-shot (two synchronisations, p times less reading) was faster from 16 KiB on.
ONESHOT_MAX = int(os.environ.get("COMMLAB_SHM_ONESHOT_MAX", str(8 << 10)))
# Pause-loop iterations before a waiter yields, only when every rank has a core: with
# more ranks than cores the awaited peer needs this very core.
SPIN = 256
# Microseconds a waiter yields before it sleeps on the futex, when every rank has a core
# or all ranks are in one scheduling group: then a yield hands the core to the peer that
# needs it. Ranks in groups of their own (torchrun and MPICH start each in its own
# session, so autogroup) are weighed group against group: a yield keeps the core
# (figures: docs/measurements.md#figures-behind-the-codes-choices).
YIELD_US = 2000
# Broadcasts of [MIN, MAX) bytes may go in one copy where the kernel lets every rank read
# its peers' memory (process_vm_readv): each receiver reads the root's tensor straight out
# of its process, as the MPIs do. Off by default: two copies in pieces were faster here
# (docs/measurements.md#figures-behind-the-codes-choices; MIN -1: never; MAX 0: no upper bound).
SINGLE_COPY_MIN = int(os.environ.get("COMMLAB_SHM_SINGLE_COPY_MIN", "-1"))
SINGLE_COPY_MAX = int(os.environ.get("COMMLAB_SHM_SINGLE_COPY_MAX", "0"))
# All-to-alls whose largest block between two ranks has at least this many bytes may go
# in one copy where every rank may read its peers' memory: each rank reads its blocks out
# of its peers' inputs (process_vm_readv), as the MPIs' cross-memory attach does. Off by
# default: the segments, a rank's own block copied straight, were as fast or faster at
# 2 and 4 ranks (docs/measurements.md#all-to-all; -1: never).
ALLTOALL_SINGLE_COPY_MIN = int(os.environ.get("COMMLAB_SHM_ALLTOALL_SINGLE_COPY_MIN", "-1"))
# Bytes per piece of a broadcast or all-gather through the segments, where every rank has
# a core: a broadcast's root copies one in while the receivers copy the last out, and a
# piece written by one core is read by the other from cache. Ranks that share cores keep
# whole buffers: each piece's handshake can cost a context switch (both measured:
# docs/measurements.md#figures-behind-the-codes-choices).
PIECE = 256 << 10


class Mode(enum.IntEnum):
    """csrc/common/codes.h's ShmMode."""

    AUTO = 0
    ONESHOT = 1
    TWOSHOT = 2
    ROOT = 3


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


_entries = groups.PerGroup(lambda g: Entry(), release=Entry.close)  # freed with the group


def _setup(entry: Entry, info: GroupInfo, algorithm: str) -> None:
    """Set the group's shared memory up (collective); a CommlabError leaves nothing behind."""
    C = ext.require()
    facts = gather(info, {"host": host_id(), "cpus": sorted(os.sched_getaffinity(0)), "capacity": CAPACITY,
                          "oneshot_max": ONESHOT_MAX,
                          "single_copy": (SINGLE_COPY_MIN, SINGLE_COPY_MAX, ALLTOALL_SINGLE_COPY_MIN),
                          "piece": os.environ.get("COMMLAB_SHM_PIECE", ""),
                          "sched_group": sched_group()})
    hosts = [f["host"] for f in facts]
    cores = len(set().union(*(set(f["cpus"]) for f in facts)))
    if len(set(hosts)) > 1:
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            label = h.split("/")[0] + ("" if h == hosts[0] else f" ({h.split('/', 1)[-1][-20:]})")
            by_host.setdefault(label, []).append(info.global_rank(r))
        raise UnsupportedError(f"commlab[{algorithm}]: the group spans more than one host, shared memory cannot "
                               "serve it: " + ", ".join(f"{h}: ranks {rs}" for h, rs in by_host.items()))
    # Ranks configured differently would pair pieces of different sizes or modes.
    diff = differing(info, facts, {"COMMLAB_SHM_CAPACITY": "capacity", "COMMLAB_SHM_ONESHOT_MAX": "oneshot_max",
                                   "COMMLAB_SHM_(ALLTOALL_)SINGLE_COPY_MIN/MAX": "single_copy",
                                   "COMMLAB_SHM_PIECE": "piece"})
    if diff:
        raise CollectiveMismatchError(f"commlab[{algorithm}]: ranks configured shared memory differently: {diff}")
    # An object broadcast works on any backend: the CUDA IPC transport's host-staged
    # path sets shared memory up over NCCL groups too.
    token = [os.urandom(16).hex() if info.rank == 0 else None]
    try:
        dist.broadcast_object_list(token, src=info.global_rank(0), group=info.group)
    except RuntimeError as e:
        raise PeerError(f"commlab[{algorithm}]: setup: agreeing on a segment name failed: {e}",
                        algorithm=algorithm) from None
    token_hex = token[0]
    timeout_ms = int(info.timeout.total_seconds() * 1000)
    made = {}

    def create():
        made["comm"] = C.ShmComm(token_hex, info.rank, info.size, CAPACITY, timeout_ms, list(info.global_ranks))

    try:
        agree(info, "creating shared-memory segments", create)
        comm = made["comm"]
        # The one place the waiting and mode knobs are decided (the C++ side reads none).
        own_cores = info.size <= cores
        one_sched_group = len({f["sched_group"] for f in facts}) == 1
        comm.oneshot_max = ONESHOT_MAX
        comm.spin = _env_int("COMMLAB_SHM_SPIN", SPIN if own_cores else 0)
        comm.yield_us = _env_int("COMMLAB_SHM_YIELD_US", YIELD_US if own_cores or one_sched_group else 0)
        comm.peer_timeout_ms = int(peer_timeout() * 1000)
        agree(info, "attaching peer segments", comm.attach)
        # One copy only where every rank can read every peer (a container's seccomp or
        # Yama's ptrace scope may refuse it): the ranks must all take the same path.
        if SINGLE_COPY_MIN >= 0 or ALLTOALL_SINGLE_COPY_MIN >= 0:  # agreed above: every rank asks, or none
            readable = gather(info, {"single_copy": comm.probe_single_copy()}, what="single-copy probe")
            if all(f["single_copy"] for f in readable):
                comm.single_copy_min = SINGLE_COPY_MIN
                comm.alltoall_single_copy_min = ALLTOALL_SINGLE_COPY_MIN
        comm.single_copy_max = SINGLE_COPY_MAX
        comm.piece_bytes = _env_int("COMMLAB_SHM_PIECE", PIECE if own_cores else 0)
    except CommlabError:
        # A rank may have died between creating its segment and the unlink: every
        # survivor knows the token, so every name of the group goes.
        C.ShmComm.unlink_names(token_hex, info.size)
        if "comm" in made:
            made["comm"].close()
        raise
    comm.unlink_own()  # every rank mapped every segment: the names go now
    entry.comm = comm


def sched_group() -> str:
    """The CFS group this process is weighed in: its cpu cgroup and, where autogroup is
    on, its session's autogroup (ranks in one group share its slices task by task)."""
    parts = []
    try:
        with open("/proc/self/cgroup") as f:
            parts += [line.strip() for line in f if ":cpu" in line or line.startswith("0::")]
    except OSError:
        pass
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = f.read().strip() == "1"
        if autogroup:
            with open("/proc/self/autogroup") as f:
                parts.append(f.read().split()[0])
    except (OSError, IndexError):
        pass
    return "|".join(parts)


def unsupported(info: GroupInfo) -> str | None:
    backend = str(dist.get_backend(info.group))
    if "gloo" not in backend and "mpi" not in backend and "commlab" not in backend:
        return f"setup needs a CPU-capable backend (gloo) on the group, it has {backend}"
    return None


def state_of(info: GroupInfo) -> Entry:
    """The group's shared-memory state (held for the group's lifetime)."""
    return _entries.get(info.group)


def all_reduce(buf: torch.Tensor, op: int, mode: int, info: GroupInfo, algorithm: str,
               entry: Entry | None = None) -> None:
    _call(info, algorithm, lambda comm: comm.allreduce(buf, op, mode), entry)


# The backend's other collectives (commlab/api/backend.py): the same communicator and
# sequence as all_reduce, so a rank that calls another collective than its peers gets
# a mismatch error, never another call's data.

def all_gather(out: torch.Tensor, inp: torch.Tensor, info: GroupInfo, algorithm: str) -> None:
    _call(info, algorithm, lambda comm: comm.allgather(out, inp))


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: int, info: GroupInfo, algorithm: str) -> None:
    _call(info, algorithm, lambda comm: comm.reduce_scatter(out, inp, op))


def broadcast(tensor: torch.Tensor, root: int, info: GroupInfo, algorithm: str) -> None:
    _call(info, algorithm, lambda comm: comm.broadcast(tensor, root))


def all_to_all(out: torch.Tensor, inp: torch.Tensor, send: list[int], recv: list[int], info: GroupInfo,
               algorithm: str) -> None:
    _call(info, algorithm, lambda comm: comm.alltoall(out, inp, send, recv))


def run_schedule(info: GroupInfo, algorithm: str, program):
    """program(comm): one call of a compiled schedule (commlab/schedule/native.py); its value."""
    return _call(info, algorithm, program)


def barrier(info: GroupInfo, algorithm: str) -> None:
    _call(info, algorithm, lambda comm: comm.barrier())


def record_poster(info: GroupInfo, algorithm: str, kind: int, dtype: int, op: int, code: int, root: int,
                  wait_all: bool):
    """ShmComm.post_record bound to one kind of point-to-point call, for the check on its
    every call: post(elements) publishes and compares the record and returns whether a
    peer's differs (a call of no elements waits for every peer's)."""
    entry = state_of(info)
    lock = entry.lock

    def post(elements: int) -> bool:
        comm = entry.comm
        if comm is None or not lock.acquire(False):  # before setup, or another thread holds it: the long way
            return _call(info, algorithm, lambda c: c.post_record(kind, elements, dtype, op, code, root,
                                                                  wait_all or not elements), entry)
        try:
            if entry.comm is not comm:  # given up while this thread looked: its failure, as every call raises it
                entry.raise_failure()
            return comm.post_record(kind, elements, dtype, op, code, root, wait_all or not elements)
        except CommlabError:
            raise
        except BaseException as e:
            raise _call_failed(entry, comm, e, algorithm, info) from None
        finally:
            lock.release()

    return post


def records(info: GroupInfo, algorithm: str) -> list[list[int]]:
    """Every rank's record of the last posted call (ShmComm.records), one row per rank."""
    flat = _call(info, algorithm, lambda comm: comm.records())
    return [flat[i:i + 9] for i in range(0, len(flat), 9)]


def mismatch_seen(info: GroupInfo) -> str | None:
    """The text of a mismatch a peer gave the group's shared memory up with, without
    waiting, or None (the watcher of a long point-to-point wait asks: the peer may be in a
    shared-memory call that met this rank's record). None also while this rank's own
    thread holds the communicator."""
    entry = _entries.get(info.group)
    if not entry.lock.acquire(False):
        return None
    try:
        comm = entry.comm
        state, _, reason = comm.peer_abort() if comm is not None else (0, -1, "")
    finally:
        entry.lock.release()
    return reason if state == 2 else None


def abort(info: GroupInfo, algorithm: str, why: str, mismatch: bool = False) -> None:
    """Give the group's shared memory up for a reason found elsewhere (another stage of
    a hierarchical call, a point-to-point call's records that differ): peers waiting on
    this rank fail at once, naming it (as a mismatch where `mismatch`)."""
    entry = _entries.get(info.group)
    with entry.lock:
        comm = entry.comm
        if comm is None:
            return
        try:
            comm.abort(why, mismatch)
        except Exception:  # noqa: BLE001 - already unusable: its peers were told then
            pass
        entry.comm = None
        later = CollectiveMismatchError(why) if mismatch else CommlabError(why)
        entry.call_failed("shared memory", algorithm, later, None)  # later calls say why
        comm.close()


def _call(info: GroupInfo, algorithm: str, run, entry: Entry | None = None):
    if entry is None:
        entry = _entries.get(info.group)
    with entry.lock:
        comm = entry.comm
        if comm is None:
            comm = _ready(entry, info, algorithm)
        try:
            return run(comm)
        except BaseException as e:
            raise _call_failed(entry, comm, e, algorithm, info) from None


def fast_call(info: GroupInfo, algorithm: str, method: str, like: torch.Tensor, *bound):
    """A call of the communicator's `method` (try_allreduce, try_allgather, ...) for
    tensors like `like`, in one C++ call (the API's fast path for small messages):
    call(*args) runs method(*args, *bound, dtype) and returns False, touching nothing,
    for any other tensors, before setup, or while another thread holds the group's
    communicator."""
    entry = state_of(info)
    lock = entry.lock
    tail = (*bound, ext.require().ShmComm.dtype_code(like))

    def call(*args) -> bool:
        if not lock.acquire(False):
            return False
        try:
            comm = entry.comm
            return comm is not None and getattr(comm, method)(*args, *tail)
        except BaseException as e:
            raise _call_failed(entry, comm, e, algorithm, info) from None
        finally:
            lock.release()

    return call


def _call_failed(entry: Entry, comm, error: BaseException, algorithm: str, info: GroupInfo) -> BaseException:
    """A failed call leaves peers at unknown phases: the communicator is done (its peers
    read our abort mark from their own mappings of our segment). Returns what to raise."""
    entry.comm = None
    mapped = translate(error, algorithm, comm.failed_peer)
    if isinstance(mapped, CollectiveMismatchError):
        # Ranks that met the difference in different pairs (or a point-to-point record) raise one text.
        mapped = CollectiveMismatchError(first_text(info.group, str(mapped)))
    raised = entry.call_failed("shared memory", algorithm, mapped, error)
    comm.close()
    return raised


def _ready(entry: Entry, info: GroupInfo, algorithm: str):
    """The group's communicator, set up on first use; raises if it cannot be had, and
    the same error again on every later call."""
    entry.raise_failure()
    try:
        _setup(entry, info, algorithm)
    except CommlabError as e:
        raise entry.fail(e)
    return entry.comm


def release(group=None) -> None:
    """Unmap the shared memory of `group` (default: all groups)."""
    _entries.free(group)


atexit.register(release)
