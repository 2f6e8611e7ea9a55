"""The bench's table, nccl-tests' columns, and the footers under it: the memory floor
each row is held to above 1 MiB, the small-message floor, and the tuning it used."""
from __future__ import annotations

from commlab import algorithms
from commlab.core.units import format_bytes
from commlab.measure import costmodel, envinfo, probes
from commlab.measure.specs import SPECS


def describe_tuning(ranges: list[dict]) -> str:
    """E.g. "up to 22.6K shm, above 22.6K builtin"."""
    if len(ranges) == 1:
        return f"{ranges[0]['algorithm']} at every size"
    parts = [f"up to {format_bytes(r['max_bytes'])} {r['algorithm']}" for r in ranges[:-1]]
    return ", ".join(parts) + f", above {format_bytes(ranges[-2]['max_bytes'])} {ranges[-1]['algorithm']}"


def report(doc: dict) -> str:
    env, results = doc["env"], doc["results"]
    p = env["world_size"]
    collective = doc.get("collective", "all_reduce")
    fits = costmodel.fit([(r["algorithm"], p, r["bytes"], r["time_us"]) for r in results],
                         env.get("gamma_us_per_byte"), collective)
    base = {r["bytes"]: r["time_us"] for r in results if r["algorithm"] == "builtin"}
    lines = envinfo.header_lines(env)
    note = SPECS[collective].size_note
    lines.append(f"# collective: {collective}" + (f" ({note})" if note else ""))
    lines.append("#")
    lines.append(f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'algorithm':>11} {'time(us)':>10} "
                 f"{'p50 call':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'model(us)':>10} {'vs builtin':>10}")
    for r in results:
        f = fits.get(r["algorithm"])
        model = f"{f.predict_us(p, r['bytes']):10.1f}" if f else f"{'-':>10}"
        vs = f"{base[r['bytes']] / r['time_us']:9.2f}x" if r["bytes"] in base else f"{'-':>10}"
        wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
        lines.append(f"  {r['bytes']:>10} {r['count']:>10} {r['dtype']:>8} {r['op']:>6} {r['algorithm']:>11} "
                     f"{r['time_us']:10.1f} {r.get('p50_us', float('nan')):10.1f} {r['algbw_gbps']:7.3f} {r['busbw_gbps']:7.3f} {wrong:>6} {model} {vs}")
    lines.append("#")
    algs = list(dict.fromkeys(r["algorithm"] for r in results))
    lines.append("# average busbw (GB/s): " + ", ".join(
        f"{a} {sum(r['busbw_gbps'] for r in results if r['algorithm'] == a) / max(1, sum(1 for r in results if r['algorithm'] == a)):.3f}"
        for a in algs))
    lines.append("# fastest per size: " + ", ".join(
        f"{format_bytes(n)}={min((r for r in results if r['bytes'] == n), key=lambda r: r['time_us'])['algorithm']}"
        for n in dict.fromkeys(r["bytes"] for r in results)))
    if doc.get("tuning"):
        t = doc["tuning"]
        lines.append(f"# tuning for auto ({t['device']}, {t['world_size']} ranks, {t['hosts']} host(s)): "
                     + describe_tuning(t["ranges"]))
    lines.append("# cost model fit (time = steps*alpha + bytes_sent*beta + bytes_reduced*gamma):")
    for a, f in fits.items():
        lines.append(f"#   {a:>11}: alpha {f.alpha_us:8.2f} us  1/beta {f.bandwidth_gbps:8.3f} GB/s  "
                     f"gamma {f.gamma_us_per_byte * 1e3:7.4f} ns/B  fit error median {f.median_rel_err * 100:.1f}% "
                     f"max {f.max_rel_err * 100:.1f}%")
    lines.extend(floor_lines(results, env))
    lines.extend(small_floor_lines(results, env))
    for name, about in env.get("anchors", {}).items():
        lines.append(f"# anchor {name}: {about}")
    for note in env.get("anchors_missing", []):
        lines.append(f"# anchor not run: {note}")
    if "timing" in env:
        lines.append(f"# timing: {env['timing']}")
    wrong = sum(r["wrong"] for r in results if r["wrong"] > 0)
    lines.append(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return "\n".join(lines)


FLOOR_MIN_BYTES = 1 << 20  # below this, synchronisation, not memory, bounds the time


def floor_lines(results: list[dict], env: dict) -> list[str]:
    """Memory-bound transports against their floor (probes.memory_floor_us), with
    rates measured in this run with every rank streaming at once."""
    rates = env.get("group_bandwidth_gbps")
    if not rates:
        return []
    p, fast, out = env["world_size"], env["group_bandwidth_fast_gbps"], []
    for r in results:
        rate = rates.get(str(r["bytes"]))
        if r["algorithm"] not in algorithms.names() or rate is None:
            continue
        traffic = algorithms.get(r["algorithm"]).memory_traffic(p, r["bytes"])
        if traffic is None:
            continue
        floor = probes.memory_floor_us(traffic, rate, fast)
        total = (traffic.tensor + traffic.staging) / r["bytes"]
        out.append(f"#   {r['algorithm']:>11} {format_bytes(r['bytes']):>5}: floor {floor:10.1f} us (tensor "
                   f"{traffic.tensor / r['bytes']:.2f}n at {rate:.1f} GB/s, or all {total:.2f}n at {fast:.1f} GB/s) "
                   f"-> efficiency {floor / r['time_us'] * 100:5.1f}%")
    if out:
        out.insert(0, f"# memory-traffic floor per rank ({p} ranks on {env['cores']} cores): the larger of the tensor's "
                      "bytes at the bandwidth each rank gets with all ranks streaming a working set of that size at "
                      "once, and all bytes at the bandwidth they get in 1 MiB working sets (best of read, copy and "
                      "in-place passes, slowest rank, measured in this run):")
    return out


SMALL_FLOOR_SIZES = (4 << 10, 64 << 10)  # where the footer compares rows with the small-message floor


def small_floor_lines(results: list[dict], env: dict) -> list[str]:
    """Every row's distance to the small-message floor: a one-way cache-line handoff
    between two ranks (no rank can finish before it has seen a peer's flag), one
    cache-hot copy of the message (the result is written at least once, after that)
    and, where k ranks share a core, k-1 context switches (each must run in every call)."""
    h, copies = env.get("handoffs"), env.get("hot_copy_us") or {}
    if not h or not copies:
        return []
    switches = (h["ranks_per_core"] - 1) * h["switch_us"] if h.get("switch_us") is not None else 0.0
    out = []
    for size in sorted(int(n) for n in copies):
        rows = sorted((r for r in results if r["bytes"] == size), key=lambda r: r["time_us"])
        if not rows:
            continue
        copy = copies[str(size)]
        floor = h["handoff_us"] + copy + switches
        parts = f"handoff {h['handoff_us']:.2f} + copy {copy:.2f}" + \
            (f" + {h['ranks_per_core'] - 1} x switch {h['switch_us']:.2f}" if switches else "")
        out.append(f"#   {format_bytes(size):>5}: floor {floor:6.2f} us = {parts};  "
                   + ", ".join(f"{r['algorithm']} {r['time_us'] / floor:.1f}x" for r in rows))
    if out:
        out.insert(0, "# small-message floor per call (measured in this run): one-way cache-line handoff between two "
                      "ranks' processes (half the best ping-pong round trip) + one cache-hot copy of the message"
                      + (" + a context switch per extra rank on a core (ping-pong pinned to one core)" if switches
                         else "") + "; each row's time as a multiple of it:")
    return out
