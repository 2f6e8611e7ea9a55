"""Correctness of every registered algorithm against float64 references, on 1-8 ranks."""
import zlib

import pytest
import torch
import torch.distributed as dist
from cases import DTYPES, OPS, check, digest, make_input, reference

import commlab

ALGORITHMS = [a for a in commlab.algorithm_names() if "cpu" in commlab.get_algorithm(a).devices]


def sizes_for(p: int) -> list[int]:
    small = [0, 1, max(p - 1, 1), 7 * p + 3]
    return small if p >= 8 else small + [1000, 4099]


def sweep(rank, p, algorithm):
    """Every dtype x op x size on this rank; returns (failures, digests)."""
    failures, digests = [], {}
    for dtype in DTYPES:
        for op in OPS:
            for n in sizes_for(p):
                seed = zlib.crc32(f"{dtype} {op} {n}".encode()) % 100003
                x = make_input(seed, rank, n, dtype, op)
                commlab.all_reduce(x, op=getattr(dist.ReduceOp, op), algorithm=algorithm)
                want, tol = reference([make_input(seed, r, n, dtype, op) for r in range(p)], op, dtype)
                why = check(x, want, tol)
                key = f"{dtype} {op} n={n}"
                if why:
                    failures.append(f"rank {rank} {key}: {why}")
                digests[key] = digest(x)
    return failures, digests


def assert_sweep(results):
    failures = [f for fails, _ in results for f in fails]
    assert not failures, "\n".join(failures[:20])
    first = results[0][1]
    for r, (_, d) in enumerate(results[1:], start=1):
        diff = [k for k in first if first[k] != d[k]]
        assert not diff, f"rank {r} differs bitwise from rank 0 at {diff[:10]}"


# hier on one host runs shm's code path: shm's sweep covers it at 5 and 8 ranks
# (tests/test_hier.py sweeps its own layouts). builtin is gloo's own all-reduce behind the
# API every algorithm shares: 1-4 ranks check that API's part (gloo at 8 ranks on 2 cores
# took 24 s of CI's budget).
SWEEP = [(w, a) for a in ALGORITHMS for w in (1, 2, 3, 4, 5, 8) if not (a in ("hier", "builtin") and w > 4)]
# 5 and 8 ranks (the folded and the larger power of two) in the full suite only.
SWEEP = [pytest.param(w, a, marks=pytest.mark.slow) if w > 4 else (w, a) for w, a in SWEEP]


@pytest.mark.parametrize("world_size,algorithm", SWEEP)
def test_sweep(ranks, world_size, algorithm):
    assert_sweep(ranks.run(world_size, sweep, algorithm, timeout=300))


def strided(rank, p, algorithm):
    out = []
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10) + rank
    before = base.clone()
    view = base[:, ::3]  # non-contiguous, 6x4
    assert not view.is_contiguous()
    commlab.all_reduce(view, algorithm=algorithm)
    want = (torch.arange(60, dtype=torch.float32).reshape(6, 10)[:, ::3]) * p + sum(range(p))
    if not torch.equal(view, want):
        out.append(f"strided view wrong: {view} vs {want}")
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, ::3] = False
    if not torch.equal(base[untouched], before[untouched]):
        out.append("elements outside the view were modified")
    t = (torch.arange(12, dtype=torch.int64).reshape(3, 4) * (rank + 1)).t()
    commlab.all_reduce(t, op=dist.ReduceOp.MAX, algorithm=algorithm)
    if not torch.equal(t, (torch.arange(12).reshape(3, 4) * p).t()):
        out.append(f"transposed MAX wrong: {t}")
    s = torch.tensor(float(rank + 1))  # 0-dim
    commlab.all_reduce(s, algorithm=algorithm)
    if s.item() != p * (p + 1) / 2 or s.dim() != 0:
        out.append(f"0-dim wrong: {s}")
    return out


def subgroups(rank, p, algorithm):
    # Groups must be created in the same order on every rank.
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    trio = dist.new_group([1, 2, 3])
    mine = evens if rank % 2 == 0 else odds
    x = torch.full((37,), float(rank + 1))
    commlab.all_reduce(x, group=mine, algorithm=algorithm)
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    out = []
    if not torch.equal(x, torch.full((37,), float(sum(m + 1 for m in members)))):
        out.append(f"pair group sum wrong on rank {rank}: {x[:3]}")
    if rank in (1, 2, 3):
        y = torch.arange(10, dtype=torch.int32) + rank
        commlab.all_reduce(y, op=dist.ReduceOp.MIN, group=trio, algorithm=algorithm)
        if not torch.equal(y, torch.arange(10, dtype=torch.int32) + 1):
            out.append(f"trio MIN wrong: {y}")
    # The world group still works after sub-group traffic.
    z = torch.ones(5)
    commlab.all_reduce(z, algorithm=algorithm)
    if not torch.equal(z, torch.full((5,), float(p))):
        out.append("world after sub-groups wrong")
    for g in (evens, odds, trio):
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return out


