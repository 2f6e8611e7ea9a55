"""The extension must share the process's C++ runtime: where the compiler wrapper links
libstdc++ statically, the first C++ error (a TORCH_CHECK, a PeerLostError) segfaults
instead of raising (docs/measurements.md, "What the tests rest on"). setup.py refuses
such a build and commlab.core.ext refuses to use one, both naming the remedy."""
import importlib
import shutil
import subprocess

import pytest

import commlab
from commlab.core import cxx_runtime, ext
from commlab.core.errors import CommlabError

SOURCE = '#include <sstream>\nextern "C" int f(long x) { std::ostringstream s; s << x; return (int)s.str().size(); }\n'


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    d = tmp_path_factory.mktemp("so")
    (d / "x.cpp").write_text(SOURCE)
    out = {}
    for name, flags in (("static", ["-static-libstdc++"]), ("shared", [])):
        out[name] = str(d / f"{name}.so")
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(d / "x.cpp"), "-o", out[name]], check=True)
    return out


def test_a_statically_linked_cxx_runtime_is_named(libraries):
    why = cxx_runtime.problem(libraries["static"])
    assert why and "statically" in why and "CXX=" in why, why
    assert cxx_runtime.problem(libraries["shared"]) is None
    assert "libstdc++.so.6" in cxx_runtime.needed(libraries["shared"])


def test_the_built_extension_shares_the_runtime():
    assert ext.C is not None, ext.IMPORT_ERROR
    assert any(n.startswith("libstdc++") for n in cxx_runtime.needed(ext.C.__file__))
    assert cxx_runtime.needed(__file__) is None  # not an ELF: nothing to judge


def test_an_unusable_extension_is_refused_with_the_remedy(monkeypatch):
    monkeypatch.setattr(cxx_runtime, "problem", lambda path: "links the C++ runtime statically; CXX=/usr/bin/g++")
    try:
        importlib.reload(ext)
        assert ext.C is None
        with pytest.raises(CommlabError, match="cannot be used: links the C\\+\\+ runtime statically"):
            ext.require()
    finally:
        monkeypatch.undo()
        importlib.reload(ext)
    assert ext.C is not None and commlab.core.ext is ext


def test_only_the_bindings_include_the_whole_torch_frontend():
    """torch/extension.h costs ~15 s of compile per file (the C++ frontend, autograd,
    data loaders); outside module.cpp the sources need the Tensor type and pybind11
    (csrc/common/torch_lite.h). Four files included it: the build took 106 s here, CI's
    C++-only build 71 s; now 49 and 36."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    heavy = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")
                   and "torch/extension.h" in p.read_text() and p.name not in ("module.cpp", "torch_lite.h"))
    assert heavy == [], heavy
