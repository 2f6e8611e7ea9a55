#!/bin/bash
# The abort channel's cost (docs/measurements.md): abeeac7 (before) in /tmp/old, this tree after;
# `git worktree add /tmp/old abeeac7 && cp commlab/_C*.so /tmp/old/commlab/` first.
# old vs new, interleaved twice, 2 ranks: ring/rhd/ps/builtin at 4 KiB and 16 MiB, back-to-back and isolated
for round in 1 2; do
for tree in /tmp/old /work/main; do
  for mode in "" "--blocking"; do
    echo "== $tree $mode round $round"
    (cd $tree && PYTHONPATH=$tree timeout 600 torchrun --nproc_per_node=2 -m commlab.allreduce_bench --algorithms ring,rhd,ps,builtin -b 4K -e 16M -f 4096 --anchors none $mode 2>/dev/null | grep -v "^#\s*$" | grep "ring\|rhd\|ps\|builtin\|size")
  done
done
done
