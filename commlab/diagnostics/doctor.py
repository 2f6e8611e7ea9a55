"""Checks for what the seed's troubleshooting section lists (NaN loss, DP OOM on GPU 0,
DDP hangs), each a PASS/WARN/FAIL line with a fix.

    python -m commlab.doctor --world-size 4
    torchrun --nnodes 2 --nproc_per_node 4 ... -m commlab.doctor   # the hosts it sees, hier's path
    # inside a torchrun job:
    commlab.doctor.check_data(loader)   # identical batches on every rank? (the seed's NaN-loss cause)
    commlab.doctor.check_grads(model)   # which rank and parameter has a non-finite gradient
"""
from __future__ import annotations

import argparse
import hashlib
import os
import socket
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import commlab
from commlab.algorithms.all_reduce import auto, hier
from commlab.core import groups
from commlab.core.cli import run
from commlab.measure import launch, pools
from commlab.transports import ipc
from commlab.transports.setup import by_host, gather, host_id

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    status: str
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}" + (f"\n       fix: {self.fix}" if self.fix and self.status != PASS else "")


def check_backends() -> list[Check]:
    out = [Check(PASS if dist.is_gloo_available() else FAIL, "backend gloo",
                 "available" if dist.is_gloo_available() else "missing", "install a torch build with distributed support")]
    if torch.cuda.is_available():
        if dist.is_nccl_available():
            v = torch.cuda.nccl.version()
            out.append(Check(PASS, "backend nccl", "NCCL " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))
                             + "; every node must run the same version (seed: DDP hangs)"))
        else:
            out.append(Check(FAIL, "backend nccl", "CUDA present but NCCL missing", "install a CUDA build of torch"))
    else:
        out.append(Check(PASS, "backend nccl", "no CUDA device: gloo serves CPU training"))
    return out


def check_gpus() -> list[Check]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return [Check(PASS, "GPUs", "none visible (CPU-only machine or CUDA_VISIBLE_DEVICES empty)")]
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    out = [Check(PASS, "GPUs", f"{n}: " + ", ".join(names))]
    if n > 1:
        rows, missing = [], 0
        for i in range(n):
            row = ""
            for j in range(n):
                ok = i == j or torch.cuda.can_device_access_peer(i, j)
                missing += not ok
                row += "X" if i == j else ("1" if ok else "0")
            rows.append(row)
        out.append(Check(PASS if missing == 0 else WARN, "GPU P2P", "matrix " + " ".join(rows),
                         "without P2P (e.g. RTX 4090) intra-node traffic goes through host memory: "
                         "prefer DDP with NCCL over DP, whose GPU 0 then copies everything through the host"))

        path, why = ipc.choose_path([ipc.device_facts(torch.device("cuda", i)) for i in range(n)])
        out.append(Check(PASS, "commlab ipc", f"one process per GPU takes the {path} path: {why}"))
    out.append(_nvlink(n))
    return out


def _nvlink(n: int) -> Check:
    try:
        # optional (nvidia-ml-py): only where NVML is asked
        import pynvml
    except ImportError:
        return Check(WARN, "NVLink", "unknown", "pip install nvidia-ml-py to query NVLink")
    try:
        pynvml.nvmlInit()
        links = 0
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for link in range(18):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
        return Check(PASS, "NVLink", f"{links} active link(s)" if links else "none (PCIe only)")
    except Exception as e:  # noqa: BLE001 - informational
        return Check(WARN, "NVLink", f"NVML query failed: {e}")


def check_shm(min_bytes: int = 1 << 30) -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return Check(WARN, "/dev/shm", f"not available ({e})", "shared-memory transports (shm, NCCL's) need it")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    if free < min_bytes:
        return Check(WARN, "/dev/shm", detail, "containers default to 64 MB: run docker with --shm-size=8g (or --ipc=host)")
    return Check(PASS, "/dev/shm", detail)


def check_rendezvous() -> list[Check]:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr and not port:
        return [Check(PASS, "MASTER_ADDR/MASTER_PORT", "not set (torchrun sets them; set both for manual launches)")]
    out = []
    try:
        infos = socket.getaddrinfo(addr or "", None)
        out.append(Check(PASS, "MASTER_ADDR", f"{addr} resolves to {infos[0][4][0]}"))
    except (socket.gaierror, UnicodeError) as e:
        return [Check(FAIL, "MASTER_ADDR", f"{addr!r} does not resolve ({e})", "use an IP address or a resolvable host name")]
    try:
        p = int(port or "")
    except ValueError:
        return out + [Check(FAIL, "MASTER_PORT", f"{port!r} is not a port number", "export MASTER_PORT=29500")]
    in_job = "RANK" in os.environ and os.environ.get("RANK") != "0"
    with socket.socket() as s:
        s.settimeout(3)
        reachable = s.connect_ex((addr, p)) == 0
    if reachable:
        out.append(Check(PASS, "MASTER_PORT", f"{addr}:{p} accepts connections (the rendezvous store is up)"))
    elif in_job:
        out.append(Check(FAIL, "MASTER_PORT", f"{addr}:{p} refuses connections from this rank",
                         "check the firewall and that rank 0 started; raise init_process_group(timeout=...)"))
    else:
        with socket.socket() as s:
            try:
                s.bind(("", p))
                out.append(Check(PASS, "MASTER_PORT", f"{p} is free for rank 0 to listen on"))
            except OSError as e:
                out.append(Check(FAIL, "MASTER_PORT", f"{p} cannot be bound ({e})", "pick another MASTER_PORT"))
    return out


