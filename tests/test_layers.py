"""The layers, pinned: an AST scan of the project's own imports (module-level and function-local alike).

Rules (docs/architecture.md, "Layers"):
1. no import cycle among the project's modules (rlkernel.*, pipelines.*), function-local imports included: a
   function-local import that hides a circle is still a circle;
2. ``rlkernel/ops/native`` never imports ``rlkernel/ops/fused`` (the reference must stand without the extension);
3. nothing in ``pipelines/`` but ``capture`` imports ``pipelines.analyze`` (the CLI sits on top of its library);
4. the analyzer side imports no torch at module level, directly or through the project modules it imports at
   module level (``python -m pipelines.analyze`` on a bare export must not pay torch's start-up).

An edge is the module an import statement names: ``import a.b`` -> a.b, ``from a import b`` -> a.b when a/b is a
module, else a. The package ``__init__`` a submodule import runs on the way is not an edge of its own: rlkernel's
``__init__`` is a lazy table, and counting it would make every module a neighbour of every other.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rlkernel", "pipelines")
ANALYZER_SIDE = ("analyze", "analysis", "sql", "trace_db", "report", "cells", "report_rows", "timeline", "outdir",
                 "inputs", "manifest", "compare", "ranks", "cross_rank")


def _module_files(root):
    """{dotted module name: path} for every .py file of the project's packages under ``root``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_package(name, modules, root):
    return name in modules and modules[name].name == "__init__.py"


def _imports(name, path, modules, root):
    """[(target module, lineno, module_level)] for every project import in one file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(name, modules, root) else name.rpartition(".")[0]
    # a statement runs at import time unless a function body holds it (class bodies run at import too)
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(child) for child in ast.walk(node) if child is not node)
    out = []
    for node in ast.walk(tree):
        at_top = id(node) not in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, node.lineno, at_top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                out.append((candidate if candidate in modules else source, node.lineno, at_top))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            # importlib.import_module("rlkernel.x"): an import written as a call is still an import
            out.append((node.args[0].value, node.lineno, at_top))
    return out


def import_graph(root=ROOT):
    """{module: {imported project module: (lineno, module_level)}}, plus every module's non-project imports."""
    modules = _module_files(root)
    graph, external = {}, {}
    for name, path in modules.items():
        graph[name], external[name] = {}, {}
        for target, lineno, at_top in _imports(name, path, modules, root):
            if target in modules:
                if target != name:
                    previous = graph[name].get(target)
                    graph[name][target] = (lineno, at_top or bool(previous and previous[1]))
            else:
                top = target.split(".")[0]
                external[name][top] = external[name].get(top, False) or at_top
    return graph, external


def cycles(graph):
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def native_to_fused(graph):
    return [(m, t) for m, targets in graph.items() if m.startswith("rlkernel.ops.native")
            for t in targets if t.startswith("rlkernel.ops.fused")]


def analyze_importers(graph):
    return sorted(m for m, targets in graph.items()
                  if "pipelines.analyze" in targets and m not in ("pipelines.analyze", "pipelines.capture"))


def analyzer_torch_at_import(graph, external):
    """[(analyzer module, chain)] where importing the module imports torch at module level."""
    bad = []
    for leaf in ANALYZER_SIDE:
        start = f"pipelines.{leaf}"
        if start not in graph:
            continue
        seen, todo = {start: [start]}, [start]
        while todo:
            module = todo.pop()
            if external[module].get("torch"):
                bad.append((start, " -> ".join(seen[module]) + " -> torch"))
                break
            for target, (_, at_top) in graph[module].items():
                if at_top and target not in seen:
                    seen[target] = seen[module] + [target]
                    todo.append(target)
    return bad


GRAPH, EXTERNAL = import_graph()


@pytest.mark.smoke
def test_no_import_cycle_among_project_modules():
    found = cycles(GRAPH)
    assert not found, "import cycles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.smoke
def test_native_backends_never_import_fused_ones():
    assert any(m.startswith("rlkernel.ops.native.") for m in GRAPH), "rlkernel/ops/native/ holds no module"
    assert any(m.startswith("rlkernel.ops.fused.") for m in GRAPH), "rlkernel/ops/fused/ holds no module"
    assert not native_to_fused(GRAPH)


@pytest.mark.smoke
def test_only_capture_imports_the_analyzer_cli():
    assert not analyze_importers(GRAPH)


@pytest.mark.smoke
def test_analyzer_side_imports_no_torch_at_module_level():
    assert [f"pipelines.{m}" for m in ANALYZER_SIDE if f"pipelines.{m}" in GRAPH], "no analyzer module found"
    assert not analyzer_torch_at_import(GRAPH, EXTERNAL)


@pytest.mark.smoke
def test_the_scan_sees_function_local_and_relative_imports(tmp_path):
    # the scanner itself: a circle closed only by a function-local import, and one through a relative import
    pkg = tmp_path / "rlkernel"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from rlkernel import b\n")
    (pkg / "b.py").write_text("def f():\n    import rlkernel.a\n")
    (pkg / "sub" / "c.py").write_text("from . import d\n")
    (pkg / "sub" / "d.py").write_text("def g():\n    from .c import x\n")
    (pkg / "e.py").write_text("import importlib\nX = importlib.import_module('rlkernel.a')\n")
    graph, _ = import_graph(tmp_path)
    assert cycles(graph) == [["rlkernel.a", "rlkernel.b"], ["rlkernel.sub.c", "rlkernel.sub.d"]]
    assert graph["rlkernel.b"]["rlkernel.a"] == (2, False)
    assert graph["rlkernel.e"]["rlkernel.a"] == (2, True)


def _readme_layout_paths():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first_cell)
    return paths


@pytest.mark.smoke
def test_every_path_in_the_readme_layout_table_exists():
    paths = _readme_layout_paths()
    assert len(paths) >= 8, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README layout table names paths that do not exist: {missing}"
