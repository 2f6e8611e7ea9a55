"""The table of docs/data/synth/measure.sh's runs for one topology: per size and timing
mode, the best built-in, the synthesized schedule, their ratio, the simulator's prediction
and the topology's lower bound beside the measured time.

    python scripts/synth_tables.py docs/data/synth 2+2
"""
import os
import re
import sys

D, name = sys.argv[1], sys.argv[2]
BUILTIN = {"builtin", "auto", "ring", "rhd", "rd", "direct", "hier"}
print("| size | mode | best built-in (ms) | synthesized (ms) | synth / best | predicted (ms) | pred / measured | lower bound (ms) | synth / bound | other rounds (ms) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for S in ["1M", "4M", "16M", "64M"]:
    syn = open(f"{D}/all_reduce-{name}-{S}.synth.txt").read()
    pred = float(re.search(r"predicted: ([\d.]+) ms", syn).group(1))
    lb = float(re.search(r"lower bound ([\d.]+) ms", syn).group(1))
    chose = re.search(r"chose: (\S+)", syn).group(1)
    for mode in ["loop", "blocking"]:
        rows = {}
        for line in open(f"{D}/all_reduce-{name}-{S}-{mode}.txt"):
            m = re.match(r"^\s+\d+\s+\d+\s+\S+\s+\S+\s+(\S+)\s+([\d.]+)\s", line)
            if m:
                rows[m.group(1)] = float(m.group(2)) / 1e3
        if not rows:
            print(f"| {S} | {mode} | no rows: see {D}/all_reduce-{name}-{S}-{mode}.txt |")
            continue
        best = min((t, a) for a, t in rows.items() if a in BUILTIN)
        # Rows of schedules are named by the path the run was given: matched by file name.
        mine = next(t for a, t in rows.items() if a.endswith(f"/all_reduce-{name}-{S}.xml"))
        others = ", ".join(f"{os.path.basename(a).split('-')[-1][:-4]} {t:.1f}" for a, t in rows.items()
                           if a.startswith("msccl:") and not a.endswith(f"-{S}.xml"))
        print(f"| {S} | {'back-to-back' if mode == 'loop' else 'isolated'} | {best[1]} {best[0]:.1f} | {chose.split('-')[-1]} {mine:.1f} | {mine / best[0]:.2f} | {pred:.1f} | {pred / mine:.2f} | {lb:.1f} | {mine / lb:.2f} | {others} |")
