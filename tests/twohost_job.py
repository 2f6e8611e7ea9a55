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
    out["all_gather"] = {}
    for name in commlab.algorithms.registry("all_gather").for_device("cpu"):
        x = torch.arange(1000, dtype=torch.float32) + 1000 * rank
        got = torch.empty(p * 1000)
        try:
            commlab.all_gather(got, x, algorithm=name)
            out["all_gather"][name] = "ok" if torch.equal(got, torch.arange(p * 1000, dtype=torch.float32)) else "wrong"
        except commlab.UnsupportedError as e:
            out["all_gather"][name] = f"unsupported: {e}"
    with open(os.path.join(os.environ["COMMLAB_JOB_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
