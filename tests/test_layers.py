"""The layers of docs/ARCHITECTURE.md, checked: no commlab module imports from a layer
above its own (function-level imports included)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "commlab"

# Top to bottom; a module may import its own layer and the ones below it.
LAYERS = [
    ("entry points", ["commlab.allreduce_bench", "commlab.compare", "commlab.advise", "commlab.doctor",
                      "commlab.costmodel", "commlab.hooks", "commlab.predict"]),
    ("tools", ["commlab.experiments", "commlab.training", "commlab.measure", "commlab.diagnostics"]),
    ("the contract of a call", ["commlab.api", "commlab"]),  # the package: the API
    ("algorithms", ["commlab.algorithms", "commlab.schedule"]),
    ("transports", ["commlab.transports"]),
    ("shared facts", ["commlab.core", "commlab._C"]),
]


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, module
    return level


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    if name == "commlab._C":
        return True
    rel = ROOT.parent.joinpath(*name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def imports(path: pathlib.Path, module: str):
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for a in node.names:
                # `from commlab.api import lanes` imports the module commlab.api.lanes;
                # `from commlab.api.lanes import lane` imports commlab.api.lanes.
                sub = f"{target}.{a.name}"
                yield (sub if is_module(sub) else target), node.lineno


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        mine = layer_of(module)
        for target, line in imports(path, module):
            if not (target == "commlab" or target.startswith("commlab.")):
                continue
            try:
                theirs = layer_of(target)
            except AssertionError:
                continue
            if theirs < mine:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({LAYERS[mine][0]}) imports {target} "
                             f"({LAYERS[theirs][0]})")
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(module_name(path))


# Pairs of modules allowed to import each other, each with its reason: none.
CYCLES_ALLOWED: set[frozenset] = set()


def _graph() -> dict[str, set[str]]:
    """commlab's module -> the commlab modules it imports (function-level imports too;
    a package's __init__ counts as the package)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        graph.setdefault(module, set()).update(
            t for t, _ in imports(path, module) if t.startswith("commlab.") and t != module and is_module(t))
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other():
    """Modules that import each other, even through a function-level import, cannot be
    read, tested or moved one at a time (compare's sharded and workers, predict's model
    and sharded were such a pair)."""
    graph = _graph()
    # A package importing its own modules (registries finding their algorithms) and a
    # module importing its package's face are one unit, not a circle.
    def own(a, b):
        return a.startswith(b + ".") or b.startswith(a + ".")

    pruned = {v: {w for w in ws if not own(v, w)} for v, ws in graph.items()}
    circles = [c for c in _circles(pruned) if frozenset(c) not in CYCLES_ALLOWED]
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def late_imports_without_a_reason(source: str) -> list[int]:
    """Lines of imports inside functions with no comment on them or on the line above:
    an import belongs at the top unless it breaks a cycle or defers a real cost
    (an optional or slow package), and then the line says which."""
    lines = source.split("\n")
    bare = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and \
                        not any("#" in line for line in lines[node.lineno - 2:node.end_lineno]):
                    bare.append(node.lineno)
    return bare


def test_every_import_inside_a_function_says_why():
    bare = [f"{path.relative_to(ROOT.parent)}:{line}" for path in sorted(ROOT.rglob("*.py"))
            for line in late_imports_without_a_reason(path.read_text())]
    assert not bare, bare


def test_the_late_import_finder_finds_one():
    assert late_imports_without_a_reason("def f():\n    import os\n") == [2]
    assert late_imports_without_a_reason("def f():\n    # optional\n    import os\n") == []
    assert late_imports_without_a_reason("import os\n") == []
