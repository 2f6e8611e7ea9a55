"""Starting ranks and their process group from whatever launched us: torchrun's env://,
mpiexec with the rendezvous address broadcast through MPI, Slurm, or a single process.
The local launcher that starts N ranks itself is measure/pools.py."""
from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing.util  # noqa: F401 - registers its exit handler on import: _close_open must come after
import os
import re
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from commlab.core.errors import CommlabError
from commlab.transports.setup import pid_alive


class LaunchError(RuntimeError):
    """The environment half-describes a launch (a rank without a world size, a world
    without this process's rank, several hosts and no address for rank 0): starting
    anyway would wait for peers forever or join the wrong job."""


@dataclass(frozen=True)
class Launch:
    kind: str  # "torchrun" | "mpi" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1  # ranks on this host
    launcher: str = ""  # who set the variables: "torchrun", "Open MPI", "MPICH (hydra)", "Slurm (srun)"
    master_addr: str | None = None  # rank 0's host where the launcher names it (Slurm's node list)
    job_id: str = ""  # the same on every rank of one job, for a default port


def _env_int(names, what: str, launcher: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                raise LaunchError(f"commlab: {launcher} set {n}={v!r}, which is not the {what} (an integer)") from None
    return None


def _required(value: int | None, names, what: str, launcher: str, present: str) -> int:
    if value is None:
        raise LaunchError(f"commlab: {present} is set ({launcher}) but not {' or '.join(names)}: nothing says this "
                          f"process's {what}. Start every rank through the launcher (torchrun, mpiexec, srun), or "
                          f"unset the launcher's variables to run one process")
    return value


# Each launcher's variables, in the order they are tried (torchrun's first: it may run
# under mpiexec or srun and then sets its own). Open MPI exports its own names; MPICH's
# hydra (and Intel MPI, MVAPICH) the PMI ones; Slurm's srun its step's.
_SOURCES = (
    ("mpi", "Open MPI", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",), ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")),
    ("mpi", "MPICH (hydra)", ("PMI_RANK", "MV2_COMM_WORLD_RANK"), ("PMI_SIZE", "MV2_COMM_WORLD_SIZE"),
     ("MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK"), ("MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE"),
     ("PMI_KVSNAME", "PMI_PORT")),
)


def _slurm() -> Launch | None:
    """A task of an srun step. The batch script itself (SLURM_PROCID=0 of an allocation
    of n tasks, no step of its own) is not a rank: it is one process that may spawn."""
    if "SLURM_PROCID" not in os.environ or os.environ.get("SLURM_STEP_ID", "batch") in ("batch", "extern", "interactive"):
        return None
    who = "Slurm (srun)"
    rank = _env_int(("SLURM_PROCID",), "rank", who)
    size = _required(_env_int(("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), "world size", who),
                     ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "world size", who, "SLURM_PROCID")
    local = _env_int(("SLURM_LOCALID",), "local rank", who) or 0
    per_node = expand_tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE") or
                                     os.environ.get("SLURM_TASKS_PER_NODE") or str(size))
    node = _env_int(("SLURM_NODEID",), "node index", who) or 0
    local_size = per_node[node] if node < len(per_node) else size
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or ""
    job = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    return Launch("slurm", rank, size, local, local_size, who, first_host(nodes) if nodes else None, job)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[003-008,011],cpu1" -> "gpu003"."""
    depth, item = 0, ""
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        item += ch
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], item.strip())


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks per node, "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"commlab: cannot read Slurm's tasks per node {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


_DAEMONS = ("hydra_pmi_proxy", "prted", "orted", "slurmstepd")


def _launcher_daemon() -> str:
    """The launcher's daemon on this host (hydra's proxy, Open MPI's prted), named by
    pid and start time: a job id every local rank shares, also through wrapper scripts
    (MPICH's hydra exports none)."""

    try:
        for p in psutil.Process().parents():
            if p.name() in _DAEMONS:
                return f"{socket.gethostname()}:{p.name()}:{p.pid}:{p.create_time():.3f}"
    except psutil.Error:
        pass
    return ""


