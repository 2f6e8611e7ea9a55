"""How unevenly this machine's cores serve equal ranks: RANKS processes each run the same
cache-resident work (256x256 matmuls, one thread) for SECONDS and count the chunks done
in windows of WINDOW seconds. Where ranks outnumber cores the counts differ from window to
window and the leading rank changes — the drift a synchronising step turns into waiting
for the last rank (docs/measurements.md, "The wait measured twice, its noise reported…").

    python scripts/core_drift.py                 # 4 ranks, 90 s, 6 s windows
    python scripts/core_drift.py 4 30 3
"""
import multiprocessing as mp
import sys
import time


def work(rank: int, seconds: float, q) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    done = []
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        done.append(time.perf_counter())
    q.put((rank, done))


def windows(done: dict[int, list[float]], window: float) -> list[list[int]]:
    """Per window (from the last rank's first chunk on, whole windows only), each rank's chunks."""
    start = max(ts[0] for ts in done.values())
    end = min(ts[-1] for ts in done.values())
    out = []
    while start + window <= end:
        out.append([sum(start <= t < start + window for t in done[r]) for r in sorted(done)])
        start += window
    return out


def main(ranks: int = 4, seconds: float = 90.0, window: float = 6.0) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=work, args=(r, seconds, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    done = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    spreads = []
    for k, counts in enumerate(windows(done, window)):
        mean = sum(counts) / len(counts)
        spreads.append((max(counts) - min(counts)) / mean * 100)
        print(f"window {k:2d}: chunks per rank {counts}  fastest - slowest: {spreads[-1]:.1f} % of the mean")
    if spreads:
        mean = sum(spreads) / len(spreads)
        print(f"spread per {window:g} s window: {min(spreads):.1f} to {max(spreads):.1f} %, mean {mean:.1f} %")


if __name__ == "__main__":
    main(*(float(a) if i else int(a) for i, a in enumerate(sys.argv[1:])))
