"""Issue order per process group, for async_op.

Collectives on a group must run in the same order on every rank. Each group gets a
lane: an async call is queued to the lane's daemon thread; a blocking call runs
inline when nothing is queued, else it queues behind the pending work and waits, so
blocking and async calls never overtake each other.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from . import groups


class Work:
    """The handle all_reduce(async_op=True) returns, shaped like torch's Work."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout=None) -> bool:
        # Every transfer inside already carries the group's timeout, so this returns.
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self):
        if not self._future.done():
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


class _Lane:
    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._name = name
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, work, stream = item
            error = None
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        job()
                else:
                    job()
            except BaseException as e:  # noqa: BLE001 - delivered through the Future
                error = e
            with self._lock:
                self._pending -= 1
            work._finish(error)

    def idle(self) -> bool:
        """Nothing queued: a blocking call may run inline on the caller's thread."""
        return self._pending == 0

    def submit(self, job: Callable[[], None], tensor: torch.Tensor, async_op: bool) -> Work | None:
        with self._lock:
            inline = not async_op and self._pending == 0
            if not inline:
                self._pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
        if inline:
            job()
            return None
        work = Work(tensor)
        # Work queued from a CUDA stream runs on that stream, keeping the caller's ordering.
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        self._q.put((job, work, stream))
        if async_op:
            return work
        work.wait()
        work.get_future().value()  # re-raise the job's error in the caller
        return None


    def stop(self) -> None:
        """Let the thread end once the queued work is done (its group is gone)."""
        self._q.put(None)


_lanes = groups.PerGroup(lambda g: _Lane(f"commlab-lane-{id(g):x}"), release=_Lane.stop)


def lane(group) -> _Lane:
    return _lanes.get(group)
