"""commlab as a torch.distributed backend: `dist.init_process_group("commlab")`,
`"cpu:commlab,cuda:nccl"` or `new_group(backend="commlab")` run unchanged training code
(DDP's reducer, torch's comm hooks, FSDP, Lightning) on commlab's algorithms.

What runs where:
- all_reduce of one dense CPU tensor: commlab.all_reduce on this group with the
  backend's algorithm (COMMLAB_ALGORITHM, default `auto`), on the backend's own thread,
  so that async callers (DDP's buckets) overlap it with their compute;
- all_gather (into one tensor or a list) of CPU tensors: commlab.all_gather with the
  family's algorithm (COMMLAB_ALL_GATHER_ALGORITHM, default `auto`: shared memory on one
  host, hier across hosts, the ring with one rank per host), on the same thread and
  sequence;
- reduce_scatter (from one tensor or a list) of CPU tensors: commlab.reduce_scatter with
  the family's algorithm (COMMLAB_REDUCE_SCATTER_ALGORITHM, default `auto`: shared
  memory on one host, the ring across hosts), on the same thread and sequence (with
  all_gather, FSDP's two halves of every step);
- broadcast of a CPU tensor: commlab.broadcast with the family's algorithm
  (COMMLAB_BROADCAST_ALGORITHM, default `auto`: shared memory on one host, the binomial
  tree or scatter + all-gather across hosts), on the same thread and sequence;
- all_to_all (all_to_all_single, uneven splits included, or lists of tensors) of CPU
  tensors: commlab.all_to_all with the family's algorithm (COMMLAB_ALL_TO_ALL_ALGORITHM,
  default `auto`: shared memory on one host, Bruck or pairwise exchange across hosts),
  on the same thread and sequence;
- barrier, when every rank is on one host: commlab's shared memory, on the same thread
  and sequence; COMMLAB_COLLECTIVES=gloo sends it, all_gather, reduce_scatter,
  broadcast and all_to_all to gloo instead;
- every other collective: a gloo backend of the same ranks ("front"), so nothing a
  user calls is missing; issued once every earlier call on the thread is done, so
  calls on one group run in the order they were made;
- every collective commlab's own algorithms issue on this group while they run (setup
  gathers, point-to-point steps, `builtin`): a second gloo backend ("inner"), so their
  order never interleaves with the caller's.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from commlab.api import all_gather as gathers
from commlab.api import all_reduce as api
from commlab.api import all_to_all as swaps
from commlab.api import broadcast as casts
from commlab.api import lanes
from commlab.api import reduce_scatter as scatters
from commlab.core import groups
from commlab.core.collectives import backend_algorithm
from commlab.core.errors import CollectiveMismatchError, CommlabError
from commlab.core.reduction import SUPPORTED_DTYPES, Op, parse_op
from commlab.transports import shm
from commlab.transports.setup import gather, host_ids

NAME = "commlab"
LABEL = "backend"  # how errors name the backend's own calls: commlab[backend]


def _collectives() -> str:
    """Where the collectives other than all_reduce go: "shm" (on one host) or "gloo"."""
    value = os.environ.get("COMMLAB_COLLECTIVES", "") or "shm"
    if value not in ("shm", "gloo"):
        raise ValueError(f"COMMLAB_COLLECTIVES must be shm or gloo, not {value!r}")
    return value


class CommlabBackend(_C10dBackend):
    def __init__(self, store, rank: int, size: int, timeout, group):
        super().__init__(rank, size)
        self.commlab_timeout = timeout  # what groups.timeout_of reads
        self._front = dist.ProcessGroupGloo(dist.PrefixStore("front/", store), rank, size, timeout)
        self._inner = dist.ProcessGroupGloo(dist.PrefixStore("inner/", store), rank, size, timeout)
        self._group = weakref.ref(group)  # the ProcessGroup this backend serves; it owns us
        self._algorithm = backend_algorithm("all_reduce")
        self._collectives = _collectives()
        self._shm: bool | None = None  # do the other collectives go through shared memory? (decided on first use)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = _Pending()  # jobs submitted and not yet finished
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        weakref.finalize(group, self._jobs.put, None)  # the thread ends with the group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # torch 2.14's PyBackend reads these through Python attribute lookup, which finds
    # its own C++ property that asks Python again: without an override, any query
    # (batch_isend_irecv asks supports_coalescing) recursed until RecursionError.
    supports_coalescing = property(lambda self: False)
    supports_splitting = property(lambda self: False)
    supports_time_estimate = property(lambda self: False)
    supports_shrinking = property(lambda self: False)
    supports_reconfigure = property(lambda self: False)
    supports_window = property(lambda self: False)

    # -- the collectives commlab serves -------------------------------------------------

    def allreduce(self, tensors, opts):
        if _internal() or len(tensors) != 1 or not _served(tensors[0]):
            return self._delegate("allreduce", tensors, opts)
        # opts.reduceOp is a new object on every call: the plan cache keys ops by identity,
        # so pass commlab's own (stable) Op, else every call would be planned afresh.
        tensor, op, group, algorithm = tensors[0], parse_op(opts.reduceOp), self._group, self._algorithm
        return self._submit(lambda: api.all_reduce(tensor, op, _alive(group), algorithm=algorithm), [tensor],
                            _caller_waits())

    def all_gather_single(self, output, inp, opts):
        if _internal() or not (_cpu_strided(output) and _cpu_strided(inp) and output.dtype == inp.dtype
                               and output.numel() == inp.numel() * self.size()):
            return self._delegate("all_gather_single", output, inp, opts)
        return self._registry_or_gloo(lambda g: gathers.all_gather(output, inp, g, algorithm=backend_algorithm("all_gather")),
                                      [output], "all_gather_single", output, inp, opts)

    def allgather(self, outputs, inputs, opts):
        p = self.size()
        if _internal() or len(inputs) != 1 or len(outputs) != 1 or len(outputs[0]) != p \
                or not _cpu_strided(inputs[0]) \
                or not all(_cpu_strided(o) and o.dtype == inputs[0].dtype and o.numel() == inputs[0].numel()
                           for o in outputs[0]):
            return self._delegate("allgather", outputs, inputs, opts)
        inp, outs = inputs[0], outputs[0]

        def run(group):
            flat = torch.empty(p * inp.numel(), dtype=inp.dtype)
            gathers.all_gather(flat, inp, group, algorithm=backend_algorithm("all_gather"))
            for j, o in enumerate(outs):
                o.copy_(flat[j * inp.numel():(j + 1) * inp.numel()].view_as(o))

        return self._registry_or_gloo(run, outputs, "allgather", outputs, inputs, opts)

    def reduce_scatter_single(self, output, inp, opts):
        op = _reduce_op(opts.reduceOp)
        if _internal() or op is None or not (_cpu_strided(output) and _cpu_strided(inp) and output.dtype == inp.dtype
                                             and output.dtype in SUPPORTED_DTYPES
                                             and inp.numel() == output.numel() * self.size()):
            return self._delegate("reduce_scatter_single", output, inp, opts)
        return self._registry_or_gloo(
            lambda g: scatters.reduce_scatter(output, inp, op, g, algorithm=backend_algorithm("reduce_scatter")),
            [output], "reduce_scatter_single", output, inp, opts)

    def reduce_scatter(self, outputs, inputs, opts):
        op = _reduce_op(opts.reduceOp)
        p = self.size()
        if _internal() or op is None or len(outputs) != 1 or len(inputs) != 1 or len(inputs[0]) != p \
                or not _cpu_strided(outputs[0]) or outputs[0].dtype not in SUPPORTED_DTYPES \
                or not all(_cpu_strided(i) and i.dtype == outputs[0].dtype and i.numel() == outputs[0].numel()
                           for i in inputs[0]):
            return self._delegate("reduce_scatter", outputs, inputs, opts)
        output, parts = outputs[0], inputs[0]

        def run(group):
            whole = torch.cat([i.reshape(-1) for i in parts])
            scatters.reduce_scatter(output, whole, op, group, algorithm=backend_algorithm("reduce_scatter"))

        return self._registry_or_gloo(run, outputs, "reduce_scatter", outputs, inputs, opts)

    def broadcast(self, tensors, opts):
        if _internal() or len(tensors) != 1 or not _cpu_strided(tensors[0]):
            return self._delegate("broadcast", tensors, opts)
        t, root = tensors[0], opts.rootRank  # a rank of this group
        return self._registry_or_gloo(
            lambda g: casts.broadcast(t, group=g, group_src=root, algorithm=backend_algorithm("broadcast")),
            tensors, "broadcast", tensors, opts)

    def all_to_all_single(self, output, inp, output_splits, input_splits, opts):
        if _internal() or not (_cpu_strided(output) and _cpu_strided(inp) and output.dtype == inp.dtype):
            return self._delegate("all_to_all_single", output, inp, output_splits, input_splits, opts)
        osp, isp = list(output_splits) or None, list(input_splits) or None  # c10d's empty list: even
        return self._registry_or_gloo(
            lambda g: swaps.all_to_all(output, inp, osp, isp, g, algorithm=backend_algorithm("all_to_all")),
            [output], "all_to_all_single", output, inp, output_splits, input_splits, opts)

    def alltoall(self, outputs, inputs, opts):
        p = self.size()
        if _internal() or len(outputs) != p or len(inputs) != p or not all(
                _cpu_strided(t) and t.dtype == inputs[0].dtype for t in (*outputs, *inputs)):
            return self._delegate("alltoall", outputs, inputs, opts)

        def run(group):
            # One flat exchange: tensor q's elements are the block for rank q.
            whole = torch.cat([t.reshape(-1) for t in inputs])
            flat = torch.empty(sum(o.numel() for o in outputs), dtype=inputs[0].dtype)
            swaps.all_to_all(flat, whole, [o.numel() for o in outputs], [t.numel() for t in inputs], group,
                             algorithm=backend_algorithm("all_to_all"))
            for o, piece in zip(outputs, flat.split([o.numel() for o in outputs])):
                o.copy_(piece.view(o.shape))

        return self._registry_or_gloo(run, outputs, "alltoall", outputs, inputs, opts)

    def barrier(self, opts=None):
        args = () if opts is None else (opts,)
        if _internal():
            return self._inner.barrier(*args)
        return self._shm_or_gloo(lambda info: shm.barrier(info, LABEL), [], "barrier", *args)

    # -- shared memory or gloo ----------------------------------------------------------

    def _shm_or_gloo(self, run, result, name, *args):
        """`run(info)` on the backend's thread when shared memory serves the group's other
        collectives, else gloo's `name(*args)` (after everything queued before it)."""
        if self._shm is False:
            return self._delegate(name, *args)
        if self._shm is None:
            # Decided once, collectively, in call order (every rank makes its first such
            # call at the same point); the call then goes the way decided.
            decided: list[bool] = []
            group, knob = self._group, self._collectives
            self._submit(lambda: decided.append(_decide(_alive(group), knob, name)), []).wait()
            self._shm = decided[0]
            if not self._shm:
                return self._delegate(name, *args)
        group = self._group
        return self._submit(lambda: run(groups.resolve(_alive(group))), result, _caller_waits())

    def _registry_or_gloo(self, run, result, name, *args):
        """`run(group)` (a call through a family's registry, on any layout) on the
        backend's thread, unless COMMLAB_COLLECTIVES=gloo sends the collective to gloo."""
        if self._collectives == "gloo":
            return self._delegate(name, *args)
        group = self._group
        return self._submit(lambda: run(_alive(group)), result, _caller_waits())

    # -- everything else: gloo ----------------------------------------------------------

    def _delegate(self, name, *args):
        """gloo's `name(*args)`; from the caller, only once every call queued before it
        has run (so calls on the group keep their order and never race on a tensor)."""
        if _internal():
            return getattr(self._inner, name)(*args)
        if self._pending.count and threading.current_thread() is not self._thread:
            self._submit(lambda: None, []).wait()
        return getattr(self._front, name)(*args)

    # -- the backend's thread -----------------------------------------------------------

    def _submit(self, job, result, caller_waits: bool = False):
        fut = torch.futures.Future()
        # Run at once, on this thread: a callback of an earlier call's future (torch's hooks
        # chain collectives that way) runs here, in the same place of the sequence on every
        # rank, and a caller that waits on it cannot wait on this thread; a blocking call
        # with nothing queued saves the hop to the backend's thread and back (a visible
        # share of a small call: docs/measurements.md#figures-behind-the-codes-choices).
        if threading.current_thread() is self._thread or (caller_waits and not self._pending.count):
            _run(job, fut, result)
            return _Work(fut, result)
        with self._lock:
            if self._thread is None:
                jobs = self._jobs  # not self: the thread must not hold the backend
                self._thread = lanes.start_daemon(_serve, (jobs,), "commlab-backend", lambda: jobs.put(None))
        self._pending.add(1)
        # What goes on the queue must not hold the backend: the thread would then free it
        # (and its gloo groups) after the job, and at interpreter exit that aborts the
        # process ("terminate called without an active exception").
        self._jobs.put((job, fut, result, self._pending))
        return _Work(fut, result)


