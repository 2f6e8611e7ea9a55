"""commlab.advise (the seed's decision tree) and commlab.doctor (its troubleshooting
section): every rule, every check's verdicts, and the in-job data/gradient checks."""
import json
import os
import subprocess
import sys

import pytest
import torch
from ranks import run_main
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from commlab.diagnostics import advise, doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kwargs,verdict,rule", [
    ({"gpus": 8, "nodes": 2}, "DDP required", "nodes > 1"),
    ({"gpus": 4}, "DDP strongly recommended", "GPUs per node >= 4"),
    ({"gpus": 2, "model_mem_frac": 0.6}, "DDP required", "model memory > 50% of a card"),
    ({"gpus": 2, "amp": True}, "DDP recommended", "mixed precision"),
    ({"gpus": 3, "batch_size": 96, "iter_ms": 60}, "DP acceptable", "small experiment"),
    ({"gpus": 2, "batch_size": 128}, "DDP recommended", "outside the small-experiment case"),
    ({"gpus": 2, "iter_ms": 150}, "DDP recommended", "outside the small-experiment case"),
    ({"gpus": 2, "custom_cpp": True}, "DDP recommended", "outside the small-experiment case"),
])
def test_decision_tree(kwargs, verdict, rule):
    got, findings = advise.decide(**kwargs)
    assert got == verdict
    assert rule in [f.rule for f in findings]
    assert all(f.reason for f in findings)


def test_every_firing_rule_is_reported():
    verdict, findings = advise.decide(gpus=4, nodes=2, model_mem_frac=0.7, amp=True)
    assert verdict == "DDP required"
    assert {f.rule for f in findings} == {"nodes > 1", "GPUs per node >= 4", "model memory > 50% of a card",
                                          "mixed precision"}


