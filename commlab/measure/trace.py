"""compare's --trace: every rank's spans as one Chrome trace-event JSON (Perfetto and
chrome://tracing open it as it is) and the exposed and total synchronisation computed
back from it.

A rank's record: its compute spans (forward, backward, optimizer of each timed
iteration), its DDP buckets as hooks.BucketStats kept them (hand-over to completion,
the end of backward, the last completion) and the blocking collectives of the sharded
modes (FSDP's all-gathers and reduce-scatters, ZeRO-1's parameter broadcast): the very
timestamps compare's table sums, so the picture and the numbers cannot disagree. Times
are time.perf_counter's, which on Linux is CLOCK_MONOTONIC: one clock for every process of a host, no offset to estimate
(ranks on several hosts are not traced yet)."""
from __future__ import annotations

import json

TRACKS = {"compute": 0, "communication": 1, "exposed sync": 2, "peer wait": 3}


def record(compute: list[tuple[str, float, float]], iterations: list[dict], algorithm: str) -> dict:
    """What one rank sends back: compute spans (name, start s, end s) and, per timed
    iteration, its communication: DDP's buckets as BucketStats.iterations() gives them
    (keys buckets, backward_end, last_done) and/or `calls`, blocking collectives the step
    waited for whole (FSDP's all-gathers and reduce-scatters, ZeRO-1's broadcasts:
    {"kind", "start", "end", "bytes"})."""
    return {"compute": [list(c) for c in compute], "iterations": iterations, "algorithm": algorithm}


def chrome_trace(records: list[dict], mode: str) -> dict:
    """One trace: a process per rank, a thread per track (compute, communication, the
    exposed part of each iteration's synchronisation, and the part of each collective
    spent before the last rank had started it, naming that rank). Every communication
    and exposed span carries its iteration, which sync_ms reads back."""
    starts = [c[1] for r in records for c in r["compute"]] + \
        [b["start"] for r in records for i in r["iterations"] for b in i.get("buckets", []) + i.get("calls", [])]
    t0 = min(starts) if starts else 0.0
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    events = []

    def span(name: str, cat: str, a: float, b: float, rank: int, track: str, args: dict) -> None:
        events.append({"name": name, "cat": cat, "ph": "X", "ts": us(a), "dur": round(max(0.0, us(b) - us(a)), 3),
                       "pid": rank, "tid": TRACKS[track], "args": args})

    # Each collective's last arrival: the latest start (hand-over, for a bucket) over the
    # ranks, which share the clock. Until then no rank's call can complete.
    last: dict[tuple, tuple[float, int]] = {}
    for rank, rec in enumerate(records):
        for k, it in enumerate(rec["iterations"]):
            for key, c in [(("bucket", b["index"]), b) for b in it.get("buckets", [])] + \
                          [(("call", j), c) for j, c in enumerate(it.get("calls", []))]:
                if c["start"] > last.get((k, key), (float("-inf"), -1))[0]:
                    last[(k, key)] = (c["start"], rank)

    def peer_wait(k: int, key: tuple, c: dict, rank: int, what: str) -> None:
        at, who = last.get((k, key), (c["start"], rank))
        if who != rank and at > c["start"]:
            span(f"waiting for rank {who}", "peer-wait", c["start"], min(at, c["end"]), rank, "peer wait",
                 {"what": what, "last_rank": who, "iteration": k,
                  "from": "this rank's start", "to": "the last rank's start (or this call's end)"})

    for rank, rec in enumerate(records):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for track, tid in TRACKS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
        ends = sorted(it["backward_end"] for it in rec["iterations"] if "backward_end" in it)
        for name, a, b in rec["compute"]:
            # backward() returns once DDP's buckets are done: past the last hand-over it waits.
            cut = next((e for e in ends if a < e < b), None) if name == "backward" else None
            for part, x, y in ((name, a, cut or b), ("waiting for the buckets", cut, b)) if cut else ((name, a, b),):
                span(part, "wait" if part != name else "compute", x, y, rank, "compute", {})
        for k, it in enumerate(rec["iterations"]):
            for bk in it.get("buckets", []):
                span(f"bucket {bk['index']}", "communication", bk["start"], bk["end"], rank, "communication",
                     {"kind": "bucket", "bytes": bk["bytes"], "algorithm": rec["algorithm"], "iteration": k})
                peer_wait(k, ("bucket", bk["index"]), bk, rank, f"bucket {bk['index']}")
            if it.get("buckets"):
                span("exposed sync", "exposed", it["backward_end"], max(it["last_done"], it["backward_end"]), rank,
                     "exposed sync", {"from": "the last bucket's hand-over (end of backward)",
                                      "to": "the last bucket's completion", "iteration": k})
            for j, c in enumerate(it.get("calls", [])):
                span(c["kind"], "communication", c["start"], c["end"], rank, "communication",
                     {"kind": c["kind"], "bytes": c["bytes"], "algorithm": rec["algorithm"], "iteration": k})
                peer_wait(k, ("call", j), c, rank, c["kind"])
                span("exposed sync", "exposed", c["start"], c["end"], rank, "exposed sync",
                     {"from": f"the {c['kind']}'s start", "to": "its end (the step waited for all of it)",
                      "iteration": k})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"mode": mode, "clock": "time.perf_counter (CLOCK_MONOTONIC), one host: no offsets",
                          "source": "commlab.compare --trace"}}


def bench_trace(ranks: list[list[dict]], meta: dict) -> dict:
    """The benchmark's --trace: per rank (a process), per algorithm (a thread), every
    timed call it recorded as a span, its size, round and index in args. `ranks[r]` is
    rank r's list of {"algorithm", "bytes", "round", "calls": [(start s, end s), ...]}."""
    starts = [c[0] for rounds in ranks for rd in rounds for c in rd["calls"]]
    t0 = min(starts) if starts else 0.0
    names = sorted({rd["algorithm"] for rounds in ranks for rd in rounds})
    events = []
    for rank, rounds in enumerate(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for tid, name in enumerate(names):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for rd in rounds:
            label = f"{rd['algorithm']} {rd['size']}"
            for j, (a, b) in enumerate(rd["calls"]):
                events.append({"name": label, "cat": "call", "ph": "X", "ts": round((a - t0) * 1e6, 3),
                               "dur": round((b - a) * 1e6, 3), "pid": rank, "tid": names.index(rd["algorithm"]),
                               "args": {"bytes": rd["bytes"], "round": rd["round"], "call": j}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**meta, "clock": "time.perf_counter (CLOCK_MONOTONIC), one host: no offsets",
                          "source": "commlab.allreduce_bench --trace"}}


def sync_ms(trace: dict) -> dict:
    """The table's sync figures back from a trace: per rank the mean over iterations of
    the summed communication spans (total) and of the exposed spans; the largest rank's,
    as compare reports them."""
    per: dict[int, dict] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["cat"] not in ("communication", "exposed"):
            continue
        d = per.setdefault(e["pid"], {"communication": {}, "exposed": {}})[e["cat"]]
        k = e["args"]["iteration"]
        d[k] = d.get(k, 0.0) + e["dur"] / 1e3
    out = {"total": 0.0, "exposed": 0.0}
    for d in per.values():
        n = len(set(d["communication"]) | set(d["exposed"])) or 1
        out["total"] = max(out["total"], sum(d["communication"].values()) / n)
        out["exposed"] = max(out["exposed"], sum(d["exposed"].values()) / n)
    return out


def write(trace: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
