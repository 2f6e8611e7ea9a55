"""Shared-memory communicators (commlab._C.ShmComm), one per process group, set up on
first use and cached.

Setup is itself collective and agreed: host ids are gathered (a group spanning hosts
is refused identically on every rank), rank 0 draws a 128-bit token that names the
segments, every rank creates its own segment, all ranks report success before anyone
attaches, and every segment is unlinked as soon as all ranks mapped it, so a crash
afterwards leaves nothing in /dev/shm.
"""
from __future__ import annotations

import atexit
import copy
import os
import socket
import threading

import torch
import torch.distributed as dist

from . import _ext, groups
from .errors import CollectiveMismatchError, CommlabError, PeerError, UnsupportedError
from .groups import GroupInfo

# Bytes per data buffer (each rank's segment holds two, by call parity); larger
# tensors go through in pieces. 1 MiB measured best here for 1-64 MiB messages:
# a piece that all ranks copy in stays in cache for the reduce and gather that follow.
CAPACITY = int(os.environ.get("COMMLAB_SHM_CAPACITY", str(1 << 20)))
# Up to this many bytes every rank reduces everything (one synchronisation); above
# it, each rank reduces 1/p and copies the rest (two synchronisations, p× less reading).
# Measured here (back-to-back calls, fp32, the two modes alternated in the same
# processes): two-shot took 0.71-0.98x one-shot's time at 16 KiB-512 KiB for 2, 3, 4
# and 8 ranks, 0.93-1.13x at 8 KiB, 1.02-1.15x at 4 KiB. The reads one-shot saves
# on the second synchronisation cost more than the synchronisation from 16 KiB on.
ONESHOT_MAX = int(os.environ.get("COMMLAB_SHM_ONESHOT_MAX", str(8 << 10)))
# Pause-loop iterations before a waiter yields its core. Worth it only when every rank
# has a core of its own: with more ranks than cores the peer being waited for needs
# this very core, and spinning measured 1.1-1.3x slower for 4 KiB-1 MiB (4 ranks on 2
# cores), while with 2 ranks on 2 cores it is 1.1x faster at 1 MiB.
SPIN = 256
# Microseconds a waiter yields its core before it sleeps on the futex, again only when
# every rank has a core (where a yield returns at once, a cheap poll). With more ranks
# than cores a waiter sleeps at once: the yielders of one core take turns on it while
# the awaited rank waits for its share, and a window that then ends in a sleep is the
# worst of both. Measured here, back-to-back calls against MPICH in the same run:
# 8 ranks on 2 cores, 4 KiB-1 MiB, 3 runs each: no window 0.31-0.60x MPICH's time at
# every size and run; 200 us and 500 us lost at 4-16 KiB in 4 of 6 runs (up to 1.75x);
# 2 ms up to 1.82x. 4 ranks: no window and 2 ms alike (0.41-0.74x, 0.20-0.82x,
# 4 KiB-16 MiB, 2 runs each); the previous session saw 200 us lose at 4 ranks too.
YIELD_US = 2000

MODE_AUTO, MODE_ONESHOT, MODE_TWOSHOT, MODE_ROOT = 0, 1, 2, 3


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


