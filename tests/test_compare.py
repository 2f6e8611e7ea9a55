"""commlab.compare: runs every mode in fresh processes and writes the documented JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODE_KEYS = {"mode", "status", "reason", "iter_ms", "samples_per_s", "peak_memory_mb", "util_percent",
             "grad_sync_ms", "final_loss"}


@pytest.mark.parametrize("extra", [[], ["--accum-steps", "2", "--amp", "bf16", "--checkpoint"]])
def test_compare_cpu_modes(tmp_path, extra):
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "commlab.compare", "--device", "cpu", "--world-size", "2",
           "--modes", "dp,ddp,ddp:ring,ddp:shm,ddp:noop,ddp:nope", "--model", "mlp", "--width", "64", "--depth", "3",
           "--batch-size", "16", "--iters", "3", "--warmup", "1", "--bucket-cap-mb", "0.01", "--json", str(out), *extra]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    modes = {m["mode"]: m for m in doc["modes"]}
    assert modes["dp"]["status"] == "unavailable" and "CUDA" in modes["dp"]["reason"]
    assert modes["ddp:nope"]["status"] == "unavailable"
    for name in ("ddp", "ddp:ring", "ddp:shm", "ddp:noop"):
        m = modes[name]
        assert m["status"] == "ok", m
        assert MODE_KEYS <= set(m)
        assert m["iter_ms"]["median"] <= m["iter_ms"]["p90"]
        assert len(m["peak_memory_mb"]) == 2 and len(m["util_percent"]) == 2
        assert set(m["grad_sync_ms"]) == {"total", "exposed"}
    # Same model, seed and data: every communicating mode trains identically.
    losses = [modes[n]["final_loss"] for n in ("ddp", "ddp:ring", "ddp:shm")]
    assert max(losses) - min(losses) < 1e-5, losses
    assert modes["ddp"]["grad_sync_ms"]["total"] > 0 and modes["ddp:noop"]["grad_sync_ms"]["total"] == 0
    assert "| iteration median (ms) |" in proc.stdout and "Definitions:" in proc.stdout
