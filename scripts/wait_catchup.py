"""Does a rank that waits in a collective give its core back to the late one? (docs/
measurements.md, "FSDP's calls priced between the allocator's two states").

Where ranks outnumber cores, a rank waiting for the last one either sleeps, and the late
rank runs faster, or keeps a core busy. Every rank does the same work, the last rank
`--lag-ms` more (in ms of an idle core), then they all-gather 1 MiB; per algorithm, the
early ranks' wait for the last arrival beside how long the late rank's extra work took,
and how much later than the late rank the early ones left the call before (their head
start, when negative).
"contended" is the reference: every rank does the extra work, so no one waits and the
extra runs at the machine's contended speed (the compute-only step's drift is measured
there).

    python scripts/wait_catchup.py --lag-ms 50 --algorithms builtin,shm,ring
"""
import argparse
import statistics
import time

import torch

from commlab.measure import pools, syncprobe

CONTENDED = "contended"


def rank_fn(rank, world, base, extra, runs, reps, nbytes):
    import torch.distributed as dist

    a = torch.randn(256, 256)
    got = []
    for alg in runs:
        # The probe's own call into buffers made once (its input rewritten before each call).
        prepare = syncprobe._caller(rank, world, "all_gather", "builtin" if alg == CONTENDED else alg, nbytes,
                                    syncprobe.REUSED)
        rows = []
        dist.barrier()
        for _ in range(reps):
            for _ in range(base):
                a @ a
            call = prepare()
            t0 = time.perf_counter()
            if alg == CONTENDED or rank == world - 1:
                for _ in range(extra):
                    a @ a
            t1 = time.perf_counter()
            call()
            rows.append((t0, t1, time.perf_counter()))
        got.append(rows)
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--lag-ms", type=float, default=50.0)
    ap.add_argument("--algorithms", default="builtin,shm,ring")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    per_ms = syncprobe._matmuls_per_ms()
    runs = [CONTENDED, *args.algorithms.split(","), CONTENDED]
    world = args.world_size
    outcomes = pools.run_once(world, rank_fn, round(50 * per_ms), round(args.lag_ms * per_ms), runs, args.reps,
                               1 << 20, backend="gloo", timeout=600)
    bad = pools.report_failures(outcomes)
    if bad:
        raise SystemExit(bad)
    print(f"# {world} ranks, the last one {args.lag_ms:g} ms of an idle core behind; means over reps 3..{args.reps}")
    for i, alg in enumerate(runs):
        calls = [outcomes[r].result[i] for r in range(world)]
        waits, extra, left = [], [], []
        for k in range(max(1, min(syncprobe.SKIP, args.reps - 1)), args.reps):
            arrived = [c[k][1] for c in calls]
            waits.append(statistics.mean(max(arrived) - x for x in arrived[:-1]))
            extra.append(calls[-1][k][1] - calls[-1][k][0])
            left.append(statistics.mean(c[k - 1][2] for c in calls[:-1]) - calls[-1][k - 1][2])
        print(f"{alg:10s} early ranks' wait {statistics.mean(waits) * 1e3:7.1f} ms   "
              f"the late rank's extra work took {statistics.mean(extra) * 1e3:7.1f} ms   "
              f"the early ranks left the call before {statistics.mean(left) * 1e3:+7.1f} ms after it")


if __name__ == "__main__":
    main()
