"""commlab as a torch.distributed backend: real clients (DDP's own reducer, torch's
comm hooks), every collective a user may call, sub-groups, errors, re-init and
/dev/shm hygiene. Each test starts fresh ranks whose world group is "commlab"."""
import os

import pytest
import torch
import torch.distributed as dist
from ranks import RankPool, clean_launch_env, run_lightning, status_payload

import commlab  # noqa: F401 - registers the backend


@pytest.fixture(scope="module")
def commlab_ranks():
    pools = {}

    def run(world, fn, *args, timeout=180.0):
        pool = pools.get(world)
        if pool is None or pool.broken:
            pool = pools[world] = RankPool(world, backend="commlab")
        return pool.run(fn, *args, timeout=timeout)

    yield run
    for pool in pools.values():
        pool.close()


def _on_fresh_ranks(world, fn, *args, env=None, timeout=60):
    """fn on ranks of their own (a commlab world group), closed afterwards."""
    pool = RankPool(world, backend="commlab", env=env)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        pool.close()


def _leftovers():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("commlab-"))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _train(ddp, rank, steps=4):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own batch
        x, y = torch.randn(16, 32), torch.randn(16, 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def ddp_parity(rank, p, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert dist.get_backend() == "commlab"
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("commlab", None), ("gloo", gloo)):
        ddp = DDP(_model(), process_group=group, bucket_cap_mb=0.01)  # several buckets
        if hook == "bf16":
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        elif hook == "powersgd":
            state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                           min_compression_rate=0.5, use_error_feedback=True, random_seed=7)
            ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        out[name] = _train(ddp, rank)
    replicas = [torch.empty_like(out["commlab"]) for _ in range(p)]
    dist.all_gather(replicas, out["commlab"], group=gloo)
    return {"max_diff": float((out["commlab"] - out["gloo"]).abs().max()),
            "replicas_identical": all(torch.equal(r, replicas[0]) for r in replicas),
            "calls": _shm_calls(), "leftovers": _leftovers()}


def _shm_calls():
    """How many all-reduces commlab's shared memory served on the world group."""
    from commlab.transports import shm
    entry = shm._entries.get(dist.group.WORLD)
    return entry.comm.calls if entry.comm is not None else 0


@pytest.mark.parametrize("hook", [None, "bf16", "powersgd"])
def test_ddp_on_the_commlab_backend_matches_gloo(commlab_ranks, hook):
    for got in commlab_ranks(2, ddp_parity, hook):
        assert got["replicas_identical"], got
        assert got["max_diff"] < (2e-2 if hook == "bf16" else 1e-5), got
        assert got["calls"] > 0, got  # DDP's buckets went through commlab's shared memory
        assert got["leftovers"] == [], got


def every_collective(rank, p):
    """Everything a user may call on a commlab group works (all-reduce through commlab,
    the rest through the backend's gloo)."""
    out = {}
    x = torch.full((5,), float(rank + 1))
    for op, want in ((dist.ReduceOp.SUM, p * (p + 1) / 2), (dist.ReduceOp.MAX, p), (dist.ReduceOp.AVG, (p + 1) / 2)):
        y = x.clone()
        dist.all_reduce(y, op=op)
        out[f"all_reduce {op}"] = torch.allclose(y, torch.full_like(y, want))
    for dtype in (torch.float64, torch.bfloat16, torch.int32, torch.uint8):
        y = torch.full((7,), rank + 1, dtype=dtype)
        dist.all_reduce(y)
        out[f"all_reduce {dtype}"] = torch.equal(y, torch.full_like(y, p * (p + 1) // 2))
    strided = torch.arange(12.0).reshape(3, 4).t() + rank
    dist.all_reduce(strided)
    out["strided"] = torch.equal(strided, p * torch.arange(12.0).reshape(3, 4).t() + sum(range(p)))
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    out["async"] = torch.equal(x, torch.full((5,), p * (p + 1) / 2))
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=p - 1)
    out["broadcast"] = torch.equal(b, torch.full((3,), float(p - 1)))
    gathered = torch.empty(p * 2)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = gathered.tolist() == [float(r) for r in range(p) for _ in range(2)]
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * p) + rank)
    out["reduce_scatter_tensor"] = shard.tolist() == [p * (2 * rank + k) + sum(range(p)) for k in range(2)]
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs == [{"rank": r} for r in range(p)]
    if rank == 0:
        dist.send(torch.ones(4), dst=1)
    elif rank == 1:
        r = torch.zeros(4)
        dist.recv(r, src=0)
        out["send/recv"] = torch.equal(r, torch.ones(4))
    dist.barrier()
    return out


