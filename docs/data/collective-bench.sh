#!/usr/bin/env bash
# Measurements of a collective family behind docs/measurements.md (#all-gather,
# #reduce-scatter, #broadcast, #all-to-all):
#   docs/data/collective-bench.sh all_gather|reduce_scatter|broadcast|all_to_all
# Output in docs/data/<collective>-bench.txt (all-gather-bench.txt, ...).
# 1. Shared memory against the peers, each under its own launcher's run: commlab's rows
#    and MPICH's call (MPI_Allgather, MPI_Reduce_scatter_block, MPI_Bcast, MPI_Alltoall) under MPICH's mpiexec,
#    and Open MPI's under Open MPI's; 2 and 4 ranks; back-to-back loops and isolated
#    calls; builtin is gloo's. REPEATS runs (default 3), the two launchers alternating
#    which goes first, each run's headers numbered: a cell is settled by the median of
#    the runs (scripts/collective_tables.py), not by one launch.
# 2. The point-to-point algorithms against their cost formulas: 3 ranks (rd runs Bruck,
#    rh folds) and 4 (powers of two), small to large.
# RANKS (default "2 4"), RANGE (default "-b 64K -e 64M -f 4") and P2P=0 narrow a run; OUT names another output.
set -uo pipefail
cd "$(dirname "$0")/../.."
collective=${1:?all_gather, reduce_scatter, broadcast or all_to_all}
repeats=${REPEATS:-3}
p2p=$(python -c "from commlab import algorithms
print(','.join(n for n in algorithms.registry('$collective').for_device('cpu') if n not in ('auto', 'shm', 'hier')))")
out=${OUT:-docs/data/${collective//_/-}-bench.txt}
: > "$out"
keep() { grep -aE '^ |^# (anchor|timing|out of|fastest|cost model|  )' | grep -av "$1" | tee -a "$out"; }
# shellcheck disable=SC2206
args=(-m commlab.allreduce_bench --collective "$collective" ${RANGE:--b 64K -e 64M -f 4} --quiet --anchors mpi
      --algorithms builtin,shm)
libmpi="$(python -c 'import sys; print(sys.prefix)')/lib/libmpi.so.40"
mpich() {
  echo "## MPICH, $1 ranks, ${2:-back-to-back}, run $3" | tee -a "$out"
  mpiexec.hydra -n "$1" python "${args[@]}" $2 2>&1 | keep '^$'
}
openmpi() {
  echo "## Open MPI, $1 ranks, ${2:-back-to-back}, run $3" | tee -a "$out"
  MPI4PY_LIBMPI="$libmpi" prterun --personality ompi --allow-run-as-root --oversubscribe -x MPI4PY_LIBMPI -n "$1" \
    python "${args[@]}" $2 2>&1 | keep '^$'
}
for run in $(seq 1 "$repeats"); do
  for p in ${RANKS:-2 4}; do
    for mode in "" "--blocking"; do
      if (( run % 2 )); then mpich "$p" "$mode" "$run"; openmpi "$p" "$mode" "$run"
      else openmpi "$p" "$mode" "$run"; mpich "$p" "$mode" "$run"; fi
    done
  done
done
[ "${P2P:-1}" = 0 ] && exit 0
for p in 3 4; do
  echo "## point-to-point, $p ranks, back-to-back" | tee -a "$out"
  python -m commlab.allreduce_bench --world-size "$p" --collective "$collective" -b 1K -e 16M -f 16 --quiet \
    --anchors none --algorithms "$p2p" 2>&1 | keep '^$'
done
