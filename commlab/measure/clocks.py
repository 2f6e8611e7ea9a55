"""One clock for ranks on several hosts: each rank's offset from rank 0's
time.perf_counter, measured through the job's store with NTP's exchange.

A rank notes its clock (t0), asks rank 0 for the time, and notes its clock again when the
answer (T) arrives (t1). Rank 0 read T somewhere between t0 and t1, so rank 0's clock is
this rank's plus an offset within T - t1 .. T - t0: the midpoint is the estimate and half
the round trip its error, a bound whatever the two directions' delays. Of several
exchanges the one with the shortest round trip is kept. On one host every process reads
the same CLOCK_MONOTONIC and no offset is needed."""
from __future__ import annotations

import itertools
import time
from typing import Callable

_calls = itertools.count()  # every rank measures in the same order: the key prefix of each measurement


def offset_to_rank0(store, rank: int, world: int, rounds: int = 8,
                    clock: Callable[[], float] = time.perf_counter, name: str | None = None) -> tuple[float, float]:
    """(offset, error) in seconds: rank 0's clock reads this rank's plus offset, within
    ±error. Rank 0 answers every other rank in turn (rounds exchanges each) and gets (0, 0).
    name: the measurement's keys (default: this process's count of measurements)."""
    prefix = f"commlab/clock/{name if name is not None else next(_calls)}"
    if rank == 0:
        for r in range(1, world):
            for k in range(rounds):
                store.get(f"{prefix}/{r}/ping/{k}")  # waits for rank r's question
                store.set(f"{prefix}/{r}/pong/{k}", repr(clock()))
        return 0.0, 0.0
    best = None
    for k in range(rounds):
        t0 = clock()
        store.set(f"{prefix}/{rank}/ping/{k}", b"")
        t = float(store.get(f"{prefix}/{rank}/pong/{k}"))
        t1 = clock()
        if best is None or t1 - t0 < best[1] - best[0]:
            best = (t0, t1, t)
    t0, t1, t = best
    return t - (t0 + t1) / 2, (t1 - t0) / 2
