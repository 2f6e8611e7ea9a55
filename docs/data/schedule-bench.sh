#!/usr/bin/env bash
# Schedules against the hand-written algorithms they were exported from, and against MPI
# (docs/measurements.md#schedules-run-natively-and-over-point-to-point):
#   bash docs/data/schedule-bench.sh [REPEATS]      -> docs/data/schedule-bench.txt
# 1. Natively over shared memory (msccl-shm:) beside `shm`, under torchrun; MPICH's
#    MPI_Allreduce beside `shm` under its own mpiexec; 2 and 4 ranks, 1-16 MiB, both
#    timing modes (back-to-back loops; isolated calls after a barrier: --blocking).
# 2. Over point-to-point (msccl:) beside the algorithm it was exported from, 4 KiB-4 MiB.
set -uo pipefail
cd "$(dirname "$0")/../.."
repeats=${1:-2}
out=docs/data/schedule-bench.txt
: > "$out"
dir=$(mktemp -d)
keep() { grep -aE '^ +[0-9]|^# (timing|out of)' | sed "s|$dir/||g" | tee -a "$out"; }
for p in 2 4; do
  python -m commlab.schedule export ring --ranks "$p" -o "$dir/ring$p.xml" > /dev/null
  python -m commlab.schedule export ps_sharded --ranks "$p" -o "$dir/ps$p.xml" > /dev/null
  python -m commlab.schedule export direct --collective all_gather --ranks "$p" -o "$dir/agdirect$p.xml" > /dev/null
done
bench=(-m commlab.allreduce_bench --no-floors)
for repeat in $(seq "$repeats"); do
  for p in 2 4; do
    for mode in "" "--blocking"; do
      echo "## repeat $repeat, $p ranks, ${mode:-back-to-back}: natively (torchrun)" | tee -a "$out"
      torchrun --nproc_per_node="$p" "${bench[@]}" -b 1M -e 16M -f 4 --anchors none $mode \
        --algorithms "shm,msccl-shm:$dir/ring$p.xml,msccl-shm:$dir/ps$p.xml" 2>&1 | keep
      echo "## repeat $repeat, $p ranks, ${mode:-back-to-back}: MPICH (mpiexec.hydra)" | tee -a "$out"
      mpiexec.hydra -n "$p" python "${bench[@]}" -b 1M -e 16M -f 4 --anchors mpi $mode --algorithms shm 2>&1 | keep
    done
    echo "## repeat $repeat, $p ranks, back-to-back: over point-to-point (torchrun)" | tee -a "$out"
    torchrun --nproc_per_node="$p" "${bench[@]}" -b 4K -e 4M -f 32 --anchors none \
      --algorithms "ring,msccl:$dir/ring$p.xml,ps_sharded,msccl:$dir/ps$p.xml" 2>&1 | keep
    torchrun --nproc_per_node="$p" "${bench[@]}" --collective all_gather -b 4K -e 4M -f 32 --anchors none \
      --algorithms "direct,msccl:$dir/agdirect$p.xml" 2>&1 | keep
  done
done
rm -rf "$dir"
