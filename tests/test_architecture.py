"""The tree's imports form layers: the paper's math (rollout, rounds, sampler, loss, advantage, reward, tools) imports
only itself and the python tool's sandbox, harness/ never imports the entry points (eval.py, train.py), eval.py never
imports train.py, and no module imports itself through others (no circle, function-level imports included). The
harness map (harness/__init__.py's docstring) names every module and package there is."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH = {"rollout", "rounds", "sampler", "loss", "advantage", "reward", "tools"}
ENTRY = {"eval", "train"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in [*ROOT.glob("*.py"), *ROOT.glob("harness/**/*.py")]}


def imports(path: Path) -> set[str]:
    """The repository's modules `path` imports anywhere in it (a package's `from P import m` counts as P.m)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return {name for name in found if name in MODULES and name != "harness"}


GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def test_no_import_circle():
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import circle: " + " -> ".join(trail[trail.index(name):] + [name])
        state[name] = "open"
        for other in sorted(GRAPH[name]):
            visit(other, trail + [name])
        state[name] = "done"

    for name in sorted(GRAPH):
        visit(name, [])


def test_imports_form_layers():
    for name, targets in GRAPH.items():
        if name in MATH:
            assert all(t in MATH or t.startswith("harness.sandbox") for t in targets), (name, targets)
        if name.startswith("harness"):
            assert not targets & ENTRY, f"{name} imports an entry point: {targets & ENTRY}"
    assert "train" not in GRAPH["eval"]


def test_the_harness_map_names_every_module():
    """harness/__init__.py's map names every harness module and package, and none that is not there."""
    doc = ast.get_docstring(ast.parse((ROOT / "harness" / "__init__.py").read_text(encoding="utf-8")))
    packages = {p.parent.name for p in ROOT.glob("harness/*/__init__.py")}
    top = {p.stem for p in ROOT.glob("harness/*.py") if p.stem != "__init__"}
    inner = {f"{p.parent.name}/{p.stem}" for p in ROOT.glob("harness/*/*.py") if p.stem != "__init__"}
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)?)/?`", doc.split("Nothing is imported here")[0]))
    tree = top | packages | inner
    assert named == tree, f"the harness map: missing {sorted(tree - named)}, not in the tree {sorted(named - tree)}"