def host_id() -> str:
    """Ranks can share memory only with the same kernel, mount and network namespace
    (separate network namespaces are how tests emulate separate hosts)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for ns in ("mnt", "net"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            pass
    return "/".join(parts)


class Entry:
    """A group's transport state (the CUDA IPC transport extends it). `failure` is the
    error that made it unusable (setup refused or failed, or a call failed): every later
    call raises it again, the same on every rank, instead of meeting a half-made state."""

    def __init__(self):
        self.comm = None
        self.failure: CommlabError | None = None
        self.lock = threading.Lock()

    def fail(self, error: CommlabError) -> CommlabError:
        self.failure = error
        return error

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise copy.copy(self.failure)  # a fresh instance each time, same type and text

    def close(self) -> None:
        with self.lock:
            if self.comm is not None:
                self.comm.close()
                self.comm = None


_entries = groups.PerGroup(lambda g: Entry(), release=Entry.close)  # freed with the group


def gather(info: GroupInfo, value, transport: str = "shm", what: str = "setup") -> list:
    out = [None] * info.size
    try:
        dist.all_gather_object(out, value, group=info.group)
    except RuntimeError as e:  # a peer died or left during setup
        raise PeerError(f"commlab[{transport}]: {what}: exchanging setup facts failed (a peer died or left?): {e}",
                        algorithm=transport, peer=None) from None
    return out


def agree(info: GroupInfo, what: str, step, transport: str = "shm") -> None:
    """Run step() on every rank; if it failed anywhere, raise the same error everywhere."""
    try:
        step()
        mine = None
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        mine = str(e)
    errors = gather(info, mine, transport, what)
    failed = {info.global_rank(r): e for r, e in enumerate(errors) if e is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        raise CommlabError(f"commlab[{transport}]: {what} failed on rank(s) {sorted(failed)}: {detail}")


def differing(info: GroupInfo, facts: list[dict], knobs: dict[str, str]) -> str | None:
    """Which per-rank settings differ across the group, for an error every rank raises."""
    diffs = []
    for env, key in knobs.items():
        values = [f[key] for f in facts]
        if len(set(values)) > 1:
            diffs.append(f"{env}: " + ", ".join(f"rank {info.global_rank(r)} {v}" for r, v in enumerate(values)))
    return "; ".join(diffs) or None


def _setup(entry: Entry, info: GroupInfo, algorithm: str) -> None:
    C = _ext.require()
    facts = gather(info, {"host": host_id(), "cpus": sorted(os.sched_getaffinity(0)), "capacity": CAPACITY,
                          "oneshot_max": ONESHOT_MAX})
    hosts = [f["host"] for f in facts]
    cores = len(set().union(*(set(f["cpus"]) for f in facts)))
    if len(set(hosts)) > 1:
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h.split("/")[0] + ("" if h == hosts[0] else f" ({h.split('/', 1)[-1][-20:]})"), []).append(
                info.global_rank(r))
        raise entry.fail(UnsupportedError(
            f"commlab[{algorithm}]: the group spans more than one host, shared memory cannot serve it: "
            + ", ".join(f"{h}: ranks {rs}" for h, rs in by_host.items())))
    # Ranks configured differently would pair pieces of different sizes or modes.
    diff = differing(info, facts, {"COMMLAB_SHM_CAPACITY": "capacity", "COMMLAB_SHM_ONESHOT_MAX": "oneshot_max"})
    if diff:
        raise entry.fail(CollectiveMismatchError(f"commlab[{algorithm}]: ranks configured shared memory differently: "
                                                 f"{diff}"))
    # An object broadcast works on any backend: the CUDA IPC transport's host-staged
    # path sets shared memory up over NCCL groups too.
    token = [os.urandom(16).hex() if info.rank == 0 else None]
    try:
        dist.broadcast_object_list(token, src=info.global_rank(0), group=info.group)
    except RuntimeError as e:
        raise entry.fail(PeerError(f"commlab[{algorithm}]: setup: agreeing on a segment name failed: {e}",
                                   algorithm=algorithm, peer=None)) from None
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
        comm.oneshot_max = ONESHOT_MAX
        comm.spin = _env_int("COMMLAB_SHM_SPIN", SPIN if own_cores else 0)
        comm.yield_us = _env_int("COMMLAB_SHM_YIELD_US", YIELD_US if own_cores else 0)
        agree(info, "attaching peer segments", comm.attach)
    except CommlabError as e:
        # A rank may have died between creating its segment and the unlink below: every
        # survivor knows the token, so every name of the group goes.
        C.ShmComm.unlink_names(token_hex, info.size)
        if "comm" in made:
            made["comm"].close()
        raise entry.fail(e)
    finally:
        # Either every rank mapped every segment, or setup failed: the names go now.
        if "comm" in made:
            made["comm"].unlink_own()
    entry.comm = comm


def unsupported(info: GroupInfo) -> str | None:
    backend = str(dist.get_backend(info.group))
    if "gloo" not in backend and "mpi" not in backend:
        return f"setup needs a CPU-capable backend (gloo) on the group, it has {backend}"
    return None


def translate(error: BaseException, algorithm: str, failed_peer: int) -> CommlabError | None:
    """The commlab error for a transport's failure (None: not ours, e.g. KeyboardInterrupt)."""
    C = _ext.C
    msg = f"commlab[{algorithm}]: {error}"
    if isinstance(error, C.MismatchError):
        return CollectiveMismatchError(msg)
    if isinstance(error, C.PeerLostError):
        return PeerError(msg, algorithm=algorithm, peer=failed_peer if failed_peer >= 0 else None)
    if isinstance(error, RuntimeError):
        return CommlabError(msg)
    return None


def all_reduce(buf: torch.Tensor, op: int, mode: int, info: GroupInfo, algorithm: str) -> None:
    entry = _entries.get(info.group)
    with entry.lock:
        comm = entry.comm
        if comm is None:
            comm = _ready(entry, info, algorithm)
        try:
            comm.allreduce(buf, op, mode)
        except BaseException as e:
            # A failed call leaves peers at unknown phases: the communicator is done (its
            # peers read our abort mark from their own mappings of our segment).
            entry.comm = None
            error = translate(e, algorithm, comm.failed_peer)
            entry.fail(CommlabError(f"commlab[{algorithm}]: this group's shared memory is unusable after: "
                                    f"{error if error is not None else repr(e)}"))
            comm.close()
            if error is None:
                raise  # KeyboardInterrupt and friends, as raised
            raise error from None


def _ready(entry: Entry, info: GroupInfo, algorithm: str):
    """The group's communicator, set up on first use; raises if it cannot be had."""
    entry.raise_failure()
    _setup(entry, info, algorithm)
    return entry.comm


def release(group=None) -> None:
    """Unmap the shared memory of `group` (default: all groups)."""
    _entries.free(group)


atexit.register(release)
