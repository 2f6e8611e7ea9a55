"""What the one-host transports (shm, ipc) share in setting a group up: the identity of
a host, gathering facts and agreeing on a step so that every rank raises the same
error, the per-group entry that remembers a failure, and the mapping of the
extension's failures onto commlab's exceptions."""
from __future__ import annotations

import copy
import os
import socket
import threading

import torch.distributed as dist

from commlab.core import ext, groups
from commlab.core.errors import (
    MISMATCH_MARKS,
    CollectiveMismatchError,
    CommlabError,
    PeerError,
)
from commlab.core.groups import GroupInfo


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
    # Tests split one machine into emulated hosts: it can only tell ranks apart, never
    # make ranks of two machines look like one host.
    if os.environ.get("COMMLAB_HOST_ID"):
        parts.append("emulated:" + os.environ["COMMLAB_HOST_ID"])
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

    def call_failed(self, what: str, algorithm: str, error: CommlabError | None,
                    original: BaseException) -> BaseException:
        """Remember that a call failed (every later call raises it again); returns what to
        raise: commlab's error, or the original (KeyboardInterrupt and friends)."""
        self.fail(CommlabError(f"commlab[{algorithm}]: this group's {what} is unusable after: "
                               f"{error if error is not None else repr(original)}"))
        return error if error is not None else original

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise copy.copy(self.failure)  # a fresh instance each time, same type and text

    def close(self) -> None:
        with self.lock:
            if self.comm is not None:
                self.comm.close()
                self.comm = None


def pid_alive(pid: int) -> bool:
    """Whether a process of this host still runs (another user's counts: it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def by_host(ids: list[str]) -> list[list[int]]:
    """Group ranks by their host_id(): one list of group ranks per host, hosts in order
    of their lowest rank, ranks ascending (every rank that gathered the same ids agrees)."""
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(ids):
        hosts.setdefault(h, []).append(r)
    return list(hosts.values())


_SLICE = 0.02  # s: the longest a setup wait sleeps between looks for an abort mark or a signal


def gather(info: GroupInfo, value, transport: str = "shm", what: str = "setup") -> list:
    """Every rank's `value`, gathered by gloo on a helper thread (interruptibly). Each
    rank's step (transport, what) travels with it: ranks whose first calls differ (shm's
    set-up on one rank, ring's agreement on another) raise the same
    CollectiveMismatchError, not a TypeError on one rank's facts read as another's."""
    out = [None] * info.size
    interruptibly(info, lambda: dist.all_gather_object(out, (transport, what, value), group=info.group), transport,
                  what)
    steps = [o[:2] for o in out]
    if any(s != steps[0] for s in steps):
        detail = "; ".join(f"rank {info.global_rank(r)}: {t} {w}" for r, (t, w) in enumerate(steps))
        raise CollectiveMismatchError(f"commlab: mismatch: ranks called differently (caught while setting the group "
                                      f"up): {detail}")
    return [o[2] for o in out]


_host_ids = groups.PerGroup(lambda g: [])


def host_ids(info: GroupInfo, transport: str, what: str = "grouping ranks by host") -> list[str]:
    """Every rank's host id, gathered on the group's first ask and remembered: shm, the
    agreement's route, hier, auto and the backend all need it, and a set-up gather is the
    one step that cannot name a peer that died during it (a later call on transports
    already set up can). Collective the first time, a lookup after."""
    known = _host_ids.get(info.group)
    if not known:
        known.extend(gather(info, host_id(), transport, what))
    return list(known)


def interruptibly(info: GroupInfo, step, transport: str = "shm", what: str = "setup", guard=None):
    """step()'s result; step is a collective of the group's setup (a gloo gather, a gloo
    context connecting). It runs on a helper thread (a dead peer still fails it at once)
    while the caller waits in slices: a signal (Ctrl-C) reaches it within 20 ms, and an
    interrupted rank leaves an abort mark in the job's store that its peers raise on,
    also after their step completed against its helper. (Waiting in the gloo gather
    itself checked no signals: Ctrl-C in a first call's setup came through only when the
    late peer arrived, 22 s.) guard() -> a mismatch's text, or None: asked as the abort
    mark is (a peer in another transport's call never joins the step)."""
    out, failed, done = [], [], threading.Event()
    group = info.group

    def run():
        try:
            out.append(step())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            failed.append(e)
        finally:
            done.set()

    # The name marks it as commlab's own traffic (api/lanes.inside) on a commlab group.
    threading.Thread(target=run, name=f"commlab-lane-setup-{transport}", daemon=True).start()
    store = dist.distributed_c10d._get_default_store()
    abort = _abort_key(group)
    try:
        pause = 50e-6
        while not done.wait(pause):
            if store.check([abort]):
                break
            if guard is not None and (text := guard()) is not None:
                raise CollectiveMismatchError(text)
            pause = min(pause * 2, _SLICE)
        if store.check([abort]):  # the interrupted rank's helper may have completed our step
            text = store.get(abort).decode()
            if text.startswith(MISMATCH_MARKS):  # a peer's calls differed: the same error as there
                raise CollectiveMismatchError(text)
            raise PeerError(f"commlab[{transport}]: {what}: {text}", algorithm=transport, peer=None)
    except KeyboardInterrupt:
        try:
            store.set(abort, f"rank {info.global_rank(info.rank)} was interrupted (Ctrl-C) during {what}")
        finally:
            raise
    except RuntimeError as e:
        if isinstance(e, CommlabError):
            raise
        failed.append(e)  # the store failed: rank 0, which serves it, is gone
    if failed:
        raise PeerError(f"commlab[{transport}]: {what}: exchanging setup facts failed (a peer died or left?): "
                        f"{failed[0]}", algorithm=transport, peer=None) from None
    return out[0]


def _abort_key(group) -> str:
    return f"commlab/setup-abort/{group.group_name}"


def mark_abort(group, text: str) -> None:
    """Peers waiting in one of the group's set-up steps raise `text` (interruptibly reads
    it); the first rank's text stays, so every waiting peer reads the same."""
    dist.distributed_c10d._get_default_store().compare_set(_abort_key(group), "", text)


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


def translate(error: BaseException, algorithm: str, failed_peer: int) -> CommlabError | None:
    """The commlab error for a transport's failure (None: not ours, e.g. KeyboardInterrupt)."""
    C = ext.C
    msg = f"commlab[{algorithm}]: {error}"
    if isinstance(error, C.MismatchError):
        # Worded from the records alone, already naming the transport: every rank's text
        # is the same whichever algorithm its caller named.
        return CollectiveMismatchError(str(error))
    if isinstance(error, C.PeerLostError):
        return PeerError(msg, algorithm=algorithm, peer=failed_peer if failed_peer >= 0 else None)
    if isinstance(error, RuntimeError):
        return CommlabError(msg)
    return None
