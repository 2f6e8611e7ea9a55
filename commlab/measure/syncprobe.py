"""Collectives as a training step issues them: each call after a stretch of compute.

The bench times calls back to back, the ranks lined up by the previous call. In training
(FSDP's all-gathers and reduce-scatters between blocks) each call follows compute, the
ranks arrive apart, and where they outnumber the cores the early ones sleep in the call
and must be woken when the last arrives; and each call writes buffers FSDP2 allocated for
it (fsdp_buffers), whose pages fault in as they are first written where the allocator
mapped them afresh, and not where it recycled a chunk of its heap (state REUSED: the
same buffers every call; which one a call meets is the heap's state at that moment,
so FSDP's calls are probed in both). This probe runs that:
every rank the same fixed work, then the call, a dozen times, and reads on the shared
clock of one host (ranks of one machine: perf_counter is CLOCK_MONOTONIC) what compare's
table reads in training:

- after_us: a call's time after the last rank arrived (per rank the mean over calls,
  the largest rank's: compare's "after the last rank arrived", per call);
- exit_spread_us: how far apart the ranks leave it (per call the mean over ranks of the
  last rank's end less its own): the head start the next synchronisation's wait begins
  with, which a compute-only step never shows.

A probe after compute reads a call as training meets it, which the bench's loop does not
(gloo's calls took longer after the last arrival than in the bench's loop), and the pages a
fresh output faults in are most of a large shm call, so compare probes at the model's
largest unit with fresh buffers (the figures: docs/measurements.md#figures-behind-the-codes-choices).

The same for DDP's buckets (an all-reduce in place at a full bucket: what is left of
them after backward) and for ZeRO-1's step end (every parameter broadcast from its
owner, issued asynchronously and waited for together, as torch's ZeroRedundancyOptimizer
does: priced one call after another from the bench, three runs measured 22-76 % less);
there the work before the call is the optimizer's step on each rank's own parameters,
all ranks at once, and the wait for the slowest is ZeRO-1's second synchronisation a step.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from commlab.core.reduction import Op
from commlab.measure import pools
from commlab.measure.specs import SPECS

WORK_MS = 50.0  # of one idle core per call: FSDP's blocks compute tens of ms between collectives
REPS = 12
SKIP = 2  # the first calls set transports up and fault buffers in


def _matmuls_per_ms() -> float:
    """How many 256x256 matmuls one idle core does per ms (the work unit, cache-resident
    so its rate does not depend on what the other ranks stream)."""

    a = torch.randn(256, 256)
    a @ a
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        best = min(best, (time.perf_counter() - t0) / 20)
    return 1e-3 / best


def fsdp_buffers(collective: str, count: int, rank: int, world: int):
    """(output, input) of one call as FSDP2 makes them: allocated for the call (on a host
    the allocator maps large ones afresh, so their pages fault in where first written) and
    the input written before it — an all-gather's shard copied into its own slice of the
    output, a reduce-scatter's gradients into a full-size input."""


    out = torch.empty(SPECS[collective].output(count, world))
    if collective == "all_gather":
        inp = out.narrow(0, rank * count, count)
    else:
        inp = torch.empty(count)
    inp.fill_(1.0)
    return out, inp


# Where FSDP2's output for a call comes from is the allocator's state at that moment: mapped
# afresh (glibc, above its mmap threshold: its pages fault in inside the call) or a free heap
# chunk already faulted in. The probe times a call in each.
FRESH, REUSED = "fresh", "reused"

ZERO1 = "zero1_broadcasts"  # ZeRO-1's step end: every parameter broadcast from its owner, waited for together
# What ZeRO-1's broadcasts follow: each rank's optimizer stepping its own parameters, all at
# once (the buckets' all-reduce lined them up). Its probe names the optimizer as its state.
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}


def _steps_optimizer(collective: str, state: str) -> bool:
    """Whether a probe is ZeRO-1's broadcasts after an optimizer's step (the optimizer named
    as its state): that step is then the call's work, no fixed work besides."""
    return collective == ZERO1 and state in OPTIMIZERS


