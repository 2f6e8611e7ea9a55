"""DDP communication hooks for every registered algorithm.

    state = commlab.hooks.CommState(algorithm="shm")           # may come before init_process_group
    commlab.hooks.register(ddp_model, state)                    # validates, then register_comm_hook
    ...
    state.stats()                                               # per-bucket and per-iteration timings

The hook never blocks backward: it hands the bucket to the state's communication
thread and returns a Future that thread completes, so buckets reduce while autograd
keeps computing. The state owns a process group of its own (same ranks), so its
point-to-point traffic can never interleave with DDP's internal collectives.

The rule for states: the members of a state's group create it, in the same order
among the states of the same ranks; a rank outside the group need not create it (a
copy it does create is inert and waits for nobody). A state binds its group on first
use (register() or the first bucket) or at creation when torch.distributed is
already up: its members meet through the job's store, then make the group among
themselves. Members that create states of different rank sets in different orders,
each waiting for the other in another state, raise the same CollectiveMismatchError
at once; a member that never comes is one after COMMLAB_SETUP_TIMEOUT.
"""


import atexit
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.api import all_reduce as api
from commlab.core.errors import CommlabError, UnsupportedError
from commlab.training.membership import bind_lock, live_states, members_group_for

_COMPRESS = (None, torch.float16, torch.bfloat16)


@dataclass
class _Iteration:
    started: float
    bytes: int = 0
    comm_s: float = 0.0
    buckets: list = field(default_factory=list)
    pending: int = 0
    backward_end: float | None = None  # when the last bucket was handed over
    last_done: float | None = None


class BucketStats:
    """Per-iteration bookkeeping of DDP buckets: each bucket's communication time, and
    the exposed time from the last bucket's hand-over (the end of backward compute) to
    the last bucket's completion. CommState keeps one; compare's `ddp` mode times DDP's
    default reduction with another."""

    def __init__(self, keep_iterations: int = 1000, wire_itemsize: int | None = None):
        self._keep = keep_iterations
        self._wire_itemsize = wire_itemsize  # bytes per element on the wire (compression)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._current: _Iteration | None = None
            self._done: list[_Iteration] = []

    def begin(self, bucket) -> _Iteration:
        """Book a bucket handed over by DDP; the last bucket marks the end of backward."""
        buf = bucket.buffer()
        now = time.perf_counter()
        with self._lock:
            it = self._current
            if it is None:
                it = self._current = _Iteration(started=now)
            it.pending += 1
            it.bytes += buf.numel() * (self._wire_itemsize or buf.element_size())
            if bucket.is_last():
                it.backward_end = now
                self._current = None  # the next hook call starts a new iteration
        return it

    def finish(self, it: _Iteration, index: int, nbytes: int, t0: float, t1: float) -> None:
        """Book a bucket's completion; the iteration is done when its last bucket is."""
        with self._lock:
            it.comm_s += t1 - t0
            # start/end on time.perf_counter's clock (CLOCK_MONOTONIC: one clock for every
            # process of a host): what compare's --trace draws
            it.buckets.append({"index": index, "bytes": nbytes, "comm_ms": (t1 - t0) * 1e3, "start": t0, "end": t1})
            it.pending -= 1
            if it.pending == 0 and it.backward_end is not None:
                it.last_done = t1
                self._done.append(it)
                del self._done[: -self._keep]

    def iterations(self) -> list[dict]:
        """Every finished iteration kept: its buckets (with start and end), the end of
        backward (the last hand-over) and the last completion; the spans stats() sums."""
        with self._lock:
            return [{"backward_end": i.backward_end, "last_done": i.last_done, "buckets": [dict(b) for b in i.buckets]}
                    for i in self._done if i.last_done is not None]

    def stats(self) -> dict:
        """Per finished iteration: bytes, total communication time (sum over buckets) and
        exposed time; plus the last iteration's buckets."""
        with self._lock:
            its = [i for i in self._done if i.last_done is not None]
            per = [{"bytes": i.bytes, "buckets": len(i.buckets), "total_comm_ms": i.comm_s * 1e3,
                    "exposed_ms": max(0.0, (i.last_done - i.backward_end) * 1e3)} for i in its]
            last = its[-1].buckets if its else []
        n = len(per)
        return {
            "iterations": n,
            "mean_total_comm_ms": sum(p["total_comm_ms"] for p in per) / n if n else 0.0,
            "mean_exposed_ms": sum(p["exposed_ms"] for p in per) / n if n else 0.0,
            "per_iteration": per,
            "last_buckets": [dict(b) for b in last],
        }


