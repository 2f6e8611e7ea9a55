#!/bin/bash
# shm against MPICH + DeepSpeed (run A) and Open MPI (run B) at 2, 3, 4 and 8 ranks, both
# timing modes (docs/measurements.md). Needs the `anchors` extra; writes A_/B_P<ranks>[_blk].json
# into the folder given (default ./peers), then: python scripts/peers_tables.py <folder>
set -u
out=${1:-peers}; mkdir -p "$out"; cd "$out"
libmpi=${LIBMPI:-$(python -c 'import sys; print(sys.prefix)')/lib/libmpi.so.40}
export DS_ACCELERATOR=cpu
for P in 2 3 4 8; do
  for MODE in "" "--blocking"; do
    tag=P${P}$( [ -n "$MODE" ] && echo _blk )
    mpiexec.hydra -n $P python -m commlab.allreduce_bench -b 4K -e 64M -f 4 --algorithms shm $MODE \
      --quiet --json A_$tag.json > A_$tag.txt 2>&1; echo "A $tag rc $?"
    MPI4PY_LIBMPI=$libmpi prterun --personality ompi --allow-run-as-root --oversubscribe -n $P python -m commlab.allreduce_bench \
      -b 4K -e 64M -f 4 --algorithms shm --anchors mpi $MODE --quiet --json B_$tag.json > B_$tag.txt 2>&1
    echo "B $tag rc $?"
  done
done
