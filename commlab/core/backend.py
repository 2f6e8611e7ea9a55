"""commlab as a torch.distributed backend: `dist.init_process_group("commlab")`,
`"cpu:commlab,cuda:nccl"` or `new_group(backend="commlab")` run unchanged training code
(DDP's reducer, torch's comm hooks, FSDP, Lightning) on commlab's algorithms.

What runs where:
- all_reduce of one dense CPU tensor: commlab.all_reduce on this group with the
  backend's algorithm (COMMLAB_ALGORITHM, default `auto`), on the backend's own thread,
  so that async callers (DDP's buckets) overlap it with their compute;
- every other collective: a gloo backend of the same ranks ("front"), so nothing a
  user calls is missing;
- every collective commlab's own algorithms issue on this group while they run (setup
  gathers, point-to-point steps, `builtin`): a second gloo backend ("inner"), so their
  order never interleaves with the caller's.
"""
from __future__ import annotations

import os
import queue
import threading
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from commlab.core import api
from commlab.core.reduction import parse_op

NAME = "commlab"
_inside = threading.local()  # set on the threads that run commlab's algorithms


def _algorithm() -> str:
    return os.environ.get("COMMLAB_ALGORITHM", "") or "auto"


class CommlabBackend(_C10dBackend):
    def __init__(self, store, rank: int, size: int, timeout, group):
        super().__init__(rank, size)
        self.commlab_timeout = timeout  # what groups.timeout_of reads
        self._front = dist.ProcessGroupGloo(dist.PrefixStore("front/", store), rank, size, timeout)
        self._inner = dist.ProcessGroupGloo(dist.PrefixStore("inner/", store), rank, size, timeout)
        self._group = weakref.ref(group)  # the ProcessGroup this backend serves; it owns us
        self._algorithm = _algorithm()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        weakref.finalize(group, self._jobs.put, None)  # the thread ends with the group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # -- the collectives commlab serves -------------------------------------------------

    def allreduce(self, tensors, opts):
        if _internal() or len(tensors) != 1 or not _served(tensors[0]):
            return self._gloo().allreduce(tensors, opts)
        # opts.reduceOp is a new object on every call: the plan cache keys ops by identity,
        # so pass commlab's own (stable) Op, else every call would be planned afresh.
        tensor, op, group = tensors[0], parse_op(opts.reduceOp), self._group()
        return self._submit(lambda: api.all_reduce(tensor, op, group, algorithm=self._algorithm), [tensor])

    def barrier(self, opts=None):
        if not _internal():
            self._submit(lambda: None, []).wait()  # everything queued before the barrier completes first
        gloo = self._gloo()
        return gloo.barrier(opts) if opts is not None else gloo.barrier()

    # -- everything else: gloo ----------------------------------------------------------

    def _gloo(self):
        return self._inner if _internal() else self._front

    # -- the backend's thread -----------------------------------------------------------

    def _submit(self, job, result):
        fut = torch.futures.Future()
        if threading.current_thread() is self._thread:
            # A callback of an earlier call's future (torch's hooks chain collectives
            # that way): it runs here, in the same place of the sequence on every rank,
            # and a caller that waits on it cannot wait on this thread.
            _run(job, fut, result)
            return _Work(fut, result)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="commlab-backend",
                                                daemon=True)
                self._thread.start()
        self._jobs.put((job, fut, result))
        return _Work(fut, result)


class _Work(_C10dWork):
    """The caller's handle. Not torch's future-wrapping Work: its wait() returns without
    raising when the future holds an error, and a failed all-reduce would read as done."""

    def __init__(self, fut: torch.futures.Future, result):
        super().__init__()
        self._fut, self._result = fut, result

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises the call's error, the same on every rank
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self):
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001 - a failure is what this reports
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def result(self):
        return self._result


# Everything but all_reduce and barrier: the gloo backend's method of the same name (its
# Python names are those PyBackend looks up on us).
for _name in ("broadcast", "allgather", "all_gather_single", "allgather_coalesced", "all_gather_single_coalesced",
              "allreduce_coalesced", "allreduce_sparse", "reduce", "gather", "gather_single", "scatter",
              "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "alltoall",
              "all_to_all_single", "send", "recv", "recv_anysource"):
    setattr(CommlabBackend, _name,
            (lambda name: lambda self, *args: getattr(self._gloo(), name)(*args))(_name))


def _internal() -> bool:
    """Is commlab itself issuing this collective (the backend's thread, or a lane thread
    running an async commlab.all_reduce on this group)?"""
    return getattr(_inside, "on", False) or threading.current_thread().name.startswith("commlab-lane-")


def _served(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_sparse


def _serve(jobs: queue.SimpleQueue) -> None:
    """Runs a backend's commlab calls in order."""
    while True:
        item = jobs.get()
        if item is None:
            return
        _run(*item)


def _run(job, fut: torch.futures.Future, result) -> None:
    # While commlab works, whatever it issues on the group goes to the inner gloo backend;
    # the future's callbacks are the caller's code again.
    _inside.on = True
    error = None
    try:
        job()
    except BaseException as e:  # noqa: BLE001 - the caller's work raises it
        error = e
    finally:
        _inside.on = False
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def _create(opts, backend_options) -> CommlabBackend:
    return CommlabBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.process_group)


def register() -> None:
    """`import commlab` calls this: the backend is then known as "commlab"."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
