"""CUDA tensors on the pure torch.distributed algorithms, found on the first GPU lent: on
a gloo group gloo's send and receive take host pointers, and a CUDA tensor ended both
ranks with "writev: Bad address" (all-gather's ring, DDP's ddp:ring hook); and batches
drawn on the CPU were most of compare's GPU step (docs/measurements.md, "What the tests
rest on"). The decisions run anywhere; the collectives need a GPU (scripts/gpu_check.sh)."""
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import registry
from commlab.experiments import workloads
from commlab.transports import p2p


@pytest.mark.parametrize("config, native", [
    ("cpu:gloo,cuda:gloo", False),   # gloo: host pointers only
    ("cpu:gloo,cuda:nccl", True),
    ("cuda:nccl", True),
    ("cpu:commlab", False),          # no CUDA backend at all
    ("cpu:commlab, cuda:nccl", True),
])
def test_which_groups_move_gpu_memory_themselves(monkeypatch, config, native):
    monkeypatch.setattr(dist, "get_backend_config", lambda group: config)
    assert p2p._moves_cuda(object()) is native


@pytest.mark.parametrize("name", ["mlp", "transformer", "tests.models:tiny_cnn", "tests.models:tokens"])
def test_batches_are_drawn_on_the_device_asked(name):
    w = workloads.build(name)
    x, y = w.make_batch(4, seed=3, device="cpu")
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert torch.equal(x, w.make_batch(4, seed=3)[0])
    if torch.cuda.is_available():
        xc, yc = w.make_batch(4, seed=3, device="cuda")
        assert xc.is_cuda and yc.is_cuda and torch.equal(xc, w.make_batch(4, seed=3, device="cuda")[0])


def _p2p_names(collective):
    return [n for n in registry(collective).for_device("cuda") if n not in ("ipc", "auto")]


def cuda_collectives(rank, p):
    """Every CUDA-claiming algorithm of each family on a gloo group, checked exactly."""
    torch.cuda.set_device(0)  # ranks share the one GPU
    wrong = []
    for name in _p2p_names("all_reduce"):
        for n in (1, 1000, 70_001):
            x = (torch.arange(n, device="cuda") % 7 + rank).float()
            commlab.all_reduce(x, algorithm=name)
            want = (p * (torch.arange(n, device="cuda") % 7) + sum(range(p))).float()
            if not torch.equal(x, want):
                wrong.append(f"all_reduce {name} n={n}")
    for name in _p2p_names("all_gather"):
        for n in (1, 333, 40_000):
            inp = torch.full((n,), rank + 1, dtype=torch.int32, device="cuda")
            out = torch.empty(p * n, dtype=torch.int32, device="cuda")
            commlab.all_gather(out, inp, algorithm=name)
            want = torch.arange(1, p + 1, dtype=torch.int32, device="cuda").repeat_interleave(n)
            if not torch.equal(out, want):
                wrong.append(f"all_gather {name} n={n}")
    return wrong


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_every_cuda_algorithm_on_a_gloo_group(ranks, world):
    for wrong in ranks.run(world, cuda_collectives):
        assert wrong == [], wrong


def test_the_gpu_check_asks_compare_only_for_modes_it_runs_on_cuda():
    """scripts/gpu_check.sh is run once, on a lent GPU, unattended: a step naming a mode
    compare does not offer on cuda comes back as an "unavailable" row in a run that
    exits 0, and the check reports as done what never ran. Its sharded step asked for
    zero1 and fsdp on cuda, which compare runs on CPU only."""
    import os
    import re
    import shlex

    from commlab.experiments.compare import modes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "gpu_check.sh")) as f:
        script = f.read().replace("\\\n", " ")
    cuda = set(modes.all_modes("cuda"))
    asked = []
    for line in script.splitlines():
        if "commlab.compare" in line and "--device cuda" in line:
            words = shlex.split(line.split("commlab.compare", 1)[1])
            asked += words[words.index("--modes") + 1].split(",")
    assert asked and not [m for m in asked if m not in cuda], (asked, sorted(cuda))
    for part in re.findall(r"want (\w+) &&", script):  # every part a step runs is in the parts list
        assert f" {part} " in " " + script.split('PARTS=" ${*:-', 1)[1].split("}", 1)[0] + " ", part


class _Span:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Kernel:
    def __init__(self, name, start, end, device=0, cuda=True):
        from torch.autograd import DeviceType

        self.name, self.device_index, self.time_range = name, device, _Span(start, end)
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU


def test_a_gpus_exposed_communication_is_what_no_other_kernel_overlaps():
    """The sharded modes' sync on a GPU, from a profiled step (compare.metrics): their
    collectives run on FSDP's and NCCL's streams beside compute, so total is the union of
    the NCCL kernels' time and exposed the part of it no other kernel or copy covers."""
    from commlab.experiments.compare.metrics import comm_overlap_ms, comm_time_ms

    events = [
        _Kernel("ncclDevKernel_AllGather_RING_LL", 0, 1000),      # 0-1000, compute covers 200-700
        _Kernel("ncclDevKernel_ReduceScatter_RING", 900, 1500),   # overlaps the first: union 0-1500
        _Kernel("sm90_xmma_gemm", 200, 500), _Kernel("elementwise_kernel", 450, 700),
        _Kernel("Memcpy DtoD (Device -> Device)", 1400, 1600),    # a copy counts as other work
        _Kernel("ncclDevKernel_AllReduce", 0, 300, device=1),      # a less busy device
        _Kernel("nccl:all_gather", 0, 5000, cuda=False),           # the host's record, not device time
    ]
    got = comm_overlap_ms(events)
    # union 1500 µs; covered 200-700 and 1400-1500: exposed 0-200, 700-1400 = 900 µs
    assert got == pytest.approx({"total": 1.5, "exposed": 0.9})
    assert comm_time_ms(events) == pytest.approx(1.6)  # DP's figure sums kernels, overlaps included
    assert comm_overlap_ms([_Kernel("gemm", 0, 10)]) == {"total": 0.0, "exposed": 0.0}
    fully_hidden = [_Kernel("ncclKernel", 10, 20), _Kernel("gemm", 0, 30)]
    assert comm_overlap_ms(fully_hidden) == pytest.approx({"total": 0.01, "exposed": 0.0})


