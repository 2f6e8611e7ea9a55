"""Starting ranks and their process group: from whatever launched us (torchrun's env://,
mpiexec with the rendezvous address broadcast through MPI, or a single process), and
the one local launcher every tool uses to start N ranks on loopback (RankPool,
run_once): the CLI's --world-size, compare's modes, doctor's smoke test, the tests'
rank pools and the bench's group."""
from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing.util  # noqa: F401 - registers its exit handler on import: _close_open must come after
import os
import queue
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


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
    import psutil

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
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
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
    import zlib

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
    import zlib

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
    from commlab.transports.setup import pid_alive

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
            from commlab.core.errors import CommlabError

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


# -- the one local launcher ----------------------------------------------------------------


class RankFailure(AssertionError):
    """Some rank of a pool failed or never answered; the message holds its traceback or
    its stacks."""


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok" | "error" | "missing"
    result: object = None  # "ok": the function's value
    error: str = ""  # "error": the traceback; "missing": the rank's stacks, when it could give them
    error_type: str = ""  # "error": the exception's class name
    alive: bool = False  # "missing": whether the process still ran


def _stacks_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"stacks{rank}")


# Ranks are forked from one server process that imported torch once (multiprocessing's
# forkserver): a spawned rank spent ~1.7 s of CPU importing torch, and the tests start
# hundreds of ranks on two cores. A forked rank starts from the server's state, so it is
# given what a spawned one inherited: the environment as it is now (set before commlab is
# imported there: some settings are read at import) and this process's stdout and stderr
# as they are now (pytest swaps them per test). What else the server imports is the
# caller's choice (preload()): DistributedDataParallel's constructor imports
# torch._dynamo, 0.85 s of CPU per rank that builds one, which compare's ranks get
# imported once; the bench's ranks never need it, and the server's import of it sat
# before every bench's first rank (0.9 s of a 3.8 s two-rank run).
_PRELOAD = ["torch", "torch.distributed"]


def preload(*modules: str) -> None:
    """Modules the ranks' server imports once, for every rank forked after: effective only
    before this process's first rank starts (the server starts then, and stays)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


_BOOT = """
import os
os.environ.clear()
os.environ.update(env)
for target, inherited in zip((1, 2), stdio):
    fd = inherited.detach()
    os.dup2(fd, target)
    os.close(fd)
from commlab.measure.launch import _rank_main
_rank_main(*args, lifeline=lifeline[0].detach())
"""


class _Stdio:
    """This process's stdout and stderr, pickled as descriptors the started process
    receives (multiprocessing's DupFd); unpickled as a plain tuple of them, so nothing
    of commlab is imported before the environment is in place."""

    def __reduce__(self):
        from multiprocessing import reduction

        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


class _Lifeline:
    """The read end of a pipe whose only writer is the process that started the pool: it
    reads end-of-file when that process is gone, however it died. (Not the parent pid:
    a rank's parent is the fork server, which every rank keeps alive.) Pickled, like
    _Stdio, as a plain 1-tuple of the descriptor the started process receives."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return tuple, ((reduction.DupFd(self.fd),),)


def _watch_lifeline(fd: int, rank: int, workdir: str) -> None:
    """Ends this rank once the process that started it is gone: killed (a scheduler's
    SIGTERM, the OOM killer), it cannot tell its ranks, which would otherwise train on for
    minutes with nobody to report to, holding their working directory."""
    import shutil

    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    shutil.rmtree(workdir, ignore_errors=True)
    os.write(2, f"commlab: rank {rank}: the process that started it is gone; exiting\n".encode())
    os._exit(1)


def _context():
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def _rank_main(rank: int, world_size: int, workdir: str, port: int, backend: str | None, pg_timeout_s: float,
               threads: int, inq, outq, lifeline: int) -> None:
    import faulthandler
    import signal
    import threading
    import traceback

    threading.Thread(target=_watch_lifeline, args=(lifeline, rank, workdir), daemon=True,
                     name="commlab-lifeline").start()

    # A rank that never answers is asked for its stacks (SIGUSR1) before it is killed.
    faulthandler.register(signal.SIGUSR1, file=open(_stacks_path(workdir, rank), "w"), all_threads=True)
    torch.set_num_threads(threads)  # ranks share the cores: intra-op threads would only fight
    try:
        if backend is not None:
            _init_pool_group(rank, world_size, workdir, backend, pg_timeout_s)
        outq.put((rank, "ready", None))
    except BaseException:
        outq.put((rank, "error", (traceback.format_exc(), "setup")))
        return
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outq.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:
            outq.put((rank, "error", (traceback.format_exc(), type(e).__name__)))
    leave(together=False)  # peers may be gone already: no barrier


def _init_pool_group(rank: int, world_size: int, workdir: str, backend: str, pg_timeout_s: float) -> None:
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))