# -- the host layout -----------------------------------------------------------------------------
def check_layout(group=None) -> Check:
    """Collective: the hosts this group's ranks are on (the identity shm and hier group
    by: hostname, boot, mount and network namespace), and the path `hier` and `auto`
    take on them."""

    info = groups.resolve(group)
    hosts = [[info.global_rank(r) for r in m]
             for m in by_host(gather(info, host_id(), "doctor", "grouping ranks by host"))]
    per_host = [len(m) for m in hosts]
    k = min(per_host)
    shown = "; ".join(f"host {i}: ranks {_ranges(m)}" for i, m in enumerate(hosts[:8]))
    detail = f"{len(hosts)} host(s), {info.size} ranks ({shown}{'; …' if len(hosts) > 8 else ''})"
    inter = hier._inter_name(len(hosts), 1 << 20)
    if len(hosts) == 1:
        path = "hier = shm on this host"
    elif k == 1 and max(per_host) == 1:
        path = f"hier = {inter} across the hosts (one rank per host: nothing to share on a host)"
    else:
        path = (f"hier: shm reduce-scatter on each host into {k} shard(s) -> {inter} all-reduce of each shard across "
                f"{len(hosts)} hosts ({k} at once, one per local index) -> shm all-gather")
        if max(per_host) > k:
            path += f"; hosts with more than {k} ranks reduce the whole tensor in shm, their extra ranks only gather"
    forced = auto._forced()
    pick = forced or auto.rule("cpu", per_host)
    detail += f"; {path}; auto on CPU tensors: {pick}" + (" (COMMLAB_ALGORITHM)" if forced else "")
    if any(m != list(range(m[0], m[0] + len(m))) for m in hosts):
        return Check(WARN, "host layout", detail, "ranks are not numbered host by host: flat ring and rhd then cross "
                     "host links at steps that would stay on a host (hier is unaffected); launch with torchrun, "
                     "which numbers ranks host by host")
    return Check(PASS, "host layout", detail)


def _ranges(ranks: list[int]) -> str:
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


# -- the all-reduce smoke test on local ranks ---------------------------------------------------
def _smoke_rank(rank: int, world: int) -> tuple[list[tuple[str, str | None, float]], Check]:
    """Every CPU algorithm once on this rank: (name, error or None, seconds); and the
    host layout."""

    layout = check_layout()
    out = []
    for name in commlab.algorithms.for_device("cpu"):
        t0 = time.perf_counter()
        try:
            x = torch.arange(1000, dtype=torch.float32) + rank
            commlab.all_reduce(x, algorithm=name)
            want = torch.arange(1000, dtype=torch.float32) * world + sum(range(world))
            status = None if torch.equal(x, want) else "wrong result"
        except Exception as e:  # noqa: BLE001 - reported as a FAIL line
            status = f"{type(e).__name__}: {e}"
        out.append((name, status, time.perf_counter() - t0))
    return out, layout


def smoke_test(world_size: int, timeout_s: float = 30.0) -> list[Check]:

    names = commlab.algorithms.for_device("cpu")
    outcomes = pools.run_once(world_size, _smoke_rank, backend="gloo", pg_timeout_s=timeout_s,
                               timeout=timeout_s * (len(names) + 1) + 60)
    return _verdicts(names, world_size, {r: o.result for r, o in outcomes.items() if o.status == "ok"}, "local ")


def _verdicts(names: list[str], world_size: int, got_by_rank: dict, where: str) -> list[Check]:
    results: dict[str, dict[int, tuple]] = {n: {} for n in names}
    for rank, (rows, _) in got_by_rank.items():
        for name, status, secs in rows:
            results[name][rank] = (status, secs)
    out = [got_by_rank[min(got_by_rank)][1]] if got_by_rank else []
    for name in names:
        got = results[name]
        missing = [r for r in range(world_size) if r not in got]
        errors = {r: s for r, (s, _) in got.items() if s}
        if missing or errors:
            detail = (f"ranks {missing} never finished; " if missing else "") + "; ".join(
                f"rank {r}: {e}" for r, e in sorted(errors.items()))
            out.append(Check(FAIL, f"all-reduce {name}", detail, "run with TORCH_DISTRIBUTED_DEBUG=DETAIL"))
        else:
            slowest = max(secs for _, secs in got.values())
            out.append(Check(PASS, f"all-reduce {name}",
                             f"{world_size} {where}ranks correct, {slowest * 1e3:.1f} ms (incl. setup)"))
    return out


