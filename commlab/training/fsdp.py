"""FSDP2 communication through commlab: the all-gather and reduce-scatter families
plugged into `fully_shard` the way commlab.hooks plugs all-reduce into DDP.

    from torch.distributed.fsdp import fully_shard
    stats = commlab.training.fsdp.CommStats()
    for block in model.blocks: fully_shard(block)
    fully_shard(model)
    commlab.training.fsdp.use(model, "shm", stats)   # every FSDP unit's gathers and reduce-scatters
    ...
    stats.summary()                                   # per step: calls, bytes, total and exposed time

`use(model, None, stats)` keeps torch's own collectives (dist.all_gather_single and
dist.reduce_scatter_single on FSDP's group, FSDP2's defaults) and only times them. Every call runs to
completion before it returns (FSDP2 on CPU issues them blocking, without streams), so
its whole time is exposed. On a GPU the calls are issued on FSDP's streams and only
launched by the time the host returns: there `use(model, None, stats)` counts each
call's bytes and leaves its time to the device (compare profiles a step); commlab's
algorithms serve CPU tensors there (FSDP2 waits on torch's Work, which commlab's handle
is not).
"""
from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from commlab import algorithms as registries
from commlab.api.all_gather import all_gather
from commlab.api.reduce_scatter import reduce_scatter
from commlab.core.errors import UnsupportedError


@dataclass
class _Step:
    # (kind, start, end, bytes, faults) per call; bytes are nccl-tests' sizes: the gathered
    # output, the reduce-scattered input; faults the process's minor page faults during the
    # call (None: not counted). The step's sums and compare --trace's spans.
    calls: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(c[3] for c in self.calls)

    @property
    def comm_s(self) -> float:
        return sum(c[2] - c[1] for c in self.calls)

    def count(self, kind: str) -> int:
        return sum(c[0] == kind for c in self.calls)


class CommStats:
    """What FSDP's collectives cost per training step; the caller marks steps with
    `step()` (compare does, before each one)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._steps: list[_Step] = []
            self._current = _Step()
            self.untimed = False

    def step(self) -> None:
        """A training step starts: the previous one's calls are booked."""
        with self._lock:
            if self._current.calls:
                self._steps.append(self._current)
            self._current = _Step()

    def add(self, kind: str, nbytes: int, start: float, end: float | None, faults: int | None = None) -> None:
        """One call, from start to end (time.perf_counter); end None: launched on a
        device stream, its bytes counted and its time the device's. faults: the minor
        page faults the process took during it (a fresh output's pages, first written)."""
        with self._lock:
            self._current.calls.append((kind, start, start if end is None else end, nbytes, faults))
            self.untimed = self.untimed or end is None

    def summary(self) -> dict:
        """Means over the finished steps (blocking calls: exposed = total; None where a
        call was launched on a device stream, untimed)."""
        self.step()
        with self._lock:
            steps = list(self._steps)
        n = len(steps)
        mean = (lambda f: sum(f(s) for s in steps) / n) if n else (lambda f: 0.0)
        total = None if self.untimed else mean(lambda s: s.comm_s * 1e3)
        return {"steps": n, "mean_total_comm_ms": total, "mean_exposed_ms": total,
                "mean_bytes": mean(lambda s: s.bytes), "mean_calls": mean(lambda s: len(s.calls)),
                "mean_all_gathers": mean(lambda s: s.count("all_gather")),
                "mean_reduce_scatters": mean(lambda s: s.count("reduce_scatter"))}

    def iterations(self) -> list[dict]:
        """The finished steps' calls, the spans summary() sums (compare --trace)."""
        with self._lock:
            steps = list(self._steps)
        return [{"calls": [{"kind": kind.replace("_", "-"), "start": a, "end": b, "bytes": n,
                            **({} if f is None else {"page_faults": f})}
                           for kind, a, b, n, f in s.calls]} for s in steps]


def minor_faults() -> int:
    """This process's minor page faults so far; the difference across a call is the pages
    it faulted in (an output mapped afresh is first written inside the call, one glibc
    recycled from its heap is not: docs/measurements.md, "The probe in fresh ranks and in
    ranks that trained")."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu(*tensors) -> None:
    for t in tensors:
        if not t.is_cpu:
            raise UnsupportedError(f"commlab.training.fsdp serves CPU tensors (FSDP2 on GPU waits on torch's Work), "
                                   f"got {t.device}")


def _timed(stats: CommStats | None, kind: str, nbytes: int, call) -> None:
    """A blocking call, booked with its time and the page faults taken inside it."""
    f0, t0 = minor_faults(), time.perf_counter()
    call()
    if stats is not None:
        stats.add(kind, nbytes, t0, time.perf_counter(), minor_faults() - f0)


def _launched(stats: CommStats | None, kind: str, nbytes: int) -> None:
    if stats is not None:
        stats.add(kind, nbytes, time.perf_counter(), None)


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class Gather(_Alloc, AllGather):
    """FSDP2's all-gather through commlab's all-gather `algorithm` (None: torch's own)."""

    def __init__(self, algorithm: str | None, stats: CommStats | None = None):
        self.algorithm, self.stats = algorithm, stats

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        nbytes = output_tensor.numel() * output_tensor.element_size()
        if self.algorithm is None and not output_tensor.is_cpu:  # FSDP2's own default call, on its stream
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            _launched(self.stats, "all_gather", nbytes)
            return work
        _cpu(output_tensor, input_tensor)
        _timed(self.stats, "all_gather", nbytes,
               lambda: dist.all_gather_single(output_tensor, input_tensor, group=group)  # FSDP2's own default call
               if self.algorithm is None else all_gather(output_tensor, input_tensor, group=group,
                                                         algorithm=self.algorithm))
        return None  # done: FSDP goes on as after a blocking call


class Scatter(_Alloc, ReduceScatter):
    """FSDP2's reduce-scatter through commlab's reduce-scatter `algorithm` (None: torch's own)."""

    def __init__(self, algorithm: str | None, stats: CommStats | None = None):
        self.algorithm, self.stats = algorithm, stats

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if self.algorithm is None and not input_tensor.is_cpu:
            work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group,
                                              async_op=async_op)
            _launched(self.stats, "reduce_scatter", nbytes)
            return work
        _cpu(output_tensor, input_tensor)
        _timed(self.stats, "reduce_scatter", nbytes,
               lambda: dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group)
               if self.algorithm is None else reduce_scatter(output_tensor, input_tensor, op, group=group,
                                                             algorithm=self.algorithm))
        return None


def use(model: torch.nn.Module, algorithm: str | None, stats: CommStats | None = None) -> int:
    """Every FSDP unit of `model` gathers and reduce-scatters through `algorithm` (a name
    both families register, e.g. shm, ring, direct, builtin, auto; None: torch's own,
    timed). Returns the number of units."""
    # ~0.5 s: only the FSDP modes load it
    from torch.distributed.fsdp import FSDPModule

    if algorithm is not None:
        for collective in ("all_gather", "reduce_scatter"):
            registries.registry(collective).get(algorithm)  # unknown: UnsupportedError naming the family
    gather, scatter = Gather(algorithm, stats), Scatter(algorithm, stats)
    units = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
            units += 1
    if not units:
        raise UnsupportedError("commlab.training.fsdp.use: the model has no fully_shard units")
    return units


def algorithms() -> list[str]:
    """The names both families register for CPU: what `fsdp:<algorithm>` takes."""
    gathers = registries.registry("all_gather").for_device("cpu")
    return [a for a in registries.registry("reduce_scatter").for_device("cpu") if a in gathers]
