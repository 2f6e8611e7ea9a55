"""Training that survives a rank's death: torchrun's elastic agent restarts the group,
training resumes from the last checkpoint, and ends with the parameters an
uninterrupted run ends with.

    torchrun --standalone --nproc_per_node=3 --max-restarts=1 --monitor-interval=3 \\
        examples/resilient_training.py --steps 20 --kill-rank 1 --kill-at 12 --out /tmp/resilient
    python examples/resilient_training.py --out /tmp/resilient --report

What happens: in the first incarnation rank 1 SIGKILLs itself at step 12. The other
ranks are waiting on it inside commlab's all-reduce (DDP's comm hook); commlab's abort
channel makes them raise within a second (no 30-minute timeout) and exit (with the
agent's default --monitor-interval of 0.1 s its SIGTERM may come first: 3 s shows that
they leave by themselves; where the agent's look falls within their ~0.1 s anyway, the
SIGTERM is logged as "terminated"), the agent sees the failure and starts a fresh group
(TORCHELASTIC_RESTART_COUNT=1), which loads the checkpoint of step 10 and trains to the
end. Data and initialisation depend only on the seed and the step, and `ps` sums in rank
order whatever DDP's bucket layout, so the final parameters match an uninterrupted run
bitwise (tests/test_recovery.py checks it). Every event goes to OUT/events.jsonl with its
wall time; `--report` prints the time from the kill to the resumed step.

The checkpoint holds the model, the optimizer (AdamW's moments) and the step; rank 0
writes it through a temporary file and a rename, so a death while writing leaves the
previous one whole.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commlab.hooks


def log(out: str, **event) -> None:
    event.update(t=time.time(), rank=dist.get_rank() if dist.is_initialized() else None,
                 incarnation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def batch(step: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 64, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--kill-rank", type=int, default=-1, help="the rank that dies (first incarnation only)")
    ap.add_argument("--kill-at", type=int, default=-1, help="the step at which it dies")
    # ps sums every element at rank 0 in rank order, whatever DDP's bucket layout: DDP lays
    # its buckets out anew after the first step of every incarnation, so with ring (whose
    # summation order follows an element's position) a resumed run differed from an
    # uninterrupted one in the last bits.
    ap.add_argument("--algorithm", default="ps", help="commlab's all-reduce algorithm for DDP's buckets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="print the recovery timeline from OUT/events.jsonl")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.report:
        return report(a.out)

    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torch 2.14's agent hands every incarnation the same store, unprefixed: a restarted
    # group's gloo read the dead incarnation's addresses ("connectFullMesh failed ...
    # Connection refused", 1 restart in 2 here, plain gloo without commlab too).
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"incarnation/{incarnation}", store), rank=rank,
                            world_size=world)
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    ckpt = os.path.join(a.out, "checkpoint.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    ddp = DDP(model)
    commlab.hooks.register(ddp, commlab.hooks.CommState(algorithm=a.algorithm))
    log(a.out, event="start", step=start)

    def terminated(signum, frame):  # the agent stopping this rank: on the record, then gone
        log(a.out, event="terminated", signal=signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        for step in range(start, a.steps):
            if incarnation == 0 and rank == a.kill_rank and step == a.kill_at:
                log(a.out, event="kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(step, rank, a.seed)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()  # DDP's buckets go through commlab
            opt.step()
            if step == start and start > 0:
                log(a.out, event="resumed", step=step + 1)
            if rank == 0 and (step + 1) % a.checkpoint_every == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
    except Exception as e:
        log(a.out, event="error", type=type(e).__name__, message=str(e)[:300])
        raise  # the agent restarts the group
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out, "final.pt"))
    log(a.out, event="done", step=a.steps)
    dist.destroy_process_group()
    return 0


def report(out: str) -> int:
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
    kill = next((e for e in events if e["event"] == "kill"), None)
    if kill is None:
        print("no kill recorded")
        return 1
    errors = [e for e in events if e["event"] == "error" and e["incarnation"] == kill["incarnation"]]
    resumed = [e for e in events if e["event"] == "resumed" and e["incarnation"] > kill["incarnation"]]
    print(f"rank {kill['rank']} killed at step {kill['step']}")
    for e in sorted(errors, key=lambda e: e["t"]):
        print(f"  rank {e['rank']} raised {e['type']} after {e['t'] - kill['t']:.2f} s: {e['message'][:120]}")
    if resumed:
        first = min(resumed, key=lambda e: e["t"])
        print(f"resumed (step {first['step']} done) {first['t'] - kill['t']:.2f} s after the kill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
