"""compare's --trace: every rank's spans as one Chrome trace-event JSON (Perfetto and
chrome://tracing open it as it is) and the exposed and total synchronisation computed
back from it.

A rank's record: its compute spans (forward, backward, optimizer of each timed
iteration), its DDP buckets as hooks.BucketStats kept them (hand-over to completion,
the end of backward, the last completion) and the blocking collectives of the sharded
modes (FSDP's all-gathers and reduce-scatters, ZeRO-1's parameter broadcast): the very
timestamps compare's table sums, so the picture and the numbers cannot disagree. Times
are time.perf_counter's, which on Linux is CLOCK_MONOTONIC: one clock for every process of a host, no offset to estimate
(compare's ranks share a host; the bench's ranks on several hosts are put on rank 0's
clock with the offsets commlab.measure.clocks measures)."""
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


def _exposed_spans(it: dict):
    """An iteration's exposed synchronisation as (arrival key, start, end, what): DDP's from
    the last bucket's hand-over to the last completion, each blocking call whole."""
    if it.get("buckets"):
        yield ("backward_end",), it["backward_end"], max(it["last_done"], it["backward_end"]), \
            {"from": "the last bucket's hand-over (end of backward)", "to": "the last bucket's completion"}
    for j, c in enumerate(it.get("calls", [])):
        yield ("call", j), c["start"], c["end"], \
            {"from": f"the {c['kind']}'s start", "to": "its end (the step waited for all of it)"}


def last_arrivals(records: list[dict]) -> dict[tuple, tuple[float, int]]:
    """(iteration, key) -> (time, rank) of the last rank to arrive: the latest start over
    the ranks (which share the clock) of each bucket, each blocking call and each
    iteration's end of backward. Until then no rank's synchronisation can complete."""
    last: dict[tuple, tuple[float, int]] = {}

    def see(k: int, key: tuple, t: float, rank: int) -> None:
        if t > last.get((k, key), (float("-inf"), -1))[0]:
            last[(k, key)] = (t, rank)

    for rank, rec in enumerate(records):
        for k, it in enumerate(rec["iterations"]):
            for b in it.get("buckets", []):
                see(k, ("bucket", b["index"]), b["start"], rank)
            for j, c in enumerate(it.get("calls", [])):
                see(k, ("call", j), c["start"], rank)
            if it.get("backward_end") is not None:
                see(k, ("backward_end",), it["backward_end"], rank)
    return last


def _arrival_cut(last: dict, k: int, key: tuple, a: float, b: float, rank: int) -> tuple[float, int]:
    """Where the span [a, b] of a rank's synchronisation (key, iteration k) stops waiting
    for the last rank to arrive, and that rank: the table's split and the trace's alike."""
    at, who = last.get((k, key), (a, rank))
    return min(max(at, a), b), who


def exposed_split(records: list[dict]) -> dict:
    """compare's exposed synchronisation from every rank's record: per rank the mean over
    iterations of its exposed spans, and of their part after the last rank arrived (the
    rest is waiting for a slower rank, not communicating); each the largest rank's, as
    compare reports; and that rank's exposed time in each iteration. None where the ranks'
    iterations do not line up."""
    counts = {len(r["iterations"]) for r in records}
    if not records or len(counts) != 1 or not counts.pop():
        return {"exposed": None, "after_arrival": None}
    last = last_arrivals(records)
    exposed, after = [], []  # per rank, per iteration (ms)
    for rank, rec in enumerate(records):
        exposed.append([])
        after.append([])
        for k, it in enumerate(rec["iterations"]):
            e = a = 0.0
            for key, x, y, _ in _exposed_spans(it):
                e += y - x
                a += y - _arrival_cut(last, k, key, x, y, rank)[0]
            exposed[-1].append(e * 1e3)
            after[-1].append(a * 1e3)
    worst = max(exposed, key=sum)
    return {"exposed": sum(worst) / len(worst), "after_arrival": max(sum(a) / len(a) for a in after),
            "exposed_per_iteration": worst}


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

    last = last_arrivals(records)

    def peer_wait(k: int, key: tuple, c: dict, rank: int, what: str) -> None:
        cut, who = _arrival_cut(last, k, key, c["start"], c["end"], rank)
        if cut > c["start"]:  # the last to start waits for nobody: its cut is its own start
            span(f"waiting for rank {who}", "peer-wait", c["start"], cut, rank, "peer wait",
                 {"what": what, "last_rank": who, "iteration": k,
                  "from": "this rank's start", "to": "the last rank's start (or this call's end)"})

    def exposed(k: int, key: tuple, a: float, b: float, rank: int, what: dict) -> None:
        # Drawn in two parts: before the last rank arrived (this rank waited for it) and after.
        cut, who = _arrival_cut(last, k, key, a, b, rank)
        if cut > a:
            span(f"exposed: waiting for rank {who}", "exposed", a, cut, rank, "exposed sync",
                 {**what, "iteration": k, "waiting_for": who, "to": "the last rank's arrival"})
        if b > cut or cut == a:
            span("exposed sync", "exposed", cut, b, rank, "exposed sync", {**what, "iteration": k})

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
            for key, a, b, what in _exposed_spans(it):
                exposed(k, key, a, b, rank, what)
            for j, c in enumerate(it.get("calls", [])):
                span(c["kind"], "communication", c["start"], c["end"], rank, "communication",
                     {"kind": c["kind"], "bytes": c["bytes"], "algorithm": rec["algorithm"], "iteration": k,
                      **({"page_faults": c["page_faults"]} if "page_faults" in c else {})})
                peer_wait(k, ("call", j), c, rank, c["kind"])
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
            "otherData": {"clock": "time.perf_counter (CLOCK_MONOTONIC), one host: no offsets", **meta,
                          "source": "commlab.allreduce_bench --trace"}}


def sync_ms(trace: dict) -> dict:
    """The table's sync figures back from a trace: per rank the mean over iterations of
    the summed communication spans (total), of the exposed spans and of their parts after
    the last rank arrived; the largest rank's, as compare reports them."""
    per: dict[int, dict] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e["cat"] not in ("communication", "exposed"):
            continue
        mine = per.setdefault(e["pid"], {"communication": {}, "exposed": {}, "after_arrival": {}})
        k = e["args"]["iteration"]
        parts = [e["cat"]] + (["after_arrival"] if e["cat"] == "exposed" and "waiting_for" not in e["args"] else [])
        for part in parts:
            mine[part][k] = mine[part].get(k, 0.0) + e["dur"] / 1e3
    out = {"total": 0.0, "exposed": 0.0, "after_arrival": 0.0}
    for d in per.values():
        n = len(set(d["communication"]) | set(d["exposed"])) or 1
        out["total"] = max(out["total"], sum(d["communication"].values()) / n)
        out["exposed"] = max(out["exposed"], sum(d["exposed"].values()) / n)
        out["after_arrival"] = max(out["after_arrival"], sum(d["after_arrival"].values()) / n)
    return out


def write(trace: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
