"""Fault drills: one rank of a job fails in a chosen way while every rank loops over
all-reduces; every other rank must raise a commlab error within seconds, never return
wrong data, never wait out the group's timeout. The README's fault table is its output.

    python -m commlab.diagnostics.drill --world-size 3
    python -m commlab.diagnostics.drill --algorithms ring,hier --faults sigkill,sigstop --hosts 2

The faults, on rank 1, `--delay` seconds into the loop:
  sigkill        the process is killed: no word to anyone, its sockets close
  sigint         Ctrl-C, wherever it lands (a wait, a reduction, the caller's code);
                 the rank then dies of the KeyboardInterrupt, as a script does
  exception      the rank's own code raises between calls and the process dies of it
  error-in-call  an error inside commlab's call on that rank (a point-to-point step
                 raises; algorithms without one show "-")
  sigstop        the process freezes, nothing closes (a hung host or a dead link):
                 peers name it after COMMLAB_PEER_TIMEOUT seconds without a heartbeat
                 (the drill kills it 5 s later: a peer that raised only then shows
                 "not noticed")
  sigstop-between  the same, between two calls: its peers wait for it in the next
                 call's agreement (not in the default table)
Each cell: seconds from the fault to the last surviving rank's error.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.core.cli import run
from commlab.core.errors import CommlabError
from commlab.core.reduction import Op
from commlab.measure.pools import RankPool
from commlab.measure.specs import SPECS, check_input
from commlab.transports import p2p
from commlab.transports.link import peer_timeout

FAULTS = ("sigkill", "sigint", "exception", "error-in-call", "sigstop")
EXTRA_FAULTS = ("sigstop-between",)
VICTIM = 1


def _arm(fault: str, at: float) -> None:
    me = os.getpid()
    later = max(0.0, at - time.monotonic())
    if fault == "sigint":  # a drill started in the background inherits SIGINT ignored: Ctrl-C as in a terminal
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if fault in ("sigkill", "sigint", "sigstop"):
        sig = {"sigkill": signal.SIGKILL, "sigint": signal.SIGINT, "sigstop": signal.SIGSTOP}[fault]
        threading.Timer(later, os.kill, (me, sig)).start()
    elif fault == "error-in-call":

        def failing(real):
            def step(self, *args, **kwargs):
                if time.monotonic() >= at:
                    raise RuntimeError("injected: a step failed on this rank")
                return real(self, *args, **kwargs)
            return step

        p2p.P2P.post = failing(p2p.P2P.post)
        p2p.P2P.collective = failing(p2p.P2P.collective)  # builtin: gloo's all-reduce


def _call_of(collective: str, algorithm: str, p: int):
    """One call of the collective through its spec (measure/specs.py) on 1 MiB, nccl-tests'
    size (several steps, several shared-memory pieces), returning whether every element
    this rank holds afterwards is what it must: wrong data is a drill's failure too."""
    spec = SPECS[collective]
    rank, count = dist.get_rank(), spec.count(1 << 20, 4, p)
    first = check_input(rank, count, torch.float32, Op.SUM, "cpu")
    want = spec.want(rank, p, count, torch.float32, Op.SUM, "cpu")
    inp = first.clone()
    out = torch.empty(spec.output(count, p)) if spec.output is not None else inp

    def call():
        inp.copy_(first)  # in place for all-reduce and broadcast: the input is the result
        if out is not inp:
            out.zero_()
        spec.run(algorithm, out, inp, Op.SUM)
        return torch.equal(out, want)
    return call


def _release_frozen(key: str, p: int, victim_pid: int) -> None:
    """A survivor has named the frozen rank. Once every survivor has, nothing is left to
    learn from it: the last of them kills it, where the drill's timer waited out the peer
    timeout and 5 s more (every sigstop drill took 7.5 s where its survivors were done in
    2.5). The timer stays, for survivors that never raise."""
    try:
        if dist.distributed_c10d._get_default_store().add(key, 1) == p - 1:
            _kill(victim_pid)
    except Exception:  # noqa: BLE001 - the store gone with a failed group: the timer kills it
        pass


def _rank(rank: int, p: int, algorithm: str, fault: str, delay: float, host_of, collective: str = "all_reduce",
          victim_pid: int | None = None, key: str = "") -> dict:
    if host_of:
        os.environ["COMMLAB_HOST_ID"] = f"h{host_of[rank]}"
    call = _call_of(collective, algorithm, p)
    call()  # set-up is not what is drilled
    dist.barrier()
    at = time.monotonic() + delay
    if rank == VICTIM:
        _arm(fault, at)
    calls = 0
    try:
        while time.monotonic() < at + 60:
            if rank == VICTIM and fault == "exception" and time.monotonic() >= at:
                raise RuntimeError("the rank's own code failed")
            if rank == VICTIM and fault == "sigstop-between" and time.monotonic() >= at:
                os.kill(os.getpid(), signal.SIGSTOP)
            if not call():
                return {"type": "WRONG DATA", "after": time.monotonic() - at, "calls": calls}
            calls += 1
    except BaseException as e:  # noqa: BLE001 - reported, or the rank dies of it like a script
        if rank == VICTIM:
            sys.excepthook(type(e), e, e.__traceback__)
            os._exit(1)

        out = {"type": type(e).__name__, "commlab": isinstance(e, CommlabError), "msg": str(e),
               "after": time.monotonic() - at, "calls": calls}
        if fault.startswith("sigstop") and victim_pid is not None:
            _release_frozen(key, p, victim_pid)
        return out
    return {"type": None, "after": None, "calls": calls}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it had exited (a set-up that failed)
        pass


