"""python -m commlab.schedule check FILE | export ALGORITHM --collective C --ranks P -o FILE

check: prove an MSCCL XML schedule before it runs; exit 0 valid, 1 a violation (named by
rank, threadblock and step), 2 not a schedule commlab can read. With --bytes, price it:
its derived α-β-γ terms at that size, under the cost model's default constants unless
given (--alpha-us, --gbps, --gamma-gbps).
export: write one of commlab's algorithms as MSCCL XML (those that are fixed schedules);
--unfused for runtimes without MSCCL's fused steps (RCCL's build)."""
from __future__ import annotations

import argparse
import sys

from commlab.algorithms import registry
from commlab.core.errors import UnsupportedError

from .check import ScheduleError, check
from .lower import unfused
from .msccl import ScheduleFormatError, load, save


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


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
        n = _size(args.bytes)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.schedule", description=__doc__.split("\n\n")[0])
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
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
