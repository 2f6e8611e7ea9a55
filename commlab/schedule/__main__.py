"""python -m commlab.schedule check FILE | export ALGORITHM --collective C --ranks P -o FILE |
synthesize --collective C --topology 2,2,1 --inter 1gbit,1gbit,200mbit:50us --size 16M -o FILE

check: prove an MSCCL XML schedule before it runs; exit 0 valid, 1 a violation (named by
rank, threadblock and step), 2 not a schedule commlab can read. With --bytes, price it:
its derived α-β-γ terms at that size, under the cost model's default constants unless
given (--alpha-us, --gbps, --gamma-gbps).
export: write one of commlab's algorithms as MSCCL XML (those that are fixed schedules);
--unfused for runtimes without MSCCL's fused steps (RCCL's build).
synthesize: the schedule for a topology of hosts (schedule/synthesize.py), checked,
with its predicted time, the topology's lower bound and every candidate's time."""
from __future__ import annotations

import argparse
import sys

from commlab.algorithms import registry
from commlab.core.cli import run
from commlab.core.errors import UnsupportedError
from commlab.core.units import parse_bytes

from .check import ScheduleError, check
from .lower import unfused
from .msccl import ScheduleFormatError, load, save
from .synthesize import SKETCHES, synthesize
from .topology import Topology


def _check(args) -> int:
    try:
        s = load(args.file)
    except ScheduleFormatError as e:
        print(f"unreadable: {e}", file=sys.stderr)
        return 2
    try:
        summary = check(s, args.file)
    except ScheduleError as e:
        print(f"invalid: {e.violation}")
        return 1
    print(f"valid: {args.file}")
    if s.absent:
        print(f"  note: written without {', '.join(s.absent)} (msccl-tools' compiler omits them; read as it meant "
              "them, but rccl's parser refuses the file: `load` then `save` writes them)")
    for line in summary.lines():
        print(f"  {line}")
    if args.bytes is not None:
        n = parse_bytes(args.bytes)
        chunk = n / summary.chunks
        a, b, g = args.alpha_us * 1e-6, 1 / (args.gbps * 1e9 / 8), 1 / (args.gamma_gbps * 1e9 / 8)
        t = summary.hops * a + summary.sent * chunk * b + summary.reduced * chunk * g
        print(f"  priced at {n} B: {summary.hops}·α + {summary.sent * chunk:.0f} B·β + {summary.reduced * chunk:.0f} B·γ"
              f" = {t * 1e6:.1f} µs (α {args.alpha_us} µs, {args.gbps} Gbit/s, reductions {args.gamma_gbps} Gbit/s)")
    return 0


def _export(args) -> int:
    try:
        alg = registry(args.collective).get(args.algorithm)
    except UnsupportedError as e:
        print(e, file=sys.stderr)
        return 2
    s = alg.schedule(args.ranks)
    if s is None:
        print(f"{args.collective} {args.algorithm!r} is no fixed schedule (its steps depend on the size)",
              file=sys.stderr)
        return 2
    if args.unfused:
        s = unfused(s)
    check(s)
    save(s, args.output)
    print(f"wrote {args.output}: {args.collective} {args.algorithm} on {args.ranks} ranks")
    return 0


def _fixed(collective: str, p: int) -> dict:
    """The family's algorithms that are fixed schedules on p ranks, by name."""
    reg = registry(collective)
    out = {}
    for name in reg.names():
        try:
            s = reg.get(name).schedule(p)
        except (UnsupportedError, ValueError, NotImplementedError):
            continue
        if s is not None:
            out[name] = s
    return out


def _synthesize(args) -> int:
    try:
        topo = Topology.parse(args.topology, args.inter, args.intra, args.step_us)
        n = parse_bytes(args.size)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    result = synthesize(args.collective, topo, n, _fixed(args.collective, topo.size))
    save(result.schedule, args.output)
    print(f"{args.collective} on {topo.size} ranks at {args.size}: {topo.describe()}")
    for line in result.lines():
        print(line)
    print(f"wrote {args.output} (proved: {', '.join(result.summary.modes)})")
    return 0


def main(argv=None) -> int:
    summary = (__doc__ or "").split("\n\n")[0]  # no docstring under python -OO
    ap = argparse.ArgumentParser(prog="python -m commlab.schedule", description=summary)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="prove a schedule (exit 0 valid, 1 invalid, 2 unreadable)")
    c.add_argument("file")
    c.add_argument("--bytes", help="price it at this size (nccl-tests' size: 4K, 1M, ...)")
    c.add_argument("--alpha-us", type=float, default=20.0, help="per-message latency, µs")
    c.add_argument("--gbps", type=float, default=10.0, help="link bandwidth, Gbit/s")
    c.add_argument("--gamma-gbps", type=float, default=100.0, help="reduction throughput, Gbit/s")
    c.set_defaults(run=_check)
    e = sub.add_parser("export", help="write one of commlab's algorithms as MSCCL XML")
    e.add_argument("algorithm")
    e.add_argument("--collective", default="all_reduce")
    e.add_argument("--ranks", type=int, required=True)
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--unfused", action="store_true",
                   help="no fused steps (rcs, rrs, rrc, rrcs): what RCCL's build runs (receives land in scratch)")
    e.set_defaults(run=_export)
    y = sub.add_parser("synthesize", help="the schedule for a topology of hosts, proved and priced")
    y.add_argument("--collective", default="all_reduce", choices=list(SKETCHES))
    y.add_argument("--topology", required=True, help="ranks per host, host by host: 2,2,1")
    y.add_argument("--inter", default="1gbit:50us",
                   help="each host's link, RATE[:LATENCY]: one for all, or one per host (1gbit,1gbit,200mbit:50us)")
    y.add_argument("--intra", default="10gbit:50us", help="point-to-point inside a host, RATE[:LATENCY] per message")
    y.add_argument("--step-us", type=float, default=250.0,
                   help="what a step costs a rank beyond its bytes (250: the point-to-point executor, 5 ranks on 2 cores)")
    y.add_argument("--size", default="16M", help="the call's larger buffer (all-gather's output): 1M, 16M, ...")
    y.add_argument("-o", "--output", required=True)
    y.set_defaults(run=_synthesize)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    run(main)
