"""Medians over rounds of docs/data/check-price-ab.sh's output: back-to-back rows take the
median call (`p50 call`), isolated rows (`--blocking`) the bench's time.
Usage: python docs/data/check-price-summary.py [docs/data/check-price-ab.txt]"""
import statistics
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "docs/data/check-price-ab.txt"
runs: dict[tuple, list[float]] = {}
head = None
for line in open(path):
    if line.startswith("round="):
        head = dict(kv.split("=") for kv in line.split())
        continue
    f = line.split()
    size, alg, time_us, p50 = int(f[0]), f[4], float(f[5]), float(f[6])
    value = time_us if head["mode"] == "--blocking" else p50
    runs.setdefault((head["ws"], head["mode"], size, alg, head["variant"]), []).append(value)
variants = [v for v in ("checked", "off", "old") if any(k[4] == v for k in runs)]
print("| ranks | mode | size | algorithm | " + " | ".join(variants) + " | checked - off |")
print("|---|---|---|---|" + "---|" * (len(variants) + 1))
for ws, mode, size, alg in sorted({k[:4] for k in runs}, key=lambda k: (k[0], k[1], k[2], k[3])):
    med = {v: statistics.median(runs[(ws, mode, size, alg, v)]) for v in variants}
    diff = med["checked"] - med["off"]
    label = "isolated" if mode == "--blocking" else "back-to-back"
    kib = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
    print(f"| {ws} | {label} | {kib} | `{alg}` | " + " | ".join(f"{med[v]:.0f}" for v in variants)
          + f" | {diff:+.0f} ({diff / med['off'] * 100:+.0f} %) |")
