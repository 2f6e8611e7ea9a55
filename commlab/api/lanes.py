"""Issue order per process group, for async_op.

Collectives on a group must run in the same order on every rank. Each group gets a
lane: an async call is queued to the lane's daemon thread; a blocking call runs
inline when nothing is queued or running, else it queues behind the pending work and
waits, so blocking and async calls never overtake each other. An inline call holds the
group's gate, which the lane thread takes before each job: two calls of a group never
run at once, and an inline call admitted first finishes first.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Callable

import torch

from commlab.core import groups
from commlab.core.errors import CommlabError

_running = threading.local()

# commlab's daemon threads (lanes, the backend's), each with how to stop it. At exit they
# are stopped and joined while the interpreter still runs: a daemon thread completing a
# Future (its callbacks release the GIL) that wakes once finalization began is ended by
# CPython with pthread_exit, whose unwinding through torch's C++ frames aborted the
# process ("terminate called without an active exception", a training script on the
# commlab backend 1 time in 8).
_daemons: "weakref.WeakKeyDictionary[threading.Thread, Callable[[], None]]" = weakref.WeakKeyDictionary()
_daemons_lock = threading.Lock()
_join_registered = False
JOIN_AT_EXIT_S = 5.0  # a thread still waiting on a peer by then is left to the process's end


def start_daemon(target: Callable, args: tuple, name: str, stop: Callable[[], None]) -> threading.Thread:
    """A daemon thread of commlab's, stopped (`stop()`) and joined at interpreter exit."""
    global _join_registered
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _daemons_lock:
        if not _join_registered:  # at the first thread: atexit runs it before the handlers registered earlier
            atexit.register(_join_daemons)
            _join_registered = True
        _daemons[thread] = stop
    thread.start()
    return thread


def _join_daemons() -> None:
    with _daemons_lock:
        live = list(_daemons.items())
        _daemons.clear()
    for thread, stop in live:
        if thread.is_alive():
            stop()
    for thread, _ in live:
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(JOIN_AT_EXIT_S)


def inside() -> bool:
    """Is this thread running a commlab collective (inline, on a lane, or on the
    torch.distributed backend's thread)? What such a call issues on its group is
    commlab's own traffic (commlab/api/backend.py sends it to its inner gloo)."""
    return getattr(_running, "on", False) or threading.current_thread().name.startswith("commlab-lane-")


class running:
    """Marks the calling thread as running commlab's collective, for the `with` block."""

    __slots__ = ("_was",)

    def __enter__(self):
        self._was = getattr(_running, "on", False)
        _running.on = True

    def __exit__(self, *exc):
        _running.on = self._was


class Work:
    """The handle all_reduce(async_op=True) returns, shaped like torch's Work. For CUDA
    tensors its Future is CUDA-aware: waiting on it orders the waiter's stream after
    the work's."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        self._future: torch.futures.Future = (torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda
                                              else torch.futures.Future())
        self._done = threading.Event()

    def wait(self, timeout=None) -> bool:
        """Block until the work finished; raise its error. With a timeout (seconds or a
        timedelta) raise CommlabError when it has not finished by then, like torch's."""
        if timeout is not None:
            secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if not self._done.wait(secs):
                raise CommlabError(f"commlab: all_reduce did not complete within {secs:g} s (Work.wait timeout)")
        else:
            while not self._done.wait(0.1):  # slices keep Ctrl-C responsive
                pass
        self._future.value()  # re-raise the job's error in the waiter
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self.exception() is None

    def exception(self):
        if not self._done.is_set():
            return None
        try:
            self._future.value()
        except Exception as e:  # noqa: BLE001 - reported, not handled
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        """Completes with [tensor], like torch.distributed's Work.get_future()."""
        return self._future

    def _finish(self, error: BaseException | None) -> None:
        if error is None:
            self._future.set_result([self._tensor])
        else:
            self._future.set_exception(error)
        self._done.set()


class _Lane:
    """One group's issue order. `_gate` is held by whoever runs a call of the group
    (a blocking caller inline, or the lane thread), so two calls never run at once; a
    blocking call runs inline only when nothing is queued, else it queues behind."""

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._pending = 0  # queued or running on the lane thread
        self._lock = threading.Lock()  # guards _pending and the thread's start
        self._gate = threading.Lock()
        self._name = name
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, work, stream = item
            error = None
            with self._gate:  # an inline call admitted before this job finishes first
                try:
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            job()
                    else:
                        job()
                except BaseException as e:  # noqa: BLE001 - delivered through the Future
                    error = e
            if stream is not None:
                with torch.cuda.stream(stream):  # the Future records its event on this stream
                    work._finish(error)
            else:
                work._finish(error)
            with self._lock:
                self._pending -= 1

    def try_inline(self) -> bool:
        """Admit a blocking call to run on the caller's thread (only when nothing is
        queued); the caller runs it and then calls end_inline(). A few C-level lock
        operations: this is on the path of every small blocking call."""
        if self._pending or not self._gate.acquire(False):
            return False
        if self._pending:  # queued between the check and the gate: it goes first
            self._gate.release()
            return False
        return True

    def end_inline(self) -> None:
        self._gate.release()

    def submit(self, job: Callable[[], None], tensor: torch.Tensor, async_op: bool) -> Work | None:
        work = Work(tensor)
        # Work queued from a CUDA stream runs on that stream, keeping the caller's ordering.
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = start_daemon(self._loop, (), self._name, self.stop)
            self._q.put((job, work, stream))
        if async_op:
            return work
        work.wait()
        return None

    def stop(self) -> None:
        """Let the thread end once the queued work is done (its group is gone)."""
        self._q.put(None)


_lanes = groups.PerGroup(lambda g: _Lane(f"commlab-lane-{id(g):x}"), release=_Lane.stop)


def lane(group) -> _Lane:
    return _lanes.get(group)
