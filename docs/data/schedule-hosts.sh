#!/usr/bin/env bash
# Schedules priced per level (commlab/schedule/price.py) against their measured time on
# emulated hosts (docs/measurements.md#schedules-priced-on-emulated-hosts). Needs root.
#   bash docs/data/schedule-hosts.sh [MSCCL_XML_DIR [REPEATS]]   -> docs/data/schedule-hosts.txt
# 2 hosts x 4 ranks, host links shaped to 1 Gbit/s (scripts/emulated_hosts.py), isolated
# calls (--blocking), 1-16 MiB: commlab's ring, its export, the all-pairs export, and
# RCCL's 8-rank all-pairs all-reduce when MSCCL_XML_DIR holds it; predicted from the
# fitted two-level model (docs/data/costmodel/fit.json) with the link at 1 Gbit/s and
# 4 ranks per core (8 ranks on this 2-core machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=docs/data/schedule-hosts.txt
dir=$(mktemp -d)
python -m commlab.schedule export ring --ranks 8 -o "$dir/ring8.xml" > /dev/null
python -m commlab.schedule export ps_sharded --ranks 8 -o "$dir/ps8.xml" > /dev/null
algs="ring,msccl:$dir/ring8.xml,msccl:$dir/ps8.xml"
rccl="${1:-}/rccl_allreduce-allpairs-8n-ll-32tb-op.xml"
[ -f "$rccl" ] && cp "$rccl" "$dir/rccl-allpairs8.xml" && algs="$algs,msccl:$dir/rccl-allpairs8.xml"
: > "$out"
for repeat in $(seq "${2:-3}"); do
echo "## repeat $repeat" | tee -a "$out"
python scripts/emulated_hosts.py --hosts 2 --ranks 4 --rate 1gbit -- --algorithms "$algs" -b 1M -e 16M -f 4 \
  --anchors none --blocking --no-floors --budget 1 --rounds 1 -n 3 -w 1 --json "$dir/run.json" 2>&1 \
  | grep -aE '^ +[0-9]|^# (timing|out of)' | sed "s|$dir/||g" | tee -a "$out"
python - "$dir/run.json" "$dir" <<'PY' | tee -a "$out"
import json, sys
from commlab.measure.twolevel import TwoLevel
from commlab.measure.units import parse_rate_gbps
doc, d = json.load(open(sys.argv[1])), sys.argv[2] + "/"
model = TwoLevel.from_json(json.load(open("docs/data/costmodel/fit.json"))).with_link(parse_rate_gbps("1gbit"), None)
print("# predicted (two-level model, 1 Gbit/s link, 4 ranks per core) against measured (median call), ms")
for r in doc["results"]:
    if r.get("wrong", 0):
        continue
    pred = model.predict_us(r["algorithm"], 2, 4, float(r["bytes"]), 4.0)
    meas = float(r.get("p50_us", r["time_us"]))
    if pred:
        print(f"{r['algorithm'].replace(d, ''):>28} {int(r['bytes']) >> 20:3d} MiB  predicted {pred / 1e3:8.1f}"
              f"  measured {meas / 1e3:8.1f}  ({(pred - meas) / meas:+.0%})")
PY
done
rm -rf "$dir"