def asynchronous(rank, p, algorithm):
    xs = [torch.full((n,), float(rank + 1)) for n in (3, 1000, 17)]
    works = [commlab.all_reduce(x, algorithm=algorithm, async_op=True) for x in xs]
    # A blocking call issued while async ones are pending must queue behind them.
    y = torch.full((5,), 2.0 * (rank + 1))
    commlab.all_reduce(y, op=dist.ReduceOp.AVG, algorithm=algorithm)
    out = []
    for w, x in zip(works, xs):
        fut = w.get_future()
        w.wait()
        if not w.is_completed() or not fut.done():
            out.append("handle not completed after wait")
        if fut.value()[0] is not x:
            out.append("future does not hold the input tensor")
        if not torch.equal(x, torch.full_like(x, p * (p + 1) / 2)):
            out.append(f"async result wrong: {x[:3]}")
    if not torch.allclose(y, torch.full((5,), float(p + 1))):
        out.append(f"blocking AVG after async wrong: {y}")
    return out


# Each case returns the list of what went wrong on its rank (empty when all is right).
CASES = {"strided and scalar": (strided, 3), "sub-groups": (subgroups, 4), "async_op": (asynchronous, 3)}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", list(CASES))
def test_contract(ranks, case, algorithm):
    fn, world = CASES[case]
    for fails in ranks.run(world, fn, algorithm):
        assert not fails, fails


def refusals(rank, p):
    out = []
    cases = {
        "bool dtype": lambda: commlab.all_reduce(torch.ones(3, dtype=torch.bool)),
        "complex dtype": lambda: commlab.all_reduce(torch.ones(3, dtype=torch.complex64)),
        "BAND op": lambda: commlab.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "unknown algorithm": lambda: commlab.all_reduce(torch.ones(3), algorithm="nope"),
        "not a tensor": lambda: commlab.all_reduce([1.0, 2.0]),
        "sparse": lambda: commlab.all_reduce(torch.ones(3).to_sparse()),
    }
    for name, call in cases.items():
        try:
            call()
        except commlab.UnsupportedError as e:
            out.append((name, str(e)))
        else:
            out.append((name, "NOT RAISED"))
    # The group must still be usable: nothing was sent.
    x = torch.ones(4)
    commlab.all_reduce(x)
    out.append(("after", x.tolist()))
    return out


def test_refusals_identical_on_every_rank(ranks):
    results = ranks.run(3, refusals)
    for name, msg in results[0][:-1]:
        assert msg != "NOT RAISED", name
    assert all(r == results[0] for r in results), "ranks raised different errors"
    assert results[0][-1] == ("after", [3.0] * 4)
    said = dict(results[0][:-1])  # each names what it refused
    assert "all_reduce of dtype torch.bool is not supported" in said["bool dtype"], said
    assert "torch.complex64" in said["complex dtype"] and "BAND" in said["BAND op"], said
    assert "'nope'" in said["unknown algorithm"] and "list" in said["not a tensor"], said
    assert "sparse" in said["sparse"], said
    assert issubclass(commlab.UnsupportedError, ValueError)
    assert issubclass(commlab.UnsupportedError, commlab.CommlabError)


def fresh_ops(rank, p):
    """Plans are cached by the op's identity: ops built afresh for every call must
    neither grow the cache without bound nor get a wrong plan."""
    from commlab.api import all_reduce as api
    from commlab.api import family
    x = torch.ones(6)
    for i in range(400):
        op = dist.ReduceOp(dist.ReduceOp.MAX if i % 2 else dist.ReduceOp.SUM)
        x.fill_(rank + 1)
        commlab.all_reduce(x, op=op, algorithm="shm")
        want = p if i % 2 else p * (p + 1) // 2
        if x.tolist() != [float(want)] * 6:
            return f"call {i}: {x.tolist()}"
    return len(api._plans), len(family._fast)


def test_fresh_op_objects_keep_the_plan_cache_bounded(ranks):
    for got in ranks.run(2, fresh_ops):
        assert isinstance(got, tuple) and got[0] <= 256 and got[1] <= 256, got


def test_registry_shape():
    names = commlab.algorithm_names()
    for required in ["builtin", "ring", "ps", "ps_sharded", "rhd", "rd"]:
        assert required in names
    for n in names:
        alg = commlab.get_algorithm(n)
        assert alg.name == n and alg.summary and alg.formula
        c = alg.cost(4, 1 << 20)
        assert c.steps > 0 and c.bytes_sent > 0
    with pytest.raises(commlab.UnsupportedError):
        commlab.get_algorithm("no-such-algorithm")


