"""All-reduce of CUDA tensors among the processes of one host, one communicator per
process group, set up on first use and cached.

Two paths, chosen once per group from facts every rank reports, so every rank takes
the same one:
- "peer": every rank on its own GPU and every pair able to read each other's memory.
  commlab._C.IpcComm: CUDA IPC buffers exchanged through the group, one-/two-shot
  kernels with release/acquire flag barriers (vLLM's design) that carry a deadline.
- "staged": GPUs without P2P (the seed's RTX 4090s) or several processes on one GPU.
  Processes sharing a GPU are time-sliced, so a kernel that spins waiting for another
  process's kernel can wait forever; the data goes through pinned host memory and the
  shared-memory transport instead, which synchronises on the host.
COMMLAB_IPC_PATH=peer|staged overrides the choice (peer on a shared GPU will hang
until the group's timeout: for experiments only).
"""
from __future__ import annotations

import atexit
import enum
import os

import torch

from commlab.core import ext, groups
from commlab.core.errors import (
    CollectiveMismatchError,
    CommlabError,
    PeerError,
    UnsupportedError,
)
from commlab.core.groups import GroupInfo
from commlab.transports import shm
from commlab.transports.setup import (
    Entry,
    agree,
    differing,
    gather,
    host_id,
    pid_alive,
    translate,
)

PATH_PEER, PATH_STAGED = "peer", "staged"


class Mode(enum.IntEnum):
    """csrc/common/codes.h's IpcMode."""

    AUTO = 0
    ONESHOT = 1
    TWOSHOT = 2


# Bytes per IPC data buffer (two per rank, by call parity); larger tensors go in pieces.
CAPACITY = int(os.environ.get("COMMLAB_IPC_CAPACITY", str(16 << 20)))
# Up to this many bytes every rank reduces all inputs (one barrier); above, two-shot.
ONESHOT_MAX = int(os.environ.get("COMMLAB_IPC_ONESHOT_MAX", str(256 << 10)))
# Thread blocks per kernel: every block of every rank must be resident at once for
# the barriers to complete, so keep this well under the SM count.
MAX_BLOCKS = int(os.environ.get("COMMLAB_IPC_MAX_BLOCKS", "32"))
MAX_P2P_RANKS = 8


def device_facts(device: torch.device) -> dict:
    """What this rank tells the others about its GPU (all plain data)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    reach = {}
    for d in range(torch.cuda.device_count()):
        if d != index:
            reach[str(torch.cuda.get_device_properties(d).uuid)] = bool(torch.cuda.can_device_access_peer(index, d))
    return {"host": host_id(), "uuid": uuid, "index": index, "pid": os.getpid(), "reach": reach}


def choose_path(facts: list[dict], forced: str | None = None) -> tuple[str | None, str]:
    """(path, why) from every rank's device_facts; path None means unsupported."""
    hosts = {f["host"] for f in facts}
    if len(hosts) > 1:
        return None, "the group spans more than one host; CUDA IPC works within one host only"
    if forced:
        if forced not in (PATH_PEER, PATH_STAGED):
            return None, f"COMMLAB_IPC_PATH must be {PATH_PEER} or {PATH_STAGED}, got {forced!r}"
        return forced, f"forced by COMMLAB_IPC_PATH={forced}"
    uuids = [f["uuid"] for f in facts]
    if len(set(uuids)) < len(uuids):
        shared = sorted({u for u in uuids if uuids.count(u) > 1})
        ranks = [r for r, u in enumerate(uuids) if u in shared]
        return PATH_STAGED, (f"group ranks {ranks} share a GPU: time-sliced processes cannot meet at an "
                             "in-kernel barrier, so data is staged through host shared memory")
    if len(facts) > MAX_P2P_RANKS:
        return PATH_STAGED, f"more than {MAX_P2P_RANKS} ranks: the P2P kernels take at most {MAX_P2P_RANKS}"
    for r, f in enumerate(facts):
        for q, g in enumerate(facts):
            if q != r and not f["reach"].get(g["uuid"], False):
                why = "cannot access" if g["uuid"] in f["reach"] else "does not see"
                return PATH_STAGED, (f"group rank {r}'s GPU {why} group rank {q}'s GPU directly (no P2P), "
                                     "so data is staged through host shared memory")
    return PATH_PEER, "every GPU can read every other's memory (P2P)"


class _Entry(Entry):
    def __init__(self):
        super().__init__()
        self.path: str | None = None  # set once setup succeeded, never before
        self.why = ""
        self.device: int | None = None
        self.pids: list[int] = []


_entries = groups.PerGroup(lambda g: _Entry(), release=_Entry.close)