def zero1_owners(sizes: list[int], world: int) -> list[list[int]]:
    """Which parameters (indices into sizes) each rank owns, in the order it broadcasts
    them, as torch's ZeroRedundancyOptimizer partitions them: largest first, each to the
    rank holding the fewest so far (its _partition_parameters)."""
    owned, held = [[] for _ in range(world)], [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = held.index(min(held))
        owned[r].append(i)
        held[r] += sizes[i]
    return owned


def _caller(rank: int, world: int, collective: str, algorithm: str, size, state: str = FRESH):
    """What one rep calls after its work, as a function that makes the call's buffers and
    returns the call to time (making them is the step's work, not the collective's): a
    collective as FSDP2 or DDP calls it (size: its bytes; FSDP2's buffers allocated for
    every call, or with state REUSED made once, as a recycled chunk, the input rewritten),
    or ZeRO-1's broadcasts (size: every parameter's bytes; torch's broadcasts, issued
    asynchronously rank by rank and waited for together, as its _sync_params; with state
    an optimizer's name, that optimizer's step on the rank's own parameters made before
    them, as ZeroRedundancyOptimizer.step makes it)."""


    if collective == ZERO1:
        params = [torch.ones(max(1, n // 4)) for n in size]  # the parameters persist from step to step
        owners = zero1_owners(size, world)
        order = [(src, params[i]) for src, idx in enumerate(owners) for i in idx]
        step = lambda: None  # noqa: E731
        if _steps_optimizer(collective, state):
            own = [params[i] for i in owners[rank]]
            for t in own:
                t.grad = torch.full_like(t, 1e-3)  # DDP's averaged gradients, left in place by the broadcasts
            step = getattr(torch.optim, OPTIMIZERS[state])(own, lr=1e-3).step

        def stepped():
            with torch.no_grad():
                step()
            return lambda: [h.wait() for h in [dist.broadcast(t, src=src, async_op=True) for src, t in order]]
        return stepped
    spec = SPECS[collective]  # the bench's sizes and call: nbytes is the gathered output, the reduced input
    count = spec.count(size, 4, world)
    if spec.output is None:  # in place (all-reduce): DDP's bucket, allocated once and reduced every step
        bucket = torch.ones(count)
        return lambda: lambda: spec.run(algorithm, None, bucket, Op.SUM)

    if state == REUSED:
        out, inp = fsdp_buffers(collective, count, rank, world)

        def reused():  # the same pages every call, as a heap chunk handed back; the input copied in again
            inp.fill_(1.0)
            return lambda: spec.run(algorithm, out, inp, Op.SUM)
        return reused

    def fresh():  # FSDP2's buffers, allocated for each call (its input written before it) and freed after
        out, inp = fsdp_buffers(collective, count, rank, world)
        return lambda: spec.run(algorithm, out, inp, Op.SUM)
    return fresh


def probe_rank(rank: int, world: int, probes: list[tuple[str, str, object]], matmuls: int,
               reps: int = REPS) -> list[list[tuple[float, float, float]]]:
    """One rank, for each (collective, algorithm, size[, state]) in turn: `reps` times the
    same work, then one call (_caller), timed from its start to its end; (start, end, the
    start of the work before it) of each call, per probe. ZeRO-1's broadcasts after an
    optimizer's step have that step for their work."""

    a = torch.randn(256, 256)
    out_calls = []
    for collective, algorithm, size, *state in probes:
        prepare = _caller(rank, world, collective, algorithm, size, *state)
        work = 0 if _steps_optimizer(collective, state[0] if state else FRESH) else matmuls
        calls = []
        dist.barrier()
        for _ in range(reps):
            w0 = time.perf_counter()
            for _ in range(work):
                a @ a
            call = prepare()
            t0 = time.perf_counter()
            call()
            calls.append((t0, time.perf_counter(), w0))
            del call  # FSDP2's buffers freed before the next
        out_calls.append(calls)
        del prepare
    return out_calls


def summarise(calls: list[list[tuple]], skip: int = SKIP) -> dict:
    """Every rank's (start, end[, start of its work]) per call, on one clock -> after_us,
    exit_spread_us, wait_us (per rank the mean over calls of its wait for the last arrival,
    the largest rank's), wait_mean_us (that wait's mean over ranks and calls: what a second
    synchronisation a step adds to the waits of whichever rank waits most at the first)
    with wait_mean_se_us (over calls), and with the work's starts work_to_last_us (per rank
    from the start of its work to the last arrival, the mean: the work's share of the step,
    the slowest rank's pace included)."""
    ranks, n = len(calls), min(len(c) for c in calls)
    idx = range(min(skip, n - 1), n)
    after, waits = [[] for _ in range(ranks)], [[] for _ in range(ranks)]
    spread, to_last = [], []
    for i in idx:
        last = max(c[i][0] for c in calls)
        done = max(c[i][1] for c in calls)
        for r, c in enumerate(calls):
            start, end, *work = c[i]
            after[r].append(end - max(last, start))
            waits[r].append(last - start)
            spread.append(done - end)
            to_last.extend(last - w for w in work)
    per_call = [statistics.mean(w[j] for w in waits) for j in range(len(idx))]  # each call's mean wait
    se = statistics.stdev(per_call) / len(per_call) ** 0.5 if len(per_call) >= 2 else 0.0
    return {"after_us": max(statistics.mean(a) for a in after) * 1e6,
            "exit_spread_us": statistics.mean(spread) * 1e6,
            "wait_us": max(statistics.mean(w) for w in waits) * 1e6,
            "wait_mean_us": statistics.mean(per_call) * 1e6, "wait_mean_se_us": se * 1e6,
            **({"work_to_last_us": statistics.mean(to_last) * 1e6} if to_last else {})}


def measure(world: int, collective: str, algorithm: str, nbytes: int, work_ms: float = WORK_MS,
            reps: int = REPS, timeout: float = 300.0) -> dict:
    """The probe at `world` ranks of this machine: summarise's figures, with what was run."""
    return measure_all(world, [(collective, algorithm, nbytes)], work_ms, reps, timeout)[0]


def measure_all(world: int, probes: list[tuple[str, str, object]], work_ms: float = WORK_MS, reps: int = REPS,
                timeout: float = 300.0) -> list[dict]:
    """Several probes, one after another on one set of ranks (a set costs a second or more
    to start and join: most of a short probe): measure()'s figures for each."""

    if not probes:
        return []
    matmuls = max(1, round(work_ms * _matmuls_per_ms()))
    outcomes = pools.run_once(world, probe_rank, list(probes), matmuls, reps, backend="gloo", timeout=timeout)
    bad = pools.report_failures(outcomes)
    if bad:
        names = ", ".join(f"{c} {a}" for c, a, *_ in probes)
        raise RuntimeError(f"the probe of {names} failed:\n{bad}")
    return [{**summarise([outcomes[r].result[i] for r in range(world)]), "work_ms": work_ms, "reps": reps,
             **({"bytes": sum(n), "sizes": list(n)} if c == ZERO1 else {"bytes": n}), **({"state": s[0]} if s else {})}
            for i, (c, _, n, *s) in enumerate(probes)]
