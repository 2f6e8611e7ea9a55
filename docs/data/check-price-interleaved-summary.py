"""Medians over repetitions of docs/data/check-price-interleaved.py's output (each line:
ranks, bytes, mode, algorithm, checked, off), as a table.
Usage: python docs/data/check-price-interleaved-summary.py [docs/data/check-price-interleaved.txt]"""
import re
import statistics
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "docs/data/check-price-interleaved.txt"
cells: dict[tuple, list[tuple[float, float]]] = {}
pat = re.compile(r"ranks (\d+) bytes (\d+) (\S+) (\w+)( swapped)?: checked ([\d.]+) off ([\d.]+)")
for line in open(path):
    m = pat.search(line)
    if m:
        cells.setdefault(m.groups()[:4], []).append((float(m.group(6)), float(m.group(7))))
print("| ranks | size | mode | algorithm | checked | off | checked - off, each run | median |")
print("|---|---|---|---|---|---|---|---|")
for (ranks, nbytes, mode, alg), runs in cells.items():
    diffs = [c - o for c, o in runs]
    d = statistics.median(diffs)
    off = statistics.median(o for _, o in runs)
    size = f"{int(nbytes) >> 10} KiB" if int(nbytes) < 1 << 20 else f"{int(nbytes) >> 20} MiB"
    print(f"| {ranks} | {size} | {mode} | `{alg}` | {statistics.median(c for c, _ in runs):.0f} | {off:.0f} | "
          + ", ".join(f"{x:+.0f}" for x in diffs) + f" | {d:+.0f} ({d / off * 100:+.1f} %) |")
