"""How long the one local launcher takes to start, use and close a pool of ranks
(commlab.measure.pools.RankPool: every test pool, fault drill and --world-size job).

    python scripts/pool_startup.py            # pools of 2, 3 and 4 ranks, 3 times each
"""
from __future__ import annotations

import statistics
import sys
import time


def _rank(rank: int, world: int) -> int:
    return rank


def main(argv=None) -> int:
    from commlab.measure.pools import RankPool

    sizes = [int(x) for x in (argv or sys.argv[1:])] or [2, 3, 4]
    print("| ranks | start (s) | one job (s) | close (s) |")
    print("|---|---|---|---|")
    for n in sizes:
        got = []
        for _ in range(3):
            t0 = time.perf_counter()
            pool = RankPool(n, pg_timeout_s=30)
            t1 = time.perf_counter()
            pool.run(_rank)
            t2 = time.perf_counter()
            pool.close()
            got.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        med = [statistics.median(g[i] for g in got) for i in range(3)]
        print(f"| {n} | {med[0]:.2f} | {med[1]:.3f} | {med[2]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
