"""Per-call cost of a small all-reduce: commlab.all_reduce against the raw shared-memory
transport in the same processes (docs/measurements.md, "Per-call cost").

    torchrun --nproc_per_node=2 scripts/percall.py            # 4 KiB fp32, 20 000 calls
    N=256 ITERS=50000 torchrun --nproc_per_node=2 scripts/percall.py
"""
import os
import time

import torch
import torch.distributed as dist

import commlab
from commlab.core import groups
from commlab.transports import shm


def loop(fn, iters: int) -> float:
    """µs per call of the slowest rank, after a warm-up."""
    dist.barrier()
    for _ in range(200):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    x = torch.tensor([(time.perf_counter() - t0) / iters * 1e6])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(int(os.environ.get("N", "1024")))
    iters = int(os.environ.get("ITERS", "20000"))
    SUM = dist.ReduceOp.SUM
    commlab.all_reduce(t, SUM, algorithm="shm")  # plans the call and sets shared memory up
    comm = shm.state_of(groups.resolve(None)).comm
    res = {"commlab.all_reduce": [], "raw transport": []}
    for _ in range(3):
        res["commlab.all_reduce"].append(loop(lambda: commlab.all_reduce(t, SUM, algorithm="shm"), iters))
        res["raw transport"].append(loop(lambda: comm.allreduce(t, 0, 0), iters))
    if dist.get_rank() == 0:
        for k, v in res.items():
            print(f"{k:>20}: " + " ".join(f"{x:.2f}" for x in v) + " us per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
