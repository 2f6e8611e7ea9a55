"""nccl-tests-style benchmark over every registered algorithm of a collective.

    torchrun --nproc_per_node=4 -m commlab.allreduce_bench          # CPU default sweep
    python -m commlab.allreduce_bench --world-size 4 -b 4K -e 64M
    python -m commlab.allreduce_bench --world-size 4 --collective all_gather
    mpiexec -n 4 python -m commlab.allreduce_bench                   # adds an `mpi` row

algbw = S/t (GB/s, 1e9 bytes); busbw = algbw × nccl-tests' factor, comparable to link
speed whatever the algorithm: 2(p-1)/p for all-reduce, (p-1)/p for all-gather (S: the
gathered output), reduce-scatter (S: the reduced input) and all-to-all (S: each rank's
input), 1 for broadcast. t is nccl-tests' time: a loop's duration over its iterations,
slowest rank; the median per call (slowest rank per call) is printed beside it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.algorithms import tuning
from commlab.core import groups
from commlab.core.cli import run
from commlab.core.reduction import Op, parse_op
from commlab.core.units import format_bytes, parse_bytes
from commlab.measure import clocks, envinfo, launch, pools, probes, trace
from commlab.measure.plots import plot_bench
from commlab.measure.rows import anchor_rows, registry_rows
from commlab.measure.specs import SPECS, check_input, check_op
from commlab.measure.table import FLOOR_MIN_BYTES, SMALL_FLOOR_SIZES, report
from commlab.measure.timing import Interleaved, round_order
from commlab.transports.setup import by_host, gather, host_id

# --trace keeps this many calls of each row's round per rank: enough to see a slow phase
# (tens of ms at a few us a call), small enough for Perfetto at every size of a sweep.
TRACE_CALLS = 2000

DTYPES = {
    "float": torch.float32, "float32": torch.float32, "double": torch.float64, "float64": torch.float64,
    "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}
OPS = {"sum": "SUM", "prod": "PRODUCT", "product": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}


def run_bench(args) -> dict | None:
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    rank, p = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.datatype]
    op = parse_op(OPS[args.op])
    collective = getattr(args, "collective", "all_reduce")
    family = algorithms.registry(collective)
    spec = SPECS[collective]
    names = family.names() if args.algorithms == "all" else [a.strip() for a in args.algorithms.split(",")]
    for n in names:
        family.get(n)  # unknown names fail here, on every rank alike
    rows = registry_rows(names, device, collective)
    anchors, anchor_notes = anchor_rows(args.anchors, dtype, op, device, collective)
    rows += anchors
    sizes = size_list(args)
    env = envinfo.collect(device)
    env["ranks_per_host"], env["machine_ranks"] = host_layout()
    to_rank0 = (0.0, 0.0)  # this rank's offset to rank 0's clock, and its error (s)
    if getattr(args, "trace", None) and len(env["ranks_per_host"]) > 1:  # every rank sees the same layout
        # Hosts read different clocks: each rank's calls go into the trace on rank 0's.
        to_rank0 = clocks.offset_to_rank0(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                                          dist.get_world_size())
    env["cores"] = len(os.sched_getaffinity(0))
    env["gamma_us_per_byte"] = probes.measure_gamma_us_per_byte(dtype, device)
    floors = spec.floors and getattr(args, "floors", True)
    if device.type == "cpu" and floors and any(algorithms.get(r.name).memory_traffic(p, 1 << 20) is not None
                                                    for r in rows if r.name in algorithms.names()):
        # Memory-bound transports get a floor: the bandwidth every rank gets with all
        # ranks streaming at once, at each size's working set and at a cache-sized one.
        env["group_bandwidth_gbps"] = {str(n): probes.measure_group_bandwidth_gbps(n)
                                       for n in sizes if n >= FLOOR_MIN_BYTES}
        env["group_bandwidth_fast_gbps"] = probes.measure_group_bandwidth_gbps(probes.FAST_WORKING_SET)
    if device.type == "cpu" and p > 1 and floors and any(n < FLOOR_MIN_BYTES for n in sizes):
        # Small calls' floor: one cache-line handoff, then the result written once.
        env["handoffs"] = probes.measure_handoffs()
        small = [n for n in sizes if n in SMALL_FLOOR_SIZES] or [min(sizes)]
        env["hot_copy_us"] = {str(n): probes.hot_copy_us(n) for n in small}
    results, traced = [], []
    progress = Progress(len(sizes) * len(rows) * max(1, args.rounds),
                        enabled=(rank == 0 and sys.stderr.isatty() and not args.quiet))
    for nbytes in sizes:
        count = spec.count(nbytes, dtype.itemsize, p)  # the per-rank input's elements
        fill = 1 if op is Op.PRODUCT else 0  # stays finite however often it is reduced
        buf = torch.full((count,), fill, dtype=dtype, device=device)
        clock = Interleaved(device=device, iters=args.iters, warmup=args.warmup_iters, blocking=args.blocking,
                            budget_s=args.budget, max_iters=args.max_iters, rounds=args.rounds,
                            trace_calls=TRACE_CALLS if getattr(args, "trace", None) else 0)
        for k in range(clock.rounds):
            for row in round_order(rows, k):
                progress.step(f"{row.name} {format_bytes(count * dtype.itemsize)}")
                clock.round(row.name, lambda: row.call(buf, op), row.barrier)
                buf.fill_(fill)
        size_b = spec.size(count, dtype.itemsize, p)
        traced += [{"algorithm": t["key"], "bytes": size_b, "size": format_bytes(size_b), "round": t["round"],
                    "calls": t["calls"]} for t in clock.traced]
        if args.check:  # once per size, not per row: at 64 MiB they cost more than the rows' timing
            x0 = check_input(rank, count, dtype, check_op(spec, op), device)
            want = spec.want(rank, p, count, dtype, op, device)
        for row in rows:
            t = clock.result(row.name)
            wrong = -1
            if args.check:
                x = x0.clone()
                row.call(x, op)
                wrong_t = torch.tensor([int((row.output(x) != want).sum())], device=device)
                dist.all_reduce(wrong_t)
                wrong = int(wrong_t.item())
            size = spec.size(count, dtype.itemsize, p)
            algbw = size / t.mean_us / 1e3
            results.append({
                "algorithm": row.name, "bytes": size, "count": count, "dtype": str(dtype).replace("torch.", ""),
                "op": op.name.lower() if spec.reduces else "none", "time_us": t.mean_us, "algbw_gbps": algbw,
                "busbw_gbps": algbw * family.busbw_factor(p), "wrong": wrong,
                "p50_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us, "iters": t.iters,
            })
    progress.done()
    for row in rows:
        row.close()
    env["anchors"] = {row.name: row.about for row in anchors}
    env["anchors_missing"] = anchor_notes
    env["timing"] = "isolated calls after a tight barrier of each row's transport" if args.blocking else \
        "back-to-back calls (nccl-tests' loop time)"
    doc = {"collective": collective, "env": env, "results": results}
    if getattr(args, "trace", None):
        per_rank = [None] * dist.get_world_size()
        shifted = [dict(t, calls=[(a + to_rank0[0], b + to_rank0[0]) for a, b in t["calls"]]) for t in traced]
        dist.all_gather_object(per_rank, (shifted, to_rank0))  # small: at most TRACE_CALLS calls a round
        doc["trace"] = [r for r, _ in per_rank]
        if len(env["ranks_per_host"]) > 1:
            doc["trace_clock"] = {"clock": "rank 0's time.perf_counter; every other rank's calls shifted by its "
                                           "offset, measured through the store before the first row (NTP's exchange)",
                                  "offsets_us": [c[0] * 1e6 for _, c in per_rank],
                                  "errors_us": [c[1] * 1e6 for _, c in per_rank]}
    if getattr(args, "tune", None) and spec.tunes:
        doc["tuning"] = tuning_entry(args, doc, device, names)
    return doc if rank == 0 else None


def host_layout() -> tuple[list[int], int]:
    """Collective: ranks on each host, hosts in order of their lowest rank (the
    identity shm and hier group by), for the two-level cost model and tuning; and the
    most ranks sharing one machine's cores (emulated hosts share them)."""
    ids = gather(groups.resolve(None), host_id(), "bench", "grouping ranks by host")
    machines = ["/".join(h.split("/")[:2]) for h in ids]  # hostname and boot: one kernel, one set of cores
    return [len(m) for m in by_host(ids)], max(len(m) for m in by_host(machines))


