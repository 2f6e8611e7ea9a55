"""Two 'hosts' on one machine: two network namespaces joined by a veth pair, with
addresses from TEST-NET-1 (192.0.2.0/24) that exist only inside them. torchrun
--nnodes 2 runs the pure algorithms across them; shm refuses naming the hosts; cutting
the link mid-run gives errors, not hangs. Skips where namespaces cannot be made."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import psutil
import pytest
from ranks import clean_launch_env

import commlab

pytestmark = pytest.mark.slow  # torchrun across network namespaces: the full suite only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "twohost_job.py")
ADDR = {0: "192.0.2.1", 1: "192.0.2.2"}


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts():
    # On by default (about 25 s for both tests); COMMLAB_TWOHOST=0 opts out.
    if os.environ.get("COMMLAB_TWOHOST") == "0":
        pytest.skip("COMMLAB_TWOHOST=0")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = secrets.token_hex(3)
    ns = [f"clA{tag}", f"clB{tag}"]
    dev = [f"cva{tag}", f"cvb{tag}"]
    try:
        _ip("netns", "add", ns[0])
    except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        _ip("netns", "add", ns[1])
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in (0, 1):
            _ip("link", "set", dev[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"{ADDR[i]}/24", "dev", dev[i])
            _ip("-n", ns[i], "link", "set", dev[i], "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
        yield ns, dev
    finally:
        for n in ns:
            _ip("netns", "del", n, check=False)


def _launch(ns, dev, node, port, out_dir, extra_env=None, nproc=2, torchrun_args=()):
    env = dict(os.environ, GLOO_SOCKET_IFNAME=dev[node], COMMLAB_JOB_OUT=str(out_dir), PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env.update(extra_env or {})
    cmd = ["ip", "netns", "exec", ns[node], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc_per_node", str(nproc), "--node_rank", str(node), "--master_addr", ADDR[0], "--master_port",
           str(port), *torchrun_args, JOB]
    # A session of its own: torchrun signals its whole process group when a worker fails.
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(procs, timeout):
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its workers: they hold the pipe
            out, _ = p.communicate()
            out = "TIMED OUT\n" + out
        outs.append((p.returncode, out))
    return outs


def test_pure_algorithms_across_two_hosts_and_shm_refuses(two_hosts, tmp_path):
    ns, dev = two_hosts
    procs = [_launch(ns, dev, node, 29611, tmp_path) for node in (0, 1)]
    outs = _wait(procs, 240)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for res in results:
        for name in commlab.algorithms.for_device("cpu"):
            got = res["algorithms"][name]
            if name.startswith("shm"):
                assert got.startswith("unsupported:") and "more than one host" in got, got
                assert got.count("ranks [") == 2, got  # both hosts named, with their ranks
            else:
                assert got == "ok", (name, got)
        for collective in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):  # hier and auto: two levels
            for name in commlab.algorithms.registry(collective).for_device("cpu"):
                got = res[collective][name]
                assert (got.startswith("unsupported:") if name == "shm" else got == "ok"), (collective, name, got)
    assert len({json.dumps(r["algorithms"]) for r in results}) == 1, "ranks disagree"


def test_cutting_the_link_gives_errors_not_hangs(two_hosts, tmp_path):
    ns, dev = two_hosts
    env = {"COMMLAB_JOB_LOOP": "1", "COMMLAB_JOB_TIMEOUT": "10"}
    procs = [_launch(ns, dev, node, 29612, tmp_path, env, nproc=1) for node in (0, 1)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"started{r}").exists() for r in (0, 1)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            outs = _wait(procs, 5)
            pytest.fail("the job did not start: " + outs[0][1][-2000:])
        time.sleep(0.2)
    time.sleep(1)  # mid-run
    _ip("-n", ns[0], "link", "set", dev[0], "down")
    t_cut = time.monotonic()
    # The group's timeout is 10 s: both ranks must report an error well within a minute.
    # (torchrun's own agents then wait on their store across the dead link; that is
    # torchrun's business, so the sessions are killed once the ranks have spoken.)
    while not all((tmp_path / f"loop{r}.json").exists() for r in (0, 1)) and time.monotonic() - t_cut < 60:
        time.sleep(0.2)
    elapsed = time.monotonic() - t_cut
    outs = _wait(procs, 1)
    assert elapsed < 60, "ranks did not give up after the link went down: " + outs[0][1][-2000:]
    for r in (0, 1):
        res = json.loads((tmp_path / f"loop{r}.json").read_text())
        assert "error" in res, res
        assert res["error"].startswith("PeerError: commlab[ring]") and "rank" in res["error"], res


@pytest.mark.parametrize("algorithm", ["ring", "hier"])
def test_a_rank_killed_on_one_host_fails_every_rank_on_both(two_hosts, tmp_path, algorithm):
    """Rank 3 (host B) is SIGKILLed mid-loop: the three survivors, on both hosts, raise
    within 5 s naming it (before the abort channel, ring's survivors on host A waited out
    the group's timeout unless they waited on rank 3 itself)."""
    ns, dev = two_hosts
    env = {"COMMLAB_JOB_LOOP": "1", "COMMLAB_JOB_TIMEOUT": "60", "COMMLAB_JOB_ALGORITHM": algorithm,
           "COMMLAB_JOB_KILL": "3"}
    # The agents look every 5 s: the survivors must leave by commlab's error, not their SIGTERM.
    port = 29614 if algorithm == "ring" else 29615
    procs = [_launch(ns, dev, node, port, tmp_path, env, torchrun_args=("--monitor-interval", "5"))
             for node in (0, 1)]
    deadline = time.monotonic() + 150
    while not all((tmp_path / f"loop{r}.json").exists() for r in (0, 1, 2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    outs = _wait(procs, 1)
    kill = json.loads((tmp_path / "kill.json").read_text())
    for r in (0, 1, 2):
        path = tmp_path / f"loop{r}.json"
        assert path.exists(), f"rank {r} never reported: " + outs[0][1][-2000:] + outs[1][1][-2000:]
        res = json.loads(path.read_text())
        assert "error" in res and "rank 3" in res["error"], (r, res)
        assert res["t"] - kill["t"] < 5.0, (r, res, kill)


def test_emulated_hosts_script_runs_the_bench_over_shaped_links():
    """docs/hosts.md's example, verbatim (scripts/emulated_hosts.py, 2 hosts x 2 ranks,
    tbf-shaped links; the documentation's examples leave it to this test): runs, every row
    right, namespaces removed."""
    if os.environ.get("COMMLAB_TWOHOST") == "0":
        pytest.skip("COMMLAB_TWOHOST=0")
    if os.geteuid() != 0 or _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("network namespaces need root")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import doc_blocks

    [block] = doc_blocks.run_by("tests/test_twohost.py")
    before = _ip("netns", "list").stdout
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=clean_launch_env(PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if " float32 " in line]
    assert {r[4] for r in rows} == {"builtin", "hier"} and all(r[9] == "0" for r in rows), proc.stdout[-3000:]
    assert "# emulated: 2 hosts x 2 ranks, each host link 1gbit" in proc.stdout
    assert _ip("netns", "list").stdout == before


def test_emulated_hosts_of_unequal_ranks_and_links(tmp_path):
    """scripts/emulated_hosts.py --ranks 2,1 --rate 1gbit,200mbit: hosts of their own rank
    counts (torchrun's nodes of unequal sizes, ranks host by host) on links of their own
    rates, as commlab.schedule synthesize describes them; a synthesized schedule runs there."""
    if os.environ.get("COMMLAB_TWOHOST") == "0":
        pytest.skip("COMMLAB_TWOHOST=0")
    if os.geteuid() != 0 or _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("network namespaces need root")
    from commlab import schedule as S
    from commlab.schedule import synthesize as Y
    from commlab.schedule.topology import Topology

    path = tmp_path / "ar.xml"
    S.save(Y.all_reduce(Topology.parse("2,1", "1gbit,200mbit"), rounds=2)[0], path)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "emulated_hosts.py"), "--ranks", "2,1",
                           "--rate", "1gbit,200mbit", "--port", "29618", "--", "--algorithms", f"ring,msccl:{path}",
                           "-b", "64K", "-e", "64K", "--anchors", "none", "-n", "3", "-w", "1", "--rounds", "1",
                           "--no-floors"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if " float32 " in line]
    assert len(rows) == 2 and all(r[9] == "0" for r in rows), proc.stdout[-3000:]
    assert "# ranks_per_host: [2, 1]" in proc.stdout
    assert "# emulated: hosts of 2,1 ranks, host links 1gbit,200mbit each way" in proc.stdout


def test_emulated_hosts_stopped_by_sigterm_leave_no_namespace_or_rank_behind():
    """A SIGTERM to scripts/emulated_hosts.py mid-run (a timeout, a killed job) stops its
    ranks and removes its namespaces, as a normal exit does (before, both were left)."""
    if os.environ.get("COMMLAB_TWOHOST") == "0":
        pytest.skip("COMMLAB_TWOHOST=0")
    if os.geteuid() != 0 or _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("network namespaces need root")
    before = set(_ip("netns", "list").stdout.split())
    # 64 MiB calls over 20 Mbit/s links: a run that is still going when the signal comes.
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "emulated_hosts.py"), "--hosts", "2",
                             "--ranks", "1", "--rate", "20mbit", "--port", "29619", "--", "--algorithms", "ring",
                             "-b", "64M", "-e", "64M", "--anchors", "none", "-n", "100", "--no-floors"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _ranks_of(29619, launchers=False):
            time.sleep(0.2)
        assert _ranks_of(29619, launchers=False), "the bench's ranks never started"
        assert set(_ip("netns", "list").stdout.split()) - before
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert set(_ip("netns", "list").stdout.split()) == before
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _ranks_of(29619):
        time.sleep(0.2)
    assert not _ranks_of(29619)


