"""A group's own gloo connection for commlab's CPU traffic, and the channel through
which a rank that gives up makes every peer raise, the same error, within a second.

gloo's waits cannot be cancelled: a wait with a timeout breaks the whole context, and
ProcessGroup.abort() leaves a pending receive waiting (both tried on torch 2.14). What
ends a wait at once is its connection closing. So commlab's point-to-point steps and
gloo's all-reduce behind `builtin` run on a gloo context of their own per group (the
caller's group stays untouched and usable), whose sockets are known: those that
appeared while it connected. A rank that gives up (its wait failed, it was interrupted,
it raised inside a call, it exits on an uncaught exception) publishes why in the
group's store, first writer wins, and shuts its connections: its peers' pending waits
fail at once and raise the published text (gloo does not fail a send whose connection
broke half-way through it: the wait on it is aborted through Work::abort). Peers not
waiting on it learn it from the store, which a watcher thread reads every 100 ms while
a wait is in flight, and shut theirs in turn. The watcher also beats a heartbeat into
the store, so a peer that is frozen or behind a dead link (no socket closes) is named
after COMMLAB_PEER_TIMEOUT seconds (default 5), and it sees Ctrl-C through Python's
wakeup fd while the main thread sits in a gloo wait. A healthy wait costs two counter updates.
"""
from __future__ import annotations

import datetime
import os
import re
import select
import signal
import socket
import stat
import sys
import threading
import time
import weakref

import torch.distributed as dist

from commlab.core import ext
from commlab.transports import setup

ABORT_KEY = "commlab/abort"
_POLL = 0.1  # s between looks at the store while a wait is in flight
_BEAT = 0.5  # s between heartbeats
_LOOK = 1.0  # s a wait lasts before peers' heartbeats are read, and between reads
_GUARD = 0.1  # s a wait lasts before the call check's guard is asked (a peer in another transport's call)
_SLICE = 1.0  # s: a collective's wait looks at the connection's state this often
_connecting = threading.Lock()  # one context connects at a time: its sockets are what appeared meanwhile


def peer_timeout() -> float:
    """Seconds without a heartbeat after which a peer is declared frozen (0: never, for a
    rank someone stops in a debugger); shared memory reads it too."""
    return float(os.environ.get("COMMLAB_PEER_TIMEOUT", "") or 5.0)


def first_text(group: dist.ProcessGroup, text: str) -> str:
    """The group's reason for giving up, first writer wins: `text` unless some rank
    published one first (ranks that found a difference in different pairs raise one text)."""
    return _first(store_of(group), text)


def _first(store, text: str) -> str:
    return _bounded(lambda: store.compare_set(ABORT_KEY, "", text).decode(), 1.0) or text


def store_of(group: dist.ProcessGroup):
    """The group's own store (torch's prefix for it), where its abort mark lives."""
    entry = dist.distributed_c10d._world.pg_map.get(group)
    if entry is not None and entry[1] is not None:
        return entry[1]
    return dist.PrefixStore(f"{group.group_name}/", dist.distributed_c10d._get_default_store())


