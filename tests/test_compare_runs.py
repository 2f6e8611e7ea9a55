"""commlab.compare end to end: the CLI writes the documented JSON, table and traces. The
documentation's runs are fresh processes, verbatim, started ahead of their tests two at a
time (tests/ahead.py); the others call the CLI's main in the test's process with the
command line a user types (their ranks forked from the tests' server, as a run forks
them from its own). None of them asserts anything about time."""
import json
import os
import statistics
import sys

import ahead
import pytest
from ranks import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import doc_blocks  # noqa: E402

# docs/predict.md's this-host example and docs/compare.md's user's model, run here verbatim
# (tests/test_docs.py leaves them to this file).
EXAMPLES = {("this-host" if "this-host" in b.code else "users-model"): b
            for b in doc_blocks.run_by("tests/test_compare_runs.py")}
MODE_KEYS = {"mode", "status", "reason", "iter_ms", "samples_per_s", "peak_memory_mb", "util_percent",
             "grad_sync_ms", "final_loss"}


SMALL = ["--model", "mlp", "--width", "64", "--depth", "3", "--batch-size", "16", "--iters", "3", "--warmup", "1",
         "--bucket-cap-mb", "0.01"]


THIS_HOST = {"COMMLAB_PROBE_REPS": "4", "COMMLAB_BENCH_BUDGET": "0.02"}  # this-host's bench and probes, short


