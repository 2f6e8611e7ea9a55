"""Markdown tables from scripts/peers_campaign.sh's JSON: per ranks and timing mode, shm
against the peers of the same run, shm / best peer (the worse of the two runs) and #wrong.

    python scripts/peers_tables.py peers
"""
import json
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "peers"
def load(f):
    p = os.path.join(d, f)
    if not os.path.exists(p): return None
    return json.load(open(p))
def fmt(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
for P in (2, 3, 4, 8):
    for blk in ("", "_blk"):
        A, B = load(f"A_P{P}{blk}.json"), load(f"B_P{P}{blk}.json")
        if not A or not B: continue
        print(f"\n**{P} ranks, {'isolated calls (--blocking)' if blk else 'back-to-back'}**\n")
        print("| size | run A: shm / MPICH / DeepSpeed | run B: shm / Open MPI | shm / best peer (worse run) | #wrong |")
        print("|---|---|---|---|---|")
        ra = {}
        for r in A["results"]: ra.setdefault(r["bytes"], {})[r["algorithm"]] = r
        rb = {}
        for r in B["results"]: rb.setdefault(r["bytes"], {})[r["algorithm"]] = r
        for n in sorted(ra):
            a, b = ra[n], rb.get(n, {})
            shmA = a["shm"]["time_us"]; mp = a.get("mpi:mpich", {}).get("time_us"); ds = a.get("deepspeed_shm", {}).get("time_us")
            shmB = b.get("shm", {}).get("time_us"); om = b.get("mpi:openmpi", {}).get("time_us")
            ratA = shmA / min(x for x in (mp, ds) if x)
            ratB = shmB / om if shmB and om else float("nan")
            wrong = sum(max(r["wrong"], 0) for r in list(a.values()) + list(b.values()))
            f = lambda x: "-" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")
            print(f"| {fmt(n)} | {f(shmA)} / {f(mp)} / {f(ds)} | {f(shmB)} / {f(om)} | {max(ratA, ratB):.2f} | {wrong} |")
        for doc, tag in ((A, "A"), (B, "B")):
            h = doc["env"].get("handoffs"); c = doc["env"].get("hot_copy_us")
            if h: print(f"floor {tag}: handoff {h['handoff_us']:.3f} switch {h.get('switch_us')} rpc {h['ranks_per_core']} copy {c}")