class _Pending:
    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


_C10D = dist.distributed_c10d.__name__


def _caller_waits() -> bool:
    """Did torch.distributed's Python API call us with async_op=False (it waits on the
    Work at once)? Read from its frame: c10d gives a backend no other sign. Anything
    else (DDP's reducer, async calls, other callers) is treated as async."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__") == __name__:
        f = f.f_back
    if f is None or f.f_globals.get("__name__") != _C10D:
        return False
    return f.f_locals.get("async_op", True) is False


def _alive(ref) -> dist.ProcessGroup:
    group = ref()
    if group is None:
        raise CommlabError("commlab backend: the process group was destroyed with this call still queued")
    return group


def _decide(group, knob: str, first: str) -> bool:
    """Do the collectives other than all_reduce go through shared memory? Collective, on
    the first of them (named in the step: ranks whose first calls differ are told which)."""
    info = groups.resolve(group)
    what = f"choosing where collectives go (on its first, {first})"
    knobs = gather(info, knob, LABEL, what)
    if len(set(knobs)) > 1:
        raise CollectiveMismatchError(
            "commlab backend: ranks set COMMLAB_COLLECTIVES differently: " +
            ", ".join(f"rank {info.global_rank(r)}: {k}" for r, k in enumerate(knobs)))
    return knob == "shm" and len(set(host_ids(info, LABEL, what))) == 1


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


# Everything else: the gloo backend's method of the same name (its Python names are
# those PyBackend looks up on us).
for _name in ("allgather_coalesced", "all_gather_single_coalesced", "allreduce_coalesced", "allreduce_sparse",
              "reduce", "gather", "gather_single", "scatter", "reduce_scatter_single_coalesced", "send", "recv", "recv_anysource"):
    setattr(CommlabBackend, _name, (lambda name: lambda self, *args: self._delegate(name, *args))(_name))


def _internal() -> bool:
    """Is commlab itself issuing this collective (from an algorithm running on the
    backend's thread, a lane, or inline: `builtin` on a commlab group)?"""
    return lanes.inside()


def _served(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_sparse


def _cpu_strided(t: torch.Tensor) -> bool:
    """What the families' APIs take (any layout of a strided CPU tensor)."""
    return isinstance(t, torch.Tensor) and t.is_cpu and t.layout == torch.strided


def _reduce_op(op) -> Op | None:
    """commlab's Op for a c10d ReduceOp it serves, None for the rest (PREMUL_SUM, BAND...)."""
    try:
        return parse_op(op)
    except Exception:  # noqa: BLE001 - whatever commlab cannot reduce, gloo does or explains
        return None


def _serve(jobs: queue.SimpleQueue) -> None:
    """Runs a backend's commlab calls in order."""
    while True:
        item = jobs.get()
        if item is None:
            return
        _run(*item)
        item = None  # nothing of a finished job stays alive while the thread waits


def _run(job, fut: torch.futures.Future, result, pending: _Pending | None = None) -> None:
    # While commlab works, whatever it issues on the group goes to the inner gloo backend;
    # the future's callbacks are the caller's code again.
    error = None
    try:
        with lanes.running():
            job()
    except BaseException as e:  # noqa: BLE001 - the caller's work raises it
        error = e
    finally:
        if pending is not None:
            pending.add(-1)  # before the caller can see the future complete
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