def detect() -> Launch:
    """How this process was started, from its launcher's variables: torchrun's, then
    Open MPI's, MPICH's (PMI), Slurm's srun's; none of them: one process ("single").
    A half-described launch is a LaunchError, never a guess."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        rank = _required(_env_int(("RANK",), "rank", "torchrun"), ("RANK",), "rank", "torchrun", "WORLD_SIZE")
        size = _required(_env_int(("WORLD_SIZE",), "world size", "torchrun"), ("WORLD_SIZE",), "world size",
                         "torchrun", "RANK")
        return Launch("torchrun", rank, size, _env_int(("LOCAL_RANK",), "local rank", "torchrun") or 0,
                      _env_int(("LOCAL_WORLD_SIZE",), "local world size", "torchrun") or size,
                      "commlab (--world-size)" if os.environ.get("COMMLAB_SPAWNED") else "torchrun")
    for kind, who, ranks, sizes, locals_, local_sizes, jobs in _SOURCES:
        if not any(n in os.environ for n in ranks + sizes):
            continue
        rank = _required(_env_int(ranks, "rank", who), ranks, "rank", who, " or ".join(sizes))
        size = _required(_env_int(sizes, "world size", who), sizes, "world size", who, " or ".join(ranks))
        job = next((os.environ[n] for n in jobs if os.environ.get(n)), "") or _launcher_daemon()
        return Launch(kind, rank, size, _env_int(locals_, "local rank", who) or 0,
                      _env_int(local_sizes, "local world size", who) or size, who, None, job)
    slurm = _slurm()
    if slurm is not None:
        return slurm
    return Launch("single", 0, 1, 0, 1)


def detect_for_cli() -> Launch | None:
    """detect() for an entry point: None after printing why the launch is half-described
    (the caller exits 2)."""
    try:
        return detect()
    except LaunchError as e:
        print(e, file=sys.stderr)
        return None


def check_gpus_per_rank(local_ranks: int, backend: str, gpus: int) -> str | None:
    """Why these ranks cannot each have a GPU of their own (None when they can). NCCL
    needs one GPU per rank: ranks sharing one fail or hang inside NCCL."""
    if gpus == 0:
        return "no CUDA device is visible (--device cuda)"
    if backend == "nccl" and local_ranks > gpus:
        return (f"{local_ranks} ranks on this host but {gpus} GPU(s): NCCL needs a GPU per rank; start at most "
                f"{gpus} ranks (torchrun --nproc_per_node={gpus}), or use --backend gloo to share GPUs")
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


_active: Launch | None = None


_MPI_FAMILY = {"Open MPI": ("Open MPI",), "MPICH (hydra)": ("MPICH", "Intel(R) MPI", "MVAPICH")}
_mpi: tuple | None = None


def mpi_world(launch: Launch | None = None):
    """(mpi4py's MPI module, None) when it may be used in this job, else (None, why).
    MPI is initialised only when the library mpi4py loads is the launcher's: MPICH's
    MPI_Init under Open MPI's mpiexec aborts the process (and an MPI of another launcher
    would see a world of one), so the library is asked first, before MPI_Init.
    MPI4PY_LIBMPI picks another library."""
    global _mpi
    launch = launch or active()
    if launch.kind != "mpi":
        return None, "not launched by mpiexec"
    if _mpi is not None:
        return _mpi
    try:
        # optional: only under an MPI launcher, and only with its own library
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
        # optional: only under an MPI launcher, and only with its own library
        from mpi4py import MPI
    except ImportError:
        _mpi = (None, "mpi4py is not installed")
        return _mpi
    version = MPI.Get_library_version().strip().splitlines()[0]
    family = _MPI_FAMILY.get(launch.launcher, ())
    if family and not any(f in version for f in family):
        _mpi = (None, f"mpi4py loads {version!r}, not the library of {launch.launcher}'s mpiexec that started "
                      "this job (MPI4PY_LIBMPI=<path of its libmpi> picks it)")
        return _mpi
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.world_size or comm.Get_rank() != launch.rank:
        _mpi = (None, f"the MPI world ({comm.Get_size()} ranks) is not this job's ({launch.world_size})")
    else:
        _mpi = (MPI, None)
    return _mpi


def job_port(job_id: str) -> int:
    """A port every rank of one job derives alike from the job's id (Lightning's rule
    for Slurm, widened): 20000-32767, below Linux's default ephemeral range (32768+),
    where any outgoing connection of the host may hold the port rank 0's store needs."""

    return 20000 + zlib.crc32(job_id.encode()) % 12768


