"""Schedules as data (commlab.schedule): MSCCL's XML in and out, the checker's proof and
its first violation, the cost derived from the steps, and `algorithm="msccl:PATH"` run
on CPU ranks with the family's contract, bit for bit against the algorithm it was
exported from. Published MSCCL files (RCCL's, msccl-tools') are read from the folder
COMMLAB_MSCCL_XML names; without it those tests skip (commlab commits only XML it writes)."""
import copy
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cases import assert_drill_named_rank_1, assert_none_failed, halves

import commlab
from commlab import schedule as S
from commlab.algorithms import registry
from commlab.core.collectives import COLLECTIVES

XML_DIR = os.environ.get("COMMLAB_MSCCL_XML", "")


def exported():
    """(collective, algorithm) of every built-in that is a fixed schedule."""
    return [(c, n) for c in COLLECTIVES for n in registry(c).names() if registry(c).get(n).schedule(2) is not None]


def published():
    if not XML_DIR or not os.path.isdir(XML_DIR):
        return []
    return sorted(os.path.join(XML_DIR, f) for f in os.listdir(XML_DIR) if f.endswith(".xml"))


needs_published = pytest.mark.skipif(not published(), reason="set COMMLAB_MSCCL_XML to a folder of MSCCL XML files")


# ---- the format and the proof, no ranks -------------------------------------------------

@pytest.mark.parametrize("collective,algorithm", exported())
def test_every_export_unfused_is_proved_and_plain(collective, algorithm):
    for p in (2, 3, 5):
        s = S.unfused(registry(collective).get(algorithm).schedule(p))
        S.check(s)
        assert not {st.type for *_, st in s.steps()} & {"rcs", "rrs", "rrc", "rrcs"}


@pytest.mark.parametrize("collective,algorithm", exported())
def test_every_exported_builtin_is_proved_and_priced_as_its_formula(collective, algorithm):
    alg = registry(collective).get(algorithm)
    for p in (2, 3, 4, 5, 8):
        s = alg.schedule(p)
        summary = S.check(s)
        want = alg.cost(p, 1.0)  # linear in the size: one byte's terms are the coefficients
        chunk = 1.0 / summary.chunks
        assert (summary.hops, summary.sent * chunk, summary.reduced * chunk) == pytest.approx(
            (want.steps, want.bytes_sent, want.bytes_reduced)), (p, summary)
        text = S.dumps(s)
        assert S.dumps(S.loads(text)) == text  # a file commlab writes reads back to the same bytes


@pytest.mark.parametrize("hosts,per_host", [(1, 4), (2, 2), (2, 4), (4, 2)])
def test_an_exported_ring_priced_per_level_is_the_hand_written_ring(tmp_path, hosts, per_host):
    from commlab.measure.twolevel import TwoLevel

    path = tmp_path / "ring.xml"
    S.save(_ring(hosts * per_host), path)
    model = TwoLevel({"shm": 1e-5, "host": 1e-4, "link": 1e-3}, {"ring@host": 50.0, "ring@link": 120.0}, 3e-5)
    for n in (1 << 20, 1 << 26):
        want = model.predict_us("ring", hosts, per_host, n, 1.5)
        assert model.predict_us(f"msccl:{path}", hosts, per_host, n, 1.5) == pytest.approx(want), (n, want)


def test_a_file_round_trips_through_save_and_load(tmp_path):
    s = registry("all_gather").get("ring").schedule(3)
    s.extra["redop"] = "nop"  # an attribute MSCCL ignores is kept
    path = tmp_path / "ag.xml"
    S.save(s, path)
    back = S.load(path)
    assert back == s
    assert path.read_text() == S.dumps(back)