@atexit.register
def _close_live_states() -> None:
    for state in list(live_states):
        state.close()


class CommState:
    """State of commlab's DDP hooks: the algorithm, its own process group and the
    communication thread. `group`: the ranks to serve (a process group, or a list of
    global ranks; default: every rank)."""

    def __init__(self, algorithm: str = "ring", group=None, compress: torch.dtype | None = None, *,
                 device: torch.device | str | None = None, keep_iterations: int = 1000):
        self.algorithm = algorithms.get(algorithm).name
        if compress not in _COMPRESS:
            raise UnsupportedError(f"commlab.hooks: compress must be None, torch.float16 or torch.bfloat16, got {compress}")
        self.compress = compress
        if device is not None:
            self.check_device(torch.device(device))
        self._parent = group
        self.timing = BucketStats(keep_iterations, compress.itemsize if compress else None)
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._streams: dict = {}
        self._checked: set = set()
        self.process_group = None
        self.ranks: list[int] | None = None
        self.world_size: int | None = None
        self.member = False
        self.bound = False
        if dist.is_available() and dist.is_initialized():
            self.bind()

    def bind(self) -> None:
        """Create the state's own process group (collective over its members, in the
        order of their states of the same ranks; a no-op once bound)."""
        if self.bound:
            return
        with bind_lock:
            if self.bound:
                return
            if not (dist.is_available() and dist.is_initialized()):
                raise CommlabError("commlab.hooks: a CommState binds on first use, and torch.distributed is not "
                                   "initialized yet: call dist.init_process_group first")
            ranks, pg = members_group_for(self._parent_ranks(), self.algorithm)
            self.ranks, self.world_size = ranks, (len(ranks) if ranks is not None else None)
            self.member = pg != dist.GroupMember.NON_GROUP_MEMBER
            self.process_group = pg if self.member else None
            if self.member:
                self._thread = threading.Thread(target=self._loop, name=f"commlab-hook-{self.algorithm}", daemon=True)
                self._thread.start()
                live_states.add(self)
            self.bound = True

    def _parent_ranks(self) -> list[int] | None:
        g = self._parent
        if g is None:
            return list(range(dist.get_world_size()))
        if isinstance(g, (list, tuple)):
            return sorted(int(r) for r in g)
        if g == dist.GroupMember.NON_GROUP_MEMBER:
            return None  # not a member: its copy is inert
        return sorted(dist.get_process_group_ranks(g))

    def _require_member(self) -> None:
        self.bind()
        if not self.member:
            raise UnsupportedError(f"commlab.hooks: rank {dist.get_rank()} is not a member of this state's group "
                                   f"{self.ranks}: its copy of the state is inert")

    # -- validation -------------------------------------------------------------------------
    def check_device(self, device: torch.device) -> None:
        alg = algorithms.get(self.algorithm)
        if device.type not in alg.devices:
            raise UnsupportedError(
                f"commlab.hooks: algorithm {self.algorithm!r} cannot serve {device.type} gradients "
                f"(it serves {', '.join(alg.devices)}); choose one of {algorithms.for_device(device.type)}"
            )

    # -- statistics --------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.timing.reset()

    def stats(self) -> dict:
        """BucketStats.stats() of this state's buckets, with the algorithm and compression."""
        compress = str(self.compress).replace("torch.", "") if self.compress else None
        return {"algorithm": self.algorithm, "compress": compress, **self.timing.stats()}

    # -- the communication thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _ready_for(self, buf: torch.Tensor) -> None:
        """First bucket of a device: bind (a state registered by hand, as Lightning does)
        and refuse gradients the algorithm cannot serve here, synchronously, where DDP
        shows the error as raised (an error through a Future reaches it garbled)."""
        key = buf.device.type
        if key not in self._checked:
            self._require_member()
            self.check_device(buf.device)
            self._checked.add(key)

    def _stream(self, device: torch.device):
        """The CUDA stream this state communicates on for `device` (one per device)."""
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = torch.cuda.Stream(device)
        return s

    def submit(self, bucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        self._ready_for(buf)
        it = self.timing.begin(bucket)
        index = bucket.index()
        # A bucket's time runs from its hand-over, as the `ddp` mode times DDP's own
        # reduction: waiting behind earlier buckets and for late peers is in it.
        t0 = time.perf_counter()
        if buf.is_cuda:
            # CUDA semantics: the work runs on the state's stream after the bucket's
            # producer stream, and the Future carries that stream to whoever waits on it.
            fut = torch.futures.Future(devices=[buf.device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
            stream = self._stream(buf.device)
        else:
            fut, ready, stream = torch.futures.Future(), None, None

        def job() -> None:
            error = None
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        self._reduce(buf)
                        stream.synchronize()  # the bucket time is the work's, not its launch's
                else:
                    self._reduce(buf)
            except BaseException as e:  # noqa: BLE001 - delivered through the Future
                error = e
            self.timing.finish(it, index, buf.numel() * buf.element_size(), t0, time.perf_counter())
            if stream is not None:
                with torch.cuda.stream(stream):
                    _complete(fut, buf, error)
            else:
                _complete(fut, buf, error)

        self._jobs.put(job)
        return fut.then(_unwrap)

    def _reduce(self, buf: torch.Tensor) -> None:
        """buf <- mean over ranks, in place, dividing first so fp16 cannot overflow."""
        p = self.world_size
        if self.compress is None:
            buf.div_(p)
            api.all_reduce(buf, group=self.process_group, algorithm=self.algorithm)
            return
        wire = buf.div(p).to(self.compress)
        api.all_reduce(wire, group=self.process_group, algorithm=self.algorithm)
        buf.copy_(wire)

    def close(self) -> None:
        """Stop the communication thread and free the state's own process group."""
        live_states.discard(self)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(5)
            self._thread = None
        pg, self.process_group = self.process_group, None
        if pg is not None and dist.is_initialized() and pg in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(pg)

    def __getstate__(self):
        # An unbound state is plain settings: launchers that spawn ranks (Lightning's
        # spawn) may pickle it. A bound one holds a process group and a thread.
        if self.bound:
            raise TypeError("a bound CommState holds a process group and a thread; it cannot be pickled")
        state = dict(self.__dict__)
        state.pop("_jobs")
        state["timing"] = self.timing._keep  # a number in place of the object and its lock
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._jobs = queue.Queue()
        self.timing = BucketStats(state["timing"], self.compress.itemsize if self.compress else None)


def _complete(fut: torch.futures.Future, buf: torch.Tensor, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(buf)
    else:
        fut.set_exception(error)


def _unwrap(fut: torch.futures.Future) -> torch.Tensor:
    # Through then(), an error becomes the child Future's C++ error, which DDP reports
    # with the message; a Python Future's exception would reach DDP as "Unable to cast".
    return fut.value()


def allreduce_hook(state: CommState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with state.algorithm on the state's communication thread."""
    return state.submit(bucket)


def blocking_allreduce_hook(state: CommState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The same reduction done inside the hook, blocking backward: the baseline that
    shows what overlap buys (benchmarks only)."""
    buf = bucket.buffer()
    state._ready_for(buf)
    it = state.timing.begin(bucket)
    t0 = time.perf_counter()
    state._reduce(buf)
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()
    state.timing.finish(it, bucket.index(), buf.numel() * buf.element_size(), t0, time.perf_counter())
    fut: torch.futures.Future = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    fut.set_result(buf)
    return fut


def noop_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """No communication at all: DDP's compute-only floor (headroom analysis)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, state: CommState, hook=allreduce_hook) -> None:
    """Validate that the state can serve the model (device, group), bind it, register."""
    devices = {p.device for p in ddp_model.parameters()}
    for d in devices:
        state.check_device(d)
    state._require_member()
    model_ranks = sorted(dist.get_process_group_ranks(ddp_model.process_group))
    if model_ranks != state.ranks:
        raise UnsupportedError(f"commlab.hooks: the state serves ranks {state.ranks} but the model's DDP group has "
                               f"ranks {model_ranks}: pass group= the model's process group")
    ddp_model.register_comm_hook(state, hook)
