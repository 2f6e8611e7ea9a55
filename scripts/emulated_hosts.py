"""Emulated hosts on one machine: H network namespaces on one bridge-less star of veth
pairs (namespace 0 routes for none: every pair joins namespace i to a hub namespace),
each host link shaped with tc's token bucket (tbf) in both directions, and the
all-reduce bench run by torchrun --nnodes H inside them. Needs root.

    python scripts/emulated_hosts.py --hosts 2 --ranks 2 --rate 1gbit -- \\
        --algorithms builtin,ring,rhd,hier -b 16M -e 64M -f 2 --anchors none --blocking

Unequal hosts, each link its own rate: `--ranks 2,2,1 --rate 1gbit,1gbit,200mbit` (the
host count is then the list's length; commlab.schedule synthesize takes the same lists).

Everything after `--` goes to `python -m commlab.allreduce_bench`; rank 0's report is
printed. The namespaces are removed on exit.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def tc(*args):
    subprocess.run(["tc", *args], capture_output=True, text=True, check=True, timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks", default="2", help="ranks per host: one count for all, or one per host (2,2,1)")
    ap.add_argument("--rate", default="1gbit",
                    help="tc rate of each host link, each direction: one for all, or one per host (none: unshaped)")
    ap.add_argument("--queue", default="10ms",
                    help="tbf latency: how long a packet may queue (long queues delay the other direction's ACKs)")
    ap.add_argument("--port", type=int, default=29640)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    counts, rates = args.ranks.split(","), args.rate.split(",")
    if len(counts) > 1:
        args.hosts = len(counts)
    counts = [int(c) for c in (counts * args.hosts if len(counts) == 1 else counts)]
    rates = rates * args.hosts if len(rates) == 1 else rates
    if len(rates) != args.hosts or min(counts) < 1:
        ap.error(f"--ranks and --rate name {len(counts)} and {len(rates)} hosts; --hosts is {args.hosts}")
    tag = secrets.token_hex(2)
    hub = f"clhub{tag}"
    ns = [f"clh{i}{tag}" for i in range(args.hosts)]
    made, procs = [], []
    # A SIGTERM or SIGHUP (a timeout, a closed terminal) unwinds as an exit does: the
    # runs are stopped and the namespaces removed, not left behind with the hosts' addresses.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    try:
        # A hub namespace with a bridge: every host's veth ends there, so host links are
        # separate (each shaped on its own) and any host reaches any other.
        ip("netns", "add", hub)
        made.append(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for i, n in enumerate(ns):
            ip("netns", "add", n)
            made.append(n)
            a, b = f"ch{i}{tag}", f"cb{i}{tag}"
            ip("link", "add", a, "type", "veth", "peer", "name", b)
            ip("link", "set", a, "netns", n)
            ip("link", "set", b, "netns", hub)
            ip("-n", n, "addr", "add", f"198.51.100.{i + 1}/24", "dev", a)
            ip("-n", n, "link", "set", a, "up")
            ip("-n", n, "link", "set", "lo", "up")
            ip("-n", hub, "link", "set", b, "master", "br0")
            ip("-n", hub, "link", "set", b, "up")
            if rates[i] != "none":  # the host's uplink (its egress) and downlink (the hub's egress to it)
                for where, dev in ((n, a), (hub, b)):
                    tc("-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rates[i], "burst", "256kb",
                       "latency", args.queue)
        for i, n in enumerate(ns):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=f"ch{i}{tag}", PYTHONUNBUFFERED="1")
            env.pop("MASTER_ADDR", None)
            env.pop("MASTER_PORT", None)
            cmd = ["ip", "netns", "exec", n, sys.executable, "-m", "torch.distributed.run", "--nnodes",
                   str(args.hosts), "--nproc_per_node", str(counts[i]), "--node_rank", str(i), "--master_addr",
                   "198.51.100.1", "--master_port", str(args.port), "-m", "commlab.allreduce_bench", "--quiet",
                   *bench]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        rc = 0
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=args.timeout)
            rc = rc or p.returncode
            if i == 0 or p.returncode:
                print("\n".join(line for line in out.splitlines() if not line.startswith(("W1", "[W"))))
        if len(set(counts)) == 1 and len(set(rates)) == 1:
            print(f"# emulated: {args.hosts} hosts x {counts[0]} ranks, each host link {rates[0]} each way (tc tbf)")
        else:
            print(f"# emulated: hosts of {','.join(map(str, counts))} ranks, host links {','.join(rates)} each way "
                  "(tc tbf)")
        return rc
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.terminate()  # torchrun stops its ranks (it gives them 30 s)
        for p in running:
            try:
                p.communicate(timeout=45)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
        for n in made:
            ip("netns", "del", n, check=False)


if __name__ == "__main__":
    sys.exit(main())