class RankPool:
    """The one local launcher: ranks as fresh processes on this host (forked from a server
    that imported torch and what preload() added, nothing of commlab; see _BOOT), each with
    torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT on loopback) and, unless backend is None, a process group already up;
    they run the functions sent to them, fn(rank, world_size, *args), and send back the
    value or the traceback. A rank that never answers is reported with its stacks.

    Tests and the bench keep one pool per world size (importing torch in fresh processes
    for every call would dominate on 2 cores); compare, doctor and the CLI take fresh
    processes for each job (run_once). `spawn` picks which ranks are spawned: the bench
    spawns 1..N-1 and this process joins as rank 0 (local_init)."""

    def __init__(self, world_size: int, *, backend: str | None = "gloo", pg_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0, env: dict | None = None, spawn=None, threads: int = 1):
        self.world_size = world_size
        self.broken = False
        self.backend, self.pg_timeout_s = backend, pg_timeout_s
        self._dir = tempfile.mkdtemp(prefix="commlab-ranks-")
        self._port = free_port()
        self._ranks = list(range(world_size) if spawn is None else spawn)
        ctx = _context()
        self._inq = {r: ctx.Queue() for r in self._ranks}
        self._outq = ctx.Queue()
        life_r, self._lifeline = os.pipe()  # this process alone holds the write end
        common = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._port),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), COMMLAB_SPAWNED="1")
        common.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._procs = {
            r: ctx.Process(target=exec, args=(_BOOT, {
                "env": dict(common, RANK=str(r), LOCAL_RANK=str(r)), "stdio": _Stdio(), "lifeline": _Lifeline(life_r),
                "args": (r, world_size, self._dir, self._port, backend, pg_timeout_s, threads, self._inq[r],
                         self._outq)}), daemon=True, name=f"commlab-rank{r}")
            for r in self._ranks
        }
        try:
            for p in self._procs.values():
                p.start()
        except BaseException:  # the ranks already started, the lifeline, the directory go with the error
            os.close(life_r)
            self.close()
            raise
        os.close(life_r)
        _open.add(self)
        self._start_timeout_s = start_timeout_s
        if len(self._ranks) == world_size:
            self._collect("start", start_timeout_s, expect="ready")

    def local_init(self, rank: int) -> None:
        """This process joins the pool's group as `rank` (one the pool did not spawn)."""
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _init_pool_group(rank, self.world_size, self._dir, self.backend, self.pg_timeout_s)
        self._collect("start", self._start_timeout_s, expect="ready")

    def pid(self, rank: int) -> int:
        """The process id of a spawned rank (fault drills signal it)."""
        return self._procs[rank].pid

    def submit(self, fn: Callable, *args, **kwargs) -> None:
        """Send fn(rank, world_size, *args, **kwargs) to every spawned rank."""
        if self.broken:
            raise RuntimeError("rank pool is retired")
        for q in self._inq.values():
            q.put((fn, args, kwargs))

    def collect(self, what: str = "fn", timeout: float | None = 120.0) -> list:
        """The submitted function's values by spawned rank; raises RankFailure (and
        retires the pool) when a rank failed or did not answer in time."""
        return self._collect(what, timeout, expect="ok")

    def run(self, fn: Callable, *args, timeout: float | None = 120.0, **kwargs) -> list:
        self.submit(fn, *args, **kwargs)
        return self.collect(getattr(fn, "__name__", "fn"), timeout)

    def outcomes(self, fn: Callable, *args, timeout: float | None = 120.0, **kwargs) -> dict[int, Outcome]:
        """For jobs where a rank may fail or die: waits up to timeout for every rank,
        returns each rank's Outcome (never raises for a rank's failure) and retires
        the pool."""
        self.submit(fn, *args, **kwargs)
        out = self._gather("ok", timeout, stop_after_error=False)
        self.close()
        return out

    def _collect(self, what: str, timeout: float | None, expect: str) -> list:
        out = self._gather(expect, timeout, stop_after_error=True)
        if any(o.status != "ok" for o in out.values()):
            self.close()
            raise RankFailure(f"{what} on {self.world_size} ranks failed (deadline {timeout}s)\n"
                              + report_failures(out))
        return [out[r].result for r in self._ranks]

    def _gather(self, expect: str, timeout: float | None, stop_after_error: bool) -> dict[int, Outcome]:
        """Every spawned rank's Outcome for the message `expect` ("ready" or "ok"): what it
        sent by the deadline, else "missing" with its stacks. With stop_after_error it
        waits only 2 s more once a rank failed: peers of a failed rank usually block
        until the group's timeout, and the first traceback is the story."""
        out: dict[int, Outcome] = {}
        end = None if timeout is None else time.monotonic() + timeout
        while len(out) < len(self._ranks):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                rank, status, payload = self._outq.get(timeout=0.2 if left is None else min(left, 0.2))
            except queue.Empty:
                if all(not p.is_alive() for r, p in self._procs.items() if r not in out):
                    break
                continue
            if status == expect:
                out[rank] = Outcome("ok", result=payload)
                continue
            out[rank] = Outcome("error", error=payload[0], error_type=payload[1])
            if stop_after_error:
                grace = time.monotonic() + 2.0
                end = grace if end is None else min(end, grace)
        missing = [r for r in self._ranks if r not in out]
        stacks = self._stacks([r for r in missing if self._procs[r].is_alive()])
        for r in missing:
            out[r] = Outcome("missing", error=stacks.get(r, ""), alive=self._procs[r].is_alive())
        return out

    def _stacks(self, ranks) -> dict[int, str]:
        """Every thread's stack of each given (live) rank, through faulthandler."""
        import signal

        out = {}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)
            try:
                with open(_stacks_path(self._dir, r)) as f:
                    out[r] = f.read()[-6000:]
            except OSError:
                pass
        return out

    def close(self) -> None:
        import shutil

        if self.broken:
            return
        self.broken = True
        _open.discard(self)
        for q in self._inq.values():
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - a closed queue: the rank is gone anyway
                pass
        deadline = time.monotonic() + 5
        started = [p for p in self._procs.values() if p.pid is not None]
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(5)
        os.close(self._lifeline)
        shutil.rmtree(self._dir, ignore_errors=True)