def test_every_collective_works_on_a_commlab_group(commlab_ranks):
    for rank, got in enumerate(commlab_ranks(3, every_collective)):
        assert all(got.values()), (rank, got)
        assert ("send/recv" in got) == (rank == 1)


def sub_groups_and_reinit(rank, p):
    out = {}
    pair = dist.new_group([0, 1], backend="commlab")
    if rank < 2:
        t = torch.full((100,), float(rank + 1))
        dist.all_reduce(t, group=pair)
        out["pair"] = torch.equal(t, torch.full((100,), 3.0))
    dist.barrier()
    dist.destroy_process_group(pair)
    # Leave the world and come back on a new one, in the same process.
    store_dir = os.environ["COMMLAB_TEST_STORE"]
    dist.destroy_process_group()
    dist.init_process_group("commlab", init_method=f"file://{store_dir}/reinit", rank=rank, world_size=p)
    t = torch.full((10,), float(rank))
    dist.all_reduce(t)
    out["reinit"] = torch.equal(t, torch.full((10,), float(sum(range(p)))))
    dist.barrier()
    out["leftovers"] = _leftovers()
    return out


@pytest.mark.slow
def test_sub_groups_destroy_and_reinit_leave_nothing_behind(tmp_path):
    res = _on_fresh_ranks(3, sub_groups_and_reinit, env={"COMMLAB_TEST_STORE": str(tmp_path)}, timeout=180)
    for rank, got in enumerate(res):
        assert got.get("pair", rank >= 2) and got["reinit"], (rank, got)
        assert got["leftovers"] == [], got
    assert _leftovers() == []


def mismatched_sizes(rank, p):
    """Through dist.all_reduce, sync and async: the mismatch is raised (torch's
    future-wrapping Work would return from wait() as if the call had succeeded), and
    every later call raises it again."""
    out = {}
    for k, async_op in enumerate((False, True)):
        t = torch.ones(1000 if rank == 0 else 2000)
        try:
            work = dist.all_reduce(t, async_op=async_op)
            if async_op:
                work.wait()
            out[k] = None
        except Exception as e:  # noqa: BLE001 - the test reads what every rank got
            out[k] = f"{type(e).__name__}: {e}"
    return out


def test_a_mismatch_is_the_same_clear_error_on_every_rank():
    pool = RankPool(2, backend="commlab")
    try:
        res = pool.outcomes(mismatched_sizes, timeout=60)
    finally:
        pool.close()
    seen = []
    for r in range(2):
        status, payload = status_payload(res[r])
        assert status == "ok", payload
        assert payload[0] is not None and payload[0].startswith("CollectiveMismatchError"), payload
        # The group's shared memory is done after a failed call: the next call says why.
        assert payload[1] is not None and payload[1].startswith("CommlabError") and "unusable after" in payload[1]
        for k in (0, 1):
            assert "4000 bytes" in payload[k] and "8000 bytes" in payload[k], payload
        seen.append(payload[0])
    assert seen[0] == seen[1]  # the same text on every rank


