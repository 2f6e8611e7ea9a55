"""PNG plots (matplotlib is an optional extra: pip install commlab[plot])."""
from __future__ import annotations


def _pyplot():
    try:
        # optional (the plot extra)
        import matplotlib

        matplotlib.use("Agg")
        # optional (the plot extra)
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or commlab[plot])") from None
    return plt


def plot_bench(doc: dict, path: str) -> None:
    plt = _pyplot()
    results = doc["results"]
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for alg in dict.fromkeys(r["algorithm"] for r in results):
        rows = [r for r in results if r["algorithm"] == alg]
        xs = [r["bytes"] for r in rows]
        ax_bw.plot(xs, [r["busbw_gbps"] for r in rows], marker="o", ms=3, label=alg)
        ax_t.plot(xs, [r["time_us"] for r in rows], marker="o", ms=3, label=alg)
    env = doc["env"]
    for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"all-reduce, {env['world_size']} ranks, {env['backend']} on {env['device']} ({env.get('cpu', '')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(doc: dict, path: str) -> None:
    plt = _pyplot()
    ok = [m for m in doc["modes"] if m["status"] == "ok"]
    names = [m.get("label", m["mode"]) for m in ok]
    panels = [("iteration median (ms)", [m["iter_ms"]["median"] for m in ok]),
              ("peak memory, busiest (MB)", [max(m["peak_memory_mb"]) for m in ok]),
              ("grad sync exposed (ms)", [m["grad_sync_ms"]["exposed"] or 0.0 for m in ok])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (title, vals) in zip(axes, panels):
        ax.bar(names, vals)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    env = doc["env"]
    fig.suptitle(f"{env.get('model')} on {env['world_size']}x {env['device']}, global batch {env.get('batch_size')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trace(trace: dict, path: str) -> None:
    """compare --trace's swimlane: a lane per rank and track (compute, communication,
    waiting for the last rank, exposed sync), time along x, for a reader without a
    trace viewer."""
    plt = _pyplot()
    colours = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b3",
               "waiting for the buckets": "#bbbbbb", "bucket": "#dd8452", "all-gather": "#da8bc3",
               "reduce-scatter": "#937860", "broadcast": "#ccb974", "exposed sync": "#c44e52",
               "exposed: waiting for the last rank": "#eba0a2", "waiting for the last rank": "#8c8c8c"}
    lane_of = {"compute": "compute", "wait": "compute", "communication": "communication", "exposed": "exposed sync",
               "peer-wait": "peer wait"}
    lanes: dict[tuple[int, str], list] = {}
    shown = set()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            name = {"communication": e["args"].get("kind"),
                    "peer-wait": "waiting for the last rank"}.get(e["cat"], e["name"])
            if e["cat"] == "exposed" and "waiting_for" in e["args"]:
                name = "exposed: waiting for the last rank"
            shown.add(name)
            lanes.setdefault((e["pid"], lane_of[e["cat"]]), []).append((e["ts"] / 1e3, e["dur"] / 1e3, colours[name]))
    tracks = ["compute", "communication", "peer wait", "exposed sync"]
    order = sorted(lanes, key=lambda k: (k[0], tracks.index(k[1])))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(order) + 1.6))
    for y, key in enumerate(order):
        spans = lanes[key]
        ax.broken_barh([(a, d) for a, d, _ in spans], (y - 0.4, 0.8), facecolors=[c for _, _, c in spans],
                       edgecolor="none")
    ax.set_yticks(range(len(order)), [f"rank {r} {c}" for r, c in order], fontsize=8)
    # optional (the plot extra)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=n) for n, c in colours.items() if n in shown], fontsize=7, ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"{trace['otherData'].get('mode')}: compute, communication (DDP's buckets from hand-over to "
                 "completion, blocking collectives), exposed sync", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