def _documented(tmp_path, example: str) -> ahead.Launch:
    """A documented run, in a folder of its own (its --json lands there)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return ahead.Launch(["bash", "-euo", "pipefail", "-c", EXAMPLES[example].code], cwd=tmp_path, timeout=600,
                        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=path, **THIS_HOST))


launches = ahead.launches({
    "test_the_documented_this_host_prediction": lambda tmp: _documented(tmp, "this-host"),
    "test_compare_trains_the_users_model": lambda tmp: _documented(tmp, "users-model"),
})


def _cmp(tmp, *args, **env):
    """`python -m commlab.compare --device cpu --world-size 2 ARGS --json <tmp>/c.json`."""
    return "compare", ["--device", "cpu", "--world-size", "2", *args, "--json", str(tmp / "c.json")], env


RUNS = {
    "test_compare_cpu_modes": lambda tmp: _cmp(
        tmp, "--modes", "dp,ddp,ddp:ring,ddp:shm,ddp:noop,ddp:nope,ddp@commlab", *SMALL, "--accum-steps", "2", "--amp",
        "bf16", "--checkpoint"),
    "test_emulated_memory_limit_on_cpu": lambda tmp: _cmp(
        tmp, "--modes", "ddp,ddp:shm", "--model", "mlp", "--width", "64", "--depth", "2", "--batch-size", "8",
        "--iters", "2", "--warmup", "1", "--bucket-cap-mb", "0.01,1", "--mem-limit-mb", "0.001"),
    "test_more_ranks_than_gpus_is_a_clear_error_before_anything_starts": lambda tmp: (
        "compare", ["--device", "cuda", "--world-size", "4"], {}),
    "test_trace_is_a_chrome_trace_that_agrees_with_the_table": lambda tmp: _cmp(
        tmp, "--modes", "ddp,ddp:shm", *SMALL, "--trace", str(tmp / "t")),
    "test_trace_of_the_sharded_modes_agrees_with_the_table": lambda tmp: _cmp(
        tmp, "--modes", "zero1,fsdp:shm", "--model", "transformer", "--width", "32", "--depth", "2", "--batch-size",
        "8", "--iters", "3", "--warmup", "1", "--trace", str(tmp / "t")),
    "test_compare_repeat_runs_and_pools_end_to_end": lambda tmp: _cmp(
        tmp, "--modes", "ddp", *SMALL, "--repeat", "2", "--predict", "this-host", "--trace", str(tmp / "t"),
        **THIS_HOST),
    "test_predict_cli_takes_the_users_model": lambda tmp: (
        "predict", ["--hardware", "h100-sxm-nvlink", "--gpus", "2", "--model", "tests.models:tiny_mlp", "--input-shape",
                    "32", "--batch-size", "64", "--json", str(tmp / "p.json")], {}),
    "test_a_factory_that_returns_no_module_is_a_clear_error": lambda tmp: (
        "compare", ["--device", "cpu", "--model", "tests.models:not_a_model"], {}),
}


@pytest.fixture
def ran(request, tmp_path, monkeypatch, capfd):
    """This test's command (RUNS) through its CLI's main: (its outcome, its folder)."""
    from commlab.experiments.compare.cli import main as compare
    from commlab.experiments.predict.cli import main as predict

    tool, args, env = RUNS[request.node.originalname](tmp_path)
    main = {"compare": compare, "predict": predict}[tool]
    return run_main(main, args, monkeypatch, capfd, **env), tmp_path


@pytest.mark.slow
def test_the_documented_this_host_prediction(launches, request):
    """docs/predict.md's `compare --predict this-host`: commlab.predict's columns beside the
    measured ones, same mode names, priced from this host's compute-only step and collectives."""
    proc, tmp_path, _ = launches.take(request)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "this-host.json").read_text())
    modes = {m["mode"]: m for m in doc["modes"] if not m.get("predicted")}
    pred = {m["mode"]: m for m in doc["modes"] if m.get("predicted")}
    assert set(pred) == {"ddp", "ddp:shm", "ddp:noop"}, pred
    for name in pred:
        assert MODE_KEYS <= set(pred[name]) and pred[name]["status"] == "ok", pred[name]
    # this-host's compute is the measured compute-only step, run first and last and pooled;
    # communication adds to it.
    noops = [m for m in doc["modes"] if m["mode"] == "ddp:noop" and not m.get("predicted")]
    assert [m.get("label") for m in noops] == ["ddp:noop (first)", "ddp:noop (last)"]
    assert doc["modes"][0].get("label") == "ddp:noop (first)"  # before every other mode
    assert "ddp:noop (first)" in proc.stdout and "ddp:noop (last)" in proc.stdout
    pooled = [t for m in noops for t in m["iteration_ms"]]
    assert pred["ddp:noop"]["iter_ms"]["median"] == pytest.approx(statistics.median(pooled))
    assert modes["ddp:noop"]["arrival_skew_ms"] >= 0
    # The ends of backward the wait is predicted from: one per timed iteration, each inside
    # its own iteration (the measuring step after the timed ones counted as part of the
    # last, whose end of backward then came an extra step late).
    ends, its = modes["ddp:noop"]["backward_end_ms"], modes["ddp:noop"]["iteration_ms"]
    assert len(ends) == len(its) > 0 and all(0 < e <= t for e, t in zip(ends, its)), (ends, its)
    # And what FSDP's waits are predicted from: the drift between every pair of units; ZeRO-1's:
    # from each step's start.
    assert set(modes["ddp:noop"]["unit_waits_ms"]) == {"fbe", "fe", "step_start"}
    assert set(modes["ddp:noop"]["wait_se_ms"]) == {"step", "fbe", "fe", "step_start"}
    assert all(w >= 0 for w in modes["ddp:noop"]["unit_waits_ms"].values())
    for name in ("ddp", "ddp:shm"):
        assert modes[name]["status"] == "ok", modes[name]
        assert pred[name]["iter_ms"]["median"] > pred["ddp:noop"]["iter_ms"]["median"]
        assert pred[name]["grad_sync_ms"]["total"] > 0
        # The arrival skew is charged to the exposed sync, not to its part after the last arrival;
        # so is how far apart the ranks leave the buckets after backward (the probe's exit spread).
        sync = pred[name]["grad_sync_ms"]
        probe = pred[name]["profile"]["in_training"]["all_reduce"]["builtin" if name == "ddp" else name[4:]]
        assert len(probe["samples_after_us"]) == 3  # probed first, after the middle mode and last
        assert sync["exposed"] - sync["after_arrival"] == pytest.approx(
            sum(m["arrival_skew_ms"] for m in noops) / 2 + sync["after_arrival"] * probe["exit_spread_us"]
            / probe["after_us"])
    assert "ddp:shm (pred)" in proc.stdout
    # this-host's benches run inside compare (--no-table): their tables stay out of its output
    assert "# average busbw" not in proc.stdout and "predicting this-host: -m commlab.allreduce_bench" in proc.stderr


@pytest.mark.slow
def test_compare_cpu_modes(ran):
    proc, tmp_path = ran
    out = tmp_path / "c.json"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    modes = {m["mode"]: m for m in doc["modes"] if not m.get("predicted")}
    assert modes["dp"]["status"] == "unavailable" and "CUDA" in modes["dp"]["reason"]
    assert modes["ddp:nope"]["status"] == "unavailable"
    for name in ("ddp", "ddp:ring", "ddp:shm", "ddp:noop", "ddp@commlab"):
        m = modes[name]
        assert m["status"] == "ok", m
        assert MODE_KEYS <= set(m)
        assert m["iter_ms"]["median"] <= m["iter_ms"]["p90"]
        assert len(m["peak_memory_mb"]) == 2 and len(m["util_percent"]) == 2
        assert set(m["grad_sync_ms"]) == {"total", "exposed", "after_arrival"} | ({"exposed_se"} if name != "ddp:noop"
                                                                                  else set())
        assert m["grad_sync_ms"].get("exposed_se", 0) >= 0  # three timed steps: their standard error
        assert 0 <= m["grad_sync_ms"]["after_arrival"] <= m["grad_sync_ms"]["exposed"]
    # Same model, seed and data: every communicating mode trains identically.
    losses = [modes[n]["final_loss"] for n in ("ddp", "ddp:ring", "ddp:shm", "ddp@commlab")]
    assert max(losses) - min(losses) < 1e-5, losses
    assert modes["ddp"]["grad_sync_ms"]["total"] > 0 and modes["ddp:noop"]["grad_sync_ms"]["total"] == 0
    assert modes["ddp@commlab"]["grad_sync_ms"]["total"] > 0
    assert "| iteration median (ms) |" in proc.stdout and "Definitions:" in proc.stdout


