#!/usr/bin/env bash
# The synthesized all-reduce against the built-ins on emulated hosts (docs/measurements.md,
# "Synthesized schedules on emulated hosts"); needs root.
#   docs/data/synth/measure.sh RANKS RATES PORTBASE [ROUNDS...]
#   docs/data/synth/measure.sh 2,2 1gbit 29800 "2 4"
#   docs/data/synth/measure.sh 1,1,1,1 1gbit,1gbit,1gbit,250mbit 29850
# Per size: the schedule `synthesize` chooses for it, the sketch at the extra ROUNDS beside
# it, and every built-in, back-to-back and isolated; then scripts/synth_tables.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=docs/data/synth
R=$1; RATE=$2; port=$3; VAR=${4:-}
name=${R//,/+}
for S in 1M 4M 16M 64M; do
  python -m commlab.schedule synthesize --topology "$R" --inter "$RATE:50us" --size $S -o $D/all_reduce-$name-$S.xml \
    > $D/all_reduce-$name-$S.synth.txt
  extra=""
  for r in $VAR; do
    python -c "from commlab import schedule as S; from commlab.schedule import synthesize as Y
from commlab.schedule.topology import Topology
S.save(Y.all_reduce(Topology.parse('$R', '$RATE:50us'), rounds=$r)[0], '$D/all_reduce-$name-r$r.xml')"
    extra="$extra,msccl:$D/all_reduce-$name-r$r.xml"
  done
  n=5; [ $S = 64M ] && n=2; [ $S = 16M ] && n=3
  for mode in loop blocking; do
    port=$((port + 1))
    python scripts/emulated_hosts.py --ranks "$R" --rate "$RATE" --port $port -- \
      --algorithms "builtin,auto,ring,rhd,rd,direct,hier,msccl:$D/all_reduce-$name-$S.xml$extra" -b $S -e $S \
      --anchors none -n $n -w 1 --no-floors $([ $mode = blocking ] && echo --blocking) \
      --json $D/all_reduce-$name-$S-$mode.json > $D/all_reduce-$name-$S-$mode.txt 2>&1 || echo "failed: $S $mode"
  done
done
python scripts/synth_tables.py $D "$name"
