"""Markdown tables from docs/data/collective-bench.sh's output: per ranks and timing mode,
shm against MPICH and Open MPI, each measured in the same launch as the shm figure beside
it. Per run (one launch under each MPI's own launcher): the ratio of the best shm of the
two launches to the best peer, and over the runs their median, which settles a cell —
behind where the median is above 1 or any run above 1.25. A file of one unnumbered run
reads as run 1.

    python scripts/collective_tables.py docs/data/broadcast-bench.txt
"""
import re
import statistics
import sys
from collections import defaultdict

ROW = re.compile(r"^\s+(\d+)\s+\d+\s+\S+\s+\S+\s+(\S+)\s+([\d.]+)\s")
HEAD = re.compile(r"^## (MPICH|Open MPI), (\d+) ranks, ([^,]+)(?:, run (\d+))?$")


def parse(path):
    """{(ranks, mode): {size: {run: {"shm:MPICH": t, "MPICH": t, "shm:Open MPI": t, "Open MPI": t}}}}"""
    runs = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    where = None
    for line in open(path, errors="replace"):
        m = HEAD.match(line)
        if m:
            peer, p, mode, run = m.groups()
            where = (int(p), mode.strip(), peer, int(run or 1))
            continue
        if line.startswith("## "):
            where = None
        m = ROW.match(line)
        if where is None or not m:
            continue
        size, alg, t = int(m.group(1)), m.group(2), float(m.group(3))
        p, mode, peer, run = where
        if alg == "shm":
            runs[(p, mode)][size][run]["shm:" + peer] = t
        elif alg.startswith("mpi:"):
            runs[(p, mode)][size][run][peer] = t
    return runs


def fmt_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def fmt(x):
    return "-" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")


def ratio(cell: dict) -> float | None:
    """One run's ratio: the best shm of its launches over the best peer."""
    shm = [cell[k] for k in ("shm:MPICH", "shm:Open MPI") if cell.get(k)]
    peers = [cell[k] for k in ("MPICH", "Open MPI") if cell.get(k)]
    return min(shm) / min(peers) if shm and peers else None


def tables(path):
    runs = parse(path)
    out = []
    misses = []
    for (p, mode), sizes in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "back-to-back")):
        out.append(f"\n{p} ranks, {'isolated calls (--blocking)' if 'blocking' in mode else 'back-to-back'} (µs)\n")
        out.append("| size | shm, MPICH, Open MPI (run 1) | shm / best peer, each run | median |")
        out.append("|---|---|---|---|")
        for n in sorted(sizes):
            per_run = sizes[n]
            ratios = [r for r in (ratio(per_run[k]) for k in sorted(per_run)) if r is not None]
            median = statistics.median(ratios) if ratios else float("nan")
            behind = median > 1 or any(r > 1.25 for r in ratios)
            if behind:
                misses.append(f"{p} ranks {mode} {fmt_size(n)}: median {median:.2f}, runs "
                              + ", ".join(f"{r:.2f}" for r in ratios))
            first = per_run[min(per_run)]
            shm = min((first[k] for k in ("shm:MPICH", "shm:Open MPI") if first.get(k)), default=None)
            mark = f"**{median:.2f}**" if behind else f"{median:.2f}"
            out.append(f"| {fmt_size(n)} | {fmt(shm)}, {fmt(first.get('MPICH'))}, {fmt(first.get('Open MPI'))} | "
                       f"{', '.join(f'{r:.2f}' for r in ratios)} | {mark} |")
    out.append("\nbehind a peer (median above 1, or a run above 1.25): " + ("; ".join(misses) if misses else "nowhere"))
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"# {path}")
        print(tables(path))