def test_cost_facts():
    n = 1 << 20
    ring = commlab.get_algorithm("ring").cost(4, n)
    assert ring.steps == 6 and ring.bytes_sent == pytest.approx(1.5 * n)
    ps = commlab.get_algorithm("ps").cost(4, n)
    assert ps.bytes_sent == pytest.approx(6 * n)  # the root: 2(p-1)·n
    rhd = commlab.get_algorithm("rhd").cost(8, n)
    assert rhd.steps == 6 and rhd.bytes_sent == pytest.approx(2 * 7 / 8 * n)
    rd = commlab.get_algorithm("rd").cost(8, n)
    assert rd.steps == 3 and rd.bytes_sent == pytest.approx(3 * n)
    assert commlab.get_algorithm("rd").cost(5, n).steps == 2 + 2  # fold adds two steps


def test_docs_document_every_algorithm():
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "allreduce.md").read_text()
    for name in commlab.algorithm_names():
        assert f"| `{name}` |" in page, f"docs/allreduce.md's algorithm table lacks {name}"


def inline_call_admitted_before_an_async_one(rank, p):
    """Thread A's blocking ring call is admitted to run inline; thread B queues an async
    call while A is still inside its algorithm (rank 1 starts A late, so A waits). B must
    run after A, not beside it on the lane thread: interleaved steps on one group pair
    each other's messages."""
    import threading
    import time

    from commlab.api import lanes

    g = dist.new_group(list(range(p)))
    alg = commlab.get_algorithm("ring")
    entered = threading.Event()
    real_run = type(alg).run
    active = {"now": 0, "max": 0}
    lock = threading.Lock()

    def run(self, buf, op, ctx):
        with lock:
            active["now"] += 1
            active["max"] = max(active["max"], active["now"])
        entered.set()
        try:
            real_run(self, buf, op, ctx)
        finally:
            with lock:
                active["now"] -= 1

    # The caller of a blocking call may be descheduled right after the admission check.
    admit = getattr(lanes._Lane, "try_inline", None) or getattr(lanes._Lane, "idle")

    def slow_admit(self):
        ok = admit(self)
        time.sleep(0.05)
        return ok

    mp_ = pytest.MonkeyPatch()
    mp_.setattr(type(alg), "run", run)
    mp_.setattr(lanes._Lane, admit.__name__, slow_admit)
    try:
        a = torch.full((20_000,), float(rank + 1))
        b = torch.full((20_000,), 100.0 * (rank + 1))
        works = {}

        def thread_b():
            entered.wait(10)
            works["b"] = commlab.all_reduce(b, group=g, algorithm="ring", async_op=True)

        tb = threading.Thread(target=thread_b)
        tb.start()
        if rank == 1:
            time.sleep(0.3)
        commlab.all_reduce(a, group=g, algorithm="ring")
        tb.join(10)
        works["b"].wait()
    finally:
        mp_.undo()
    dist.destroy_process_group(g)
    total = sum(range(1, p + 1))
    return {"a": a.unique().tolist(), "b": b.unique().tolist(), "overlap": active["max"], "want": total}


def test_a_blocking_call_admitted_inline_is_never_overtaken(ranks):
    for r in ranks.run(2, inline_call_admitted_before_an_async_one):
        assert r["overlap"] == 1, r
        assert r["a"] == [float(r["want"])] and r["b"] == [100.0 * r["want"]], r


def wait_with_timeout(rank, p):
    import time

    g = dist.new_group(list(range(p)))
    x = torch.full((1000,), float(rank + 1))
    if rank == 1:
        time.sleep(1.5)
    w = commlab.all_reduce(x, group=g, algorithm="ring", async_op=True)
    out = {}
    t0 = time.monotonic()
    try:
        w.wait(timeout=0.3)
        out["timeout"] = None if rank == 0 else "completed"
    except commlab.CommlabError as e:
        out["timeout"] = str(e)
    out["timeout_s"] = time.monotonic() - t0
    w.wait()  # the work itself goes on and completes
    out["x"] = x.unique().tolist()
    dist.destroy_process_group(g)
    return out


def test_work_wait_honours_its_timeout(ranks):
    r0, r1 = ranks.run(2, wait_with_timeout)
    assert r0["timeout"] and "within 0.3 s" in r0["timeout"], r0
    assert r0["timeout_s"] < 1.0, r0
    assert r0["x"] == r1["x"] == [3.0]


def test_docs_show_the_registry_as_it_is():
    import ast
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "allreduce.md").read_text()
    line = next(x for x in page.splitlines() if x.startswith("commlab.algorithm_names()"))
    assert ast.literal_eval(line.split("#", 1)[1].strip()) == commlab.algorithm_names(), line


def test_docs_example_algorithm_is_the_registered_file():
    """docs/allreduce.md's "Add an algorithm" example is commlab/algorithms/all_reduce/direct.py
    itself, so the sweeps above run it like every other registered algorithm."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    page = (root / "docs" / "allreduce.md").read_text()
    section = page.split("## Add an algorithm", 1)[1]
    block = section.split("```python file=commlab/algorithms/all_reduce/direct.py\n", 1)[1].split("```", 1)[0]
    source = (root / "commlab" / "algorithms" / "all_reduce" / "direct.py").read_text()
    assert block == source
    assert len(source.splitlines()) <= 40
    assert "direct" in commlab.algorithm_names()
