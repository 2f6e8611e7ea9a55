#!/usr/bin/env bash
# The point-to-point call check's price: the bench with the check (this tree), with it
# off (COMMLAB_UNSAFE_SKIP_AGREEMENT=1, measurement only) and, where OLD names a built
# tree of an earlier commit, that tree's check, alternated, 3 rounds, 2 and 4 ranks, both
# timing modes. Usage: bash docs/data/check-price-ab.sh [OUT] [OLD]
set -euo pipefail
out=${1:-docs/data/check-price-ab.txt}
old=${2:-}
here=$(pwd)
: > "$out"
run() {  # label, directory, skip switch, ranks, mode
  echo "round=$round variant=$1 ws=$4 mode=${5:-loop}" >> "$out"
  (cd "$2" && COMMLAB_UNSAFE_SKIP_AGREEMENT=$3 python -m commlab.allreduce_bench --world-size "$4" -b 4K -e 1M \
    -f 256 --algorithms ps,ring,rhd,builtin --anchors none --quiet $5 | grep " sum ") >> "$here/$out"
}
for round in 1 2 3; do for ws in 2 4; do for mode in "" "--blocking"; do
  run checked "$here" 0 $ws "$mode"
  run off "$here" 1 $ws "$mode"
  if [ -n "$old" ]; then run old "$old" 0 $ws "$mode"; fi
done; done; done