def tuning_entry(args, doc: dict, device, names: list[str]) -> dict:
    """This run's winners per size range for `auto`, for its layout."""
    env = doc["env"]
    return {"device": device.type, "world_size": dist.get_world_size(), "hosts": len(env["ranks_per_host"]),
            "ranges": tuning.winners(doc["results"], [n for n in names if n != "auto"]),
            "measured": {"command": "python -m commlab.allreduce_bench " + " ".join(getattr(args, "argv", [])),
                         "timing": env["timing"], "dtype": str(DTYPES[args.datatype]).replace("torch.", ""),
                         "op": args.op, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                         "commlab": env.get("commlab"), "torch": env.get("torch"), "cpu": env.get("cpu")}}


def size_list(args) -> list[int]:
    lo, hi = parse_bytes(args.minbytes), parse_bytes(args.maxbytes)
    if lo <= 0 or hi < lo:
        raise SystemExit(f"allreduce_bench: need 0 < minbytes <= maxbytes (got {lo}, {hi})")
    sizes, n = [], lo
    step = parse_bytes(args.stepbytes) if args.stepbytes else None
    while n <= hi:
        sizes.append(n)
        n = n + step if step else n * args.stepfactor
        if not step and args.stepfactor <= 1:
            break
    return sizes


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled = total, 0, enabled

    def step(self, what: str) -> None:
        self.n += 1
        if self.enabled:
            filled = int(30 * self.n / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.n}/{self.total} {what:<24}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 72 + "\r")
            sys.stderr.flush()