_open: set = set()  # pools not closed yet


@atexit.register  # after multiprocessing.util's own (imported above), so it runs first
def _close_open() -> None:
    """A pool its process leaves open is closed as the interpreter exits: multiprocessing's
    exit handler would terminate the ranks outright, leaving the pool's directory behind."""
    for pool in list(_open):
        pool.close()


def run_once(world_size: int, fn: Callable, *args, backend: str | None = None, timeout: float | None = None,
             env: dict | None = None, threads: int = 1, pg_timeout_s: float = 30.0, **kwargs) -> dict[int, Outcome]:
    """Fresh processes for one job (a compare mode, doctor's smoke test, the CLI's
    --world-size): spawn, run fn on every rank, collect every rank's Outcome, close.
    With backend None the function starts its own process group (env://)."""
    pool = RankPool(world_size, backend=backend, env=env, threads=threads, pg_timeout_s=pg_timeout_s)
    return pool.outcomes(fn, *args, timeout=timeout, **kwargs)


def report_failures(outcomes: dict[int, Outcome]) -> str:
    """One readable block for the ranks that did not finish (empty when all did)."""
    lines = []
    for r, o in sorted(outcomes.items()):
        if o.status == "error":
            lines.append(f"--- rank {r} failed ---\n{o.error.rstrip()}")
        elif o.status == "missing":
            lines.append(f"--- rank {r} did not finish (alive: {o.alive}) ---" + (f"\n{o.error}" if o.error else ""))
    return "\n".join(lines)
