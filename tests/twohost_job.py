"""Run by torchrun inside two network namespaces (tests/test_twohost.py): each pure
algorithm must be correct across the 'hosts', shm must refuse naming them; with
COMMLAB_JOB_LOOP=1 it loops until the link is cut, and must then fail, not hang."""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import commlab


def _check(call, got: torch.Tensor, want: torch.Tensor) -> str:
    call(got)
    return "ok" if torch.equal(got, want) else "wrong"


def main() -> int:
    timeout = datetime.timedelta(seconds=float(os.environ.get("COMMLAB_JOB_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": p, "algorithms": {}}
    if os.environ.get("COMMLAB_JOB_LOOP") == "1":
        algorithm = os.environ.get("COMMLAB_JOB_ALGORITHM", "ring")
        victim = int(os.environ.get("COMMLAB_JOB_KILL", "-1"))  # this rank SIGKILLs itself 2 s in
        x = torch.ones(50_000)
        commlab.all_reduce(x, algorithm=algorithm)
        open(os.path.join(os.environ["COMMLAB_JOB_OUT"], f"started{rank}"), "w").close()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 120:
                if rank == victim and time.monotonic() - t0 > 2:
                    with open(os.path.join(os.environ["COMMLAB_JOB_OUT"], "kill.json"), "w") as f:
                        json.dump({"t": time.time()}, f)
                    os.kill(os.getpid(), 9)
                commlab.all_reduce(x.fill_(1.0), algorithm=algorithm)
        except Exception as e:  # noqa: BLE001 - the expected outcome
            out["error"] = f"{type(e).__name__}: {e}"[:300]
            out["seconds_after_start"] = time.monotonic() - t0
            out["t"] = time.time()
        with open(os.path.join(os.environ["COMMLAB_JOB_OUT"], f"loop{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(0)  # the group is broken; do not wait on it
    for name in commlab.algorithms.for_device("cpu"):
        x = torch.arange(1000, dtype=torch.float32) + rank
        try:
            commlab.all_reduce(x, algorithm=name)
            want = torch.arange(1000, dtype=torch.float32) * p + sum(range(p))
            out["algorithms"][name] = "ok" if torch.equal(x, want) else "wrong"
        except commlab.UnsupportedError as e:
            out["algorithms"][name] = f"unsupported: {e}"
    # Every other family: one call each, its result checked exactly.
    send = [rank + q + 1 for q in range(p)]  # all-to-all: uneven, rank r sends q r+q+1 elements
    calls = {
        "all_gather": lambda name: _check(
            lambda got: commlab.all_gather(got, torch.arange(1000, dtype=torch.float32) + 1000 * rank, algorithm=name),
            torch.empty(p * 1000), torch.arange(p * 1000, dtype=torch.float32)),
        "reduce_scatter": lambda name: _check(
            lambda got: commlab.reduce_scatter(got, torch.arange(p * 1000, dtype=torch.float32) + rank, algorithm=name),
            torch.empty(1000), (torch.arange(1000, dtype=torch.float32) + 1000 * rank) * p + sum(range(p))),
        "broadcast": lambda name: _check(
            lambda got: commlab.broadcast(got, src=p - 1, algorithm=name),
            torch.full((70_001,), float(rank)), torch.full((70_001,), float(p - 1))),
        "all_to_all": lambda name: _check(
            lambda got: commlab.all_to_all(got, torch.cat([torch.full((n,), float(10 * rank + q)) for q, n in
                                                           enumerate(send)]), [j + rank + 1 for j in range(p)], send,
                                           algorithm=name),
            torch.empty(sum(j + rank + 1 for j in range(p))),
            torch.cat([torch.full((j + rank + 1,), float(10 * j + rank)) for j in range(p)])),
    }
    for collective, call in calls.items():
        out[collective] = {}
        for name in commlab.algorithms.registry(collective).for_device("cpu"):
            try:
                out[collective][name] = call(name)
            except commlab.UnsupportedError as e:
                out[collective][name] = f"unsupported: {e}"
    with open(os.path.join(os.environ["COMMLAB_JOB_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