LIGHTNING_SCRIPT = '''
import datetime, json, os, sys
import torch
import torch.distributed as dist
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy
import commlab  # registers the backend
from commlab.measure.launch import leave
from commlab.transports import shm

backend = sys.argv[2]


class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = M()
start = {k: v.detach().flatten().tolist() for k, v in model.net.state_dict().items()}
trainer = pl.Trainer(strategy=DDPStrategy(process_group_backend=backend, timeout=datetime.timedelta(seconds=90)),
                     accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
entry = shm._entries.get(dist.group.WORLD)
out = {"weight": trainer.lightning_module.net.weight.detach().flatten().tolist(), "backend": dist.get_backend(),
       "start": start,
       "shm_calls": entry.comm.calls if entry.comm is not None else 0}
with open(os.path.join(sys.argv[1], f"{backend}{trainer.global_rank}.json"), "w") as f:
    json.dump(out, f)
# Lightning leaves the group up; one that dies in interpreter shutdown can abort the process
# (pytorch/pytorch#190489). The trainer's DDP module holds it too.
del trainer
leave()
'''


def _one_process_sgd(start: dict, steps: int = 4, per_rank: int = 8, ranks: int = 2) -> list[float]:
    """What LIGHTNING_SCRIPT's two DDP ranks train to: Lightning's DistributedSampler
    shuffles (seed 0, epoch 0) and gives rank r every other sample of the permutation
    from r on, so step i averages the gradients of its samples 16i .. 16i+15, as one
    process taking those 16 at a time does."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    g = torch.Generator()
    g.manual_seed(0)
    order = torch.randperm(64, generator=g)
    x, y = x[order], y[order]
    net = torch.nn.Linear(8, 1)
    net.load_state_dict({k: torch.tensor(v).reshape_as(p) for (k, v), p in zip(start.items(), net.state_dict().values())})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    n = per_rank * ranks
    for i in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[i * n:(i + 1) * n]), y[i * n:(i + 1) * n]).backward()
        opt.step()
    return net.weight.detach().flatten().tolist()


@pytest.mark.slow
def test_lightning_ddp_strategy_on_the_commlab_backend(tmp_path):
    """Lightning's DDP on the commlab backend trains as DDP must: the same weights on both
    ranks, the weights one process gets on the same samples (a second Lightning run on
    gloo took as long again for the same reference), through commlab's shared memory."""
    pytest.importorskip("pytorch_lightning")
    c = run_lightning(tmp_path, LIGHTNING_SCRIPT, "commlab")
    assert c[0]["backend"] == "commlab" and c[0]["weight"] == c[1]["weight"], c
    assert all(o["shm_calls"] > 0 for o in c), c  # Lightning's DDP went through commlab's shared memory
    diff = max(abs(a - b) for a, b in zip(c[0]["weight"], _one_process_sgd(c[0]["start"])))
    assert diff < 1e-5, diff


def fsdp2_parity(rank, p):
    from commlab.algorithms.all_gather import shm as gather_shm
    from commlab.algorithms.reduce_scatter import shm as scatter_shm

    # Counted, not assumed: FSDP's all-gathers and reduce-scatters reach their registries' shm.
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counting(kind, real):
        def call(*args, **kwargs):
            counts[kind] += 1
            return real(*args, **kwargs)
        return call

    gather_shm.ALGORITHM.run = counting("all_gather", gather_shm.ALGORITHM.run)  # instance attributes
    scatter_shm.ALGORITHM.run = counting("reduce_scatter", scatter_shm.ALGORITHM.run)
    try:
        return _fsdp2_runs(rank, counts)
    finally:
        del gather_shm.ALGORITHM.run
        del scatter_shm.ALGORITHM.run


def _fsdp2_runs(rank, counts):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("commlab", dist.group.WORLD), ("gloo", gloo)):
        model = _model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(100 + 10 * step + rank)
            x, y = torch.randn(16, 32), torch.randn(16, 8)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[name] = torch.cat([prm.full_tensor().reshape(-1) for prm in model.parameters()])
        if name == "commlab":
            served = dict(counts)
    return {"max_diff": float((out["commlab"] - out["gloo"]).abs().max()), "leftovers": _leftovers(),
            "served": served, "after_gloo": dict(counts)}