def rendezvous(launch: Launch) -> tuple[str, str]:
    """Where rank 0's store listens, for a job mpiexec or srun started: MASTER_ADDR and
    MASTER_PORT when the user exported them; else through MPI itself (rank 0's host and a
    free port, broadcast: no port to collide on); else Slurm's first node, or loopback
    when every rank is on this host, with a port derived from the job's id."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, port
    mpi, _ = mpi_world(launch)
    if mpi is not None:
        comm = mpi.COMM_WORLD
        mine = (socket.gethostname(), str(free_port())) if launch.rank == 0 else None
        got = comm.bcast(mine, root=0)
        one_host = launch.local_world_size == launch.world_size
        return addr or ("127.0.0.1" if one_host else got[0]), port or got[1]
    host = launch.master_addr or ("127.0.0.1" if launch.local_world_size == launch.world_size else None)
    if host is None:
        raise LaunchError(
            f"commlab: {launch.launcher} started {launch.world_size} ranks on several hosts and nothing names rank "
            "0's host: export MASTER_ADDR (and MASTER_PORT) to every rank (Open MPI: mpiexec -x MASTER_ADDR -x "
            "MASTER_PORT; MPICH: mpiexec -genv MASTER_ADDR <host> -genv MASTER_PORT <port>), or install mpi4py "
            "for the launcher's MPI so rank 0's address goes through MPI")
    if not launch.job_id and not port:
        raise LaunchError(f"commlab: {launch.launcher} gave no job id to derive a port from: export MASTER_PORT "
                          "to every rank")
    if not port and launch.master_addr is None:
        return addr or host, None  # one host: rank 0's own port, through a note on the host (one_host_store)
    return addr or host, port or str(job_port(launch.job_id))


def _note_path(launch: Launch) -> str:

    job = zlib.crc32(launch.job_id.encode())
    return os.path.join(tempfile.gettempdir(), f"commlab-rendezvous-{os.getuid()}-{job:08x}")


def _write_note(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # readers see the whole note or none


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def one_host_store(launch: Launch, timeout_s: float):
    """The job's store when every rank is on this host and only the launcher's variables
    say so: rank 0 listens on a port the kernel gives it (a port derived from the job's id
    was found held by another process, and the other ranks waited out the timeout) and
    writes it, with its pid, in a note in the host's temporary folder; a rank 0 that cannot
    start the store writes why, which the others raise at once. A note whose rank 0 is
    dead (a crashed job with the same id) is not read."""

    path = _note_path(launch)
    timeout = datetime.timedelta(seconds=timeout_s)
    if launch.rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, launch.world_size, True, timeout, wait_for_workers=False)
        except Exception as e:
            _write_note(path, f"error {os.getpid()} {e}")
            raise
        _write_note(path, f"port {store.port} {os.getpid()}")
        # Kept while rank 0 lives: a backend that connects lazily (NCCL) may return from
        # init before every rank has read it. Once rank 0 is gone, its pid says so.
        atexit.register(_remove, path)
        return store
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                note = f.read().split(" ", 2)
        except OSError:
            note = []
        kind, first, rest = note if len(note) == 3 else ("", "", "")
        if kind == "error" and first.isdigit() and pid_alive(int(first)):
            raise LaunchError(f"commlab: rank 0 could not start the job's store: {rest}")
        if kind == "port" and first.isdigit() and rest.isdigit() and pid_alive(int(rest)):
            return dist.TCPStore("127.0.0.1", int(first), launch.world_size, False, timeout)
        time.sleep(0.05)
    raise LaunchError(f"commlab: rank 0 did not publish its store's port in {path} within {timeout_s:.0f} s (is it "
                      "running, on this host, with the same TMPDIR?)")


def active() -> Launch:
    """How this process was launched, as init() saw it (init rewrites RANK/WORLD_SIZE)."""
    return _active or detect()


def init(launch: Launch, backend: str, timeout_s: float, device: str) -> None:
    global _active
    _active = launch
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        problem = check_gpus_per_rank(launch.local_world_size, backend, torch.cuda.device_count())
        if problem:

            raise CommlabError(f"commlab: {problem}")
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    store = None
    if launch.kind == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif launch.kind != "torchrun":
        addr, port = rendezvous(launch)
        if port is None:
            store = one_host_store(launch, timeout_s)
            port = str(store.port)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(launch.rank), str(launch.world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(launch.local_rank), str(launch.local_world_size)
    where = {"init_method": "env://"} if store is None else {"store": store}
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout, **where)


def leave(together: bool = True) -> None:
    """Leave the process group (together: after a barrier) and free it while the
    interpreter is alive.

    The barrier: gloo can abort a process whose peers tear their connections down while
    it still uses them. The collect: a group that only dies during interpreter shutdown
    has gloo worker threads releasing Python-owned tensors after the GIL is gone, which
    aborts the process; nothing of commlab's holds a group (groups.py), but cycles in the
    caller's objects can, so they go now.
    """
    if not dist.is_initialized():
        return
    try:
        if together:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()
