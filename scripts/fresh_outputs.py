"""FSDP's collectives into a fresh output per call (as FSDP2 allocates them) against a
reused one, back to back on 4 ranks of this machine; and gloo's reduce-scatter with AVG
(FSDP2's op for fp32) against SUM (the bench's). docs/measurements.md, "FSDP's waits at
every unit, and its calls as training makes them".

    python scripts/fresh_outputs.py            # 12.6 MB and 50 MB, gloo (builtin) and shm
"""
import statistics
import time

import torch
import torch.distributed as dist

from commlab.core.reduction import Op
from commlab.measure import pools
from commlab.measure.specs import SPECS

RANKS, ROUNDS, CALLS = 4, 6, 5


def fresh_or_reused(rank, world, algorithm, collective, nbytes):
    """Per round and kind (0 reused, 1 fresh): this rank's mean call time, rounds alternating."""
    spec = SPECS[collective]  # the bench's sizes and call: nbytes is the gathered output, the reduced input
    count = spec.count(nbytes, 4, world)
    inp, out = torch.ones(count), torch.empty(spec.output(count, world))

    def call(fresh):
        spec.run(algorithm, torch.empty(out.numel()) if fresh else out, inp, Op.SUM)

    call(0), call(1)
    times = {0: [], 1: []}
    for r in range(ROUNDS):
        for fresh in ((0, 1) if r % 2 else (1, 0)):
            dist.barrier()
            call(fresh)
            t0 = time.perf_counter()
            for _ in range(CALLS):
                call(fresh)
            times[fresh].append((time.perf_counter() - t0) / CALLS)
    return times


def avg_or_sum(rank, world, nbytes):
    n = nbytes // 4 // world
    full, out = torch.ones(n * world), torch.empty(n)
    times = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) * 2:
        dist.reduce_scatter_tensor(out, full, op=op)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(8):
            dist.reduce_scatter_tensor(out, full, op=op)
        times.setdefault(str(op).rsplit(".", 1)[-1], []).append((time.perf_counter() - t0) / 8)
    return times


def slowest(outcomes, key):
    """Per round the slowest rank's time, then the median over rounds (ms)."""
    res = [outcomes[r].result[key] for r in range(RANKS)]
    return statistics.median(max(r[i] for r in res) for i in range(len(res[0]))) * 1e3


if __name__ == "__main__":
    for nbytes in (12_600_000, 50_000_000):
        for algorithm in ("builtin", "shm"):
            for collective in ("all_gather", "reduce_scatter"):
                o = pools.run_once(RANKS, fresh_or_reused, algorithm, collective, nbytes, backend="gloo", timeout=600)
                reused, fresh = slowest(o, 0), slowest(o, 1)
                print(f"{nbytes / 1e6:5.1f} MB {algorithm:8s} {collective:15s} reused {reused:7.1f} ms  "
                      f"fresh {fresh:7.1f} ms", flush=True)
        o = pools.run_once(RANKS, avg_or_sum, nbytes, backend="gloo", timeout=600)
        print(f"{nbytes / 1e6:5.1f} MB gloo reduce_scatter_tensor  SUM {slowest(o, 'SUM'):7.1f} ms  "
              f"AVG {slowest(o, 'AVG'):7.1f} ms", flush=True)