class Link:
    """One group's connection and abort state; `error` is set once it gave up (every
    later call on the group raises it: a retry could pair with a failed step's traffic)."""

    def __init__(self):
        self.backend = None
        self.error: str | None = None
        self.calls = 0  # calls agreed on the group across hosts (P2P.agree)
        self.route = None  # how call records are checked (P2P.checker)
        self.checks = {}  # the checker of each kind of call agree() was asked about, bound once
        self.guard = None  # () -> a peer's mismatch text or None: asked by tick and connect (P2P.checker sets it)
        self.dependents: list = []  # GroupInfos of sub-groups made for the same calls (P2P.derive)
        self.waiting = 0
        self.inflight = None  # the send or receive work the main path waits on (trip aborts it)
        self.waiter = 0  # thread ident of the latest waiter: Ctrl-C gives up only a main-thread wait
        self.label = ""  # the algorithm of the latest wait, for the errors the watcher publishes
        self.since = 0.0
        self.me = -1  # global rank
        self.peers: tuple[int, ...] = ()  # (group rank, global rank) is global_ranks[group rank]
        self.store = None
        self._fds: list[int] = []  # duplicates of the context's connected sockets (gloo may close its own)
        self._beats: dict[int, tuple[int, float]] = {}  # group rank -> (count, when it last changed)
        self._next_beat = 0.0
        self._next_look = 0.0

    # -- set-up ---------------------------------------------------------------------
    def connect(self, info, label: str):
        """The group's gloo context, connected on first use (collective)."""
        if self.backend is not None:
            return self.backend

        store = store_of(info.group)
        with _connecting:
            before = _sockets()
            backend = setup.interruptibly(
                info, lambda: dist.ProcessGroupGloo(dist.PrefixStore("commlab/link/", store), info.rank, info.size,
                                                    info.timeout), label, "connecting commlab's channel", self.guard)
            fresh = _sockets() - before
        # Each rank's addresses in the context (its listener's, its connections' ends), so
        # an error that names only an address ("Connection reset by peer [10.0.0.2]:40521",
        # from inside gloo's all-reduce) can name the rank behind it.
        names = []
        for fd in sorted(fresh):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                names.append("[%s]:%d" % s.getsockname()[:2])
            except (OSError, TypeError):
                pass
            # Never the listener: shut, gloo's accept thread dies and takes the process.
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.close()
            else:
                self._fds.append(s.detach())
        store.set(f"commlab/link/ends/{info.rank}", " ".join(names))
        self.me, self.peers, self.store = info.global_rank(info.rank), info.global_ranks, store
        self._rank, self._size = info.rank, info.size
        self.backend = backend
        _watch(self)
        return backend

    def close(self) -> None:
        _watched.discard(self)
        # The group is gone: its gloo context goes now, on this thread, while the interpreter
        # runs (plans cached past the group's end still hold this link; a context they kept
        # was torn down at interpreter shutdown, where its worker threads abort the process).
        self.backend = self.inflight = None
        self.checks = {}
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the healthy path -------------------------------------------------------------
    def wait(self, work, timeout, label: str, sliced: bool = False) -> bool:
        """work.wait(timeout), counted for the watcher. `sliced`: a collective's work (gloo's
        all-reduce), waited in 1 s slices that end once the connection was given up: one
        issued on a context its peers had just shut waited out the group's timeout (1
        run in 3 of builtin's Ctrl-C drill). A send's or receive's wait cannot be sliced:
        its timeout breaks the whole context."""
        if self.waiting == 0:
            self.since = time.monotonic()
            self.waiter = threading.get_ident()
            self.label = label
        self.waiting += 1
        try:
            if not sliced:
                # Set before error is read, as trip sets error before reading it: one of the
                # two sees the other (under the GIL), so a give-up never misses this wait.
                self.inflight = work
                if self.error is not None:
                    return False
                try:
                    return work.wait(timeout)
                finally:
                    self.inflight = None
            end = time.monotonic() + timeout.total_seconds()
            while True:
                left = end - time.monotonic()
                try:
                    return work.wait(datetime.timedelta(seconds=max(0.0, min(left, _SLICE))))
                except RuntimeError as e:
                    if "timed out" not in str(e) or left <= _SLICE:
                        raise
                    if self.error is not None:
                        raise RuntimeError(f"the group's connection was given up: {self.error}") from None
        finally:
            self.waiting -= 1

    # -- giving up --------------------------------------------------------------------
    def give_up(self, text: str) -> str:
        """Publish why this rank gives up (unless a peer did first) and close the
        connection; returns the text every rank raises. Before the group connected it
        only records the text (there is no store key or socket yet)."""
        if self.error is not None:
            return self.error
        if self.store is not None:
            text = _first(self.store, text)
        self.trip(text)
        return text

    def published(self) -> str | None:
        """A peer's published reason, if there is one (asked after a failed wait)."""
        if self.store is None:
            return None
        return _bounded(lambda: self.store.get(ABORT_KEY).decode() if self.store.check([ABORT_KEY]) else None, 1.0)

    def rank_at(self, message: str) -> int | None:
        """The group rank whose connection end a gloo error names, if one does."""
        found = re.search(r"\[([^\]]+)\]:(\d+)", message)
        if found is None or self.store is None:
            return None
        port = int(found.group(2)) & 0xFFFF
        # gloo 2.14's read errors print the port in network byte order ([127.0.0.1]:7808 for 32798).
        names = {f"[{found.group(1)}]:{port}", f"[{found.group(1)}]:{((port & 0xFF) << 8) | (port >> 8)}"}
        for q in range(self._size):
            ends = _bounded(lambda q=q: self.store.get(f"commlab/link/ends/{q}").decode().split(), 1.0) or []
            if names & set(ends):
                return q
        return None

    def trip(self, text: str) -> None:
        """Close this rank's connections of the group: every pending wait on them, here
        and at the peers, fails at once."""
        if self.error is None:
            self.error = text
        for fd in self._fds:
            try:
                s = socket.socket(fileno=fd)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.detach()
            except OSError:
                pass
        # A send half written when its connection broke is never told by gloo (it fails
        # queued and unstarted transfers only): its wait would last the group's timeout.
        work = self.inflight
        if work is not None:
            try:
                ext.require().abort_wait(work)
            except Exception:  # noqa: BLE001 - a work without abort (not gloo's): the sockets' closing ends it
                pass

    # -- the watcher's rounds -------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.error is not None or self.store is None:
            return
        try:
            if now >= self._next_beat:
                self.store.add(f"commlab/beat/{self._rank}", 1)
                self._next_beat = now + _BEAT
            if not self.waiting:
                self._beats.clear()
                return
            if self.store.check([ABORT_KEY]):
                self.trip(self.store.get(ABORT_KEY).decode())
            elif self.guard is not None and now - self.since >= _GUARD and (text := self._guarded()) is not None:
                self.give_up(text)
            elif now - self.since >= _LOOK and now >= self._next_look:
                self._next_look = now + _LOOK
                self._look_at_peers(now)
        except Exception as e:  # noqa: BLE001 - the store itself failed
            if self.waiting and self.error is None:
                self.trip(f"commlab[{self.label}] rank {self.me}: the job's store stopped answering (the process serving it, "
                          f"rank 0 or torchrun's agent, is gone?): {e}"[:600])

    def _guarded(self) -> str | None:
        try:
            return self.guard()
        except Exception:  # noqa: BLE001 - the group is going away: its own waits say so
            return None

    def _look_at_peers(self, now: float) -> None:
        limit = peer_timeout()
        if limit <= 0:
            return
        for q in range(self._size):
            if q == self._rank:
                continue
            count = self.store.add(f"commlab/beat/{q}", 0)
            seen = self._beats.get(q)
            if seen is None or seen[0] != count:
                self._beats[q] = (count, now)
            elif now - seen[1] >= limit:
                self.give_up(f"commlab[{self.label}]: rank {self.peers[q]} stopped responding: no heartbeat for "
                             f"{now - seen[1]:.0f} s (its process is frozen, or its host or link is down)")
                return


