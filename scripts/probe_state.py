"""Does the FSDP probe read gloo's 48 MiB all-gather slower because its ranks are fresh?
(docs/measurements.md, "The probe in fresh ranks and in ranks that trained").

syncprobe's loop (fixed work, a fresh FSDP-style buffer, the call; after the last rank's
arrival, per rank the mean, the largest rank's) with torch's own call as FSDP2 makes it
(the probe calls gloo's through commlab's connection), in one set of ranks, first
fresh, then after the issue's transformer was built, fully_shard-ed per block and trained
a step or more (AdamW, FSDP2's own collectives); each call's minor page faults beside it.

    python scripts/probe_state.py                              # probe, probe, steps, probe, probe
    python scripts/probe_state.py --order probe,shard,probe    # sharding only, no step

With --trace, training's side instead: a compare --trace file of an FSDP mode, its calls
of 16 MiB or more after the last rank's arrival, by kind and thousands of page faults:

    python scripts/probe_state.py --trace T/fsdp.json
"""
import argparse
import collections
import json
import statistics
import time

import torch
import torch.distributed as dist

from commlab.measure import pools, syncprobe
from commlab.training.fsdp import minor_faults


def _probe(rank: int, world: int, nbytes: int, matmuls: int, reps: int):
    count = nbytes // 4 // world
    a = torch.randn(256, 256)
    calls, faults = [], []
    dist.barrier()
    for _ in range(reps):
        for _ in range(matmuls):
            a @ a
        out, inp = syncprobe.fsdp_buffers("all_gather", count, rank, world)
        f0, t0 = minor_faults(), time.perf_counter()
        dist.all_gather_single(out, inp)
        calls.append((t0, time.perf_counter()))
        faults.append(minor_faults() - f0)
        del out, inp
    return calls, faults


def _rank(rank: int, world: int, order: list[str], width: int, depth: int, steps: int, nbytes: int, matmuls: int,
          reps: int):
    from torch.distributed.fsdp import fully_shard

    from commlab.experiments import workloads

    torch.manual_seed(0)
    w = workloads.build("transformer", width=width, depth=depth)
    x, y = w.make_batch(16, rank)
    opt, probes = None, []
    for what in order:
        if what == "probe":
            probes.append(_probe(rank, world, nbytes, matmuls, reps))
        elif what == "shard":
            for b in workloads.blocks(w.model):
                fully_shard(b)
            fully_shard(w.model)
        elif what == "steps":  # after "shard": FSDP2's steps, its own collectives
            opt = opt or torch.optim.AdamW(w.model.parameters(), lr=1e-3)
            for _ in range(steps):
                torch.nn.functional.mse_loss(w.model(x), y).backward()
                opt.step()
                opt.zero_grad()
    return probes


def trace_classes(path: str) -> None:
    """Each large call's time after the last rank's arrival, grouped by kind and by the
    page faults it took (thousands): training's two classes, output recycled or mapped."""
    calls, seq = collections.defaultdict(dict), collections.Counter()
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "communication"]
    for e in sorted(events, key=lambda e: (e["pid"], e["ts"])):
        k, r = e["args"]["iteration"], e["pid"]
        calls[(k, seq[(r, k)])][r] = e
        seq[(r, k)] += 1
    classes = collections.defaultdict(list)
    for ranks in calls.values():
        last = max(e["ts"] for e in ranks.values())
        for e in ranks.values():
            if e["args"]["bytes"] >= 16 << 20 and "page_faults" in e["args"]:
                after = (e["ts"] + e["dur"] - max(last, e["ts"])) / 1e3
                classes[(e["args"]["kind"], round(e["args"]["page_faults"] / 1e3))].append(after)
    for (kind, k), v in sorted(classes.items()):
        print(f"{kind} with ~{k}k page faults: {len(v)} calls, {statistics.mean(v):.1f} ms after the last arrival")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", default="probe,probe,shard,steps,probe,probe",
                    help="comma list of probe, shard, steps (steps needs shard before it)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mib", type=int, default=48, help="the all-gather's output (the issue's block: 48 MiB)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace", help="read a compare --trace file of an FSDP mode instead of probing")
    a = ap.parse_args()
    if a.trace:
        return trace_classes(a.trace)
    order = a.order.split(",")
    matmuls = max(1, round(syncprobe.WORK_MS * syncprobe._matmuls_per_ms()))
    outcomes = pools.run_once(a.world_size, _rank, order, a.width, a.depth, a.steps, a.mib << 20, matmuls, a.reps,
                               backend="gloo", timeout=1800)
    bad = pools.report_failures(outcomes)
    if bad:
        raise SystemExit(bad)
    for i, at in enumerate(j for j, w in enumerate(order) if w == "probe"):
        calls = [outcomes[r].result[i][0] for r in range(a.world_size)]
        faults = outcomes[0].result[i][1][syncprobe.SKIP:]
        got = syncprobe.summarise(calls)
        state = "+".join(w for w in order[:at] if w != "probe") or "fresh"
        print(f"probe {i} ({state}): after the last arrival {got['after_us'] / 1e3:.1f} ms, "
              f"rank 0's page faults per call {min(faults)}-{max(faults)}")


if __name__ == "__main__":
    main()
