"""Timing collectives the way nccl-tests does, once for every algorithm and anchor.

The headline is nccl-tests' (and OSU's): the time of a loop of back-to-back calls
divided by its iterations, from the slowest rank. Per-call durations are taken too and
combined element-wise with MAX across ranks; their median and p10/p90 show the spread.
They are not the headline because with back-to-back calls the ranks' i-th calls cover
different stretches of wall-clock time: where ranks outnumber cores, whichever rank was
descheduled makes every index look slow (docs/measurements.md#the-benchmarks-headline-time).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Timing:
    mean_us: float  # loop time / iterations, slowest rank: the headline
    median_us: float  # per call, slowest rank per call
    p10_us: float
    p90_us: float
    iters: int


def percentile(sorted_vals: list[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated (the one formula commlab
    reports percentiles with)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


class Clock:
    """perf_counter on CPU; CUDA events on GPU so asynchronous launches are timed by
    their completion, not their issue."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def durations_us(self, marks) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e3 for a, b in zip(marks, marks[1:])]
        return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]


def agree_min(value: int, device: torch.device) -> int:
    """The smallest value any rank has (every rank must run the same number of
    iterations; every rank must be able to start a peer)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def slowest(durations: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(durations, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def round_order(rows: list, k: int) -> list:
    """The order round k times the rows in: rotated by k // 2 and reversed on odd rounds,
    so no row always follows the same one. A row's speed depends on its predecessor
    here: after gloo's row (ranks asleep, woken onto one core) the two ranks of the
    next shared-memory or MPI row ran on one core for tens of ms, every call paying a
    context switch. Every rank derives the same order (they call the rows together)."""
    shift = (k // 2) % len(rows) if rows else 0
    order = rows[shift:] + rows[:shift]
    return order[::-1] if k % 2 else order


class Interleaved:
    """Times several calls of one size side by side: `rounds` rounds, each of which
    times every call once for its share of the iterations. On a machine whose speed
    drifts (shared hosts, other tenants) every call then sees the same slow and fast
    phases, so their ratios hold even when absolute times move."""

    def __init__(self, *, device: torch.device, iters: int | None, warmup: int, blocking: bool,
                 budget_s: float, max_iters: int, rounds: int, trace_calls: int = 0):
        self.clock = Clock(device)
        self.device, self.iters, self.warmup, self.blocking = device, iters, warmup, blocking
        self.budget_s, self.max_iters, self.rounds = budget_s, max_iters, max(1, rounds)
        self._per_round: dict[object, int] = {}
        self._durations: dict[object, list[float]] = {}
        self._total_us: dict[object, float] = {}
        # --trace: this rank's own timed calls, (start, end) in perf_counter seconds, at
        # most trace_calls of each round: {"key", "round", "calls"} per round.
        self.trace_calls, self.traced = trace_calls, []

    def _plan(self, call: Callable[[], None]) -> int:
        """Warm up once and decide how many iterations each round gets (agreed across ranks)."""
        call()  # the first call may set a transport up (shared memory, IPC): not a sample of its speed
        # The fastest warm-up call sets the pace: the first calls at a new size fault in
        # fresh buffers, and their mean gave a fast row a tenth of its budget
        # (docs/measurements.md#figures-behind-the-codes-choices). A fixed count: every rank calls alike.
        per_call = float("inf")
        for _ in range(max(self.warmup, 1)):
            t0 = time.perf_counter()
            call()
            if self.clock.cuda:
                torch.cuda.synchronize()
            per_call = min(per_call, time.perf_counter() - t0)
        total = self.iters
        if total is None:
            total = int(min(self.max_iters, max(3, self.budget_s / max(per_call, 1e-6))))
        total = agree_min(total, self.device)
        return max(1, -(-total // self.rounds))

    def round(self, key, call: Callable[[], None], barrier: Callable[[], None] | None = None) -> None:
        """Time one round of `call`, under the name `key`; with blocking, every call
        starts right after `barrier` (default: the group's barrier)."""
        if key not in self._per_round:
            self._per_round[key] = self._plan(call)
            self._durations[key] = []
            self._total_us[key] = 0.0
        durations, total, calls = _timed(call, self.clock, self._per_round[key], self.blocking, self.device,
                                         barrier or dist.barrier)
        if self.trace_calls and calls is not None:
            done = sum(1 for t in self.traced if t["key"] == key)
            self.traced.append({"key": key, "round": done, "calls": calls[:self.trace_calls]})
        self._durations[key].extend(durations)
        self._total_us[key] += total

    def result(self, key) -> Timing:
        worst = sorted(self._durations[key])
        return Timing(self._total_us[key] / len(worst), statistics.median(worst), percentile(worst, 0.1),
                      percentile(worst, 0.9), len(worst))


def _timed(call: Callable[[], None], clock: Clock, iters: int, blocking: bool, device,
           barrier: Callable[[], None] = dist.barrier) -> tuple[list[float], float, list | None]:
    """Per-iteration durations, each the slowest rank's, the slowest rank's total, and
    this rank's own (start, end) of every timed call (perf_counter seconds; None on a GPU,
    whose events have no common clock).
    The garbage collector is off while calls are timed, as timeit has it: a collection
    walks every object of the process (tens of ms where torch is loaded) and is set off by
    whatever row made the garbage, so it landed in the row that happened to be running
    (docs/measurements.md#every-family-measured-again-the-timings-fixes-and-all-gather-in-pieces)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        return _timed_loop(call, clock, iters, blocking, device, barrier)
    finally:
        if was_on:
            gc.enable()


def _timed_loop(call, clock, iters, blocking, device, barrier) -> tuple[list[float], float, list | None]:
    dist.barrier()
    if blocking:
        durations, calls = [], []
        for _ in range(iters):
            # The transport's own barrier: gloo's releases 4 ranks on 2 cores milliseconds
            # apart, and a call timed after it would measure that skew.
            barrier()
            start = clock.mark()
            call()
            end = clock.mark()
            durations.extend(clock.durations_us([start, end]))
            calls.append((start, end))
        worst = slowest(durations, device)
        # every call starts together: the slowest rank per call
        return worst, sum(worst), None if clock.cuda else calls
    # A barrier releases the ranks up to milliseconds apart when they outnumber the
    # cores; one untimed call lines them up again, so the first sample is not skew.
    call()
    marks = [clock.mark()]
    for _ in range(iters):
        call()
        marks.append(clock.mark())
    durations = clock.durations_us(marks)
    # The loop's total rides along as one more element of the element-wise MAX.
    worst = slowest(durations + [sum(durations)], device)
    return worst[:-1], worst[-1], None if clock.cuda else list(zip(marks, marks[1:]))