def test_a_file_msccl_tools_compiled_loads_as_it_meant_it():
    """msccl-tools' compiler writes `inplace` but never `outofplace`, `minBytes` or
    `maxBytes`, which rccl's parser requires: read as it meant them and named, and a
    save completes the file."""
    for (collective, name), inplace in ((("all_reduce", "ring"), True), (("all_to_all", "pairwise"), False)):
        s = registry(collective).get(name).schedule(3)
        assert s.modes() == [inplace]  # what the compiler's one flag can say
        text = S.dumps(s)
        for attr in ("outofplace", "minBytes", "maxBytes"):
            text = re.sub(f' {attr}="[^"]*"', "", text, count=1)
        back = S.loads(text)
        assert back.absent == ("outofplace", "minBytes", "maxBytes") and back.modes() == [inplace], back
        assert (back.min_bytes, back.max_bytes) == (0, 0)
        S.check(back)
        saved = S.loads(S.dumps(back))
        assert saved.absent == () and saved.outofplace == (not inplace)
    with pytest.raises(S.ScheduleFormatError, match="attribute 'inplace' missing"):
        S.loads(re.sub(' inplace="[^"]*"', "", text, count=1))  # the flag it does write stays required


def _ring(p=4):
    return registry("all_reduce").get("ring").schedule(p)


def _block(s, rank, **peers):
    return next(b for b in s.ranks[rank].blocks if all(getattr(b, k) == v for k, v in peers.items()))


def _violation(s) -> S.Violation:
    with pytest.raises(S.ScheduleError) as e:
        S.check(s)
    return e.value.violation


def _mutated(make, mutate):
    s = copy.deepcopy(make())
    mutate(s)
    return s


def _delete_step(s):
    del _block(s, 1, send=2).steps[-1]  # the last: no other step's index moves


def _wrong_offset(s):
    _block(s, 2, recv=1).steps[0].dstoff = 3  # lands on a chunk it was not meant for


def _receive_without_send(s):
    b = _block(s, 0, send=1)
    b.send = -1
    for st in b.steps:
        st.type = "nop"
        st.depid = st.deps = -1


def _swapped(s):
    b = _block(s, 0, send=1)
    b.steps[0], b.steps[1] = b.steps[1], b.steps[0]


def _cycle(s):
    send, recv = _block(s, 1, send=2), _block(s, 1, recv=0)
    send.steps[0].depid, send.steps[0].deps = recv.id, len(recv.steps) - 1
    recv.steps[-1].hasdep = True
    recv.steps[0].depid, recv.steps[0].deps = send.id, len(send.steps) - 1
    send.steps[-1].hasdep = True


def _scratch_overrun(s):
    st = _block(s, 3, recv=2).steps[0]
    s.ranks[3].s_chunks = 1
    st.dstbuf, st.dstoff = "s", 1


def _reduced_twice(s):
    b = _block(s, 1, recv=0)
    last = b.steps[-1]  # an all-gather receive made a receive-and-reduce: one chunk folded twice
    last.type, last.srcbuf, last.srcoff = "rrc", last.dstbuf, last.dstoff


SEEDED = {
    "a deleted step": (_delete_step, "never come"),
    "a wrong offset": (_wrong_offset, "output chunk"),
    "a receive with no send": (_receive_without_send, "no threadblock of rank 0 sends"),
    "a swapped order on a channel": (_swapped, "not ordered"),
    "a dependency cycle": (_cycle, "cycle"),
    "a scratch overrun": (_scratch_overrun, "outside its buffer"),
    "a chunk reduced twice": (_reduced_twice, "reduced more than once"),
}


@pytest.mark.parametrize("fault", list(SEEDED))
def test_the_checker_names_each_seeded_fault_before_anything_runs(fault):
    mutate, words = SEEDED[fault]
    v = _violation(_mutated(_ring, mutate))
    assert words in v.text, str(v)
    text = str(v)
    assert text.startswith(f"rank {v.rank}"), text
    if fault not in ("a wrong offset", "a chunk reduced twice"):  # a postcondition names the chunk's last writer
        assert v.block is not None and v.step is not None and f"threadblock {v.block}, step {v.step}" in text, text
    else:
        assert "threadblock" in text and "step" in text, text