def test_fsdp2_on_the_commlab_backend_matches_gloo(commlab_ranks):
    for got in commlab_ranks(2, fsdp2_parity):
        assert got["max_diff"] < 1e-5 and got["leftovers"] == [], got
        # 3 steps of 3 sharded modules: every forward and backward gathers, every backward reduce-scatters.
        assert got["served"]["all_gather"] >= 9 and got["served"]["reduce_scatter"] >= 3, got
        assert got["after_gloo"] == got["served"], got  # the gloo run went to gloo


def plans_per_call(rank, p):
    """c10d builds a new ReduceOp object for every call: the backend must still reuse one
    plan (a fresh plan per call re-ran auto's host gathering every time)."""
    from commlab.api import all_reduce as api
    x = torch.ones(100)
    dist.all_reduce(x)
    before = len(api._plans)
    for _ in range(20):
        dist.all_reduce(x)
    return len(api._plans) - before


def test_the_backend_reuses_its_plan_across_calls(commlab_ranks):
    assert commlab_ranks(2, plans_per_call) == [0, 0]


EXIT_SCRIPT = '''
import os, sys
import torch
import torch.distributed as dist
import commlab  # registers the backend

rank = int(sys.argv[2])
dist.init_process_group("commlab", init_method=f"file://{sys.argv[1]}/store", rank=rank, world_size=2)
t = torch.ones(1000)
dist.all_reduce(t)
dist.all_reduce(t, async_op=True).wait()
dist.broadcast(t, src=0)
dist.barrier()
dist.destroy_process_group()
print("done", flush=True)
'''


