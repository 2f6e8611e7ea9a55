"""The one local launcher every tool uses to start N ranks on loopback (RankPool,
run_once): the CLI's --world-size, compare's modes, doctor's smoke test, the tests' rank
pools and the bench's group. A pool's ranks are forked from one server process that
imported torch once, watch a lifeline to the process that started them, and leave
their stacks behind when they do not answer."""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import multiprocessing.util  # noqa: F401 - registers its exit handler on import: _close_open must come after
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Callable

import torch
import torch.distributed as dist

from commlab.measure.launch import free_port, leave


class RankFailure(AssertionError):
    """Some rank of a pool failed or never answered; the message holds its traceback or
    its stacks."""


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok" | "error" | "missing"
    result: object = None  # "ok": the function's value
    error: str = ""  # "error": the traceback; "missing": the rank's stacks, when it could give them
    error_type: str = ""  # "error": the exception's class name
    alive: bool = False  # "missing": whether the process still ran


def _stacks_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"stacks{rank}")


# Ranks are forked from one server process that imported torch once (multiprocessing's
# forkserver): a spawned rank spent ~1.7 s of CPU importing torch, and the tests start
# hundreds of ranks on two cores. A forked rank starts from the server's state, so it is
# given what a spawned one inherited: the environment as it is now (set before commlab is
# imported there: some settings are read at import) and this process's stdout and stderr
# as they are now (pytest swaps them per test). What else the server imports is the
# caller's choice (preload()): DistributedDataParallel's constructor imports
# torch._dynamo, 0.85 s of CPU per rank that builds one, which compare's ranks get
# imported once; the bench's ranks never need it, and the server's import of it sat
# before every bench's first rank (0.9 s of a 3.8 s two-rank run).
_PRELOAD = ["torch", "torch.distributed"]


def preload(*modules: str) -> None:
    """Modules the ranks' server imports once, for every rank forked after: effective only
    before this process's first rank starts (the server starts then, and stays)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


_BOOT = """
import os
os.environ.clear()
os.environ.update(env)
for target, inherited in zip((1, 2), stdio):
    fd = inherited.detach()
    os.dup2(fd, target)
    os.close(fd)
from commlab.measure.pools import _rank_main
_rank_main(*args, lifeline=lifeline[0].detach())
"""


class _Stdio:
    """This process's stdout and stderr, pickled as descriptors the started process
    receives (multiprocessing's DupFd); unpickled as a plain tuple of them, so nothing
    of commlab is imported before the environment is in place."""

    def __reduce__(self):

        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


class _Lifeline:
    """The read end of a pipe whose only writer is the process that started the pool: it
    reads end-of-file when that process is gone, however it died. (Not the parent pid:
    a rank's parent is the fork server, which every rank keeps alive.) Pickled, like
    _Stdio, as a plain 1-tuple of the descriptor the started process receives."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):

        return tuple, ((reduction.DupFd(self.fd),),)


def _watch_lifeline(fd: int, rank: int, workdir: str) -> None:
    """Ends this rank once the process that started it is gone: killed (a scheduler's
    SIGTERM, the OOM killer), it cannot tell its ranks, which would otherwise train on for
    minutes with nobody to report to, holding their working directory."""

    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    shutil.rmtree(workdir, ignore_errors=True)
    os.write(2, f"commlab: rank {rank}: the process that started it is gone; exiting\n".encode())
    os._exit(1)


def _context():

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def warm() -> None:
    """Starts the ranks' server now, with what preload() named so far: it imports torch on
    another core while this process goes on, not when its first rank is wanted."""
    _context()
    forkserver.ensure_running()


def _rank_main(rank: int, world_size: int, workdir: str, port: int, backend: str | None, pg_timeout_s: float,
               threads: int, inq, outq, lifeline: int) -> None:

    gc.freeze()  # the server's imports, as a CLI's (commlab.core.cli.run): never walked again
    threading.Thread(target=_watch_lifeline, args=(lifeline, rank, workdir), daemon=True,
                     name="commlab-lifeline").start()

    # A rank that never answers is asked for its stacks (SIGUSR1) before it is killed.
    faulthandler.register(signal.SIGUSR1, file=open(_stacks_path(workdir, rank), "w"), all_threads=True)
    torch.set_num_threads(threads)  # ranks share the cores: intra-op threads would only fight
    try:
        if backend is not None:
            _init_pool_group(rank, world_size, workdir, backend, pg_timeout_s)
        outq.put((rank, "ready", None))
    except BaseException:
        outq.put((rank, "error", (traceback.format_exc(), "setup")))
        return
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outq.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:
            outq.put((rank, "error", (traceback.format_exc(), type(e).__name__)))
    leave(together=False)  # peers may be gone already: no barrier


def _init_pool_group(rank: int, world_size: int, workdir: str, backend: str, pg_timeout_s: float) -> None:
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))


