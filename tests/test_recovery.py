"""Training survives a rank's death: under torchrun --max-restarts, a rank SIGKILLed at
step 12 makes its peers raise within seconds (commlab's abort channel, not the group's
timeout), the elastic agent restarts the group, training resumes from the checkpoint of
step 10, nothing is left in /dev/shm, and the final parameters equal an uninterrupted
run's bitwise (examples/resilient_training.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from ranks import clean_launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "resilient_training.py")


def _torchrun(out, *extra, restarts=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           # The agent looks every 3 s: survivors must leave by commlab's error, not its SIGTERM.
           f"--max-restarts={restarts}", "--monitor-interval=3", EXAMPLE, "--steps", "20",
           "--checkpoint-every", "5", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_launch_env(OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_a_killed_rank_is_survived_and_the_result_is_unchanged(tmp_path):
    whole = _torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    hurt = _torchrun(tmp_path / "hurt", "--kill-rank", "1", "--kill-at", "12", restarts=1)
    assert hurt.returncode == 0, hurt.stderr[-3000:]

    a = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "hurt" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    events = [json.loads(line) for line in open(tmp_path / "hurt" / "events.jsonl")]
    kill = next(e for e in events if e["event"] == "kill")
    assert (kill["rank"], kill["step"], kill["incarnation"]) == (1, 12, 0)
    errors = {e["rank"]: e for e in events if e["event"] == "error" and e["incarnation"] == 0}
    assert set(errors) == {0, 2}, events  # both survivors raised, neither waited to be killed
    for e in errors.values():
        assert e["t"] - kill["t"] < 2.0, e
        assert "rank 1" in e["message"], e
    starts = [e for e in events if e["event"] == "start" and e["incarnation"] == 1]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2] and all(e["step"] == 10 for e in starts), starts
    resumed = min((e for e in events if e["event"] == "resumed"), key=lambda e: e["t"])
    print(f"kill to first resumed step: {resumed['t'] - kill['t']:.2f} s")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("commlab-")]