@pytest.mark.slow
def test_a_script_that_destroys_its_group_exits_cleanly(tmp_path):
    """The usual end of a training script. The backend's thread held the last reference to
    the backend after its last job; Python freed the gloo groups on that daemon thread at
    interpreter exit and the process aborted ("terminate called without an active
    exception", SIGABRT) after a successful run."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    env = clean_launch_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for attempt in range(3):  # the abort depended on which thread lost the race at exit: try it more than once
        (tmp_path / str(attempt)).mkdir()
        procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / str(attempt)), str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and "done" in out, (proc.returncode, err[-2000:])
            assert "terminate called" not in err, err[-2000:]
    assert _leftovers() == []


def shm_collectives(rank, p):
    """all_gather, reduce_scatter, broadcast, all_to_all and barrier through the backend: served by
    commlab's shared memory (its call counter moves), right for every size (several
    pieces past the 1 MiB buffers), dtype, op, list form and aliasing."""
    import functools
    out, calls0 = {}, _shm_calls()
    n_calls = 0
    for n in (1, 7, 70_000, 600_000):  # 600k fp32 = 2.4 MB per rank: pieces
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            x = (torch.arange(n) % 97 + rank).to(dtype)
            g = torch.empty(p * n, dtype=dtype)
            dist.all_gather_into_tensor(g, x)
            out[f"all_gather {n} {dtype}"] = torch.equal(
                g, torch.cat([(torch.arange(n) % 97 + r).to(dtype) for r in range(p)]))
            inp = torch.cat([(torch.arange(n) % 89 + r + rank).to(dtype) for r in range(p)])
            for op, fold in ((dist.ReduceOp.SUM, sum), (dist.ReduceOp.MAX, lambda ts: functools.reduce(torch.maximum, ts))):
                s = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(s, inp, op=op)
                want = fold([(torch.arange(n) % 89 + rank + r).to(dtype) for r in range(p)])
                out[f"reduce_scatter {n} {dtype} {op}"] = torch.equal(s, want)
            b = (torch.arange(n) % 13 + rank).to(dtype)
            dist.broadcast(b, src=1)
            out[f"broadcast {n} {dtype}"] = torch.equal(b, (torch.arange(n) % 13 + 1).to(dtype))
            n_calls += 4
    # all_to_all: even (one and several pieces), uneven splits of 2-element rows, list form.
    for n in (1, 300_000):
        x = (torch.arange(p * n) + 100 * rank).float()
        y = torch.empty(p * n)
        dist.all_to_all_single(y, x)
        out[f"all_to_all {n}"] = torch.equal(y, torch.cat(
            [(torch.arange(p * n) + 100 * j).float()[rank * n:(rank + 1) * n] for j in range(p)]))
    isp, osp = [rank + q + 1 for q in range(p)], [j + rank + 1 for j in range(p)]
    y = torch.empty(sum(osp), 2)
    dist.all_to_all_single(y, torch.cat([torch.full((s, 2), float(10 * rank + q)) for q, s in enumerate(isp)]), osp, isp)
    out["all_to_all uneven"] = torch.equal(y, torch.cat([torch.full((s, 2), float(10 * j + rank))
                                                         for j, s in enumerate(osp)]))
    outs = [torch.empty(j + rank + 1) for j in range(p)]
    dist.all_to_all(outs, [torch.full((rank + q + 1,), float(10 * rank + q)) for q in range(p)])
    out["all_to_all list"] = all(torch.equal(o, torch.full((j + rank + 1,), float(10 * j + rank)))
                                 for j, o in enumerate(outs))
    n_calls += 4
    # Types only copied (never reduced) and AVG.
    flags = torch.tensor([rank % 2 == 0, True])
    gf = torch.empty(2 * p, dtype=torch.bool)
    dist.all_gather_into_tensor(gf, flags)
    out["all_gather bool"] = gf.tolist() == [v for r in range(p) for v in (r % 2 == 0, True)]
    avg = torch.empty(3)
    dist.reduce_scatter_tensor(avg, torch.full((3 * p,), float(rank)), op=dist.ReduceOp.AVG)
    out["reduce_scatter AVG"] = torch.allclose(avg, torch.full((3,), (p - 1) / 2))
    n_calls += 2
    # List forms, and outputs that are views of the inputs (torch allows both).
    lst = [torch.empty(2, 3) for _ in range(p)]
    dist.all_gather(lst, torch.full((2, 3), float(rank)))
    out["all_gather list"] = all(torch.equal(t, torch.full((2, 3), float(r))) for r, t in enumerate(lst))
    o = torch.empty(4)
    dist.reduce_scatter(o, [torch.full((4,), float(r * rank)) for r in range(p)])
    out["reduce_scatter list"] = torch.equal(o, torch.full((4,), float(rank * sum(range(p)))))
    whole = torch.zeros(p * 5)
    whole[rank * 5:(rank + 1) * 5] = rank + 1
    dist.all_gather_into_tensor(whole, whole[rank * 5:(rank + 1) * 5])
    out["all_gather in place"] = torch.equal(whole, torch.arange(1.0, p + 1).repeat_interleave(5))
    src = torch.arange(p * 5, dtype=torch.float32) + rank
    expect = p * torch.arange(rank * 5, (rank + 1) * 5, dtype=torch.float32) + sum(range(p))
    dist.reduce_scatter_tensor(src[rank * 5:(rank + 1) * 5], src)
    out["reduce_scatter in place"] = torch.equal(src[rank * 5:(rank + 1) * 5], expect)
    dist.barrier()
    n_calls += 5
    # Async, and order: a broadcast issued right after an async all_reduce of the same
    # tensor (no wait between) sends the reduced value; so does a gloo-served reduce.
    t = torch.full((1000,), float(rank + 1))
    w1 = dist.all_reduce(t, async_op=True)
    w2 = dist.broadcast(t, src=0, async_op=True)
    w2.wait()
    w1.wait()
    out["ordered broadcast"] = torch.equal(t, torch.full((1000,), float(p * (p + 1) // 2)))
    r = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(r, async_op=True)
    dist.reduce(r, dst=0)  # gloo: issued after the queued all-reduce ran
    if rank == 0:
        out["ordered gloo reduce"] = torch.equal(r, torch.full((100_000,), float(p * p * (p + 1) // 2)))
    n_calls += 3
    out["served by shm"] = _shm_calls() - calls0 == n_calls
    out["leftovers"] = _leftovers() == []
    return out


def test_other_collectives_go_through_shared_memory(commlab_ranks):
    for rank, got in enumerate(commlab_ranks(3, shm_collectives)):
        assert all(got.values()), (rank, {k: v for k, v in got.items() if not v})
        assert ("ordered gloo reduce" in got) == (rank == 0)


def mismatched_collectives(rank, p, case):
    """Ranks that call different collectives (or the same with another root or size):
    a mismatch error naming both calls, the same text on every rank, and no hang."""
    try:
        t = torch.ones(8)
        if case == "kind":
            if rank == 0:
                dist.broadcast(t, src=0)
            else:
                dist.all_gather_into_tensor(torch.empty(8 * p), t)
        elif case == "root":
            dist.broadcast(t, src=rank)
        else:  # size
            dist.reduce_scatter_tensor(torch.empty(4 + rank), torch.ones(p * (4 + rank)))
        return None
    except Exception as e:  # noqa: BLE001 - the test reads what every rank got
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("case", ["kind", "root", "size"])
def test_mismatched_collectives_fail_alike_on_every_rank(case):
    res = _on_fresh_ranks(2, mismatched_collectives, case)
    assert res[0] is not None and res[0] == res[1], res
    assert res[0].startswith("CollectiveMismatchError") and "mismatch" in res[0], res
    want = {"kind": ("broadcast", "all_gather"), "root": ("from rank 0", "from rank 1"),
            "size": ("reduce_scatter of 32 bytes", "reduce_scatter of 40 bytes")}[case]
    assert all(w in res[0] for w in want), res


def collectives_on_gloo(rank, p):
    calls0 = _shm_calls()
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=0)
    g = torch.empty(p)
    dist.all_gather_into_tensor(g, torch.tensor([float(rank)]))
    dist.barrier()
    return {"right": torch.equal(b, torch.zeros(4)) and g.tolist() == [float(r) for r in range(p)],
            "shm calls": _shm_calls() - calls0}


def test_commlab_collectives_gloo_sends_them_to_gloo():
    res = _on_fresh_ranks(2, collectives_on_gloo, env={"COMMLAB_COLLECTIVES": "gloo"})
    assert res == [{"right": True, "shm calls": 0}] * 2, res


def every_algorithm_on_a_commlab_group(rank, p):
    """commlab.all_reduce with every registered CPU algorithm on a commlab group: what the
    algorithms issue on the group goes to the backend's inner gloo. `builtin` deadlocked
    (its inline call held the group's lane, the backend's thread waited for it) and the
    p2p algorithms died in RecursionError (batch_isend_irecv asks the backend whether it
    supports coalescing, and torch's PyBackend asked itself again)."""
    out = {}
    for name in commlab.algorithm_names():
        if "cpu" not in commlab.get_algorithm(name).devices:
            continue
        t = torch.arange(1000.0) + rank
        try:
            commlab.all_reduce(t, algorithm=name)
            out[name] = torch.equal(t, p * torch.arange(1000.0) + sum(range(p)))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def test_every_algorithm_runs_on_a_commlab_group(commlab_ranks):
    for rank, got in enumerate(commlab_ranks(3, every_algorithm_on_a_commlab_group, timeout=120)):
        assert got and all(v is True for v in got.values()), (rank, got)
        assert {"builtin", "ring", "shm", "auto"} <= set(got), got


def where_calls_run(rank, p):
    """A blocking dist.all_reduce / broadcast runs on the caller's thread (the hop to the
    backend's thread cost ~120 us per 4 KiB call); async calls run on the backend's."""
    import threading

    from commlab.api import backend
    seen = []
    real_all_reduce, real_broadcast = backend.api.all_reduce, backend.shm.broadcast

    def all_reduce(*a, **k):
        seen.append(("all_reduce", threading.current_thread().name))
        return real_all_reduce(*a, **k)

    def broadcast(*a, **k):
        seen.append(("broadcast", threading.current_thread().name))
        return real_broadcast(*a, **k)

    backend.api.all_reduce, backend.shm.broadcast = all_reduce, broadcast
    try:
        t = torch.ones(10)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, src=0)
        dist.broadcast(t, src=0, async_op=True).wait()
    finally:
        backend.api.all_reduce, backend.shm.broadcast = real_all_reduce, real_broadcast
    return {"seen": seen, "main": threading.current_thread().name, "right": torch.equal(t, torch.full((10,), p * p))}


