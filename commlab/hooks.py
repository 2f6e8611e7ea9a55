"""DDP communication hooks for every registered algorithm.

    state = commlab.hooks.CommState(algorithm="shm")           # collective: same order on all ranks
    commlab.hooks.register(ddp_model, state)                    # validates, then register_comm_hook
    ...
    state.stats()                                               # per-bucket and per-iteration timings

The hook never blocks backward: it hands the bucket to the state's communication
thread and returns a Future that thread completes, so buckets reduce while autograd
keeps computing. The state owns a process group of its own (same ranks), so its
point-to-point traffic can never interleave with DDP's internal collectives.
"""


import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import algorithms, api
from .errors import CommlabError, UnsupportedError

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


class CommState:
    def __init__(self, algorithm: str = "ring", group=None, compress: torch.dtype | None = None, *,
                 device: torch.device | str | None = None, keep_iterations: int = 1000):
        self.algorithm = algorithms.get(algorithm).name
        if compress not in _COMPRESS:
            raise UnsupportedError(f"commlab.hooks: compress must be None, torch.float16 or torch.bfloat16, got {compress}")
        self.compress = compress
        if not dist.is_initialized():
            raise CommlabError("commlab.hooks: initialize torch.distributed before creating a CommState")
        parent = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        # Collective: every rank of the parent group creates its CommStates in the same order.
        self.process_group = dist.new_group(ranks)
        self.world_size = len(ranks)
        if device is not None:
            self.check_device(torch.device(device))
        self._keep = keep_iterations
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"commlab-hook-{self.algorithm}", daemon=True)
        self._thread.start()
        self.reset_stats()

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
        with self._lock:
            self._current: _Iteration | None = None
            self._done: list[_Iteration] = []

    def stats(self) -> dict:
        """Per finished iteration: bytes, total communication time (sum over buckets) and
        exposed time (from the last bucket's hand-over, i.e. the end of backward
        compute, to the last bucket's completion); plus the last iteration's buckets."""
        with self._lock:
            its = [i for i in self._done if i.last_done is not None]
            per = [{"bytes": i.bytes, "buckets": len(i.buckets), "total_comm_ms": i.comm_s * 1e3,
                    "exposed_ms": max(0.0, (i.last_done - i.backward_end) * 1e3)} for i in its]
            last = its[-1].buckets if its else []
        n = len(per)
        return {
            "algorithm": self.algorithm,
            "compress": str(self.compress).replace("torch.", "") if self.compress else None,
            "iterations": n,
            "mean_total_comm_ms": sum(p["total_comm_ms"] for p in per) / n if n else 0.0,
            "mean_exposed_ms": sum(p["exposed_ms"] for p in per) / n if n else 0.0,
            "per_iteration": per,
            "last_buckets": [dict(b) for b in last],
        }

    # -- the communication thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _begin(self, bucket) -> _Iteration:
        """Book a bucket handed over by DDP; the last bucket marks the end of backward."""
        buf = bucket.buffer()
        now = time.perf_counter()
        with self._lock:
            it = self._current
            if it is None:
                it = self._current = _Iteration(started=now)
            it.pending += 1
            it.bytes += buf.numel() * (self.compress.itemsize if self.compress else buf.element_size())
            if bucket.is_last():
                it.backward_end = now
                self._current = None  # the next hook call starts a new iteration
        return it

    def _finish(self, it: _Iteration, index: int, nbytes: int, t0: float, t1: float) -> None:
        """Book a bucket's completion; the iteration is done when its last bucket is."""
        with self._lock:
            it.comm_s += t1 - t0
            it.buckets.append({"index": index, "bytes": nbytes, "comm_ms": (t1 - t0) * 1e3})
            it.pending -= 1
            if it.pending == 0 and it.backward_end is not None:
                it.last_done = t1
                self._done.append(it)
                del self._done[: -self._keep]

    def submit(self, bucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future()
        it = self._begin(bucket)
        index = bucket.index()
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        if stream is not None:
            # The comm thread must see the gradients the backward stream produced.
            ready = torch.cuda.Event()
            ready.record(stream)
        else:
            ready = None

        def job() -> None:
            t0 = time.perf_counter()
            try:
                if ready is not None:
                    ready.synchronize()
                self._reduce(buf)
                error = None
            except BaseException as e:  # noqa: BLE001 - delivered through the Future
                error = e
            self._finish(it, index, buf.numel() * buf.element_size(), t0, time.perf_counter())
            if error is None:
                fut.set_result(buf)
            else:
                fut.set_exception(error)

        self._jobs.put(job)
        return fut

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
        self._jobs.put(None)
        self._thread.join(5)
        pg, self.process_group = self.process_group, None
        if pg is not None and dist.is_initialized() and pg in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(pg)

    def __getstate__(self):  # DDP pickles nothing, but make misuse obvious
        raise TypeError("CommState holds a process group and a thread; it cannot be pickled")


def allreduce_hook(state: CommState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with state.algorithm on the state's communication thread."""
    return state.submit(bucket)


def blocking_allreduce_hook(state: CommState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The same reduction done inside the hook, blocking backward: the baseline that
    shows what overlap buys (benchmarks only)."""
    buf = bucket.buffer()
    it = state._begin(bucket)
    t0 = time.perf_counter()
    state._reduce(buf)
    state._finish(it, bucket.index(), buf.numel() * buf.element_size(), t0, time.perf_counter())
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def noop_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """No communication at all: DDP's compute-only floor (headroom analysis)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, state: CommState, hook=allreduce_hook) -> None:
    """Validate that the state's algorithm can serve the model's gradients, then register."""
    devices = {p.device for p in ddp_model.parameters()}
    for d in devices:
        state.check_device(d)
    ddp_model.register_comm_hook(state, hook)
