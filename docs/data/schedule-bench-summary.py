"""The table of docs/measurements.md#schedules-run-natively-and-over-point-to-point from
docs/data/schedule-bench.txt: per ranks, timing mode and size, the median over repeats
of each row's time (µs), and each schedule's ratio to the hand-written algorithm and to
MPICH's MPI_Allreduce."""
import collections
import re
import statistics
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "docs/data/schedule-bench.txt"
times = collections.defaultdict(list)
section = None
for line in open(path):
    m = re.match(r"## repeat \d+, (\d) ranks, (\S+): (\S+)", line)
    if m:
        section = (int(m.group(1)), m.group(2).rstrip(":"), m.group(3))  # ranks, mode, who launched
        continue
    f = line.split()
    if section and len(f) > 6 and f[0].isdigit() and (f[4] != "shm" or section[2] == "natively"):
        times[(*section[:2], int(f[0]), f[4])].append(float(f[5]))  # shm as under torchrun, its launcher
med = {k: statistics.median(v) for k, v in times.items()}
pairs = {"msccl-shm:ring{p}.xml": "shm", "msccl-shm:ps{p}.xml": "shm", "msccl:ring{p}.xml": "ring",
         "msccl:ps{p}.xml": "ps_sharded", "msccl:agdirect{p}.xml": "direct"}
print("| ranks | mode | size | schedule | µs | hand-written | µs | ratio | MPICH µs | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (p, mode, size, alg), t in sorted(med.items()):
    for pattern, hand in pairs.items():
        if alg != pattern.format(p=p):
            continue
        h = med.get((p, mode, size, hand))
        mpi = med.get((p, mode, size, "mpi:mpich")) if hand == "shm" else None
        size_text = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {p} | {mode} | {size_text} | `{alg}` | {t:.0f} | `{hand}` | {h:.0f} | {t / h:.2f} |"
              + (f" {mpi:.0f} | {t / mpi:.2f} |" if mpi else " | |"))
