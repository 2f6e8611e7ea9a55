#!/usr/bin/env bash
# The point-to-point agreement's price: the bench with the agreement on and off
# (COMMLAB_UNSAFE_SKIP_AGREEMENT=1, measurement only), alternated, 3 rounds, 2 and 4
# ranks, both timing modes. Output: docs/data/agreement-price-ab.txt.
set -euo pipefail
out=${1:-docs/data/agreement-price-ab.txt}
: > "$out"
for round in 1 2 3; do for sw in 0 1; do for ws in 2 4; do for mode in "" "--blocking"; do
  echo "round=$round skip=$sw ws=$ws mode=${mode:-loop}" >> "$out"
  COMMLAB_UNSAFE_SKIP_AGREEMENT=$sw python -m commlab.allreduce_bench --world-size $ws -b 4K -e 1M -f 256 \
    --algorithms ps,ring,rhd,builtin --anchors none --quiet $mode | grep " sum " >> "$out"
done; done; done; done