def test_the_sharded_modes_offered_on_a_gpu_and_where_they_are_refused():
    """ZeRO-1 and FSDP2's own collectives run on GPUs over NCCL (the day a GPU is lent,
    gpu_check runs them on one); commlab's FSDP algorithms serve CPU tensors only, and
    --share-gpu (gloo) or a run without a warm-up step (where the device is profiled)
    are refused with the reason, before any rank starts."""
    from commlab.experiments.compare import modes

    cuda = modes.all_modes("cuda")
    assert {"zero1", "fsdp", "fsdp:noreshard"} <= set(cuda)
    assert not [m for m in cuda if m.startswith("fsdp:") and m != "fsdp:noreshard"]
    assert "fsdp:shm" in modes.all_modes("cpu")
    base = {"device": "cuda", "share_gpu": False, "warmup": 3}
    assert modes.sharded_refusal(base) is None
    shared = modes.run_mode("fsdp", 2, dict(base, share_gpu=True))
    assert shared["status"] == "unavailable" and "NCCL" in shared["reason"]
    assert modes.sharded_refusal(dict(base, device="cpu", share_gpu=True)) is None


def test_on_a_gpu_ddps_nccl_sync_is_read_from_the_device_after_a_warm_up_step(capsys):
    """NCCL marks a collective's future complete when it launches it, so the hook that
    times `ddp`'s buckets saw launches on a GPU, not the all-reduces: `ddp` over NCCL is
    timed from a profiled warm-up step instead,
    as the sharded modes; gloo (--share-gpu) and commlab's hooks keep their own clocks.
    Without a warm-up step there is nothing to profile: refused before anything starts."""
    from commlab.experiments.compare import cli, workers

    assert workers.timed_on_device("ddp", "cuda", "nccl")
    assert not workers.timed_on_device("ddp", "cuda", "gloo")   # --share-gpu: gloo completes when done
    assert not workers.timed_on_device("ddp:ipc", "cuda", "nccl")
    assert not workers.timed_on_device("ddp", "cpu", "gloo")
    with pytest.raises(SystemExit):
        cli.main(["--device", "cuda", "--warmup", "0", "--modes", "ddp,zero1"])
    assert "--warmup 1 or more" in capsys.readouterr().err


def test_fsdps_own_collectives_on_a_device_pass_its_async_work_through_and_count_bytes(monkeypatch):
    """On a GPU FSDP2 issues its gathers on its own stream and waits on the Work it gets
    back: commlab's wrapper must return torch's Work as FSDP2's default does (a blocking
    call would serialise the streams) and, seeing only the launch, count bytes but no
    time; on CPU the calls stay blocking and timed."""
    from commlab.training import fsdp

    seen = []

    def fake(kind):
        def call(*args, **kwargs):
            seen.append((kind, kwargs.get("async_op")))
            return f"work:{kind}"
        return call

    monkeypatch.setattr(fsdp.dist, "all_gather_single", fake("all_gather"))
    monkeypatch.setattr(fsdp.dist, "reduce_scatter_single", fake("reduce_scatter"))
    stats = fsdp.CommStats()
    stats.step()
    out, inp = torch.empty(8, device="meta"), torch.empty(2, device="meta")  # not CPU: stands for a GPU's
    assert fsdp.Gather(None, stats)(out, inp, group=None, async_op=True) == "work:all_gather"
    assert fsdp.Scatter(None, stats)(inp, out, group=None, op=None, async_op=False) == "work:reduce_scatter"
    assert seen == [("all_gather", True), ("reduce_scatter", False)]
    got = stats.summary()
    assert got["mean_bytes"] == 2 * 8 * 4 and got["mean_calls"] == 2
    assert got["mean_total_comm_ms"] is None and got["mean_exposed_ms"] is None  # the device's, not the host's
    with pytest.raises(commlab.UnsupportedError, match="CPU tensors"):  # commlab's algorithms: CPU only
        fsdp.Gather("ring", stats)(out, inp, group=None)
    timed = fsdp.CommStats()
    timed.step()
    timed.add("all_gather", 64, 1.0, 1.25)
    assert timed.summary()["mean_total_comm_ms"] == pytest.approx(250.0)


def test_the_step_profiled_on_a_device_is_the_last_warm_up_step(monkeypatch):
    """Warm (NCCL's communicators and the allocator settled by the earlier steps) and not
    one the table times; every warm-up step still runs once, so every mode trains the same
    number of steps as on CPU."""
    from commlab.experiments.compare import metrics, steps

    ran, profiled = [], []

    def profile(step):
        profiled.append(len(ran))
        step()
        return {"total": 1.0, "exposed": 0.5}

    monkeypatch.setattr(metrics, "profiled_sync_ms", profile)
    assert steps.warm_up(ran.append, 3, True) == {"total": 1.0, "exposed": 0.5}
    assert ran == [0, 1, 2] and profiled == [2]
    ran.clear()
    assert steps.warm_up(ran.append, 3, False) is None and ran == [0, 1, 2]
    with pytest.raises(ValueError, match="warm-up step"):
        steps.warm_up(ran.append, 0, True)