# Settings every rank must share: a different capacity or grid would read past a
# peer's allocation or meet the wrong thread block; a different path would hang.
KNOBS = {"COMMLAB_IPC_CAPACITY": "capacity", "COMMLAB_IPC_MAX_BLOCKS": "max_blocks",
         "COMMLAB_IPC_ONESHOT_MAX": "oneshot_max", "COMMLAB_IPC_PATH": "forced"}


def settings() -> dict:
    return {"capacity": CAPACITY, "max_blocks": MAX_BLOCKS, "oneshot_max": ONESHOT_MAX,
            "forced": os.environ.get("COMMLAB_IPC_PATH") or None}


def _setup(entry: _Entry, info: GroupInfo, device: torch.device, algorithm: str) -> None:
    try:
        mine = {**device_facts(device), **settings()}
    except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others would wait
        mine = {"error": f"{type(e).__name__}: {e}"}
    facts = gather(info, mine, "ipc")
    errors = {info.global_rank(r): f["error"] for r, f in enumerate(facts) if "error" in f}
    if errors:
        raise CommlabError(f"commlab[{algorithm}]: reading the GPU's facts failed on rank(s) {sorted(errors)}: "
                           + "; ".join(f"rank {r}: {e}" for r, e in errors.items()))
    path, why = choose_path(facts, facts[0]["forced"])
    if path is None:
        raise UnsupportedError(f"commlab[{algorithm}]: {why}")
    diff = differing(info, facts, KNOBS)
    if diff:
        raise CollectiveMismatchError(f"commlab[{algorithm}]: ranks configured CUDA IPC differently: {diff}")
    device_index = facts[info.rank]["index"]
    if path == PATH_PEER:
        C = ext.require()
        made = {}

        def create():
            made["comm"] = C.IpcComm(info.rank, info.size, device_index, CAPACITY,
                                     int(info.timeout.total_seconds() * 1000), list(info.global_ranks))

        try:
            agree(info, "allocating CUDA IPC buffers", create, "ipc")
            comm = made["comm"]
            comm.oneshot_max = ONESHOT_MAX
            comm.max_blocks = MAX_BLOCKS
            handles = gather(info, comm.handle(), "ipc")
            agree(info, "mapping peers' CUDA IPC buffers", lambda: comm.open(handles), "ipc")
        except CommlabError:
            if "comm" in made:
                made["comm"].close()
            raise
        entry.comm = comm
    # Only a complete setup names a path: a failed one raises its error again next time.
    entry.device = device_index
    entry.pids = [f["pid"] for f in facts]
    entry.path, entry.why = path, why


def path_of(group) -> tuple[str | None, str]:
    """The path a group's ipc communicator took, and why (None before the first call)."""
    entry = _entries.get(group)
    return entry.path, entry.why


def all_reduce(buf: torch.Tensor, op: int, mode: int, info: GroupInfo, algorithm: str) -> None:
    entry = _entries.get(info.group)
    with entry.lock:
        entry.raise_failure()
        if entry.path is None:
            try:
                _setup(entry, info, buf.device, algorithm)
            except CommlabError as e:
                raise entry.fail(e)
        if buf.device.index != entry.device:
            raise CommlabError(f"commlab[{algorithm}]: this group's communicator lives on cuda:{entry.device}, "
                               f"the tensor is on {buf.device}")
        if entry.path == PATH_STAGED:
            _staged(buf, op, info, algorithm)
            return
        try:
            entry.comm.allreduce(buf, op, mode)
        except BaseException as e:
            lost = entry.comm.failed_peer
            # The communicator refuses further calls, but its memory stays mapped until the
            # group goes: peers still waiting read our abort word from it to give up at once.
            error = translate(e, algorithm, info.global_rank(lost) if lost >= 0 else -1)
            if isinstance(error, PeerError) and lost >= 0:
                pid = entry.pids[lost]
                error = PeerError(f"{error} [rank {info.global_rank(lost)} is pid {pid}, "
                                  f"{'alive' if pid_alive(pid) else 'dead'}]", algorithm=algorithm, peer=error.peer)
            raise entry.call_failed("CUDA IPC", algorithm, error, e) from None


def _staged(buf: torch.Tensor, op: int, info: GroupInfo, algorithm: str) -> None:
    # Pinned memory makes the copies DMA at full speed; the caching host allocator
    # keeps it from being reused while a copy is still in flight.
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf)  # waits for the producer's stream, then for the copy
    shm.all_reduce(host, op, shm.Mode.AUTO, info, algorithm)
    buf.copy_(host, non_blocking=True)


def release(group=None) -> None:
    """Free the CUDA IPC buffers of `group` (default: all groups)."""
    _entries.free(group)


# Free the CUDA allocations and IPC mappings while the CUDA context still exists.
atexit.register(release)
