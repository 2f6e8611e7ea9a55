"""The two-level cost model: per-level α, β recovered from layouts of known cost,
predictions at topologies nobody here has, crossovers, and the committed emulated-host
measurements predicted where they were not fitted."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import commlab
from commlab.core.units import parse_duration_us, parse_rate_gbps
from commlab.measure import twolevel
from tests.test_cli import ROOT, _run

BETA = {"shm": 1 / 8e3, "host": 1 / 2e3, "link": 1 / 125.0}  # µs/B: 8, 2, 0.125 GB/s
ALPHA = {"shm@shm": 3.0, "builtin@host": 400.0, "ring@host": 150.0, "rhd@host": 170.0,  # µs per step
         "builtin@link": 450.0, "ring@link": 210.0, "rhd@link": 230.0}
GAMMA = 1 / 4e3
RUNS = {(1, 2): ["builtin", "ring", "rhd", "shm", "hier"], (2, 1): ["builtin", "ring", "rhd", "hier"],
        (2, 2): ["builtin", "ring", "rhd", "hier"], (4, 1): ["builtin", "ring", "rhd", "hier"]}


def truth(alg, hosts, k, n):
    return sum(s.steps * ALPHA[f"{s.by}@{s.level}"] + s.bytes * BETA[s.level] + s.reduced * GAMMA
               for s in commlab.get_algorithm(alg).stages(hosts, k, n))


def write_runs(tmp_path, noise=0.0):
    rng = np.random.default_rng(0)
    paths = []
    for (hosts, k), algs in RUNS.items():
        results = [{"algorithm": a, "bytes": n, "time_us": truth(a, hosts, k, n) * (1 + noise * rng.standard_normal())}
                   for a in algs for n in [2 ** e for e in range(12, 27)]]
        results.append({"algorithm": "mpi", "bytes": 4096, "time_us": 1.0})  # an anchor: no schedule, left out
        doc = {"env": {"world_size": hosts * k, "ranks_per_host": [k] * hosts, "gamma_us_per_byte": GAMMA}, "results": results}
        paths.append(tmp_path / f"{hosts}x{k}.json")
        paths[-1].write_text(json.dumps(doc))
    return [str(p) for p in paths]


def test_two_level_fit_recovers_each_levels_alpha_and_beta(tmp_path):
    pts, gamma = twolevel.load_points(write_runs(tmp_path))
    assert gamma == GAMMA and {q.layout for q in pts} == {"1x2", "2x1", "2x2", "4x1"}
    m = twolevel.fit_levels(pts, gamma)
    assert m.beta_us_per_byte == pytest.approx(BETA, rel=1e-6) and m.alpha_us == pytest.approx(ALPHA, rel=1e-6)
    h = twolevel.holdout(pts, gamma)
    assert set(h["layouts"]) == {"2x1", "2x2", "4x1"}  # each layout across hosts, composed from the others
    assert all(e["max_rel_err"] < 1e-6 for errs in [h["sizes"], *h["layouts"].values()] for e in errs.values())


def test_a_noisy_fit_still_predicts_held_out_sizes(tmp_path):
    pts, gamma = twolevel.load_points(write_runs(tmp_path, noise=0.05))
    h = twolevel.holdout(pts, gamma)
    assert all(e["median_rel_err"] < 0.1 for e in h["sizes"].values()), h["sizes"]


@pytest.mark.slow
@pytest.mark.parametrize("link,gbps", [("10gbit:20us", 1.25)])
def test_topology_prediction_names_the_fastest_and_its_crossovers(tmp_path, link, gbps):
    out = tmp_path / "pred.json"
    saved = tmp_path / "fit.json"
    proc = _run(["-m", "commlab.costmodel", "--fit", *write_runs(tmp_path), "--save", str(saved)])
    assert proc.returncode == 0, proc.stderr
    proc = _run(["-m", "commlab.costmodel", "--intra", str(saved), "--topology", "2x8,64x8,512x8", "--inter",
                 link, "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "64 hosts x 8 ranks" in proc.stdout and "fastest:" in proc.stdout
    doc = json.loads(out.read_text())
    lat = parse_duration_us(link.split(":")[1])
    model = twolevel.TwoLevel.from_json(doc["fit"]).with_link(gbps, lat)
    assert model.beta_us_per_byte["link"] == pytest.approx(1e-3 / gbps)
    assert model.alpha_us["ring@link"] == pytest.approx(ALPHA["ring@link"] + lat)  # software per step + the wire
    for topo, (hosts, k) in (("2x8", (2, 8)), ("64x8", (64, 8)), ("512x8", (512, 8))):
        spans = doc["topologies"][topo]["fastest"]
        assert spans[0]["from"] == 4096 and spans[-1]["to"] == 1 << 30
        assert all(a["to"] == b["from"] for a, b in zip(spans, spans[1:]))
        assert all(a["algorithm"] != b["algorithm"] for a, b in zip(spans, spans[1:]))
        for s in spans:  # the named algorithm is the fastest inside its span ...
            mid = (s["from"] * s["to"]) ** 0.5
            ts = {a: model.predict_us(a, hosts, k, mid) for a in ("builtin", "ring", "rhd", "hier")}
            assert ts[s["algorithm"]] == min(ts.values()), (topo, s, ts)
        for a, b in zip(spans, spans[1:]):  # ... and at a crossover the two meet
            x = a["to"]
            ta, tb = model.predict_us(a["algorithm"], hosts, k, x), model.predict_us(b["algorithm"], hosts, k, x)
            assert ta == pytest.approx(tb, rel=0.02)
        if gbps < 8 and hosts == 2:  # a link slower than shared memory: hier sends n across it, a flat ring 1.875 n
            assert spans[-1]["algorithm"] == "hier"
        # Many hosts: a flat ring's link bytes 2(p-1)/p n approach hier's 2(H-1)/H n; hier's gain is its steps.
        rows = doc["topologies"][topo]["rows"]
        assert "ps" not in rows[0]["time_us"] and "shm" not in rows[0]["time_us"]  # no schedule across hosts


def test_link_and_topology_specs():
    assert parse_rate_gbps("1gbit") == pytest.approx(0.125) and parse_rate_gbps("400gbit") == pytest.approx(50)
    assert parse_duration_us("5us") == 5 and parse_duration_us("1.5ms") == 1500
    assert twolevel.parse_topology("64x8") == (64, 8)
    for bad in ("64", "0x8", "ax8"):
        with pytest.raises(ValueError):
            twolevel.parse_topology(bad)
    with pytest.raises(ValueError):
        parse_rate_gbps("fast")


MEASURED = sorted(f for f in glob.glob(os.path.join(ROOT, "docs", "data", "costmodel", "*.json"))
                  if "gbit" not in f or "-1gbit" in f)  # one link rate; fit.json is a saved fit, not a run


@pytest.mark.skipif(not MEASURED, reason="no committed measurements")
def test_the_emulated_host_measurements_predict_what_was_left_out():
    """docs/data/costmodel: this machine's runs on one host and on emulated hosts over
    1 Gbit/s links (docs/measurements.md has the commands). Across hosts, from 1 MiB
    (below, 4 ranks on 2 cores measure the scheduler), the model predicts sizes it was
    not fitted on, and whole layouts composed from the others, within ±25 % (median
    per layout and algorithm)."""
    pts, gamma = twolevel.load_points([f for f in MEASURED if not f.endswith("fit.json")])
    assert {q.layout for q in pts} >= {"1x2", "1x4", "2x1", "2x2", "4x1"}
    h = twolevel.holdout([q for q in pts if q.nbytes >= 1 << 20], gamma)
    across = {k: e for k, e in h["sizes"].items() if not k.startswith("1x")}
    assert len(across) == 12 and set(h["layouts"]) == {"2x1", "2x2", "4x1"}
    for errs in (across, *h["layouts"].values()):
        bad = {k: e for k, e in errs.items() if e["median_rel_err"] > 0.25}
        assert not bad, bad


@pytest.mark.slow
def test_one_level_fit_of_another_collective_names_its_winners_per_size_range(tmp_path):
    """costmodel --from a bench JSON of all_to_all fits that family's formulas (pairwise,
    bruck) and prints who wins each size range: Bruck's log2 p steps below the crossover
    the formulas give, pairwise above."""
    fam = commlab.algorithms.registry("all_to_all")
    alpha, beta = 200.0, 1 / 1e3  # µs per step, µs per byte
    results = [{"algorithm": a, "bytes": n, "time_us": fam.get(a).cost(4, n).time(alpha, beta)}
               for a in ("pairwise", "bruck") for n in [2 ** e for e in range(10, 25)]]
    src = tmp_path / "a2a.json"
    src.write_text(json.dumps({"collective": "all_to_all", "env": {"world_size": 4}, "results": results}))
    out = tmp_path / "fit.json"
    proc = _run(["-m", "commlab.costmodel", "--from", str(src), "--ranks", "64", "--bytes", "1M",
                 "--min-bytes", "1K", "--max-bytes", "1G", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "all_to_all: fitted on 4 ranks" in proc.stdout and "winners per size range" in proc.stdout
    got = json.loads(out.read_text())
    assert got["fits"]["pairwise"]["alpha_us"] == pytest.approx(alpha, rel=1e-3)
    spans = got["winners"]["64"]
    assert [s["algorithm"] for s in spans] == ["bruck", "pairwise"], spans
    # Where the formulas cross at 64 ranks: 63α + 63/64·nβ = 6α + moved/64·nβ.
    b, pw = fam.get("bruck").cost(64, 1.0), fam.get("pairwise").cost(64, 1.0)
    cross = (pw.steps - b.steps) * alpha / ((b.bytes_sent - pw.bytes_sent) * beta)
    assert spans[0]["to_bytes"] == pytest.approx(cross, rel=0.01)
    # A JSON of one collective is not fitted with another's formulas.
    bad = _run(["-m", "commlab.costmodel", "--from", str(src), "--collective", "all_gather"])
    assert bad.returncode == 2 and "measured all_to_all, not all_gather" in bad.stderr


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mmap threshold")
@pytest.mark.slow
def test_first_touch_is_measured_per_size_as_the_allocator_recycles():
    """A freed buffer below glibc's mmap threshold (raised to each freed mapping, at most 32
    MiB) comes back from the heap without faults; above it every allocation is mapped
    afresh, so one rate measured at a large size charges FSDP's smaller outputs faults they
    never take. Measured in a fresh interpreter: whether a freed 4 MiB chunk comes back or
    the heap's top is trimmed and faulted afresh depends on what the process allocated
    before, and inside the test session the 4 MiB rate read as faulting on some runs
    (docs/measurements.md, "What the tests rest on")."""
    code = "import json; from commlab.measure import probes; " \
           "print(json.dumps(probes.measure_first_touch([4 << 20, 64 << 20])))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    small, big = json.loads(proc.stdout)
    assert small[0] == 4 << 20 and big[0] == 64 << 20
    assert big[1] > 5 * max(small[1], 0.0) and big[1] > 0