# -- checks for a running job --------------------------------------------------------------------
def _digest(obj) -> str:
    h = hashlib.sha1()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().cpu()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            h.update(_digest(o).encode())
    elif isinstance(obj, dict):
        for k in sorted(obj):
            h.update(str(k).encode() + _digest(obj[k]).encode())
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()


_last_first_batch: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # sampler -> (epoch, digest)


def check_data(loader, epochs: int = 1, group=None) -> Check:
    """Collective. Compares each rank's first batch: identical batches on every rank mean
    the DistributedSampler is missing (every rank trains on the same data: the seed's
    NaN-loss / no-speedup cause).

    Call it once per epoch, after sampler.set_epoch(epoch) where your loop has it: a
    shuffling DistributedSampler whose first batch repeats the previous call's while its
    epoch did not advance means set_epoch() is missing. With epochs >= 2 it also takes
    that many passes, advancing the sampler's epoch between them as a correct loop does
    (and restoring it), and checks that the order changes: a sampler that ignores
    set_epoch() repeats it."""

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    sampler = getattr(loader, "sampler", None)
    shuffling = isinstance(sampler, DistributedSampler) and sampler.shuffle
    first = _digest(next(iter(loader)))
    passes = [first]
    if epochs >= 2 and shuffling:
        start = sampler.epoch
        try:
            for k in range(1, epochs):
                sampler.set_epoch(start + k)
                passes.append(_digest(next(iter(loader))))
        finally:
            sampler.set_epoch(start)
    gathered = [first]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, first, group=group)
    if world > 1 and len(set(gathered)) == 1:
        return Check(WARN, "data", f"all {world} ranks received the same first batch",
                     "use DistributedSampler(dataset) in the DataLoader (and call sampler.set_epoch(epoch) every epoch)")
    if len(passes) >= 2 and len(set(passes)) < len(passes):
        return Check(WARN, "data", f"rank {rank}'s sampler repeats its order when its epoch advances",
                     "use a sampler that reshuffles per epoch (DistributedSampler(shuffle=True) with set_epoch)")
    if shuffling:
        before = _last_first_batch.get(sampler)
        _last_first_batch[sampler] = (sampler.epoch, first)
        if before is not None and before == (sampler.epoch, first):
            return Check(WARN, "data", f"rank {rank} saw the same first batch as at the previous check, and its "
                         f"sampler's epoch is still {sampler.epoch}",
                         "call loader.sampler.set_epoch(epoch) at the start of every epoch")
    return Check(PASS, "data", f"{world} rank(s) receive different batches")


def check_grads(model: torch.nn.Module, group=None) -> Check:
    """Collective: names every rank and parameter whose gradient has a NaN or Inf."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    found = {rank: bad}
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        lists = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, bad, group=group)
        found = {dist.get_global_rank(group or dist.group.WORLD, r): b for r, b in enumerate(lists)}
    offenders = {r: b for r, b in found.items() if b}
    if not offenders:
        return Check(PASS, "gradients", "all finite on every rank")
    detail = "; ".join(f"rank {r}: {', '.join(b[:5])}{' …' if len(b) > 5 else ''}" for r, b in sorted(offenders.items()))
    return Check(FAIL, "gradients", "non-finite gradients on " + detail,
                 "lower the learning rate or use GradScaler with AMP; check that rank's data; "
                 "torch.autograd.set_detect_anomaly(True) finds the op")


def run_all(world_size: int, timeout_s: float) -> list[Check]:
    checks = check_backends() + check_gpus() + [check_shm()] + check_rendezvous()
    if world_size > 0:
        checks += smoke_test(world_size, timeout_s)
    return checks


def in_job(timeout_s: float) -> list[Check] | None:
    """Under a launcher (torchrun, mpiexec, srun; any number of hosts): the host layout and every CPU algorithm on
    the job's ranks; rank 0 gets the checks, the others None."""

    launch.init(launch.detect(), "gloo", timeout_s, "cpu")
    try:
        mine = _smoke_rank(dist.get_rank(), dist.get_world_size())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank():
            return None
        return check_backends() + [check_shm()] + _verdicts(commlab.algorithms.for_device("cpu"),
                                                              dist.get_world_size(), dict(enumerate(every)), "")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2, help="local ranks for the all-reduce smoke test (0: skip); "
                    "under a launcher (torchrun, mpiexec, srun) the job's ranks, on every host, are used instead")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds each collective may take")
    args = ap.parse_args(argv)
    how = launch.detect_for_cli()
    if how is None:
        return 2
    if how.kind != "single":
        checks = in_job(args.timeout)
        if checks is None:
            return 0
    else:
        checks = run_all(args.world_size, args.timeout)
    for c in checks:
        print(c.line(), flush=True)
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"# {len(checks)} checks: {fails} failed, {warns} warnings")
    return 1 if fails else 0


if __name__ == "__main__":
    run(main)