def write_outputs(doc: dict, args, suffix: str | None = None) -> None:
    """JSON, CSV, plot, tuning; with `suffix` (--collective all) each file name gets it."""
    def named(path):
        if not suffix:
            return path
        stem, dot, ext = path.rpartition(".")
        return f"{stem}.{suffix}.{ext}" if dot else f"{path}.{suffix}"

    if doc.get("tuning"):
        t = doc["tuning"]
        tuning.write(args.tune, t["device"], t["world_size"], t["hosts"], t["ranges"], t["measured"])
    traced = doc.pop("trace", None)
    if traced is not None:

        meta = {"collective": doc["collective"], "timing": doc["env"]["timing"], **doc.pop("trace_clock", {})}
        trace.write(trace.bench_trace(traced, meta), named(args.trace))
    if args.json:
        with open(named(args.json), "w") as f:
            json.dump(doc, f, indent=2)
    if args.csv:
        with open(named(args.csv), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(doc["results"][0].keys()) if doc["results"] else ["algorithm"])
            w.writeheader()
            w.writerows(doc["results"])
    if args.plot:

        plot_bench(doc, named(args.plot))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="commlab.allreduce_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=int, default=2)
    ap.add_argument("-i", "--stepbytes", default=None, help="linear steps of this size instead of -f")
    ap.add_argument("-n", "--iters", type=int, default=None,
                    help="timed iterations per size (default: as many as fit --budget, at most --max-iters)")
    ap.add_argument("-w", "--warmup_iters", type=int, default=3)
    ap.add_argument("-c", "--check", type=int, default=1, help="1: verify results exactly (#wrong)")
    ap.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    ap.add_argument("-o", "--op", default="sum", choices=sorted(OPS))
    ap.add_argument("--collective", default="all_reduce", choices=list(algorithms.COLLECTIVES) + ["all"],
                    help="the collective measured (all: each in turn); sizes are nccl-tests': the all-reduced buffer, "
                         "the gathered output, the reduce-scattered input, the broadcast message, each rank's all-to-all input")
    ap.add_argument("--algorithms", default="all", help="comma list of the collective's registered algorithms, or all")
    ap.add_argument("--blocking", action="store_true",
                    help="isolated calls: each starts from a tight barrier made of the row's own transport (a "
                         "one-element all-reduce through it; MPI_Barrier for MPI) and is timed alone")
    ap.add_argument("--floors", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the memory-traffic and small-message floors each row is set against (CPU; "
                         "--no-floors: the rows alone, as compare's this-host fit needs)")
    ap.add_argument("--anchors", default="all",
                    help="external peers measured in the same run: all (what can run here), none, or a comma list "
                         "of mpi (MPICH or Open MPI through mpi4py, under mpiexec) and deepspeed (its CPU shm all-reduce)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("COMMLAB_BENCH_BUDGET", 0.25)),
                    help="seconds of timing per size and algorithm (default 0.25, or $COMMLAB_BENCH_BUDGET)")
    # OSU's count for small messages is 10,000: a fast row's rare slow phases (ranks woken
    # onto one core, a stall) then average in instead of landing in a few ms of samples.
    ap.add_argument("--max-iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="time the algorithms of a size in this many interleaved rounds, so a machine "
                         "whose speed drifts slows them alike (1: one after the other)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default=None, help="process-group backend (default: nccl on GPU, gloo on CPU)")
    ap.add_argument("--world-size", type=int, default=None, help="spawn this many local ranks (no torchrun)")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds")
    ap.add_argument("--json"), ap.add_argument("--csv"), ap.add_argument("--plot")
    ap.add_argument("--trace", metavar="FILE",
                    help="CPU: every rank's timed calls (up to 2000 a round) as one Chrome trace (Perfetto, "
                         "chrome://tracing): a process per rank, a thread per algorithm; ranks on several hosts "
                         "on rank 0's clock, with the offsets measured through the store")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--no-table", action="store_true",
                    help="print no table: the outputs (--json, --csv, ...) only, as compare's this-host fit reads them")
    ap.add_argument("--tune", metavar="FILE",
                    help="write the fastest correct algorithm per size range for this layout into FILE (kept "
                         "entries of other layouts); COMMLAB_TUNING=FILE makes `auto` use it")
    return ap


def _threads() -> int:
    return int(os.environ.get("COMMLAB_BENCH_THREADS", "1"))


def rank_main(args) -> None:
    torch.set_num_threads(_threads())
    info = launch.detect()
    backend = args.backend or launch.default_backend(args.device)
    launch.init(info, backend, args.timeout, args.device)
    todo = algorithms.COLLECTIVES if args.collective == "all" else (args.collective,)
    for collective in todo:
        doc = run_bench(argparse.Namespace(**{**vars(args), "collective": collective}))
        if doc is not None:
            if not args.no_table:
                print(report(doc), flush=True)
            write_outputs(doc, args, collective if len(todo) > 1 else None)
    launch.leave()


def _spawned_rank(rank: int, world: int, args) -> None:
    rank_main(args)  # the launcher gave it torchrun's environment


def output_problem(args) -> str | None:
    """Why an output could not be written, found before anything runs: rank 0 writes them
    after the run, where a failure left its peers waiting in the closing barrier."""
    if getattr(args, "trace", None) and args.device != "cpu":
        return "--trace records host clocks: CPU tensors only (a GPU's calls are timed by CUDA events)"
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot), ("--tune", args.tune),
                       ("--trace", getattr(args, "trace", None))):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"{flag} {path}: the folder {folder} does not exist or is not writable"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install matplotlib (or commlab[plot])"
    return None


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    problem = output_problem(args)
    if problem:
        ap.error(problem)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for what --tune records
    how = launch.detect_for_cli()
    if how is None:
        return 2
    if args.world_size and how.kind == "single":
        outcomes = pools.run_once(args.world_size, _spawned_rank, args, threads=_threads())
        failed = pools.report_failures(outcomes)
        if failed:
            print(failed, file=sys.stderr)
            return 1
    else:
        rank_main(args)
    return 0


if __name__ == "__main__":
    run(main)