def _sockets() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode):
                found.add(int(name))
        except (OSError, ValueError):
            pass
    return found


def _bounded(fn, seconds: float):
    """fn()'s result, or None when it failed or took longer (a frozen store host must
    not hold an error path)."""
    out = []

    def run():
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - None says it failed
            pass

    t = threading.Thread(target=run, name="commlab-store", daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


# -- the watcher ------------------------------------------------------------------------
_watched: "weakref.WeakSet[Link]" = weakref.WeakSet()
_thread: threading.Thread | None = None
_wakeup: int | None = None  # read end of Python's signal wakeup pipe, when commlab set it
_start = threading.Lock()


def _watch(link: Link) -> None:
    global _thread
    _watched.add(link)
    with _start:
        if _thread is None:
            _hook_signals()
            _hook_exit()
            _thread = threading.Thread(target=_loop, name="commlab-watcher", daemon=True)
            _thread.start()


def _hook_signals() -> None:
    """Receive the signal numbers Python's C handler writes while the main thread sits
    in a gloo wait, unless someone else (asyncio) already reads them."""
    global _wakeup
    if threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old = None
    if old != -1:  # theirs stays theirs
        if old is not None:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _wakeup = r


def _hook_exit() -> None:
    """A rank dying of an uncaught exception tells its peers why before its sockets close."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        for link in list(_watched):
            if link.backend is not None and link.error is None:
                link.give_up(f"commlab: rank {link.me} exited on an uncaught {kind.__name__}: {value}"[:600])
        previous(kind, value, tb)

    sys.excepthook = hook


def _loop() -> None:
    main = threading.main_thread().ident
    while True:
        if _wakeup is not None:
            ready, _, _ = select.select([_wakeup], [], [], _POLL)
            signums = os.read(_wakeup, 512) if ready else b""
        else:
            time.sleep(_POLL)
            signums = b""
        if signal.SIGINT in signums and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            for link in list(_watched):
                if link.waiting and link.waiter == main:
                    link.give_up(f"commlab[{link.label}]: rank {link.me} was interrupted (Ctrl-C)")
        now = time.monotonic()
        for link in list(_watched):
            link.tick(now)