def test_advise_from_measurements(tmp_path, capsys):
    doc = {"env": {}, "modes": [
        {"mode": "dp", "status": "ok", "iter_ms": {"median": 152.0, "p90": 160.0}, "peak_memory_mb": [19200, 14100]},
        {"mode": "ddp", "status": "ok", "iter_ms": {"median": 89.0, "p90": 95.0}, "peak_memory_mb": [14700, 14700]},
        {"mode": "ddp:ps", "status": "oom", "reason": "CUDA out of memory"},
    ]}
    lines = advise.from_compare(doc)
    assert any("DDP is 1.71x DP's speed -> DDP" in line for line in lines), lines
    assert any("ddp:ps: oom" in line for line in lines)
    assert any("+4500 MB" in line for line in lines)
    src = tmp_path / "c.json"
    src.write_text(json.dumps(doc))
    assert advise.main(["--from", str(src), "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "fastest: ddp" in out and "DDP strongly recommended" in out


def _row(mode, ms, mb, comm=0.0, state=0.0, opt=None):
    return {"mode": mode, "status": "ok", "iter_ms": {"median": ms, "p90": ms}, "peak_memory_mb": [mb] * 4,
            "comm_mb": comm, "tensor_mb": mb, "tensor_breakdown_mb": {"optimizer_state": state},
            "breakdown": {"optimizer_ms": opt}}


@pytest.mark.parametrize("limit,verdict,rules", [
    # Everything fits: DDP is fastest, and sharding's extra bytes are what it costs.
    (30000, "DDP", {"the fastest that fits"}),
    # DDP no longer fits; the optimizer state divided is enough, but FSDP without
    # resharding fits too and is faster.
    (18000, "FSDP without resharding (ZeRO-2-like)", {"model + optimizer state above a device",
                                                     "sharding the optimizer state brings it under",
                                                     "FSDP's second all-gather costs more than it saves"}),
    # Only resharding fits.
    (8000, "FSDP (ZeRO-3)", {"model + optimizer state above a device", "only resharding fits"}),
    (1000, "nothing fits", {"every mode above the limit"}),
])
def test_sharding_decision_is_the_fastest_mode_that_fits_with_its_reasons(limit, verdict, rules):
    rows = [_row("ddp", 100.0, 23000, 4600, 9000, opt=40.0), _row("zero1", 130.0, 17000, 9200),
            _row("fsdp:noreshard", 110.0, 9600, 9200, opt=10.0), _row("fsdp", 140.0, 6600, 13800)]
    got, findings = advise.sharding(rows, limit)
    if verdict.startswith("FSDP without"):  # the winner's reason cites its numbers against DDP's
        assert any("optimizer step 10.0 ms against DDP's 40.0" in f.reason for f in findings), findings
    assert got == verdict
    assert rules <= {f.rule for f in findings}, findings
    assert all(f.reason for f in findings)
    fit = {f.rule.split()[0]: f.verdict for f in findings if f.rule.endswith(" memory")}
    assert fit == {m: "fits" if mb <= limit else "does not fit"
                   for m, mb in (("ddp", 23000), ("zero1", 17000), ("fsdp:noreshard", 9600), ("fsdp", 6600))}


@pytest.mark.slow
def test_advise_sharding_cli_predicts_a_gpu_profile(monkeypatch, capfd):
    proc = run_main(advise.main, ["--hardware", "rtx4090-pcie4", "--gpus", "4", "--model", "transformer", "--width",
                                  "256", "--depth", "2", "--mem-limit-mb", "40"], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr
    assert "# DDP, ZeRO-1/2 or FSDP (predicted on rtx4090-pcie4):" in proc.stdout
    for mode in ("ddp memory", "zero1 memory", "fsdp:noreshard memory", "fsdp memory"):
        assert mode in proc.stdout


@pytest.mark.slow
def test_where_nothing_fits_advise_predicts_accumulation_and_recomputation_at_the_same_batch():
    """"Nothing fits" said only "checkpoint activations, mixed precision or a smaller batch",
    with no number behind it. Now every mode is predicted again with --checkpoint and with
    the global batch split into 2, 4, ... micro-steps: the verdict is the fastest that fits,
    its figures those commlab.predict gives for the same flags; where even one sample per
    device does not fit, the least it could take is named (where the parameters, gradients
    and optimizer state alone do not fit, which neither option shrinks, nothing is tried)."""
    from commlab.experiments.predict import hardware, per_mode, replicated

    got = {}
    for limit in (120, 60, 16, 10):
        verdict, findings, rows = advise.predicted_sharding("rtx4090-pcie4", 4, "transformer", 256, 256, 2, None, limit)
        assert all(max(r["peak_memory_mb"]) > limit for r in rows)  # nothing fits as asked
        got[limit] = verdict, findings[-1]
    prof = hardware.load_profile("rtx4090-pcie4")
    for limit in (120, 60):
        verdict, f = got[limit]
        mode = next(k for k, name in advise.SHARDING.items() if verdict.startswith(name + " with "))
        accum = int(verdict.split("--accum-steps ")[1]) if "--accum-steps" in verdict else 1
        s = replicated.Setup("transformer", world=4, batch_size=256, width=256, depth=2, optimizer="adamw",
                             checkpoint="--checkpoint" in verdict, accum_steps=accum)
        again = per_mode.predict([mode], s, prof)[0]
        assert max(again["peak_memory_mb"]) <= limit and f"{max(again['peak_memory_mb']):.0f} MB" in f.reason
        assert f"{again['iter_ms']['median']:.1f} ms per iteration" in f.reason
        # The fastest that fits: no option tried is faster and fits.
        for o in advise.remedies(replicated.Setup("transformer", world=4, batch_size=256, width=256, depth=2,
                                                  optimizer="adamw"), prof, limit, "cuda"):
            assert not (o["fits"] and o["ms"] < again["iter_ms"]["median"] - 1e-9), o
    assert got[60][0] != got[120][0]  # a tighter limit needs smaller micro-steps
    verdict, f = got[16]  # the tensors fit, not even one sample per device beside them
    assert verdict == "nothing fits" and f.rule == "not even recomputed and accumulated" and "micro-batch 1" in f.reason
    verdict, f = got[10]  # not even the tensors: nothing is predicted again
    assert verdict == "nothing fits" and f.rule == "not even recomputed and accumulated" and "alone are" in f.reason


@pytest.mark.slow
def test_doctor_cli_smoke_tests_every_algorithm(monkeypatch, capfd):
    import commlab

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    proc = run_main(doctor.main, ["--world-size", "2", "--timeout", "20"], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in commlab.algorithms.for_device("cpu"):
        assert f"[PASS] all-reduce {name}: 2 local ranks correct" in proc.stdout, proc.stdout
    assert "[PASS] host layout: 1 host(s), 2 ranks" in proc.stdout
    assert "[PASS] /dev/shm" in proc.stdout or "[WARN] /dev/shm" in proc.stdout


def layout_check(rank, p, hosts):
    os.environ["COMMLAB_HOST_ID"] = f"h{hosts[rank]}"
    try:
        c = doctor.check_layout()
        return c.status, c.detail, c.fix
    finally:
        del os.environ["COMMLAB_HOST_ID"]


@pytest.mark.parametrize("hosts,status,says", [
    ([0, 0, 1, 1], doctor.PASS, ["2 host(s), 4 ranks (host 0: ranks 0-1; host 1: ranks 2-3)",
                                 "shm reduce-scatter on each host into 2 shard(s) -> builtin all-reduce of each shard "
                                 "across 2 hosts", "auto on CPU tensors: hier"]),
    ([0, 0, 0, 1], doctor.PASS, ["host 0: ranks 0-2; host 1: ranks 3", "into 1 shard(s)",
                                 "hosts with more than 1 ranks reduce the whole tensor in shm"]),
    ([0, 1, 2, 2], doctor.PASS, ["3 host(s)"]),
    ([0, 1, 0, 1], doctor.WARN, ["host 0: ranks 0,2; host 1: ranks 1,3"]),
    ([0, 1, 2, 3], doctor.PASS, ["hier = builtin across the hosts", "auto on CPU tensors: builtin"]),
    ([0, 0, 0, 0], doctor.PASS, ["1 host(s), 4 ranks", "hier = shm on this host", "auto on CPU tensors: shm"]),
])
@pytest.mark.slow
def test_doctor_reports_the_host_layout_and_hiers_path(ranks, hosts, status, says):
    got = ranks.run(4, layout_check, hosts)
    assert all(g == got[0] for g in got), got  # every rank sees the same layout
    assert got[0][0] == status, got[0]
    for text in says:
        assert text in got[0][1], (text, got[0][1])
    if status == doctor.WARN:
        assert "not numbered host by host" in got[0][2]


@pytest.mark.slow
def test_doctor_under_torchrun_checks_the_jobs_ranks():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "commlab.doctor", "--timeout", "20"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[PASS] host layout: 1 host(s), 2 ranks (host 0: ranks 0-1); hier = shm on this host" in proc.stdout
    assert "[PASS] all-reduce hier: 2 ranks correct" in proc.stdout, proc.stdout
    assert proc.stdout.count("# ") == 1  # rank 0 alone reports


def test_rendezvous_checks(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert doctor.check_rendezvous()[0].status == doctor.FAIL
    from commlab.measure.launch import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("RANK", raising=False)
    checks = doctor.check_rendezvous()
    assert [c.status for c in checks] == [doctor.PASS, doctor.PASS] and "free" in checks[1].detail
    monkeypatch.setenv("MASTER_PORT", "http")
    assert doctor.check_rendezvous()[-1].status == doctor.FAIL


def data_checks(rank, p):
    ds = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(32, 2))
    plain = doctor.check_data(DataLoader(ds, batch_size=4))
    out = {"plain": (plain.status, plain.detail)}
    # A training loop that forgets set_epoch(): the check runs once per epoch.
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    out["forgot"] = [(c.status, c.fix) for c in (doctor.check_data(loader) for _ in range(2))]
    # The correct loop: set_epoch(epoch) first, then the check.
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    correct = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        correct.append(doctor.check_data(loader).status)
    out["correct"] = correct
    # epochs=2 on a correct shuffling sampler: the check advances the epoch itself.
    fresh = DistributedSampler(ds, shuffle=True, seed=0)
    out["two_epochs"] = doctor.check_data(DataLoader(ds, batch_size=4, sampler=fresh), epochs=2).status
    out["epoch_restored"] = fresh.epoch
    return out


@pytest.mark.slow
def test_check_data_flags_identical_batches_and_missing_set_epoch(ranks):
    for out in ranks.run(2, data_checks):
        assert out["plain"][0] == doctor.WARN and "same first batch" in out["plain"][1]
        (s1, _), (s2, fix2) = out["forgot"]
        assert s1 == doctor.PASS and s2 == doctor.WARN and "set_epoch" in fix2, out
        assert out["correct"] == [doctor.PASS] * 3, out
        assert out["two_epochs"] == doctor.PASS and out["epoch_restored"] == 0, out


def grad_checks(rank, p):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model(torch.ones(2, 4)).sum().backward()
    clean = doctor.check_grads(model)
    if rank == 1:
        model[1].weight.grad[0, 0] = float("nan")
    dirty = doctor.check_grads(model)
    return clean.status, dirty.status, dirty.detail


def test_check_grads_names_rank_and_parameter(ranks):
    for clean, dirty, detail in ranks.run(3, grad_checks):
        assert clean == doctor.PASS
        assert dirty == doctor.FAIL and detail == "non-finite gradients on rank 1: 1.weight"
