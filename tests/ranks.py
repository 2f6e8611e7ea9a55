"""Run a function on N local ranks (gloo over loopback) with a hard deadline.

Ranks are spawned once per world size and reused across tests (importing torch
N times per test would dominate the suite on 2 cores). A test that fails or times out
retires its pool, so the next test starts from fresh processes. A failing rank's
traceback, or the list of ranks that never answered, is the test's error message.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback


class RankFailure(AssertionError):
    pass


def _rank_main(rank, world_size, store, inq, outq, pg_timeout_s, env):
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import faulthandler
    import signal

    # A rank that never answers is asked for its stacks (SIGUSR1) before it is killed.
    faulthandler.register(signal.SIGUSR1, file=open(_stacks_path(store, rank), "w"), all_threads=True)
    import torch
    import torch.distributed as dist

    # Ranks share 2 cores here: intra-op threads would only fight each other.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        outq.put((rank, "ready", None))
    except BaseException:
        outq.put((rank, "error", traceback.format_exc()))
        return
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outq.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:
            outq.put((rank, "error", traceback.format_exc()))
    try:
        from commlab import launch

        launch.leave(together=False)  # peers may be gone already: no barrier
    except Exception:
        pass


def _stacks_path(store: str, rank: int) -> str:
    return f"{store}.stacks{rank}"


class RankPool:
    def __init__(self, world_size: int, *, pg_timeout_s: float = 30.0, start_timeout_s: float = 120.0, env=None):
        self.world_size = world_size
        self.broken = False
        self._dir = tempfile.mkdtemp(prefix="commlab-ranks-")
        ctx = mp.get_context("spawn")
        self._inq = [ctx.Queue() for _ in range(world_size)]
        self._outq = ctx.Queue()
        env = dict(env or {})
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, os.path.join(self._dir, "store"), self._inq[r], self._outq, pg_timeout_s, env),
                daemon=True,
                name=f"commlab-rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start", start_timeout_s, expect="ready")

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """fn(rank, world_size, *args, **kwargs) on every rank; returns results by rank."""
        if self.broken:
            raise RuntimeError("rank pool is retired")
        for q in self._inq:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "fn"), timeout, expect="ok")

    def run_faulty(self, fn, *args, timeout: float = 120.0, **kwargs) -> dict:
        """For fault tests, where some rank is meant to die or fail: waits up to timeout
        for every rank, returns {rank: ("ok"|"error", payload) or ("missing", alive)}
        and retires the pool."""
        for q in self._inq:
            q.put((fn, args, kwargs))
        out: dict = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = self._outq.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for r, p in enumerate(self._procs) if r not in out):
                    break
                continue
            out[rank] = (status, payload)
        for r in range(self.world_size):
            out.setdefault(r, ("missing", self._procs[r].is_alive()))
        self.close()
        return out

    def _collect(self, what: str, timeout: float, expect: str) -> list:
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            if errors:
                # Peers of a failed rank usually block until the group's timeout; their
                # errors add nothing, the first traceback is the story.
                left = min(left, 2.0)
            try:
                rank, status, payload = self._outq.get(timeout=max(left, 0.01))
            except queue.Empty:
                if left <= 0.01 or errors:
                    break
                continue
            (results if status == expect else errors)[rank] = payload
        if errors or len(results) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in results and r not in errors]
            alive = {r: self._procs[r].is_alive() for r in missing}
            stacks = self._stacks(r for r in missing if alive[r])
            self.close()
            lines = [f"{what} on {self.world_size} ranks failed"]
            if missing:
                lines.append(
                    "no answer within %.0fs from rank(s) %s (alive: %s)" % (timeout, missing, alive)
                )
            for r, text in stacks.items():
                lines.append(f"--- rank {r} (no answer): where it is ---\n{text}")
            for r in sorted(errors):
                lines.append(f"--- rank {r} ---\n{errors[r]}")
            raise RankFailure("\n".join(lines))
        return [results[r] for r in range(self.world_size)]

    def _stacks(self, ranks) -> dict:
        """Every thread's stack of each given (live) rank, through faulthandler."""
        import signal

        out = {}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)
            try:
                with open(_stacks_path(os.path.join(self._dir, "store"), r)) as f:
                    out[r] = f.read()[-6000:]
            except OSError:
                pass
        return out

    def close(self) -> None:
        if self.broken:
            return
        self.broken = True
        for q in self._inq:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)