@pytest.mark.slow
def test_emulated_memory_limit_on_cpu(ran):
    proc, tmp_path = ran
    out = tmp_path / "c.json"
    assert proc.returncode == 1, proc.stderr[-3000:]  # nothing ran: exit 1
    doc = json.loads(out.read_text())
    assert [(m["mode"], m["bucket_cap_mb"], m["label"]) for m in doc["modes"]] == [
        ("ddp", 0.01, "ddp @0.01MB"), ("ddp", 1.0, "ddp @1MB"), ("ddp:shm", 0.01, "ddp:shm @0.01MB"),
        ("ddp:shm", 1.0, "ddp:shm @1MB")]
    for m in doc["modes"]:
        assert m["status"] == "oom" and "emulated" in m["reason"] and "--mem-limit-mb" in m["reason"], m


@pytest.mark.slow
def test_more_ranks_than_gpus_is_a_clear_error_before_anything_starts(ran):
    proc, tmp_path = ran
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device is visible" in proc.stderr or "NCCL needs a GPU per rank" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_trace_is_a_chrome_trace_that_agrees_with_the_table(ran):
    """--trace: a Chrome trace-event JSON per mode (a process per rank; compute,
    communication and exposed-sync tracks), from the very timestamps the table sums: the
    exposed and total sync read back from the trace are the table's."""
    import importlib.util

    proc, tmp_path = ran
    out, traces = tmp_path / "c.json", tmp_path / "t"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    for mode in ("ddp", "ddp:shm"):
        doc = json.loads((traces / f"{mode}.json").read_text())
        events = doc["traceEvents"]
        # The trace-event format: complete events with name, category, µs timestamps, process and thread.
        for e in events:
            assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
            if e["ph"] == "X":
                assert isinstance(e["name"], str) and e["cat"] and e["ts"] >= 0 and e["dur"] >= 0, e
        names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M"}
        assert {(0, "rank 0"), (1, "rank 1"), (0, "compute"), (1, "communication"), (1, "exposed sync"),
                (0, "peer wait")} <= names
        for rank in (0, 1):
            got = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
            assert sum(e["name"] == "forward" for e in got) == sum(e["name"] == "optimizer" for e in got) == 3
            assert sum(e["name"] == "exposed sync" for e in got) == 3
            assert any(e["cat"] == "communication" and e["args"]["bytes"] > 0 for e in got)
        # A bucket's wait for the last rank ends where that rank handed the bucket over,
        # the latest hand-over of the bucket (or at the bucket's own end).
        starts = {}
        for e in events:
            if e["ph"] == "X" and e["cat"] == "communication":
                starts.setdefault((e["args"]["iteration"], e["name"]), {})[e["pid"]] = e
        waits = [e for e in events if e["ph"] == "X" and e["cat"] == "peer-wait"]
        assert waits  # with two ranks one hands each bucket over first
        for e in waits:
            k, what, who = e["args"]["iteration"], e["args"]["what"], e["args"]["last_rank"]
            mine, theirs = starts[(k, what)][e["pid"]], starts[(k, what)][who]
            assert who != e["pid"] and e["ts"] == pytest.approx(mine["ts"], abs=0.002), e
            assert theirs["ts"] == max(b["ts"] for b in starts[(k, what)].values())
            end = e["ts"] + e["dur"]
            assert end == pytest.approx(min(theirs["ts"], mine["ts"] + mine["dur"]), abs=0.002), (e, theirs)
        table = rows[mode]["grad_sync_ms"]
        back = rows[mode]["trace"]["sync_ms"]
        assert back["total"] == pytest.approx(table["total"], abs=0.01)
        assert back["exposed"] == pytest.approx(table["exposed"], abs=0.01)
        assert back["after_arrival"] == pytest.approx(table["after_arrival"], abs=0.01)
        assert 0 < table["after_arrival"] <= table["exposed"]
        if importlib.util.find_spec("matplotlib"):
            assert (traces / f"{mode}.png").stat().st_size > 0


