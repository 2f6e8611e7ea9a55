"""The benchmark CLI end to end: its main in the test's process with the command line a
user types (its ranks forked from the tests' server, as a `--world-size` run forks them
from its own), and the entry points as fresh interpreters. Outputs' correctness only, no
timing asserted. The runs whose rows are set against floors, and the refusals, are in
tests/test_cli.py; `pytest bench/` runs whole in the documentation's example
(docs/bench.md, tests/test_docs.py)."""
import json
import os
import sys

import ahead
import pytest
from ranks import run_main

import commlab
from commlab.core.units import format_bytes
from commlab.measure import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_KEYS = {"algorithm", "bytes", "count", "dtype", "op", "time_us", "algbw_gbps", "busbw_gbps", "wrong",
               "p10_us", "p50_us", "p90_us", "iters"}


def _python(*args, timeout=240) -> ahead.Launch:
    return ahead.Launch([sys.executable, *args], env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1"),
                        timeout=timeout)


ENTRY_POINTS = ["allreduce_bench", "compare", "advise", "doctor", "costmodel", "predict", "schedule"]
_EVERY_HELP = f"""
import runpy, sys
for module in {ENTRY_POINTS!r}:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module("commlab." + module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        print("exit", module, e.code, flush=True)
"""

launches = ahead.launches({
    # One interpreter under -OO for every entry point: runpy runs each as `python -m` would.
    "test_entry_points_run_without_docstrings": lambda tmp: _python("-OO", "-c", _EVERY_HELP, timeout=120),
})


@pytest.mark.slow  # the quick tier's bench run with --json: the trace's (its rows' keys, exactness, busbw)
@pytest.mark.parametrize("op,dtype", [("sum", "float"), ("avg", "int32"), ("max", "bfloat16")])
def test_bench_cli_spawn_json(tmp_path, monkeypatch, capfd, op, dtype):
    tmp = tmp_path
    # The floors (set against sum's rows) once: the other ops' runs are about their rows.
    ran = run_main(bench.main, ["--world-size", "3", "-b", "8", "-e", "8K", "-f", "32", "--anchors", "none", "-n", "3",
                                "-w", "1", "-o", op, "-d", dtype, "--json", str(tmp / "r.json"), "--csv",
                                str(tmp / "r.csv"), *([] if op == "sum" else ["--no-floors"])], monkeypatch, capfd)
    assert ran.returncode == 0, ran.stderr[-3000:]
    doc = json.loads((tmp / "r.json").read_text())
    assert doc["env"]["world_size"] == 3 and doc["env"]["backend"] == "gloo" and doc["env"]["ranks_per_host"] == [3]
    algs = commlab.algorithms.for_device("cpu")
    assert {r["algorithm"] for r in doc["results"]} == set(algs)
    assert len(doc["results"]) == 3 * len(algs)  # 8, 256, 8K bytes
    for r in doc["results"]:
        assert RESULT_KEYS <= set(r)
        assert r["wrong"] == 0, r
        assert r["p10_us"] <= r["p50_us"] <= r["p90_us"]
        assert r["time_us"] > 0 and r["iters"] == 3
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 4 / 3)
    assert "out of bounds values: 0 OK" in ran.stdout
    assert (tmp / "r.csv").read_text().startswith("algorithm,bytes,count")


