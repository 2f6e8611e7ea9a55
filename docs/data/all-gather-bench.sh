#!/usr/bin/env bash
# All-gather measurements behind docs/measurements.md#all-gather; output in
# docs/data/all-gather-bench.txt.
# 1. Shared memory against the peers, each under its own launcher's run: commlab's rows
#    and MPICH's MPI_Allgather under MPICH's mpiexec, then Open MPI's under Open MPI's;
#    2 and 4 ranks; back-to-back loops and isolated calls; builtin is gloo's.
# 2. The point-to-point algorithms against their cost formulas: 3 ranks (rd runs Bruck)
#    and 4 (recursive doubling), small to large.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=docs/data/all-gather-bench.txt
: > "$out"
keep() { grep -aE '^ |^# (anchor|timing|out of|fastest|cost model|  )' | grep -av "$1" | tee -a "$out"; }
args=(-m commlab.allreduce_bench --collective all_gather -b 64K -e 64M -f 4 --quiet --anchors mpi
      --algorithms builtin,shm)
libmpi="$(python -c 'import sys; print(sys.prefix)')/lib/libmpi.so.40"
for p in 2 4; do
  for mode in "" "--blocking"; do
    echo "## MPICH, $p ranks, ${mode:-back-to-back}" | tee -a "$out"
    mpiexec.hydra -n "$p" python "${args[@]}" $mode 2>&1 | keep '^$'
    echo "## Open MPI, $p ranks, ${mode:-back-to-back}" | tee -a "$out"
    MPI4PY_LIBMPI="$libmpi" mpiexec --allow-run-as-root --oversubscribe -x MPI4PY_LIBMPI -n "$p" \
      python "${args[@]}" $mode 2>&1 | keep '^$'
  done
done
for p in 3 4; do
  echo "## point-to-point, $p ranks, back-to-back" | tee -a "$out"
  python -m commlab.allreduce_bench --world-size "$p" --collective all_gather -b 1K -e 16M -f 16 --quiet \
    --anchors none --algorithms builtin,ring,rd,direct 2>&1 | keep '^$'
done