def test_the_formats_rules_are_checked_with_the_place_named():
    def unknown_peer(s):
        _block(s, 2, send=3).send = 7

    def two_blocks_one_connection(s):
        b = copy.deepcopy(_block(s, 0, send=1))
        b.id, b.steps = len(s.ranks[0].blocks), []
        s.ranks[0].blocks.append(b)

    def dependency_on_a_silent_step(s):
        b = _block(s, 1, send=2)
        b.steps[1].depid, b.steps[1].deps = _block(s, 1, recv=0).id, 0
        _block(s, 1, recv=0).steps[0].hasdep = False

    cases = [(unknown_peer, "send peer 7"), (two_blocks_one_connection, "one connection"),
             (dependency_on_a_silent_step, "does not publish")]
    for mutate, words in cases:
        v = _violation(_mutated(_ring, mutate))
        assert words in v.text and v.rank is not None and v.block is not None, str(v)


def test_unreadable_files_are_told_apart(tmp_path):
    bad = tmp_path / "bad.xml"
    for text, words in (("<algo", "not XML"), ("<gpu/>", "not <algo>"),
                        ('<algo name="x" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="reduce"'
                         ' inplace="1" outofplace="0" minBytes="0" maxBytes="0"/>', "coll='reduce'")):
        bad.write_text(text)
        with pytest.raises(S.ScheduleFormatError, match=words):
            S.load(bad)
    missing = S.dumps(_ring(2)).replace(' cnt="1"', "", 1)
    with pytest.raises(S.ScheduleFormatError, match="attribute 'cnt' missing"):
        S.loads(missing)