def _ranks_of(port: int, launchers: bool = True) -> list[int]:
    """The bench's processes of this rendezvous port: its ranks (their environment) and,
    with `launchers`, torchrun (its flag)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        cmd, env = proc.info["cmdline"] or [], proc.info["environ"] or {}
        if "commlab.allreduce_bench" in cmd and (
                env.get("MASTER_PORT") == str(port) or launchers and str(port) in cmd):
            found.append(proc.pid)
    return found


def test_the_bench_traces_ranks_on_two_hosts_on_rank_0s_clock(tmp_path):
    """--trace across hosts (refused before: the hosts' clocks were not aligned): each rank
    measures its offset from rank 0's clock through the store and its calls enter the
    trace on rank 0's. The emulated hosts share one kernel clock, so every offset found
    must be zero within the error it states."""
    import json

    if os.environ.get("COMMLAB_TWOHOST") == "0":
        pytest.skip("COMMLAB_TWOHOST=0")
    if os.geteuid() != 0 or _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("network namespaces need root")
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "emulated_hosts.py"), "--hosts", "2",
                           "--ranks", "2", "--rate", "10gbit", "--port", "29617", "--", "--algorithms", "builtin",
                           "-b", "64K", "-e", "64K", "--anchors", "none", "-n", "4", "-w", "1", "--rounds", "1",
                           "--no-floors", "--trace", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    meta = doc["otherData"]
    assert "rank 0's time.perf_counter" in meta["clock"], meta
    offsets, errors = meta["offsets_us"], meta["errors_us"]
    assert len(offsets) == len(errors) == 4 and offsets[0] == errors[0] == 0
    for off, err in zip(offsets[1:], errors[1:]):
        assert 0 < err < 20_000 and abs(off) <= err + 1, (offsets, errors)
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in calls} == {0, 1, 2, 3} and all(e["ts"] >= 0 for e in calls)