def applies(algorithm: str, fault: str, hosts: int = 1) -> bool:
    """error-in-call injects into a point-to-point step: shared-memory algorithms have
    none; shared memory alone does not span hosts."""
    if hosts > 1 and algorithm in ("shm", "shm_ps"):
        return False
    return not (fault == "error-in-call" and algorithm in ("shm", "shm_ps", "auto", "hier", "ipc"))


def drill(algorithm: str, fault: str, world_size: int = 3, delay: float = 0.5, hosts: int = 1,
          pg_timeout_s: float = 60.0, collective: str = "all_reduce") -> dict:
    """Run one drill in fresh processes; returns every survivor's outcome and `last_s`,
    the time from the fault to the last survivor's error (None if one never raised)."""

    host_of = [r * hosts // world_size for r in range(world_size)] if hosts > 1 else None
    pool = RankPool(world_size, pg_timeout_s=pg_timeout_s)
    killed_s = None
    timer = None
    if fault.startswith("sigstop"):  # the frozen rank is killed once its peers had every chance to name it
        killed_s = peer_timeout() + 5
        timer = threading.Timer(delay + killed_s, _kill, (pool.pid(VICTIM),))
        timer.start()
    res = pool.outcomes(_rank, algorithm, fault, delay, host_of, collective, pool.pid(VICTIM),
                        f"commlab/drill/{os.urandom(8).hex()}/named", timeout=delay + 75)
    if timer is not None:
        timer.cancel()
    survivors = {r: (res[r].result if res[r].status == "ok" else {"type": "NO ANSWER", "error": res[r].error})
                 for r in range(world_size) if r != VICTIM}
    raised = [o for o in survivors.values() if o.get("after") is not None and o["type"] not in (None, "WRONG DATA")]
    last = max(o["after"] for o in raised) if len(raised) == len(survivors) else None
    # A frozen rank's peers that raised only once the drill killed it did not notice the freeze.
    noticed = last is not None and (killed_s is None or last < killed_s - 1.0)
    return {"algorithm": algorithm, "collective": collective, "fault": fault, "world_size": world_size, "hosts": hosts, "last_s": last,
            "noticed": noticed,
            "survivors": survivors, "same_text": len({o.get("msg") for o in survivors.values()}) == 1}


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(prog="python -m commlab.diagnostics.drill", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--collective", default="all_reduce", choices=algorithms.COLLECTIVES)
    ap.add_argument("--algorithms", help="default: every CPU algorithm of the collective")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--hosts", type=int, default=1, help="emulated hosts (COMMLAB_HOST_ID), ranks split in order")
    ap.add_argument("--delay", type=float, default=0.5)
    a = ap.parse_args(argv)
    a.algorithms = a.algorithms or ",".join(algorithms.registry(a.collective).for_device("cpu"))
    faults = a.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS + EXTRA_FAULTS))
    if unknown:
        ap.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS + EXTRA_FAULTS)}")
    print(f"# seconds from the fault on rank {VICTIM} to the last of the other {a.world_size - 1} ranks' error "
          f"({a.world_size} ranks, {a.hosts} host(s), COMMLAB_PEER_TIMEOUT={os.environ.get('COMMLAB_PEER_TIMEOUT', 5)})")
    print("| algorithm | " + " | ".join(faults) + " |")
    print("|---|" + "---|" * len(faults))
    bad = 0
    for alg in a.algorithms.split(","):
        cells = []
        for fault in faults:
            if not applies(alg, fault, a.hosts):
                cells.append("-")
                continue
            got = drill(alg, fault, a.world_size, a.delay, a.hosts, collective=a.collective)
            if got["last_s"] is None:
                bad += 1
                kinds = sorted({str(o["type"]) for o in got["survivors"].values()})
                cells.append("FAIL " + "/".join(kinds))
            elif not got["noticed"]:  # a freeze seen only once the drill killed the frozen rank
                cells.append(f"not noticed (killed at {got['last_s']:.0f})")
            else:
                cells.append(f"{got['last_s']:.2f}")
        print(f"| {alg} | " + " | ".join(cells) + " |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    run(main)
