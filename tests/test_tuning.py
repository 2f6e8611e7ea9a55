"""Tuning files for `auto`: written from a bench run (--tune), read per layout
(COMMLAB_TUNING), the pick per message size, and the same decision — or the same
error — on every rank."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import tuning
from commlab.core.errors import UnsupportedError
from commlab.measure.table import describe_tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(alg, n, t, wrong=0):
    return {"algorithm": alg, "bytes": n, "time_us": t, "wrong": wrong}


def test_winners_merge_neighbours_and_put_boundaries_at_the_geometric_mean():
    results = [_row("shm", 4096, 2.0), _row("ring", 4096, 90.0), _row("auto", 4096, 1.0),
               _row("shm", 65536, 8.0), _row("ring", 65536, 80.0),
               _row("shm", 1 << 20, 300.0, wrong=3), _row("ring", 1 << 20, 400.0),
               _row("shm", 16 << 20, 900.0), _row("ring", 16 << 20, 800.0)]
    ranges = tuning.winners(results, ["shm", "ring"])  # auto is never a candidate; wrong rows never win
    assert ranges == [{"max_bytes": int((65536 * (1 << 20)) ** 0.5), "algorithm": "shm"},
                      {"max_bytes": None, "algorithm": "ring"}]
    table = tuning.Table(ranges, "test")
    assert [table.pick(n) for n in (1, 65536, 262144, 262145, 1 << 30)] == ["shm", "shm", "shm", "ring", "ring"]
    assert describe_tuning(ranges) == "up to 256K shm, above 256K ring"


def test_a_malformed_or_foreign_file_is_a_clear_error_and_other_layouts_are_ignored(tmp_path):
    f = tmp_path / "t.json"
    known = commlab.algorithm_names()
    tuning.write(str(f), "cpu", 4, 1, [{"max_bytes": None, "algorithm": "shm"}], {"command": "x"})
    tuning.write(str(f), "cpu", 2, 1, [{"max_bytes": 100, "algorithm": "ring"},
                                       {"max_bytes": None, "algorithm": "shm"}], {"command": "y"})
    tuning.write(str(f), "cpu", 4, 1, [{"max_bytes": None, "algorithm": "rhd"}], {"command": "z"})  # replaces
    doc = json.loads(f.read_text())
    assert [(e["world_size"], e["ranges"][-1]["algorithm"]) for e in doc["layouts"]] == [(2, "shm"), (4, "rhd")]
    assert tuning.load(str(f), "cpu", 4, 1, known).pick(10) == "rhd"
    assert tuning.load(str(f), "cpu", 3, 1, known) is None  # no entry: auto's built-in rule
    assert tuning.load(str(f), "cuda", 2, 1, known) is None
    doc["layouts"][0]["ranges"][0]["algorithm"] = "nope"
    f.write_text(json.dumps(doc))
    with pytest.raises(UnsupportedError, match="malformed"):
        tuning.load(str(f), "cpu", 2, 1, known)
    f.write_text("{")
    with pytest.raises(UnsupportedError, match="cannot read the tuning file"):
        tuning.load(str(f), "cpu", 2, 1, known)


def tuned_auto(rank, p, file, counted=None, sizes=(10, 250, 251, 5000)):
    """auto with a table, one call per size: which ran is named by the runs of the class
    `counted` (ring's by default: shm's own call counter also counts the call agreement,
    which uses shared memory), "another" where it did not run."""
    cls = counted or type(commlab.algorithms.get("ring"))
    runs = []
    original = cls.run
    cls.run = lambda self, *args: (runs.append(self.name), original(self, *args))
    os.environ["COMMLAB_TUNING"] = file
    try:
        group = dist.new_group()  # a fresh plan reads the file
        out = {}
        for n in sizes:  # 250 float32 = 1000 bytes
            before = len(runs)
            t = torch.arange(float(n)) + rank
            commlab.all_reduce(t, group=group, algorithm="auto")
            out[n] = (runs[-1] if len(runs) > before else "another",
                      torch.equal(t, p * torch.arange(float(n)) + sum(range(p))))
        dist.destroy_process_group(group)
        return out
    finally:
        cls.run = original
        del os.environ["COMMLAB_TUNING"]


def test_auto_follows_the_tuning_file_per_message_size(ranks, tmp_path):
    f = tmp_path / "t.json"
    tuning.write(str(f), "cpu", 2, 1, [{"max_bytes": 1000, "algorithm": "ring"},
                                       {"max_bytes": None, "algorithm": "shm"}], {"command": "test"})
    for got in ranks.run(2, tuned_auto, str(f)):
        assert got == {10: ("auto->ring", True), 250: ("auto->ring", True), 251: ("another", True),
                       5000: ("another", True)}, got


def different_files(rank, p, folder):
    f = os.path.join(folder, f"t{rank}.json")
    tuning.write(f, "cpu", p, 1, [{"max_bytes": None, "algorithm": "ring" if rank else "shm"}], {"command": "t"})
    os.environ["COMMLAB_TUNING"] = f
    try:
        group = dist.new_group()
        try:
            commlab.all_reduce(torch.ones(4), group=group, algorithm="auto")
            return None
        except Exception as e:  # noqa: BLE001 - the test reads it
            return f"{type(e).__name__}: {e}"
        finally:
            dist.destroy_process_group(group)
    finally:
        del os.environ["COMMLAB_TUNING"]


def test_ranks_with_different_tuning_files_fail_alike(ranks, tmp_path):
    got = ranks.run(2, different_files, str(tmp_path))
    assert got[0] is not None and got[0] == got[1], got
    assert got[0].startswith("CollectiveMismatchError") and "different tuning files" in got[0], got


@pytest.mark.slow
def test_bench_tune_writes_the_layouts_entry(tmp_path):
    f = tmp_path / "tuning.json"
    tuning.write(str(f), "cpu", 8, 2, [{"max_bytes": None, "algorithm": "builtin"}], {"command": "kept"})
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, "-m", "commlab.allreduce_bench", "--world-size", "2", "--algorithms",
                           "builtin,shm,ring,auto", "-b", "4K", "-e", "64K", "-f", "16", "--anchors", "none", "-n", "3",
                           "-w", "1", "--rounds", "1", "--no-floors", "--tune", str(f)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(f.read_text())
    entries = {(e["device"], e["world_size"], e["hosts"]): e for e in doc["layouts"]}
    assert set(entries) == {("cpu", 8, 2), ("cpu", 2, 1)}  # the other layout is kept
    mine = entries[("cpu", 2, 1)]
    assert mine["measured"]["command"].endswith(f"--tune {f}") and mine["measured"]["dtype"] == "float32"
    assert {r["algorithm"] for r in mine["ranges"]} <= {"builtin", "shm", "ring"}
    assert mine["ranges"][-1]["max_bytes"] is None
    assert "# tuning for auto (cpu, 2 ranks, 1 host(s)): " in proc.stdout
    assert tuning.load(str(f), "cpu", 2, 1, commlab.algorithm_names()) is not None
