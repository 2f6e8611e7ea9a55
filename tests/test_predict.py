"""commlab.predict: the traced step (FLOPs, gradient order, memory facts), DDP's
buckets as torch makes them, the roofline and link arithmetic on a profile, DP's
device-0 extras, every profile's sources, the CLI and compare's --predict columns."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from commlab.experiments.predict import hardware, per_mode, replicated
from commlab.experiments.predict.graph import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The article's model: an optional package; without it these tests say so and skip.
needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="needs torchvision for resnet50 (pip install torchvision)")


def test_the_trace_counts_an_mlps_flops_exactly_and_sees_every_gradient():
    b, w = 8, 64
    st = trace("mlp", b, width=w, depth=2)  # 256 -> 64 -> 64 -> 16
    macs = 256 * w + w * w + w * 16
    assert st.flops("fwd") == 2 * b * macs
    assert st.flops("bwd") == pytest.approx(2 * st.flops("fwd") - 2 * b * 256 * w)  # no gradient for the input
    assert sorted(st.grad_ready) == list(range(len(st.params)))
    # Backward meets the last layer first: its gradients are ready before the first layer's.
    assert st.grad_ready[len(st.params) - 1] < st.grad_ready[0]
    assert st.param_bytes == 4 * (macs + 2 * w + 16)
    two = trace("mlp", 2 * b, width=w, depth=2)
    assert two.activation_bytes == pytest.approx(2 * st.activation_bytes)  # saved tensors grow with the batch


def test_copies_move_bytes_in_the_roofline():
    """A clone or a dtype cast does no FLOPs but reads and writes its tensor: counted
    free, the transformer's attention clones left ~7 % of its step's bytes out."""
    from commlab.experiments.predict.graph import _Recorder

    x = torch.empty(1 << 18, device="meta")  # 1 MiB of fp32
    rec = _Recorder(set())
    with rec:
        x.clone()
        x.to(torch.float16)
    assert [o.bytes for o in rec.ops] == [2 << 20, (1 << 20) + (1 << 19)], rec.ops
    assert all(o.flops == 0 and o.kind == "" for o in rec.ops)


@pytest.mark.parametrize("name,batch", [("mlp", 8192), ("transformer", 64),
                                        pytest.param("resnet50", 16, marks=needs_torchvision)])
def test_the_peak_follows_what_checkpointing_recomputes(name, batch):
    """The step's peak of live bytes, not a sum of saved tensors: checkpointing a
    Sequential in two segments cuts it, and so do a transformer's layers and a ResNet's
    bottlenecks recomputed block by block. Both were checkpointed whole, which recomputes
    every activation at once in backward and cut nothing (517 and 1,333 MB either way);
    that is still the fallback for a model without blocks."""
    plain, ck = trace(name, batch, width=256, depth=8), trace(name, batch, width=256, depth=8, checkpoint=True)
    assert plain.peak_bytes >= plain.activation_bytes
    assert ck.activation_bytes < plain.activation_bytes  # fewer tensors saved in forward, either way
    assert ck.peak_bytes < 0.8 * plain.peak_bytes, (name, ck.peak_bytes, plain.peak_bytes)
    # The recomputation is paid: a forward more block by block, half of one for the MLP's first segment.
    assert ck.flops("bwd") > plain.flops("bwd") + (0.4 if name == "mlp" else 0.9) * plain.flops("fwd")


def test_a_model_without_blocks_is_checkpointed_whole_and_keeps_its_peak():
    from commlab.experiments import workloads

    class Flat(torch.nn.Module):  # one layer per child: nothing to recompute block by block
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    ck = workloads.Checkpointed(Flat())
    assert not ck.blockwise and not any(isinstance(m, workloads.Recomputed) for m in ck.modules())


def test_a_recomputed_block_gets_its_keyword_arguments_and_the_same_gradients():
    from commlab.experiments import workloads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, scale=1.0):
            return self.lin(x) * scale

    class Model(torch.nn.Module):  # a user's model calls its block with a keyword
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x, scale=2.0)

    torch.manual_seed(0)
    m, x = Model(), torch.randn(3, 4)
    want = m(x).sum()
    want.backward()
    grad = m.block.lin.weight.grad.clone()
    m.zero_grad()
    ck = workloads.Checkpointed(m)
    got = ck(x).sum()
    got.backward()
    assert ck.blockwise and torch.equal(got, want) and torch.equal(m.block.block.lin.weight.grad, grad)


@pytest.mark.parametrize("name,cap", [pytest.param("resnet50", 25, marks=needs_torchvision),
                                      pytest.param("resnet50", 5, marks=needs_torchvision), ("transformer", 25), ("mlp", 1)])
def test_buckets_are_the_ones_ddps_reducer_rebuilds(name, cap):
    st = trace(name, 1)
    order = replicated.ready_order(st)
    tensors = [torch.empty(st.params[i] // 4) for i in order]  # the reducer's rebuilt order, sizes as they come
    want, _ = dist._compute_bucket_assignment_by_size(tensors, [replicated.FIRST_BUCKET_BYTES, cap << 20],
                                                      [False] * len(order), order)
    assert replicated.buckets(st.params, cap, order) == want


def test_ddp_given_its_cap_makes_the_first_bucket_that_size_too(tmp_path):
    """torch 2.14's DDP makes a 1 MiB first bucket only when bucket_cap_mb is left to its
    default; given one (as compare always gives it) every bucket is that size. Predicted
    with a 1 MiB first bucket, the 1024x8 transformer's last bucket (the one left after
    backward) came out a small remainder where training's is a full one, and DDP's part
    after the last arrival was predicted well under what training measured
    (docs/measurements.md, "What the tests rest on")."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig as Config

    counts = {}
    for given, cap in ((True, 25), (False, None)):
        first = Config.create(cap, None, False).first_bucket_bytes_cap
        s = replicated.Setup("transformer", world=4, batch_size=16, width=128, depth=2, bucket_cap_given=given)
        st = replicated.Steps(s).at(4)
        order = replicated.ready_order(st)
        tensors = [torch.empty(st.params[i] // 4) for i in order]
        want, _ = dist._compute_bucket_assignment_by_size(tensors, [first, 25 << 20], [False] * len(order), order)
        row = per_mode.predict(["ddp"], s, hardware.load_profile("rtx4090-pcie4"), replicated.Steps(s))[0]
        assert row["breakdown"]["buckets"] == len(want), given
        counts[given] = len(want)
    assert counts[False] == counts[True] + 1  # this model: the 1 MiB first bucket is one more
    # predict's --bucket-cap-mb says whether DDP was given it (compare's DDP always is).
    from commlab.experiments.predict import cli as pcli

    for argv, given in (([], False), (["--bucket-cap-mb", "25"], True)):
        out = tmp_path / "p.json"
        pcli.main(["--hardware", "rtx4090-pcie4", "--gpus", "4", "--model", "transformer", "--width", "128",
                   "--depth", "2", "--batch-size", "16", "--modes", "ddp", "--json", str(out), *argv])
        doc = json.loads(out.read_text())
        assert doc["env"]["bucket_cap_mb"] == 25.0
        assert doc["modes"][0]["breakdown"]["buckets"] == counts[given], argv


def test_a_profile_prices_compute_and_links_from_its_own_numbers():
    prof = hardware.load_profile("rtx4090-pcie4")
    s = replicated.Setup("mlp", world=4, batch_size=256, width=1024, depth=4)
    steps = replicated.Steps(s)
    st = steps.at(64)
    exact = trace("mlp", 64)
    assert [o.flops for o in st.ops] == pytest.approx([o.flops for o in exact.ops])  # affine in the batch
    t = hardware.op_times_us(st, prof, None)
    for o, us in zip(st.ops, t):  # a roofline: never faster than either limit
        assert us >= o.bytes / (prof.memory_bandwidth_gbps * 1e3) - 1e-9
        assert us >= o.flops / (max(prof.peak_tflops.values()) * 1e6) - 1e-9
    n = 25 << 20
    ring = hardware.allreduce_us(prof, "builtin", 4, n)
    assert ring == pytest.approx(8.4 + 6 * 5.7 + 1.5 * n / 28.8e3 + 0.75 * n * 3 / 1008e3)
    rows = {r["mode"]: r for r in per_mode.predict(["dp", "ddp", "ddp:noop", "ddp:ring", "ddp:nope"], s, prof, steps)}
    assert rows["ddp:nope"]["status"] == "unavailable"
    noop, ddp, dp = rows["ddp:noop"], rows["ddp"], rows["dp"]
    assert all(r["predicted"] for r in rows.values())
    assert noop["grad_sync_ms"]["total"] == 0 and ddp["grad_sync_ms"]["total"] > 0
    assert 0 <= ddp["grad_sync_ms"]["exposed"] <= ddp["grad_sync_ms"]["total"]
    assert ddp["iter_ms"]["median"] == pytest.approx(noop["iter_ms"]["median"] + ddp["grad_sync_ms"]["exposed"])
    # DP: nothing hidden, and device 0 holds the whole batch, the gathered outputs and the leaf gradients.
    assert dp["grad_sync_ms"]["exposed"] == dp["grad_sync_ms"]["total"]
    extra = (dp["peak_memory_mb"][0] - dp["peak_memory_mb"][1]) * 2**20
    assert extra == pytest.approx(st.param_bytes + 4 * (st.input_bytes + st.output_bytes), rel=1e-6)
    # DDP: every device alike, its bucket copies on top of parameters and gradients.
    assert len(set(ddp["peak_memory_mb"])) == 1
    assert (ddp["peak_memory_mb"][0] - noop["peak_memory_mb"][0]) * 2**20 == pytest.approx(st.param_bytes)


@needs_torchvision
def test_a_faster_link_shrinks_only_communication():
    s = replicated.Setup("resnet50", world=4, batch_size=128)
    steps = replicated.Steps(s)
    slow, fast = hardware.load_profile("rtx4090-pcie4"), hardware.load_profile("rtx4090-pcie4")
    fast.link = dict(fast.link, gbps=10 * fast.link["gbps"])
    a, b = (per_mode.predict(["ddp", "dp"], s, p, steps) for p in (slow, fast))
    assert b[0]["grad_sync_ms"]["total"] < a[0]["grad_sync_ms"]["total"] and b[1]["iter_ms"]["median"] < a[1]["iter_ms"]["median"]
    assert a[0]["breakdown"]["backward_ms"] == b[0]["breakdown"]["backward_ms"]


def test_where_ranks_outnumber_cores_the_buckets_share_backwards_cores():
    """4 ranks on 2 cores: gloo's threads ran DDP's buckets during backward on the cores
    backward needed, which slowed backward and left little after it, where the model ran
    every bucket after backward, all of it exposed (docs/measurements.md, "What the tests
    rest on"). Processor sharing: each at half speed while both run."""
    assert replicated.shared_cores([10.0], [5.0], 10.0) == (10.0, 15.0)  # ready at the end: all of it exposed
    assert replicated.shared_cores([0.0], [4.0], 10.0) == pytest.approx((14.0, 14.0))  # both at half speed for 8
    assert replicated.shared_cores([0.0, 10.0], [4.0, 3.0], 10.0) == pytest.approx((14.0, 17.0))
    import dataclasses

    prof = dataclasses.replace(hardware.load_profile("rtx4090-pcie4"), overlap=False)
    s = replicated.Setup("mlp", world=4, batch_size=256, width=1024, depth=4, bucket_cap_mb=1)
    rows = {r["mode"]: r for r in per_mode.predict(["ddp", "ddp:noop"], s, prof)}
    ddp, noop = rows["ddp"], rows["ddp:noop"]
    sync = ddp["grad_sync_ms"]
    assert ddp["breakdown"]["buckets"] > 2
    assert 0 < sync["exposed"] < sync["total"]  # only what is left after backward is exposed
    # Nothing runs in parallel: the step still pays for all of it, partly inside backward.
    assert ddp["iter_ms"]["median"] == pytest.approx(noop["iter_ms"]["median"] + sync["total"])
    assert ddp["breakdown"]["backward_slowed_by_sync_ms"] == pytest.approx(sync["total"] - sync["exposed"])


def test_the_peak_at_a_larger_batch_is_the_one_traced_there():
    """At a small batch the gradients make the step's peak, at a large one the
    activations: one line through the two traced peaks put a transformer's 8 % low at
    2.5x the batch and further below beyond (--find-max-batch 40x too high for a 1.3B
    model on a 4090); each moment's bytes, followed one by one, give the traced peak."""
    s = replicated.Setup("transformer", world=1, batch_size=2, width=256, depth=4)
    steps = replicated.Steps(s)
    for b in (2, 5, 32):
        assert steps.at(b).peak_bytes == pytest.approx(trace("transformer", b, width=256, depth=4).peak_bytes,
                                                       rel=1e-6), b


def _sharded(prof, modes=("ddp", "zero1", "fsdp", "fsdp:noreshard", "fsdp:ring"), p=4):
    s = replicated.Setup("transformer", world=p, batch_size=16, width=256, depth=4, optimizer="adamw")
    steps = replicated.Steps(s)
    return steps.at(s.batch_size // p), {r["mode"]: r for r in per_mode.predict(list(modes), s, prof, steps)}


def test_sharding_divides_what_each_device_holds_as_the_formulas_say():
    """Per device, in B per fp32 parameter: DDP 4 + 4 + 4 (buckets) + 8 (Adam); ZeRO-1
    Adam / p; FSDP all of it / p plus what is gathered (a block and the next one
    prefetched, or every block without resharding); bytes per step 1, 2, 3, 2 × the
    parameters (the root, kept gathered, is not gathered again for backward)."""
    prof, p = hardware.load_profile("h100-sxm-nvlink"), 4
    st, rows = _sharded(prof, p=p)
    n = st.param_bytes
    unit = max(sum(st.params[i] for i in u.params) for u in st.units[:-1])
    root = sum(st.params[i] for i in st.units[-1].params)  # gathered from forward to the end of backward
    held = {m: r["tensor_breakdown_mb"] for m, r in rows.items()}
    mib = 2**20
    assert sum(held["ddp"].values()) * mib == pytest.approx(5 * n)
    assert held["zero1"]["optimizer_state"] * mib == pytest.approx(2 * n / p)
    for m in ("fsdp", "fsdp:noreshard", "fsdp:ring"):
        assert held[m]["parameters"] * mib == pytest.approx(n / p)
        assert held[m]["optimizer_state"] * mib == pytest.approx(2 * n / p)
    assert unit + root < held["fsdp"]["gathered"] * mib <= 2 * unit + root  # a block and the one prefetched
    assert held["fsdp:noreshard"]["gathered"] * mib == pytest.approx(n, rel=0.01)
    assert rows["fsdp"]["tensor_mb"] < rows["fsdp:noreshard"]["tensor_mb"] < rows["zero1"]["tensor_mb"] \
        < rows["ddp"]["tensor_mb"]
    for m, k in (("ddp", 1), ("zero1", 2), ("fsdp", 3), ("fsdp:noreshard", 2), ("fsdp:ring", 3)):
        again = root if m in ("fsdp", "fsdp:ring") else 0  # the root stays gathered into backward
        assert rows[m]["comm_mb"] * mib == pytest.approx(k * n - again, rel=1e-6), m
    # On a GPU the step's activations come on top of the tensors held.
    assert rows["fsdp"]["peak_memory_mb"][0] * mib == pytest.approx(
        rows["fsdp"]["tensor_mb"] * mib + st.activation_bytes + st.input_bytes + st.buffers_bytes)


def test_zero1_saves_ddp_exactly_the_sharded_optimizer_state_with_or_without_checkpointing():
    """On a GPU ZeRO-1 holds what DDP holds but (p-1)/p of the optimizer state. The sharded
    modes counted only the activations forward saves, where DDP counts the step's traced
    peak: under --checkpoint (then the whole model, recomputed in backward all at once)
    ZeRO-1 came out at 29 MB against DDP's 185, and 40 MB apart without it."""
    prof, p = hardware.load_profile("rtx4090-pcie4"), 4
    for checkpoint in (False, True):
        s = replicated.Setup("transformer", world=p, batch_size=256, width=256, depth=2, optimizer="adamw",
                             checkpoint=checkpoint)
        steps = replicated.Steps(s)
        rows = {r["mode"]: r for r in per_mode.predict(["ddp", "zero1", "fsdp"], s, prof, steps)}
        state = 2 * steps.at(s.micro_batch()).param_bytes  # AdamW's two moments
        ddp, zero1 = (max(rows[m]["peak_memory_mb"]) * 2**20 for m in ("ddp", "zero1"))
        assert ddp - zero1 == pytest.approx(state * (p - 1) / p, rel=1e-6), checkpoint
        assert max(rows["fsdp"]["peak_memory_mb"]) < max(rows["zero1"]["peak_memory_mb"])


def test_fsdp_schedule_hides_its_collectives_only_where_they_can_overlap():
    """A link with no cost leaves FSDP the compute and its sharded optimizer step; where
    ranks outnumber cores (no overlap) every collective is exposed; with overlap some
    of them hide behind forward and backward."""
    prof = hardware.load_profile("rtx4090-pcie4")
    free = hardware.load_profile("rtx4090-pcie4")
    free.link = dict(free.link, gbps=1e12, call_latency_us=0.0, step_latency_us=0.0)
    free.memory_bandwidth_gbps = 1e12  # no reduction cost either (it is not compute the trace saw)
    _, rows = _sharded(free)
    r = rows["fsdp"]
    b = r["breakdown"]
    assert r["iter_ms"]["median"] == pytest.approx(b["forward_ms"] + b["backward_ms"] + b["optimizer_ms"], rel=1e-3)
    assert r["grad_sync_ms"]["exposed"] == pytest.approx(0, abs=1e-3)
    _, on = _sharded(prof)
    prof.overlap = False
    _, off = _sharded(prof)
    for m in ("fsdp", "fsdp:noreshard"):
        assert off[m]["grad_sync_ms"]["exposed"] == pytest.approx(off[m]["grad_sync_ms"]["total"])
        assert on[m]["grad_sync_ms"]["exposed"] < on[m]["grad_sync_ms"]["total"]
        assert on[m]["iter_ms"]["median"] < off[m]["iter_ms"]["median"]
    # Resharding gathers every block again for backward: more on the wire, never less time.
    assert on["fsdp"]["grad_sync_ms"]["total"] > on["fsdp:noreshard"]["grad_sync_ms"]["total"]
    _, bad = _sharded(prof, modes=("fsdp:nope",))
    assert bad["fsdp:nope"]["status"] == "unavailable" and "nope" in bad["fsdp:nope"]["reason"]


def _affine_bench(collective: str, names, p: int, a: float, b: float) -> dict:
    """A bench JSON whose every row is the algorithm's formula at α a µs, β b µs/B (no γ),
    4 KiB to 16 MiB: what this_host's fits and interpolation must give back."""
    from commlab import algorithms

    rows = [{"algorithm": n, "bytes": x, "time_us": algorithms.registry(collective).get(n).cost(p, x).time(a, b, 0.0)}
            for n in names for x in (4096, 65536, 1 << 20, 16 << 20)]
    return {"collective": collective, "env": {"world_size": p, "gamma_us_per_byte": 3e-4}, "results": rows}


def test_this_host_fits_every_collective_the_sharded_modes_use():
    """compare --predict this-host benches what each mode calls (all-reduce for DDP's
    buckets, broadcast for ZeRO-1's parameters, all-gather and reduce-scatter by the
    fsdp mode's algorithm) and predicts from those fits; with ranks outnumbering cores
    every FSDP collective is exposed, its time the fitted formulas' sum."""
    from commlab import algorithms
    from commlab.experiments.compare.calibrate import host_collectives

    assert host_collectives(["ddp", "ddp:ring", "zero1", "fsdp", "fsdp:shm", "fsdp:noreshard"]) == {
        "all_reduce": ["builtin", "ring"], "broadcast": ["builtin"],
        "all_gather": ["builtin", "shm"], "reduce_scatter": ["builtin", "shm"]}
    p, a, b = 4, 30.0, 2e-3  # α µs, β µs/B: what the synthetic benches below are made of
    benches = [_affine_bench(c, names, p, a, b) for c, names in host_collectives(["ddp", "zero1", "fsdp:shm"]).items()]
    prof = hardware.this_host(benches, compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0)
    assert prof.fits["all_gather"]["shm"]["alpha_us"] == pytest.approx(a, rel=1e-3)
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    row = per_mode.predict(["fsdp:shm"], s, prof, steps)[0]
    st = steps.at(2)
    sizes = [sum(st.params[i] for i in u.params) for u in st.units]  # blocks, then the root
    cost = lambda c, n: algorithms.registry(c).get("shm").cost(p, n).time(a, b, 0.0)  # noqa: E731
    want = sum(2 * cost("all_gather", n) + cost("reduce_scatter", n) for n in sizes[:-1]) \
        + cost("all_gather", sizes[-1]) + cost("reduce_scatter", sizes[-1]) + 5.0e3
    assert row["grad_sync_ms"]["total"] * 1e3 == pytest.approx(want, rel=1e-6)
    assert row["grad_sync_ms"]["exposed"] == pytest.approx(row["grad_sync_ms"]["total"])
    # The measured step, less three quarters of its optimizer, plus the collectives and FSDP's copies.
    assert row["iter_ms"]["median"] > 500.0 - 0.75 * 50.0 + (want - 5.0e3) / 1e3
    # Each call's fresh output is first written inside it: the page faults the bench's
    # reused buffers never pay, measured on one idle process, stretched as 4 ranks share 2 cores.
    touched = hardware.this_host(benches, compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0,
                                 first_touch_us_per_byte=1e-4)
    again = per_mode.predict(["fsdp:shm"], s, touched, steps)[0]
    outputs = sum(2 * n + n / p for n in sizes[:-1]) + sizes[-1] + sizes[-1] / p
    assert (again["grad_sync_ms"]["total"] - row["grad_sync_ms"]["total"]) * 1e3 == pytest.approx(
        2 * 1e-4 * outputs, rel=1e-6)
    # Measured per size: glibc recycles a freed buffer below its mmap threshold (at most 32
    # MiB) from the heap, faulting nothing; above it every call's output is mmapped afresh
    # (docs/measurements.md, "What the tests rest on"). A size pays the rate measured at the
    # largest size not above it.
    big = max(sizes[:-1])
    table = [[1, 0.0], [big, 1e-4]]  # faults only from the blocks' size up
    stepped = hardware.this_host(benches, compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0,
                                 first_touch_us_per_byte=table)
    assert stepped.first_touch_us_per_byte == [[1, 0.0], [big, 2e-4]]  # stretched: 4 ranks share 2 cores
    assert hardware.first_touch_us(stepped, big - 1) == 0.0 and hardware.first_touch_us(stepped, big) == pytest.approx(2e-4 * big)
    third = per_mode.predict(["fsdp:shm"], s, stepped, steps)[0]
    gathered = sum(2 * n for n in sizes[:-1] if n >= big) + (sizes[-1] if sizes[-1] >= big else 0)
    assert (third["grad_sync_ms"]["total"] - row["grad_sync_ms"]["total"]) * 1e3 == pytest.approx(
        2e-4 * gathered, rel=1e-6)  # the all-gathers' block-sized outputs; the reduce-scatters' quarters, none


def test_this_host_charges_fsdp_the_waits_at_every_unit():
    """FSDP synchronises at every unit (each block's all-gathers and reduce-scatter), so its
    ranks wait at every one: this host charges the waits ddp:noop's marks give for those
    synchronisations (resharded: each block's forward, backward and backward's end; not:
    forward and backward's end), where DDP and ZeRO-1 keep the one figure per step their
    single synchronisation sees."""
    p, a, b = 4, 30.0, 2e-3
    names = ("shm", "builtin")  # fsdp:shm's, and FSDP2's own (gloo's) that fsdp:noreshard calls
    benches = [_affine_bench(c, names, p, a, b) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0)
    base = hardware.this_host(benches, **kw)
    units = hardware.this_host(benches, **kw, unit_waits_ms={"fbe": 70.0, "fe": 30.0, "unused": None})
    assert units.unit_waits_ms == {"fbe": 70.0, "fe": 30.0}
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    modes = ["ddp", "zero1", "fsdp:shm", "fsdp:noreshard"]
    before = {r["mode"]: r["grad_sync_ms"] for r in per_mode.predict(modes, s, base, steps)}
    after = {r["mode"]: r["grad_sync_ms"] for r in per_mode.predict(modes, s, units, steps)}
    for mode, wait in (("ddp", 5.0), ("zero1", 5.0), ("fsdp:shm", 70.0), ("fsdp:noreshard", 30.0)):
        # Without the marks every mode is charged the one figure per step (5 ms).
        assert before[mode]["exposed"] - before[mode]["after_arrival"] == pytest.approx(5.0), mode
        assert after[mode]["exposed"] - after[mode]["after_arrival"] == pytest.approx(wait), mode
        assert after[mode]["after_arrival"] == pytest.approx(before[mode]["after_arrival"]), mode
        assert "exposed_se" not in after[mode]  # no step-to-step spread measured: no ±
    # Each carries the standard error of the wait it is charged, over ddp:noop's steps: the
    # ± of compare's exposed row (the one figure's for DDP and ZeRO-1; FSDP's by its kinds).
    spread = hardware.this_host(benches, **kw, unit_waits_ms={"fbe": 70.0, "fe": 30.0},
                                wait_se_ms={"step": 2.0, "fbe": 9.0, "fe": 4.0, "unused": None})
    assert spread.wait_se_ms == {"step": 2.0, "fbe": 9.0, "fe": 4.0}
    got = {r["mode"]: r["grad_sync_ms"] for r in per_mode.predict(modes, s, spread, steps)}
    assert {m: got[m]["exposed_se"] for m in modes} == {"ddp": 2.0, "zero1": 2.0, "fsdp:shm": 9.0,
                                                        "fsdp:noreshard": 4.0}
    assert {m: got[m]["exposed"] for m in modes} == {m: after[m]["exposed"] for m in modes}
    # Without the marks FSDP is charged the one figure, and its spread.
    no_units = hardware.this_host(benches, **kw, wait_se_ms={"step": 2.0})
    assert per_mode.predict(["fsdp:shm"], s, no_units, steps)[0]["grad_sync_ms"]["exposed_se"] == 2.0


def test_this_host_charges_ddp_the_drift_through_its_optimizer_and_zero1_not():
    """DDP's ranks drift apart from one end of backward to the next, through the optimizer
    step between (arrival_skew_ms); ZeRO-1's broadcasts line them up after the optimizer, so
    it is charged the drift from the step's start ("step_start", with its own ±)."""
    p, a, b = 4, 30.0, 2e-3
    names = ("builtin",)
    benches = [_affine_bench(c, names, p, a, b) for c in ("all_reduce", "broadcast")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=40.0, optimizer_ms=50.0)
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    prof = hardware.this_host(benches, **kw, unit_waits_ms={"step_start": 15.0}, wait_se_ms={"step": 4.0, "step_start": 3.0})
    got = {r["mode"]: r for r in per_mode.predict(["ddp", "zero1"], s, prof, steps)}
    for mode, wait, se in (("ddp", 40.0, 4.0), ("zero1", 15.0, 3.0)):
        sync = got[mode]["grad_sync_ms"]
        assert sync["exposed"] - sync["after_arrival"] == pytest.approx(wait), mode
        assert sync["exposed_se"] == se, mode
    # ZeRO-1's other figures are DDP's, its broadcasts added: only the wait differs.
    old = {r["mode"]: r for r in per_mode.predict(["ddp", "zero1"], s, hardware.this_host(benches, **kw), steps)}
    z, z0 = got["zero1"]["grad_sync_ms"], old["zero1"]["grad_sync_ms"]
    assert z["after_arrival"] == pytest.approx(z0["after_arrival"])
    assert z["total"] == pytest.approx(z0["total"] - 40.0 + 15.0)
    assert got["zero1"]["iter_ms"] == old["zero1"]["iter_ms"]


def test_this_host_cannot_price_dp_or_a_mode_it_does_not_know():
    """On CPU ranks this-host has no DataParallel (one process driving GPUs) and no fit for a
    mode nobody can run: their rows say so, beside the modes it prices (compare's this-host
    columns show them as unavailable)."""
    p = 2
    benches = [_affine_bench("all_reduce", ("builtin", "shm"), p, 30.0, 2e-3)]
    prof = hardware.this_host(benches, compute_ms=20.0, ranks=p, cores=2)
    s = replicated.Setup("mlp", world=p, batch_size=16, width=64, depth=3)
    got = {r["mode"]: r for r in per_mode.predict(["dp", "ddp", "ddp:shm", "ddp:nope"], s, prof, replicated.Steps(s))}
    assert got["dp"]["status"] == got["ddp:nope"]["status"] == "unavailable", got
    assert got["ddp"]["status"] == got["ddp:shm"]["status"] == "ok"


def test_this_host_prices_fsdps_calls_as_training_issues_them():
    """FSDP's collectives come after compute, the ranks arriving apart and, where they
    outnumber the cores, the early ones asleep: this host's probe (measure.syncprobe)
    times a call after the last arrival and how far apart the ranks leave it. Each call
    is priced at the probe's ratio to the bench's back-to-back time, its exit spread added
    to the wait: a call in training takes far longer than the bench's, and the probe's
    comes close to training's (docs/measurements.md, "What the tests rest on")."""
    p, a, b, n16 = 4, 30.0, 2e-3, 16 << 20
    names = ("shm", "builtin")
    benches = [_affine_bench(c, names, p, a, b) for c in ("all_reduce", "all_gather", "reduce_scatter")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0,
              unit_waits_ms={"fbe": 7.0, "fe": 3.0})
    base = hardware.this_host(benches, **kw)
    at16 = {c: {n: hardware.collective_us(base, c, n, p, n16) for n in names} for c in ("all_gather", "reduce_scatter")}
    probe = {c: {n: {"after_us": 2 * t, "exit_spread_us": 0.5 * t, "bytes": n16} for n, t in by.items()}
             for c, by in at16.items()}
    slow = hardware.this_host(benches, **kw, in_training=probe)
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    for mode, drift in (("fsdp:shm", 7.0), ("fsdp:noreshard", 3.0)):
        before = per_mode.predict([mode], s, base, steps)[0]["grad_sync_ms"]
        after = per_mode.predict([mode], s, slow, steps)[0]["grad_sync_ms"]
        assert before["exposed"] - before["after_arrival"] == pytest.approx(drift)  # no probe: the drift alone
        # Every call twice the bench's (no page faults priced here): twice the communication.
        assert after["after_arrival"] == pytest.approx(2 * before["after_arrival"], rel=1e-9)
        # The wait: the drift between units, plus each call's exit spread (a quarter of its time).
        assert after["exposed"] - after["after_arrival"] == pytest.approx(drift + 0.25 * after["after_arrival"])
        # The probe's calls write fresh buffers as FSDP2's do: their page faults are in its
        # ratio, not charged again; without a probe a fresh output's faults are.
        touch = dict(first_touch_us_per_byte=1e-4)
        probed = per_mode.predict([mode], s, hardware.this_host(benches, **kw, **touch, in_training=probe), steps)[0]
        assert probed["grad_sync_ms"]["after_arrival"] == pytest.approx(after["after_arrival"], rel=1e-9)
        unprobed = per_mode.predict([mode], s, hardware.this_host(benches, **kw, **touch), steps)[0]
        assert unprobed["grad_sync_ms"]["after_arrival"] > before["after_arrival"]
        # A probe that timed nothing (no call after the last arrival) is no probe: the
        # bench's time and the fresh output's faults, as without one.
        empty = {c: {n: {**v, "after_us": 0.0} for n, v in by.items()} for c, by in probe.items()}
        void = per_mode.predict([mode], s, hardware.this_host(benches, **kw, **touch, in_training=empty), steps)[0]
        assert void["grad_sync_ms"] == pytest.approx(unprobed["grad_sync_ms"], rel=1e-9)


def test_this_host_prices_fsdps_calls_between_the_allocators_two_states():
    """Whether FSDP2's output for a call is mapped afresh (its pages faulted in inside the
    call) or recycled from the heap is the allocator's state at that moment, which nothing
    before the run tells, and a call into recycled buffers is much faster than one mapped
    afresh (docs/measurements.md, "What the tests rest on"). With the probe's call into
    recycled buffers beside the fresh one, the prediction is the middle of the two states'
    and its standard error takes in their range (as a mixture anywhere in it: half the range
    over √3); the range is in the breakdown. Without the recycled probe: the fresh one alone."""
    p, a, b, n16 = 4, 30.0, 2e-3, 16 << 20
    names = ("shm", "builtin")
    benches = [_affine_bench(c, names, p, a, b) for c in ("all_reduce", "all_gather", "reduce_scatter")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0,
              unit_waits_ms={"fbe": 7.0, "fe": 3.0}, wait_se_ms={"fbe": 0.3, "fe": 0.4})
    base = hardware.this_host(benches, **kw)
    at16 = {c: {n: hardware.collective_us(base, c, n, p, n16) for n in names} for c in ("all_gather", "reduce_scatter")}

    def probe(k):
        return {c: {n: {"after_us": k * t, "exit_spread_us": 0.25 * k * t, "bytes": n16} for n, t in by.items()}
                for c, by in at16.items()}

    both = probe(3.0)
    for c, by in both.items():
        for n in by:
            by[n]["reused"] = probe(1.5)[c][n]
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    for mode in ("fsdp", "fsdp:shm", "fsdp:noreshard"):
        fresh, recycled, mid = (per_mode.predict([mode], s, hardware.this_host(benches, **kw, in_training=pr), steps)[0]
                                for pr in (probe(3.0), probe(1.5), both))
        for key in ("exposed", "after_arrival", "total"):
            assert mid["grad_sync_ms"][key] == pytest.approx(
                (fresh["grad_sync_ms"][key] + recycled["grad_sync_ms"][key]) / 2, rel=1e-9), (mode, key)
        assert mid["iter_ms"]["median"] == pytest.approx((fresh["iter_ms"]["median"] + recycled["iter_ms"]["median"])
                                                         / 2, rel=1e-9)
        lo, hi = recycled["grad_sync_ms"]["exposed"], fresh["grad_sync_ms"]["exposed"]
        assert lo < hi and mid["breakdown"]["allocator_range_ms"]["exposed"] == pytest.approx([lo, hi])
        assert mid["breakdown"]["allocator_range_ms"]["iteration"] == pytest.approx(
            [recycled["iter_ms"]["median"], fresh["iter_ms"]["median"]])
        se = fresh["grad_sync_ms"]["exposed_se"]
        assert se == recycled["grad_sync_ms"]["exposed_se"] > 0
        assert mid["grad_sync_ms"]["exposed_se"] == pytest.approx((se ** 2 + ((hi - lo) / 2) ** 2 / 3) ** 0.5)
        assert "allocator_range_ms" not in fresh["breakdown"]
        assert mid["tensor_mb"] == fresh["tensor_mb"] and mid["comm_mb"] == fresh["comm_mb"]


def test_this_host_prices_what_is_left_of_ddps_buckets_after_backward_as_the_probe_times_it():
    """DDP's buckets left after backward are called after compute, the ranks arriving
    apart; in training that tail took far longer after the last arrival than the bench's
    back-to-back calls priced (docs/measurements.md, "What the tests rest on"). The
    probe's all-reduce in place at a bucket's size gives the ratio and how far apart the
    ranks leave it, as for FSDP's calls: the tail priced at the ratio, the spread joining
    the wait; a hardware profile (no probe) unchanged."""
    p, a, b, n = 4, 30.0, 2e-3, 8 << 20
    benches = [_affine_bench("all_reduce", ("builtin", "shm"), p, a, b)]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0)
    base = hardware.this_host(benches, **kw)
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, bucket_cap_mb=0.05)
    steps = replicated.Steps(s)
    probe = {"all_reduce": {"builtin": {"after_us": 3 * hardware.collective_us(base, "all_reduce", "builtin", p, n),
                                        "exit_spread_us": 0.0, "bytes": n}}}
    probe["all_reduce"]["builtin"]["exit_spread_us"] = probe["all_reduce"]["builtin"]["after_us"] / 10
    slow = hardware.this_host(benches, **kw, in_training=probe)
    before = per_mode.predict(["ddp", "ddp:shm"], s, base, steps)
    after = per_mode.predict(["ddp", "ddp:shm"], s, slow, steps)
    tail = before[0]["grad_sync_ms"]["after_arrival"]
    assert tail > 0
    assert after[0]["grad_sync_ms"]["after_arrival"] == pytest.approx(3 * tail, rel=1e-9)
    # The wait: the drift from one end of backward to the next, plus the ranks' exit spread.
    assert after[0]["grad_sync_ms"]["exposed"] - after[0]["grad_sync_ms"]["after_arrival"] == pytest.approx(
        5.0 + 0.3 * tail)
    assert after[0]["grad_sync_ms"]["total"] == pytest.approx(before[0]["grad_sync_ms"]["total"] + 2 * tail
                                                              + 0.3 * tail)
    # The longer tail delays the step; the wait does not (the measured compute holds it).
    assert after[0]["iter_ms"]["median"] == pytest.approx(before[0]["iter_ms"]["median"] + 2 * tail, rel=1e-9)
    # An algorithm not probed is priced as before.
    assert after[1]["grad_sync_ms"] == pytest.approx(before[1]["grad_sync_ms"], rel=1e-9)


def test_this_host_prices_zero1s_broadcasts_as_its_probe_timed_them_together():
    """ZeRO-1 broadcasts every parameter from its owner after the step, asynchronously
    (gloo's two worker threads take them in turn) and waits for them together: priced one
    call after another from the bench, they came out well over what training measured
    (docs/measurements.md, "What the tests rest on"). On this host the probe of that phase,
    with the model's parameters, scales them; its exit spread joins the wait; a hardware
    profile is unchanged."""
    from commlab.experiments.predict import sharded as S
    from commlab.measure.syncprobe import ZERO1

    p, a, b = 4, 30.0, 2e-3
    benches = [_affine_bench(c, ("builtin",), p, a, b) for c in ("all_reduce", "broadcast")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=5.0, optimizer_ms=50.0,
              unit_waits_ms={"step_start": 4.0})
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    base = hardware.this_host(benches, **kw)
    params = steps.at(steps.b).params
    priced = sum(hardware.collective_us(base, "broadcast", "builtin", p, n) for n in params)
    probe = {ZERO1: {"builtin": {"after_us": 0.6 * priced, "exit_spread_us": 0.1 * priced, "bytes": sum(params),
                                 "sizes": list(params)}}}
    before = per_mode.predict(["zero1"], s, base, steps)[0]
    after = per_mode.predict(["zero1"], s, hardware.this_host(benches, **kw, in_training=probe), steps)[0]
    assert before["breakdown"]["broadcast_ms"] == pytest.approx(priced / 1e3)
    assert after["breakdown"]["broadcast_ms"] == pytest.approx(0.6 * priced / 1e3)
    assert S.zero1_broadcasts_us(hardware.this_host(benches, **kw, in_training=probe), p, params) == pytest.approx(
        (0.6 * priced, 0.1 * priced))
    gap = lambda r: r["grad_sync_ms"]["exposed"] - r["grad_sync_ms"]["after_arrival"]  # noqa: E731
    assert gap(before) == pytest.approx(4.0) and gap(after) == pytest.approx(4.0 + 0.1 * priced / 1e3)
    assert after["iter_ms"]["median"] == pytest.approx(before["iter_ms"]["median"] - 0.4 * priced / 1e3)
    # Probed with other parameters (another model): the same ratio to the bench's price.
    half = {ZERO1: {"builtin": dict(probe[ZERO1]["builtin"], sizes=params[: len(params) // 2])}}
    half_priced = sum(hardware.collective_us(base, "broadcast", "builtin", p, n) for n in params[: len(params) // 2])
    got, _ = S.zero1_broadcasts_us(hardware.this_host(benches, **kw, in_training=half), p, params)
    assert got == pytest.approx(priced * 0.6 * priced / half_priced)


def test_this_host_charges_zero1_the_wait_at_its_broadcasts_after_its_optimizer():
    """ZeRO-1's ranks, lined up by the buckets, step their quarters at once and the
    broadcasts wait for the slowest: 4 ranks on 2 cores reached them far apart and waited
    there every step, which the prediction did not charge: ZeRO-1 was under-predicted
    (docs/measurements.md, "What the tests rest on"). From the probe of that phase:
    the wait added to the drift before the buckets (± of both), the phase (the slowest
    rank's pace) in place of 1/p of the optimizer; a probe after fixed work, as before."""
    from commlab.measure.syncprobe import ZERO1

    p, a, b = 4, 30.0, 2e-3
    benches = [_affine_bench(c, ("builtin",), p, a, b) for c in ("all_reduce", "broadcast")]
    kw = dict(compute_ms=500.0, ranks=p, cores=2, arrival_skew_ms=40.0, optimizer_ms=80.0,
              unit_waits_ms={"step_start": 15.0}, wait_se_ms={"step": 4.0, "step_start": 3.0})
    s = replicated.Setup("transformer", world=p, batch_size=8, width=128, depth=2, optimizer="adamw")
    steps = replicated.Steps(s)
    phase = {"after_us": 5e3, "exit_spread_us": 0.0, "bytes": 1, "sizes": [1], "state": "adamw",
             "wait_mean_us": 30e3, "wait_mean_se_us": 4e3, "work_to_last_us": 50e3}
    fixed = dict(phase, state="fresh")
    before, after = (per_mode.predict(["zero1"], s, hardware.this_host(benches, **kw, in_training={ZERO1: {"builtin": g}}), steps)[0]
                     for g in (fixed, phase))
    gap = lambda r: r["grad_sync_ms"]["exposed"] - r["grad_sync_ms"]["after_arrival"]  # noqa: E731
    assert gap(before) == pytest.approx(15.0) and before["grad_sync_ms"]["exposed_se"] == 3.0
    assert gap(after) == pytest.approx(15.0 + 30.0)
    assert after["grad_sync_ms"]["exposed_se"] == pytest.approx(5.0)  # (3² + 4²)^½
    assert before["breakdown"]["optimizer_ms"] == pytest.approx(20.0) and after["breakdown"]["optimizer_ms"] == 50.0
    assert after["iter_ms"]["median"] == pytest.approx(before["iter_ms"]["median"] + 30.0)
    # A hardware profile: a device per rank, 1/p of the optimizer and no wait there.
    from commlab.experiments.predict import sharded as S

    assert S.zero1_optimizer_us(hardware.load_profile("h100-sxm-nvlink"), 8, 800.0) == (100.0, 0.0, None)


def test_this_host_prices_a_call_from_the_bench_times_around_its_size():
    """Between two sizes the bench timed, a call costs what the bench measured there,
    interpolated; the α-β fit only past them. gloo's all-gather grows faster than linearly
    past 16 MiB: the fit put 64 MiB well under what the bench measured, and FSDP's 48 MiB
    blocks fall in between (docs/measurements.md, "What the tests rest on")."""
    times = {4096: 1000.0, 1 << 20: 2000.0, 16 << 20: 14000.0, 64 << 20: 100000.0}
    bench = {"collective": "all_gather", "env": {"world_size": 4, "gamma_us_per_byte": 3e-5},
             "results": [{"algorithm": "builtin", "bytes": n, "time_us": t} for n, t in times.items()]}
    prof = hardware.this_host([bench], compute_ms=100.0, ranks=4, cores=2)
    for n, t in times.items():
        assert hardware.collective_us(prof, "all_gather", "builtin", 4, n) == pytest.approx(t)
    assert hardware.collective_us(prof, "all_gather", "builtin", 4, 48 << 20) == pytest.approx(14000 + 86000 * 32 / 48)
    f = prof.fits["all_gather"]["builtin"]
    from commlab import algorithms

    fitted = algorithms.registry("all_gather").get("builtin").cost(4, 128 << 20).time(
        f["alpha_us"], f["beta_us_per_byte"], f["gamma_us_per_byte"])
    assert hardware.collective_us(prof, "all_gather", "builtin", 4, 128 << 20) == pytest.approx(fitted)


@pytest.mark.parametrize("name", hardware.profile_names())
def test_every_profile_cites_its_numbers(name):
    prof = hardware.load_profile(name)
    assert prof.device == "cuda" and prof.memory_bytes > 0 and prof.memory_bandwidth_gbps > 0
    assert {"fp32", "tf32", "fp16", "bf16"} <= set(prof.peak_tflops)
    assert {"gbps", "call_latency_us", "step_latency_us", "p2p"} <= set(prof.link)
    cited = " ".join(x["what"] for x in prof.sources)
    for fact in ("peak_tflops", "call_latency_us"):
        assert fact in cited, (name, fact)
    assert all(x["source"] for x in prof.sources)
    with pytest.raises(ValueError, match="no hardware profile"):
        hardware.load_profile("no-such-card")


def test_accumulation_computes_every_micro_step_and_communicates_as_compare_does():
    """--accum-steps k (compare's: k micro-steps of batch / world / k, one optimizer step):
    DDP and ZeRO-1 reduce in the last micro-step only, DP moves everything in each, FSDP
    gathers in each and reduce-scatters once, holding every unit's full gradients until
    then. predict ignored it (every mode priced one micro-step of the whole batch)."""
    prof, p, mib = hardware.load_profile("h100-sxm-nvlink"), 4, 2**20
    rows = {}
    for k in (1, 2):
        s = replicated.Setup("transformer", world=p, batch_size=32, width=256, depth=4, optimizer="adamw", accum_steps=k)
        steps = replicated.Steps(s)
        rows[k] = {r["mode"]: r for r in per_mode.predict(["ddp", "zero1", "fsdp", "fsdp:noreshard", "dp"], s, prof, steps)}
    st = steps.at(s.micro_batch())
    n, root = st.param_bytes, sum(st.params[i] for i in st.units[-1].params)
    one, two = rows[1], rows[2]
    for m, r in two.items():
        b = r["breakdown"]
        assert (b["micro_steps"], b["micro_batch"], b["per_device_batch"]) == (2, 4, 8), m
        assert b["forward_ms"] < one[m]["breakdown"]["forward_ms"], m  # half the batch a micro-step
    for m in ("ddp", "zero1"):  # the same reduction once a step, after two micro-steps of compute
        assert two[m]["comm_mb"] == one[m]["comm_mb"]
        assert two[m]["grad_sync_ms"]["total"] == pytest.approx(one[m]["grad_sync_ms"]["total"])
    b = two["ddp"]["breakdown"]
    assert two["ddp"]["iter_ms"]["median"] == pytest.approx(2 * (b["forward_ms"] + b["backward_ms"])
                                                            + b["optimizer_ms"] + two["ddp"]["grad_sync_ms"]["exposed"])
    assert two["dp"]["grad_sync_ms"]["total"] > 1.9 * one["dp"]["grad_sync_ms"]["total"]  # replicas, every forward
    # FSDP: the gathers again in the second micro-step (compare measured 5 x 4 B/param with
    # resharding); without resharding once per micro-step, and the reduce-scatters once.
    assert two["fsdp"]["comm_mb"] * mib == pytest.approx(5 * n - 2 * root)
    assert two["fsdp:noreshard"]["comm_mb"] * mib == pytest.approx(3 * n)
    for m in ("fsdp", "fsdp:noreshard"):
        held, before = two[m]["tensor_breakdown_mb"], one[m]["tensor_breakdown_mb"]
        assert held["gradients"] * mib >= n - max(sum(st.params[i] for i in u.params) for u in st.units), m
        assert held["gradients"] > before["gradients"] and two[m]["tensor_mb"] > one[m]["tensor_mb"], m
    # This host: the measured compute-only step holds every micro-step, shared out among them.
    host = hardware.Profile(name="t", description="", device="cpu", memory_bytes=0.0, memory_bandwidth_gbps=0.0,
                            peak_tflops={}, link={}, compute_ms=100.0, optimizer_ms=10.0, overlap=False)
    t = hardware.op_times_us(st, host, None, micro_steps=2)
    micro = sum(x for x, o in zip(t, st.ops) if o.phase != "opt")
    assert 2 * micro / 1e3 + sum(x for x, o in zip(t, st.ops) if o.phase == "opt") / 1e3 == pytest.approx(100.0)


@needs_torchvision
def test_max_batch_is_the_largest_that_fits():
    s = replicated.Setup("resnet50", world=4, batch_size=64)
    steps = replicated.Steps(s)
    prof = hardware.load_profile("rtx4090-pcie4")
    limit = 8 << 30
    for mode in ("dp", "ddp"):
        got = per_mode.max_batch(mode, s, prof, steps, limit)
        assert got % 4 == 0
        mem = [max(per_mode.predict([mode], replicated.Setup("resnet50", world=4, batch_size=b), prof, steps)[0]["peak_memory_mb"])
               for b in (got, got + 4)]
        assert mem[0] * 2**20 <= limit < mem[1] * 2**20


@pytest.mark.slow
@needs_torchvision
def test_predict_cli_prints_the_seeds_table_and_json(tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "commlab.predict", "--hardware", "rtx4090-pcie4", "--gpus", "4",
                           "--model", "resnet50", "--batch-size", "256", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "| iteration median (ms) |" in proc.stdout and "dp (pred)" in proc.stdout and "# source:" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["predicted"] is True and [m["mode"] for m in doc["modes"]] == ["dp", "ddp", "ddp:noop"]
    for m in doc["modes"]:
        assert m["predicted"] is True
        assert {"iter_ms", "samples_per_s", "peak_memory_mb", "util_percent", "grad_sync_ms", "final_loss"} <= set(m)
    bad = subprocess.run([sys.executable, "-m", "commlab.predict", "--hardware", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no hardware profile 'nope'" in bad.stderr
