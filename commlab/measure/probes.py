"""What this machine does, measured: the cost of reducing a byte (γ), of touching a fresh
page, of the ranks' memory traffic at a working set, of one rank handing work to
another; and the memory floor of an all-reduce, a true lower bound from those rates."""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from commlab.core import ext
from commlab.core.reduction import Op, combine_
from commlab.measure.timing import agree_min


def measure_gamma_us_per_byte(dtype=None, device="cpu", nbytes: int = 8 << 20) -> float:
    """γ measured directly: one in-place element-wise SUM of two nbytes buffers on
    this device (best of 5), per byte of input folded in. Fixing γ from this keeps the
    fit identifiable: for most algorithms bytes sent and bytes reduced are proportional."""



    dtype = dtype or torch.float32
    n = max(nbytes // torch.empty((), dtype=dtype).element_size(), 1)
    a = torch.zeros(n, dtype=dtype, device=device)
    b = torch.zeros(n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(5):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        combine_(a, b, Op.SUM)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6 / (n * a.element_size())


TOUCH_SIZES = [1 << k for k in range(20, 28)]  # 1-128 MiB by powers of two: 32 MiB (glibc's top threshold) among them


def measure_first_touch(sizes: list[int] = TOUCH_SIZES) -> list[list]:
    """measure_first_touch_us_per_byte at each size, ascending: [[bytes, µs/B], ...]. glibc
    maps an allocation above its mmap threshold afresh (page faults at every first write)
    and raises the threshold to any mapped buffer it frees, up to 32 MiB, after which
    buffers of that size are recycled from the heap, faulting nothing: what a process
    that allocates the same sizes again and again (FSDP's collectives) pays (what fresh
    outputs cost FSDP's all-gathers: docs/measurements.md#figures-behind-the-codes-choices)."""
    return [[n, measure_first_touch_us_per_byte(n)] for n in sorted(sizes)]


def measure_first_touch_us_per_byte(nbytes: int = 48 << 20) -> float:
    """What a freshly allocated host buffer costs per byte the first time it is written,
    beyond writing a warm one (best of 5): an allocation the allocator maps afresh (glibc:
    above its mmap threshold) pays a page fault per page, so every call that allocates its
    output (FSDP's collectives do; the bench reuses its buffers) does."""


    best_fresh = best_warm = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        t1 = time.perf_counter()
        a.fill_(2)
        t2 = time.perf_counter()
        best_fresh, best_warm = min(best_fresh, t1 - t0), min(best_warm, t2 - t1)
        del a
    return max(best_fresh - best_warm, 0.0) * 1e6 / nbytes


FAST_WORKING_SET = 1 << 20  # the staging buffers' size class: cache-resident


def measure_group_bandwidth_gbps(nbytes: int, group=None, trials: int = 3) -> float:
    """Collective: the memory bandwidth each rank gets while every rank of the group
    streams over an nbytes working set at the same time, in GB/s (1e9 B) of bytes read
    plus written. Three patterns, the fastest counts: read only (a sum), copy (half the
    set to the other half) and in place (x += 1, what an all-reduce does to its tensor).
    Each trial starts from a barrier and is timed by its slowest rank, as a collective is.
    This bounds the rate any byte of an all-reduce's traffic can move at this working set
    with these ranks on these cores, so traffic / rate is a floor."""


    n = max(nbytes // 4, 2)
    buf = torch.ones(n, dtype=torch.float32)
    half = n // 2
    patterns = [
        (lambda: buf.sum(), 4 * n),
        (lambda: buf[half:2 * half].copy_(buf[:half]), 2 * 4 * half),
        (lambda: buf.add_(1.0), 2 * 4 * n),
    ]
    best = 0.0
    for fn, moved in patterns:
        fn()  # fault in, warm up
        t0 = time.perf_counter()
        fn()
        # Trials of ~30 ms: long against a scheduler slice, so ranks that share a core
        # share it inside the trial (a short loop would run alone and read too fast).
        reps = torch.tensor([max(1, int(0.03 / max(time.perf_counter() - t0, 1e-7)))], dtype=torch.int64)
        dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
        reps = int(reps.item())
        for _ in range(trials):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            best = max(best, moved * reps / float(t.item()) / 1e9)
    return best


def measure_handoffs(group=None, iters: int = 2000, trials: int = 5, timeout_s: float = 10.0) -> dict | None:
    """Collective: what passing a cache line between two ranks' processes costs, from
    ping-pongs through shared memory (rank 0 with each other rank in turn while the rest
    wait; half the best round trip, in µs): `handoff_us` as the ranks run, and, where
    ranks outnumber cores, `switch_us` with the pair pinned to one core (a yield-driven
    context switch, the cheapest kind). Every rank gets the same values, or None if any
    rank could not take part. No shared-memory all-reduce finishes before a peer has
    seen a flag, and a core hosting k ranks must switch k-1 times per call."""


    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p < 2:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    mine = sorted(os.sched_getaffinity(0))
    facts = [None] * p
    dist.all_gather_object(facts, mine, group=group)
    cores = len(set().union(*map(set, facts)))
    shared = p > cores  # then a waiter yields: its peer may need this very core
    token = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(token, src=ranks[0], group=group)
    pin = facts[0][0]  # for the switch: both of a pair on rank 0's first CPU
    best = {"handoff_us": float("inf"), "switch_us": float("inf")}
    ok = 1
    for kind in ("handoff_us", "switch_us") if shared else ("handoff_us",):
        for peer in range(1, p):
            for trial in range(trials):
                if rank in (0, peer) and ok:
                    try:
                        if kind == "switch_us":
                            os.sched_setaffinity(0, {pin})
                        ns = ext.require().handoff_pingpong_ns(f"/commlab-handoff-{token[0]}-{kind[0]}{peer}-{trial}",
                                                               rank == 0, iters, shared, int(timeout_s * 1000))
                        best[kind] = min(best[kind], ns / iters / 2 / 1e3)
                    except Exception:  # noqa: BLE001 - no floor rather than no benchmark
                        ok = 0
                    finally:
                        os.sched_setaffinity(0, mine)
                dist.barrier(group=group)
    if not agree_min(ok, torch.device("cpu")):
        return None
    out = torch.tensor([best["handoff_us"], best["switch_us"] if shared else -1.0], dtype=torch.float64)
    dist.broadcast(out, src=ranks[0], group=group)
    return {"handoff_us": float(out[0]), "switch_us": float(out[1]) if shared else None,
            "ranks_per_core": -(-p // cores)}


def hot_copy_us(nbytes: int) -> float:
    """The best time of one memcpy of nbytes between cache-hot buffers, in µs: the least
    an all-reduce spends writing its result into the caller's tensor."""

    return ext.require().hot_copy_ns(nbytes, max(100, (64 << 20) // max(nbytes, 1))) / 1e3


def memory_floor_us(traffic, tensor_rate_gbps: float, fast_rate_gbps: float) -> float:
    """A lower bound on one all-reduce's time from its memory traffic per rank: the
    larger of (the caller's tensor bytes at the rate the ranks together get at the
    tensor's working set) and (all bytes, staging included, at the rate they get in a
    cache-sized working set). With rates from measure_group_bandwidth_gbps both terms
    are bounds, so efficiency = floor / time cannot pass 100 %."""
    tensor_s = traffic.tensor / (tensor_rate_gbps * 1e9)
    all_s = (traffic.tensor + traffic.staging) / (fast_rate_gbps * 1e9)
    return max(tensor_s, all_s) * 1e6
