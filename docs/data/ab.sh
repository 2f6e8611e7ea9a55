#!/usr/bin/env bash
# A/B of two commits in one session: the command runs alternately in this tree and in a
# worktree of BASE (its extension built there), REPS times each, same machine state.
#   docs/data/ab.sh BASE REPS COMMAND...
# e.g. the broadcast's 4-rank protocol change (docs/measurements.md#broadcast-without-the-arrival-handshake):
#   docs/data/ab.sh 4fb0cf6 2 mpiexec.hydra -n 4 python -m commlab.allreduce_bench --collective broadcast \
#     -b 64K -e 64M -f 4 --quiet --anchors none --algorithms shm [--blocking]
# (docs/data/broadcast-ab.txt ran both timing modes per run: bash -c "for m in '' --blocking; do ...; done")
set -euo pipefail
base=${1:?base commit}; reps=${2:?repetitions}; shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
old=$(mktemp -d /tmp/commlab-ab.XXXXXX)
trap 'git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || rm -rf "$old"' EXIT
git -C "$here" worktree add -q --detach "$old" "$base"
(cd "$old" && python setup.py -q build_ext --inplace > "$old/build.log" 2>&1) || { tail -30 "$old/build.log"; exit 1; }
for rep in $(seq "$reps"); do
  for tree in "$old" "$here"; do
    [ "$tree" = "$old" ] && name="base $base" || name="this tree $(git -C "$here" rev-parse --short HEAD)"
    echo "## $name, run $rep: $*"
    (cd "$tree" && "$@" 2>&1 | grep -aE '^ |^# timing') || true
  done
done
