"""One rank of test_shm_protocol's PID-namespace test: python pidns_job.py RANK STORE OUT.
Rank 1 is late for the second call; rank 0 waits for it."""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import commlab

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
result = {"pid": os.getpid(), "error": None}
try:
    x = torch.full((1000,), float(rank + 1))
    commlab.all_reduce(x, algorithm="shm")  # setup: both ranks map both segments
    dist.barrier()
    if rank == 1:
        time.sleep(1.5)  # 15 of the waiter's liveness probes
    t0 = time.monotonic()
    y = torch.full((1000,), float(rank + 1))
    commlab.all_reduce(y, algorithm="shm")
    result["waited_s"] = time.monotonic() - t0
    result["values"] = y.unique().tolist()
except Exception as e:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(e).__name__}: {e}"
with open(out, "w") as f:
    json.dump(result, f)
try:
    dist.barrier()
finally:
    dist.destroy_process_group()