class RankPool:
    """The one local launcher: ranks as fresh processes on this host (forked from a server
    that imported torch and what preload() added, nothing of commlab; see _BOOT), each with
    torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT on loopback) and, unless backend is None, a process group already up;
    they run the functions sent to them, fn(rank, world_size, *args), and send back the
    value or the traceback. A rank that never answers is reported with its stacks.

    Tests and the bench keep one pool per world size (importing torch in fresh processes
    for every call would dominate on 2 cores); compare, doctor and the CLI take fresh
    processes for each job (run_once). `spawn` picks which ranks are spawned: the bench
    spawns 1..N-1 and this process joins as rank 0 (local_init)."""

    def __init__(self, world_size: int, *, backend: str | None = "gloo", pg_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0, env: dict | None = None, spawn=None, threads: int = 1):
        self.world_size = world_size
        self.broken = False
        self.backend, self.pg_timeout_s = backend, pg_timeout_s
        self._dir = tempfile.mkdtemp(prefix="commlab-ranks-")
        self._port = free_port()
        self._ranks = list(range(world_size) if spawn is None else spawn)
        ctx = _context()
        self._inq = {r: ctx.Queue() for r in self._ranks}
        self._outq = ctx.Queue()
        life_r, self._lifeline = os.pipe()  # this process alone holds the write end
        common = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._port),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), COMMLAB_SPAWNED="1")
        common.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._procs = {
            r: ctx.Process(target=exec, args=(_BOOT, {
                "env": dict(common, RANK=str(r), LOCAL_RANK=str(r)), "stdio": _Stdio(), "lifeline": _Lifeline(life_r),
                "args": (r, world_size, self._dir, self._port, backend, pg_timeout_s, threads, self._inq[r],
                         self._outq)}), daemon=True, name=f"commlab-rank{r}")
            for r in self._ranks
        }
        try:
            for p in self._procs.values():
                p.start()
        except BaseException:  # the ranks already started, the lifeline, the directory go with the error
            os.close(life_r)
            self.close()
            raise
        os.close(life_r)
        _open.add(self)
        self._start_timeout_s = start_timeout_s
        if len(self._ranks) == world_size:
            self._collect("start", start_timeout_s, expect="ready")

    def local_init(self, rank: int) -> None:
        """This process joins the pool's group as `rank` (one the pool did not spawn)."""
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _init_pool_group(rank, self.world_size, self._dir, self.backend, self.pg_timeout_s)
        self._collect("start", self._start_timeout_s, expect="ready")

    def pid(self, rank: int) -> int:
        """The process id of a spawned rank (fault drills signal it)."""
        return self._procs[rank].pid

    def submit(self, fn: Callable, *args, **kwargs) -> None:
        """Send fn(rank, world_size, *args, **kwargs) to every spawned rank."""
        if self.broken:
            raise RuntimeError("rank pool is retired")
        for q in self._inq.values():
            q.put((fn, args, kwargs))

    def collect(self, what: str = "fn", timeout: float | None = 120.0) -> list:
        """The submitted function's values by spawned rank; raises RankFailure (and
        retires the pool) when a rank failed or did not answer in time."""
        return self._collect(what, timeout, expect="ok")

    def run(self, fn: Callable, *args, timeout: float | None = 120.0, **kwargs) -> list:
        self.submit(fn, *args, **kwargs)
        return self.collect(getattr(fn, "__name__", "fn"), timeout)

    def outcomes(self, fn: Callable, *args, timeout: float | None = 120.0, **kwargs) -> dict[int, Outcome]:
        """For jobs where a rank may fail or die: waits up to timeout for every rank,
        returns each rank's Outcome (never raises for a rank's failure) and retires
        the pool."""
        self.submit(fn, *args, **kwargs)
        out = self._gather("ok", timeout, stop_after_error=False)
        self.close()
        return out

    def _collect(self, what: str, timeout: float | None, expect: str) -> list:
        out = self._gather(expect, timeout, stop_after_error=True)
        if any(o.status != "ok" for o in out.values()):
            self.close()
            raise RankFailure(f"{what} on {self.world_size} ranks failed (deadline {timeout}s)\n"
                              + report_failures(out))
        return [out[r].result for r in self._ranks]

    def _gather(self, expect: str, timeout: float | None, stop_after_error: bool) -> dict[int, Outcome]:
        """Every spawned rank's Outcome for the message `expect` ("ready" or "ok"): what it
        sent by the deadline, else "missing" with its stacks. With stop_after_error it
        waits only 2 s more once a rank failed: peers of a failed rank usually block
        until the group's timeout, and the first traceback is the story."""
        out: dict[int, Outcome] = {}
        end = None if timeout is None else time.monotonic() + timeout
        while len(out) < len(self._ranks):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                rank, status, payload = self._outq.get(timeout=0.2 if left is None else min(left, 0.2))
            except queue.Empty:
                if all(not p.is_alive() for r, p in self._procs.items() if r not in out):
                    break
                continue
            if status == expect:
                out[rank] = Outcome("ok", result=payload)
                continue
            out[rank] = Outcome("error", error=payload[0], error_type=payload[1])
            if stop_after_error:
                grace = time.monotonic() + 2.0
                end = grace if end is None else min(end, grace)
        missing = [r for r in self._ranks if r not in out]
        stacks = self._stacks([r for r in missing if self._procs[r].is_alive()])
        for r in missing:
            out[r] = Outcome("missing", error=stacks.get(r, ""), alive=self._procs[r].is_alive())
        return out

    def _stacks(self, ranks) -> dict[int, str]:
        """Every thread's stack of each given (live) rank, through faulthandler."""

        out = {}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)
            try:
                with open(_stacks_path(self._dir, r)) as f:
                    out[r] = f.read()[-6000:]
            except OSError:
                pass
        return out

    def close(self) -> None:

        if self.broken:
            return
        self.broken = True
        _open.discard(self)
        for q in self._inq.values():
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - a closed queue: the rank is gone anyway
                pass
        deadline = time.monotonic() + 5
        started = [p for p in self._procs.values() if p.pid is not None]
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(5)
        os.close(self._lifeline)
        shutil.rmtree(self._dir, ignore_errors=True)


