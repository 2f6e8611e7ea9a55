"""compare's --trace: every rank's spans as one Chrome trace-event JSON (Perfetto and
chrome://tracing open it as it is) and the exposed and total synchronisation computed
back from it.

A rank's record: its compute spans (forward, backward, optimizer of each timed
iteration) and its DDP buckets as hooks.BucketStats kept them (hand-over to completion,
the end of backward, the last completion): the very timestamps compare's table sums, so
the picture and the numbers cannot disagree. Times are time.perf_counter's, which on
Linux is CLOCK_MONOTONIC: one clock for every process of a host, no offset to estimate
(ranks on several hosts are not traced yet)."""
from __future__ import annotations

import json

TRACKS = {"compute": 0, "communication": 1, "exposed sync": 2}


def record(compute: list[tuple[str, float, float]], iterations: list[dict], algorithm: str) -> dict:
    """What one rank sends back: compute spans (name, start s, end s) and BucketStats.iterations()."""
    return {"compute": [list(c) for c in compute], "iterations": iterations, "algorithm": algorithm}


def chrome_trace(records: list[dict], mode: str) -> dict:
    """One trace: a process per rank, a thread per track (compute, communication, the
    exposed part of each iteration's synchronisation)."""
    starts = [c[1] for r in records for c in r["compute"]] + \
        [b["start"] for r in records for i in r["iterations"] for b in i["buckets"]]
    t0 = min(starts) if starts else 0.0
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    events = []
    for rank, rec in enumerate(records):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for track, tid in TRACKS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
        ends = sorted(it["backward_end"] for it in rec["iterations"])
        for name, a, b in rec["compute"]:
            # backward() returns once DDP's buckets are done: past the last hand-over it waits.
            cut = next((e for e in ends if a < e < b), None) if name == "backward" else None
            for part, x, y in ((name, a, cut or b), ("waiting for the buckets", cut, b)) if cut else ((name, a, b),):
                events.append({"name": part, "cat": "wait" if part != name else "compute", "ph": "X", "ts": us(x),
                               "dur": us(y) - us(x), "pid": rank, "tid": TRACKS["compute"], "args": {}})
        for it in rec["iterations"]:
            for bk in it["buckets"]:
                events.append({"name": f"bucket {bk['index']}", "cat": "communication", "ph": "X",
                               "ts": us(bk["start"]), "dur": us(bk["end"]) - us(bk["start"]), "pid": rank,
                               "tid": TRACKS["communication"],
                               "args": {"bytes": bk["bytes"], "algorithm": rec["algorithm"]}})
            exposed = max(0.0, it["last_done"] - it["backward_end"])
            events.append({"name": "exposed sync", "cat": "exposed", "ph": "X", "ts": us(it["backward_end"]),
                           "dur": round(exposed * 1e6, 3), "pid": rank, "tid": TRACKS["exposed sync"],
                           "args": {"from": "the last bucket's hand-over (end of backward)",
                                    "to": "the last bucket's completion"}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"mode": mode, "clock": "time.perf_counter (CLOCK_MONOTONIC), one host: no offsets",
                          "source": "commlab.compare --trace"}}


def sync_ms(trace: dict) -> dict:
    """The table's grad-sync figures back from a trace: per rank the mean over iterations
    of the summed bucket times (total) and of the exposed spans; the largest rank's, as
    compare reports them."""
    per: dict[int, dict] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        d = per.setdefault(e["pid"], {"communication": 0.0, "exposed": [], })
        if e["cat"] == "communication":
            d["communication"] += e["dur"] / 1e3
        elif e["cat"] == "exposed":
            d["exposed"].append(e["dur"] / 1e3)
    out = {"total": 0.0, "exposed": 0.0}
    for d in per.values():
        n = len(d["exposed"]) or 1
        out["total"] = max(out["total"], d["communication"] / n)
        out["exposed"] = max(out["exposed"], sum(d["exposed"]) / n)
    return out


def write(trace: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