def test_blocking_calls_run_on_the_callers_thread(commlab_ranks):
    for got in commlab_ranks(2, where_calls_run):
        main = got["main"]
        assert got["right"] and got["seen"] == [("all_reduce", main), ("all_reduce", "commlab-backend"),
                                                ("broadcast", main), ("broadcast", "commlab-backend")], got


def backend_peer_dies(rank, p, collective):
    """Through dist.* on a commlab group: a peer that dies is named, fast, by every
    survivor (the group timeout is 60 s; shared memory sees the death in ~0.1 s)."""
    import time
    x = torch.ones(2000)
    dist.all_reduce(x)
    dist.barrier()
    if rank == 1:
        os._exit(9)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            if collective == "all_reduce":
                dist.all_reduce(x, async_op=True).wait()
            else:
                dist.all_gather_into_tensor(torch.empty(p * 2000), x)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "msg": str(e)[:400], "seconds": time.monotonic() - t0}
    return {"type": None}


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_a_dead_peer_is_named_fast_through_the_backend(collective):
    pool = RankPool(3, backend="commlab", pg_timeout_s=60)
    res = pool.outcomes(backend_peer_dies, collective, timeout=90)
    assert res[1].status == "missing"
    for r in (0, 2):
        status, payload = status_payload(res[r])
        assert status == "ok", payload
        assert payload["type"] == "PeerError", payload
        assert "rank 1" in payload["msg"] and "died" in payload["msg"], payload
        assert payload["seconds"] < 10, payload