@pytest.mark.slow  # three fresh interpreters; the checker's verdicts are the quick tests above
def test_the_cli_exits_0_1_2_and_prints_the_verdict(tmp_path):
    good, broken, junk = tmp_path / "ring.xml", tmp_path / "broken.xml", tmp_path / "junk.xml"
    run = [sys.executable, "-m", "commlab.schedule"]
    out = subprocess.run(run + ["export", "ring", "--ranks", "4", "-o", str(good)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    S.save(_mutated(_ring, _cycle), broken)
    junk.write_text("<algo")
    got = {}
    for f in (good, broken, junk):
        r = subprocess.run(run + ["check", str(f), "--bytes", "1M"], capture_output=True, text=True)
        got[f.name] = (r.returncode, r.stdout + r.stderr)
    assert got["ring.xml"][0] == 0 and "all_reduce on 4 ranks" in got["ring.xml"][1] and "priced at" in got["ring.xml"][1]
    assert got["broken.xml"][0] == 1 and "cycle" in got["broken.xml"][1] and "threadblock" in got["broken.xml"][1]
    assert got["junk.xml"][0] == 2 and "not XML" in got["junk.xml"][1]


@needs_published
@pytest.mark.parametrize("path", published(), ids=os.path.basename)
def test_published_schedules_load_and_pass_the_checker(path):
    s = S.load(path)
    summary = S.check(s, path)
    assert summary.ranks == s.size and summary.steps > 0
    S.check(S.unfused(s), path)  # and without fused steps, as RCCL's build would need them


# ---- running them on CPU ranks ----------------------------------------------------------

def _inputs(family, rank, p, n, dtype):
    """(inp, out, root) for one call of n elements per rank block."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    size = {"all_reduce": n, "broadcast": n, "all_gather": n}.get(family, n * p)
    x = (torch.randn(size, generator=g) * 8).to(dtype) if dtype.is_floating_point else \
        torch.randint(-50, 50, (size,), generator=g).to(dtype)
    out = {"all_gather": n * p, "reduce_scatter": n, "all_to_all": n * p}.get(family)
    return x, (torch.empty(out, dtype=dtype) if out else None)


EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _close(ours, family, rank, p, n, dtype):
    """Within rounding of the float64 sum of every rank's input, whatever the fold's
    order: |error| <= (p + 2)·eps·Σ|x| per element."""
    xs = torch.stack([_inputs(family, q, p, n, dtype)[0].double() for q in range(p)])
    if family == "reduce_scatter":
        xs = xs.view(p, p, -1)[:, rank]
    err = (ours.double() - xs.sum(0)).abs()
    return bool((err <= (p + 2) * EPS[dtype] * xs.abs().sum(0) + 1e-30).all())


def _call(family, algorithm, inp, out, op, root=0, inplace=False):
    if family == "all_reduce":
        t = inp.clone()
        commlab.all_reduce(t, op=op, algorithm=algorithm)
        return t
    if family == "broadcast":
        t = inp.clone()
        commlab.broadcast(t, root, algorithm=algorithm)
        return t
    out = out.clone()
    if family == "all_gather":
        if inplace:
            p, r = dist.get_world_size(), dist.get_rank()
            own = out.view(p, -1)[r]
            own.copy_(inp)
            commlab.all_gather(out, own, algorithm=algorithm)
        else:
            commlab.all_gather(out, inp, algorithm=algorithm)
    elif family == "reduce_scatter":
        commlab.reduce_scatter(out, inp, op=op, algorithm=algorithm)
    else:
        commlab.all_to_all(out, inp, algorithm=algorithm)
    return out


EXECUTORS = ("msccl", "msccl-shm")  # point-to-point, and native over shared memory


def against_the_builtins(rank, p, cases):
    """Every (family, algorithm, path) run as msccl:path and as the algorithm itself:
    bitwise equal where the fold order is the same (chunks that split like the
    built-in's, or an order-free op), within rounding otherwise."""
    failures = []
    for family, name, path in cases:
        reducing = family in ("all_reduce", "reduce_scatter")
        chunks = S.load(path).per_rank
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) if reducing else (None,):
                for n in (chunks * 5, chunks * 5 + 3, 1):
                    for root in ((0, p - 1) if family == "broadcast" else (0,)):
                        for inplace in ((False, True) if family == "all_gather" else (False,)):
                            inp, out = _inputs(family, rank, p, n, dtype)
                            want = _call(family, name, inp, out, op, root, inplace)
                            for executor in EXECUTORS:
                                ours = _call(family, f"{executor}:{path}", inp, out, op, root, inplace)
                                exact = (not reducing or not dtype.is_floating_point or op == dist.ReduceOp.MAX
                                         or dtype == torch.float32 and n % chunks == 0)
                                ok = torch.equal(ours, want) if exact else _close(ours, family, rank, p, n, dtype)
                                if not ok:
                                    failures.append(f"rank {rank}: {executor} {family} {name} {dtype} {op} n={n}"
                                                    f" root={root} inplace={inplace}: {ours[:4].tolist()} !="
                                                    f" {want[:4].tolist()}")
    return failures


@pytest.mark.parametrize("world_size", [3, 4])
def test_exported_schedules_run_with_the_builtins_bits(ranks, world_size, tmp_path):
    cases = []
    for family, name in exported():
        path = tmp_path / f"{family}-{name}.xml"
        S.save(registry(family).get(name).schedule(world_size), path)
        cases.append((family, name, str(path)))
    plain = tmp_path / "ring-unfused.xml"  # receives into scratch, then re: the same bits
    S.save(S.unfused(_ring(world_size)), plain)
    cases.append(("all_reduce", "ring", str(plain)))
    assert_none_failed(ranks.run(world_size, against_the_builtins, cases, timeout=300))


def refusals(rank, p, path_8, path_ag, path_bad):
    """Each refusal: (type, message) on this rank."""
    out = []
    t = torch.ones(8)
    for alg in (f"msccl:{path_8}", f"msccl:{path_ag}", f"msccl:{path_bad}", "msccl:/nonexistent.xml"):
        try:
            commlab.all_reduce(t, algorithm=alg)
            out.append(("returned", ""))
        except Exception as e:  # noqa: BLE001 - the type is what is asserted
            out.append((type(e).__name__, str(e)))
    return out


def test_a_schedule_that_cannot_serve_the_call_is_refused_alike_on_every_rank(ranks, tmp_path):
    p8, ag, bad = tmp_path / "ring8.xml", tmp_path / "ag.xml", tmp_path / "bad.xml"
    S.save(_ring(8), p8)
    S.save(registry("all_gather").get("ring").schedule(2), ag)
    S.save(_mutated(lambda: _ring(2), _swapped), bad)
    got = ranks.run(2, refusals, str(p8), str(ag), str(bad))
    assert got[0] == got[1], got
    kinds = [k for k, _ in got[0]]
    assert kinds == ["UnsupportedError", "UnsupportedError", "ScheduleError", "UnsupportedError"], got[0]
    assert "for 8 ranks; the group has 2" in got[0][0][1]
    assert "all_gather schedule, not all_reduce" in got[0][1][1]
    assert "threadblock" in got[0][2][1]


def mismatched(rank, p, ours, theirs):
    group = dist.new_group(list(range(p)))  # a fresh group: the failed call ends it
    t = torch.ones(64)
    try:
        commlab.all_reduce(t, group=group, algorithm=ours if rank == 0 else theirs)
        return "returned"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("ours,theirs", [("msccl", "ring"), ("msccl-shm", "shm"), ("msccl-shm", "msccl")])
def test_a_schedule_against_another_algorithm_is_a_mismatch_on_every_rank(ranks, tmp_path, ours, theirs):
    path = tmp_path / "ring2.xml"
    S.save(_ring(2), path)
    other = f"msccl:{path}" if theirs == "msccl" else theirs
    assert ranks.run(2, mismatched, f"{ours}:{path}", other) == ["CollectiveMismatchError"] * 2


def published_run(rank, p, path):
    s = S.load(path)
    family = s.collective
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) if family in ("all_reduce", "reduce_scatter") else (None,):
            for n in (s.per_rank * 2, s.per_rank * 2 + 5):
                inp, out = _inputs(family, rank, p, n, dtype)
                inplace = family == "all_gather" and not s.outofplace
                want = _call(family, "builtin" if family != "all_to_all" else "pairwise", inp, out, op, 0, inplace)
                for executor in EXECUTORS:
                    ours = _call(family, f"{executor}:{path}", inp, out, op, 0, inplace)
                    exact = not dtype.is_floating_point or op in (None, dist.ReduceOp.MAX)
                    ok = torch.equal(ours, want) if exact else _close(ours, family, rank, p, n, dtype)
                    if not ok:
                        failures.append(f"rank {rank}: {executor} {os.path.basename(path)} {dtype} {op} n={n}: wrong")
    return failures


@pytest.mark.slow
@needs_published
@pytest.mark.parametrize("path", published(), ids=os.path.basename)
def test_published_schedules_give_exact_results_at_their_rank_counts(ranks, path):
    p = S.load(path).size
    assert_none_failed(ranks.run(p, published_run, path, timeout=600))


def fused_ring(p: int, cnt: int = 2) -> S.Schedule:
    """MSCCL's ring all-reduce with fused steps, as its runtime's files have it and as
    no builder of commlab's writes: s, rrs..., rrcs (reduce-scatter done, all-gather
    begun), rcs..., r; each step `cnt` chunks back to back."""
    ranks = []
    for r in range(p):
        c = lambda k: ((r - k) % p) * cnt  # noqa: E731 - this rank's chunk at round k
        steps = [S.Step("s", "i", c(0), "i", c(0), cnt)]
        steps += [S.Step("rrs", "i", c(k), "i", c(k), cnt) for k in range(1, p - 1)]
        steps.append(S.Step("rrcs", "i", c(p - 1), "i", c(p - 1), cnt))
        steps += [S.Step("rcs", "i", c(k - 1), "i", c(k - 1), cnt) for k in range(1, p - 1)]
        steps.append(S.Step("r", "i", c(p - 2), "i", c(p - 2), cnt))
        ranks.append(S.Rank(r, p * cnt, 0, 0, [S.Block(0, (r + 1) % p, (r - 1) % p, 0, steps)]))
    return S.Schedule("all_reduce", ranks, p * cnt, name="fused-ring", inplace=True, outofplace=False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_steps_run_as_the_runtime_runs_them(ranks, world_size, tmp_path):
    """rrs, rrcs and rcs (what MSCCL's own files use) over spans of chunks: proved, and
    right on both executors against the built-in, every dtype and op."""
    path = tmp_path / "fused.xml"
    S.save(fused_ring(world_size), path)
    S.check(S.load(path))
    assert_none_failed(ranks.run(world_size, published_run, str(path), timeout=300))


def groups_ops_and_async(rank, p, path):
    """On each half of four ranks (a sub-group of 2), every op of the family, a strided
    tensor and an async handle: as torch's all_reduce has them."""
    failures = []
    with halves(rank) as (group, members):
        for executor in EXECUTORS:
            for op, fold in ((dist.ReduceOp.AVG, lambda v: sum(v) / len(v)), (dist.ReduceOp.MIN, min),
                             (dist.ReduceOp.PRODUCT, lambda v: v[0] * v[1]), (dist.ReduceOp.SUM, sum)):
                t = torch.full((6, 5), float(rank + 1)).t()  # not contiguous
                commlab.all_reduce(t, op=op, group=group, algorithm=f"{executor}:{path}", async_op=True).wait()
                want = fold([float(m + 1) for m in members])
                if not torch.all(t == want):
                    failures.append(f"rank {rank} {executor} {op}: {t.flatten()[:3].tolist()} != {want}")
    return failures


def test_schedules_serve_sub_groups_every_op_strided_tensors_and_async_handles(ranks, tmp_path):
    path = tmp_path / "ring2.xml"
    S.save(_ring(2), path)
    assert_none_failed(ranks.run(4, groups_ops_and_async, str(path)))


@pytest.mark.parametrize("executor,fault", [("msccl-shm", "sigkill"),
                                            pytest.param("msccl", "sigint", marks=pytest.mark.slow)])
def test_a_failed_rank_makes_every_peer_raise_within_two_seconds(tmp_path, executor, fault):
    path = tmp_path / "ring3.xml"
    S.save(_ring(3), path)
    assert_drill_named_rank_1(f"{executor}:{path}", fault, "all_reduce")


def registered(rank, p, path):
    from commlab.algorithms import names, scheduled

    if "my_ring" not in names():
        scheduled.register(path, "my_ring")
    t = torch.full((10,), float(rank + 1))
    commlab.all_reduce(t, algorithm="my_ring")
    return "my_ring" in names(), t.tolist()


def test_a_schedule_registered_by_name_is_an_algorithm_like_any_other(tmp_path):
    from commlab.measure.pools import RankPool

    path = tmp_path / "ring2.xml"
    S.save(_ring(2), path)
    pool = RankPool(2)  # its own ranks: the name stays registered in them
    try:
        assert pool.run(registered, str(path)) == [(True, [3.0] * 10)] * 2
    finally:
        pool.close()


def test_the_cost_model_fits_a_schedules_rows_through_its_own_terms(tmp_path):
    from commlab.measure import costmodel

    path = tmp_path / "ring4.xml"
    S.save(_ring(4), path)
    name = f"msccl:{path}"
    alpha, beta = 300.0, 1e-3  # µs, µs per byte: times made from the schedule's own terms
    cost = registry("all_reduce").get(name).cost
    points = [(name, 4, n, alpha * cost(4, n).steps + beta * cost(4, n).bytes_sent) for n in (1 << 16, 1 << 20, 1 << 24)]
    points.append(("mpi:mpich", 4, 1 << 20, 900.0))  # an anchor: no formula, left out
    fits = costmodel.fit(points, gamma_us_per_byte=0.0)
    assert set(fits) == {name}
    assert fits[name].alpha_us == pytest.approx(alpha, rel=1e-3)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_schedule_reduces_ddps_buckets_as_ddps_own_allreduce(ranks, tmp_path, executor):
    from test_hooks import _check, parity

    path = tmp_path / "ring3.xml"
    S.save(_ring(3), path)
    _check(ranks.run(3, parity, f"{executor}:{path}", "plain"), tol=1e-5)