@pytest.mark.slow
def test_trace_of_the_sharded_modes_agrees_with_the_table(ran):
    """--trace on ZeRO-1 and FSDP: DDP's buckets plus the parameter broadcast, FSDP's
    all-gathers and reduce-scatters, every one of them a blocking span of the
    communication and exposed tracks; read back, they are the table's sync figures."""
    proc, tmp_path = ran
    out, traces = tmp_path / "c.json", tmp_path / "t"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    # Per rank and iteration: fsdp gathers each of the 3 units (2 blocks, the root) in forward
    # and again in backward, and reduce-scatters each once; zero1 broadcasts once.
    want = {"zero1": {"broadcast": 1}, "fsdp:shm": {"all-gather": 6, "reduce-scatter": 3}}
    for mode, kinds in want.items():
        events = [e for e in json.loads((traces / f"{mode}.json").read_text())["traceEvents"] if e["ph"] == "X"]
        for rank in (0, 1):
            for k in range(3):
                comm = [e for e in events if e["pid"] == rank and e["cat"] == "communication"
                        and e["args"]["iteration"] == k]
                got = {kind: sum(e["args"]["kind"] == kind for e in comm) for kind in kinds}
                assert got == kinds, (mode, rank, k, got)
                assert all(e["args"]["bytes"] > 0 for e in comm)
                if mode.startswith("fsdp"):
                    assert all(isinstance(e["args"]["page_faults"], int) for e in comm)
        table, back = rows[mode]["grad_sync_ms"], rows[mode]["trace"]["sync_ms"]
        assert back["total"] == pytest.approx(table["total"], abs=0.01), mode
        assert back["exposed"] == pytest.approx(table["exposed"], abs=0.01), mode
        assert back["after_arrival"] == pytest.approx(table["after_arrival"], abs=0.01), mode
        assert 0 < table["after_arrival"] <= table["exposed"], mode


@pytest.mark.slow
def test_compare_repeat_runs_and_pools_end_to_end(ran):
    proc, tmp_path = ran
    out, traces = tmp_path / "c.json", tmp_path / "t"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["env"]["repeat"] == 2
    measured = {m["mode"]: m for m in doc["modes"] if not m.get("predicted")}
    assert {k: m["runs"] for k, m in measured.items()} == {"ddp:noop": 3, "ddp": 2}
    ddp = measured["ddp"]
    assert len(ddp["iteration_ms"]) == 6 and len(ddp["grad_sync_ms"]["exposed_runs"]) == 2
    assert ddp["grad_sync_ms"]["exposed"] == pytest.approx(sum(ddp["grad_sync_ms"]["exposed_runs"]) / 2)
    pred = {m["mode"]: m for m in doc["modes"] if m.get("predicted")}
    assert pred["ddp"]["status"] == "ok" and pred["ddp"]["grad_sync_ms"]["exposed_se"] >= 0
    assert sorted(f for f in os.listdir(traces) if f.endswith(".json")) == sorted(
        f"{m}_run_{k}.json" for m in ("ddp", "ddp:noop") for k in ((1, 2) if m == "ddp" else (1, 2, 3)))
    assert " σ)" in proc.stdout  # the predicted column against the one pooled measured column
    assert "# running ddp (run 2 of 2) ..." in proc.stderr and "# running ddp:noop (run 3 of 3) ..." in proc.stderr


# The user's own model, `--model package.module:factory` (tests/models.py; its units: tests/test_user_models.py).

@pytest.mark.slow
def test_compare_trains_the_users_model(launches, request):
    proc, tmp_path, _ = launches.take(request)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "cnn.json").read_text())  # docs/compare.md's run
    assert doc["env"]["model"] == "tests.models:tiny_cnn"
    modes = {m["mode"]: m for m in doc["modes"]}
    assert modes["ddp"]["status"] == modes["ddp:ring"]["status"] == "ok"
    # One model, one seed, one data set: the same training whatever carries the gradients.
    assert modes["ddp"]["final_loss"] == pytest.approx(modes["ddp:ring"]["final_loss"], rel=1e-5)


@pytest.mark.slow
def test_predict_cli_takes_the_users_model(ran):
    proc, tmp_path = ran
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "p.json").read_text())["modes"]}
    assert rows["ddp"]["status"] == "ok" and rows["ddp"]["iter_ms"]["median"] > 0


@pytest.mark.slow
def test_a_factory_that_returns_no_module_is_a_clear_error(ran):
    bad, _ = ran
    assert bad.returncode == 2 and "must return an nn.Module" in bad.stderr and "Traceback" not in bad.stderr