_open: set = set()  # pools not closed yet


@atexit.register  # after multiprocessing.util's own (imported above), so it runs first
def _close_open() -> None:
    """A pool its process leaves open is closed as the interpreter exits: multiprocessing's
    exit handler would terminate the ranks outright, leaving the pool's directory behind."""
    for pool in list(_open):
        pool.close()


def run_once(world_size: int, fn: Callable, *args, backend: str | None = None, timeout: float | None = None,
             env: dict | None = None, threads: int = 1, pg_timeout_s: float = 30.0, **kwargs) -> dict[int, Outcome]:
    """Fresh processes for one job (a compare mode, doctor's smoke test, the CLI's
    --world-size): spawn, run fn on every rank, collect every rank's Outcome, close.
    With backend None the function starts its own process group (env://)."""
    pool = RankPool(world_size, backend=backend, env=env, threads=threads, pg_timeout_s=pg_timeout_s)
    return pool.outcomes(fn, *args, timeout=timeout, **kwargs)


def report_failures(outcomes: dict[int, Outcome]) -> str:
    """One readable block for the ranks that did not finish (empty when all did)."""
    lines = []
    for r, o in sorted(outcomes.items()):
        if o.status == "error":
            lines.append(f"--- rank {r} failed ---\n{o.error.rstrip()}")
        elif o.status == "missing":
            lines.append(f"--- rank {r} did not finish (alive: {o.alive}) ---" + (f"\n{o.error}" if o.error else ""))
    return "\n".join(lines)
