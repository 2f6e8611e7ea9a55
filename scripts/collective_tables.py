"""Markdown tables from docs/data/collective-bench.sh's output: per ranks and timing mode,
shm against MPICH and Open MPI, each measured in the same run as the shm figure beside it,
and the worse of the two same-run ratios (shm / MPICH, shm / Open MPI): the issue's bar
is met where it is at most 1.

    python scripts/collective_tables.py docs/data/broadcast-bench.txt
"""
import re
import sys
from collections import defaultdict

ROW = re.compile(r"^\s+(\d+)\s+\d+\s+\S+\s+\S+\s+(\S+)\s+([\d.]+)\s")
HEAD = re.compile(r"^## (MPICH|Open MPI), (\d+) ranks, (.+)$")


def parse(path):
    """{(ranks, mode): {size: {"shm:MPICH": t, "MPICH": t, "shm:Open MPI": t, "Open MPI": t}}}"""
    runs = defaultdict(lambda: defaultdict(dict))
    where = None
    for line in open(path, errors="replace"):
        m = HEAD.match(line)
        if m:
            peer, p, mode = m.groups()
            where = (int(p), mode.strip(), peer)
            continue
        if line.startswith("## "):
            where = None
        m = ROW.match(line)
        if where is None or not m:
            continue
        size, alg, t = int(m.group(1)), m.group(2), float(m.group(3))
        p, mode, peer = where
        if alg == "shm":
            runs[(p, mode)][size]["shm:" + peer] = t
        elif alg.startswith("mpi:"):
            runs[(p, mode)][size][peer] = t
    return runs


def fmt_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def fmt(x):
    return "-" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")


def tables(path):
    runs = parse(path)
    out = []
    misses = []
    for (p, mode), sizes in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "back-to-back")):
        out.append(f"\n{p} ranks, {'isolated calls (--blocking)' if 'blocking' in mode else 'back-to-back'} (µs)\n")
        out.append("| size | shm, MPICH (one run) | shm, Open MPI (one run) | shm / peer, worse run |")
        out.append("|---|---|---|---|")
        for n in sorted(sizes):
            c = sizes[n]
            ratios = [c["shm:" + peer] / c[peer] for peer in ("MPICH", "Open MPI")
                      if c.get(peer) and c.get("shm:" + peer)]
            worst = max(ratios) if ratios else float("nan")
            if worst > 1:
                misses.append(f"{p} ranks {mode} {fmt_size(n)}: {worst:.2f}")
            mark = f"**{worst:.2f}**" if worst > 1 else f"{worst:.2f}"
            out.append(f"| {fmt_size(n)} | {fmt(c.get('shm:MPICH'))}, {fmt(c.get('MPICH'))} | "
                       f"{fmt(c.get('shm:Open MPI'))}, {fmt(c.get('Open MPI'))} | {mark} |")
    out.append("\nbehind a peer (shm / peer > 1): " + ("; ".join(misses) if misses else "nowhere"))
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"# {path}")
        print(tables(path))
