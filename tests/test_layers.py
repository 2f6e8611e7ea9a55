"""The layers of docs/ARCHITECTURE.md, checked: no commlab module imports from a layer
above its own (function-level imports included)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "commlab"

# Top to bottom; a module may import its own layer and the ones below it.
LAYERS = [
    ("entry points", ["commlab.allreduce_bench", "commlab.compare", "commlab.advise", "commlab.doctor",
                      "commlab.costmodel", "commlab.hooks", "commlab.predict"]),
    ("tools", ["commlab.training", "commlab.measure", "commlab.diagnostics"]),
    ("the contract of a call", ["commlab.api", "commlab"]),  # the package: the API
    ("algorithms", ["commlab.algorithms"]),
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