def detail_mismatch(rank, p):
    t = torch.ones(10 if rank == 0 else 20)
    try:
        dist.all_reduce(t)
        return None
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_torch_distributed_debug_detail_checks_calls_on_a_commlab_group():
    res = _on_fresh_ranks(2, detail_mismatch, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    # commlab's own check (torch wraps only its built-in backends): before any traffic,
    # the same text on both ranks, naming both calls.
    assert res[0] is not None and res[0] == res[1], res
    assert res[0].startswith("CollectiveMismatchError") and "numel=10" in res[0] and "numel=20" in res[0], res


CALLBACK_AT_EXIT_SCRIPT = '''
import sys, time
import torch
import torch.distributed as dist
import commlab  # registers the backend

rank = int(sys.argv[2])
dist.init_process_group("commlab", init_method=f"file://{sys.argv[1]}/store", rank=rank, world_size=2)
slow_to_finalize = [[i] for i in range(4_000_000)]  # the interpreter's last garbage collection walks them
w = dist.all_reduce(torch.ones(4), async_op=True)
w.get_future().then(lambda f: time.sleep(0.3))  # runs on the backend's thread once the result is set
w.wait()
print("done", flush=True)
'''


@pytest.mark.slow
def test_a_future_callback_still_running_at_exit_does_not_abort(tmp_path):
    """A Future's callbacks run on commlab's daemon thread after waiters are woken (DDP's
    own bucket callbacks do): when the script ended meanwhile, the thread woke during
    interpreter finalization, CPython ended it with pthread_exit through torch's C++
    frames and the process aborted ("terminate called without an active exception";
    the README's DDP example 1 run in 8 under load, every run here). commlab's threads
    are now stopped and joined at exit."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(CALLBACK_AT_EXIT_SCRIPT)
    env = clean_launch_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert "terminate called" not in err and proc.returncode == 0 and "done" in out, (proc.returncode, err[-2000:])