@pytest.mark.parametrize("blocking", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bench_trace_holds_every_timed_call_and_gives_back_the_table(tmp_path, monkeypatch, capfd, blocking):
    """--trace: per rank and algorithm every timed call as a span, in order, none
    overlapping; the table's time read back from the spans (back-to-back: the slowest
    rank's loop per round, summed; isolated: the slowest rank per call). The CLI's main
    in this process (its ranks forked from the tests' server; fresh interpreters: the
    runs above)."""
    tmp = tmp_path
    ran = run_main(bench.main, ["--world-size", "3", "-b", "1K", "-e", "64K", "-f", "8", "-n", "8", "--rounds", "2",
                                "--algorithms", "builtin,shm,ring", "--anchors", "none", "--quiet", "--json",
                                str(tmp / "r.json"), "--trace", str(tmp / "t.json"), "--no-floors",
                                *(["--blocking"] if blocking else [])], monkeypatch, capfd)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = json.loads((tmp / "r.json").read_text())["results"]
    assert "trace" not in json.loads((tmp / "r.json").read_text())
    assert len(rows) == 3 * 3  # algorithms x sizes
    for r in rows:
        assert RESULT_KEYS <= set(r) and r["wrong"] == 0, r
        assert r["p10_us"] <= r["p50_us"] <= r["p90_us"] and r["iters"] == 8, r
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 4 / 3)
    spans = [e for e in json.loads((tmp / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 3 * 3 * 8  # ranks x algorithms x sizes x calls
    for rank in range(3):
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank)
        # one call at a time (ts and dur are each rounded to 0.001 us: an end may read 0.0015 past the next start)
        assert all(a[1] <= b[0] + 2e-3 for a, b in zip(mine, mine[1:]))
    for r in rows:
        name = f"{r['algorithm']} {format_bytes(r['bytes'])}"
        mine = [e for e in spans if e["name"] == name]
        assert len(mine) == 3 * 8
        if blocking:
            per_call: dict = {}
            for e in mine:
                key = (e["args"]["round"], e["args"]["call"])
                per_call[key] = max(per_call.get(key, 0.0), e["dur"])
            total = sum(per_call.values())
        else:
            per_round: dict = {}
            for e in mine:
                key = (e["args"]["round"], e["pid"])
                per_round[key] = per_round.get(key, 0.0) + e["dur"]
            total = sum(max(v for (k, _), v in per_round.items() if k == rd) for rd in (0, 1))
        assert total / r["iters"] == pytest.approx(r["time_us"], rel=1e-3, abs=0.01), name


@pytest.mark.slow
def test_bench_measures_every_all_gather_algorithm_checked(tmp_path, monkeypatch, capfd):
    """--collective all_gather: every registered all-gather algorithm, sizes as nccl-tests
    prints them (the gathered output), busbw = algbw·(p-1)/p, #wrong 0 on every row."""
    tmp = tmp_path
    ran = run_main(bench.main, ["--world-size", "3", "--collective", "all_gather", "-b", "96", "-e", "96K", "-f", "32",
                                "--anchors", "none", "-n", "3", "-w", "1", "--rounds", "1", "--json",
                                str(tmp / "g.json")], monkeypatch, capfd)
    assert ran.returncode == 0, ran.stderr[-3000:]
    doc = json.loads((tmp / "g.json").read_text())
    assert doc["collective"] == "all_gather"
    algs = commlab.algorithms.registry("all_gather").for_device("cpu")
    assert {r["algorithm"] for r in doc["results"]} == set(algs)
    for r in doc["results"]:
        assert r["wrong"] == 0, r
        assert r["bytes"] == 3 * r["count"] * 4  # float32, 3 ranks
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 / 3)
    assert "collective: all_gather" in ran.stdout and "out of bounds values: 0 OK" in ran.stdout


@pytest.mark.slow
def test_bench_on_the_commlab_backend_measures_it_beside_gloo(tmp_path, monkeypatch, capfd):
    """--backend commlab: every algorithm right on a commlab world group, and a
    builtin@commlab row (dist.all_reduce as unchanged training code calls it)."""
    tmp = tmp_path
    ran = run_main(bench.main, ["--world-size", "2", "--backend", "commlab", "-b", "4K", "-e", "64K", "-f", "16",
                                "--anchors", "none", "-n", "3", "-w", "1", "--rounds", "1", "--json",
                                str(tmp / "r.json")], monkeypatch, capfd)
    assert ran.returncode == 0, ran.stderr[-3000:]
    doc = json.loads((tmp / "r.json").read_text())
    assert doc["env"]["backend"] == "commlab"
    names = {r["algorithm"] for r in doc["results"]}
    assert names == set(commlab.algorithms.for_device("cpu")) | {"builtin@commlab"}, names
    assert all(r["wrong"] == 0 for r in doc["results"]), doc["results"]


@pytest.mark.slow
def test_bench_cli_rejects_unknown_algorithm(monkeypatch, capfd):
    ran = run_main(bench.main, ["--world-size", "2", "--algorithms", "ring,nope", "-e", "8"], monkeypatch, capfd)
    assert ran.returncode != 0
    assert "unknown algorithm 'nope'" in ran.stderr


@pytest.mark.slow
def test_entry_points_run_without_docstrings(launches, request):
    """python -OO strips docstrings; no entry point may depend on one."""
    proc, _, _ = launches.take(request)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for module in ENTRY_POINTS:
        assert f"exit {module} 0" in proc.stdout, (module, proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.stdout.count("usage: ") >= len(ENTRY_POINTS)
