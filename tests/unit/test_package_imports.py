"""megarl's packages depend on each other one way only.

Every import of another megarl package (at module level or inside a function: a lazy import
is still a dependency) is read from the source with `ast`; the packages and those imports
must form a graph without cycles. A new import that closes a cycle fails here, naming the
packages on the cycle and the file and line of each import along it.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "megarl"


def _imported(path: Path, root: Path, node: ast.AST) -> list[str]:
    """Dotted megarl module names an import statement brings in (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        # the file's package (a module's or an __init__'s alike), then one up per extra dot
        here = list(path.relative_to(root.parent).parts[:-1])
        base = here[:len(here) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if node.module is None or mod == "megarl":  # `from megarl import x`: x is the package
        return [f"{mod}.{a.name}" for a in node.names]
    return [mod]


def package_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: ["file:line", ...]}} over megarl's top-level packages
    (a top-level module such as cli.py counts as a package of its own)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        pkg = rel[0].removesuffix(".py")
        if pkg == "__init__":
            continue
        graph[pkg]  # a package that imports nothing is still a node
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for mod in _imported(path, root, node):
                parts = mod.split(".")
                if parts[0] == "megarl" and len(parts) > 1 and parts[1] != pkg:
                    graph[pkg][parts[1]].append(
                        f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of packages (first package repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(p: str) -> list[str] | None:
        state[p] = 1
        path.append(p)
        for q in sorted(graph.get(p, {})):
            if state.get(q) == 1:
                return path[path.index(q):] + [q]
            if q not in state and (found := visit(q)):
                return found
        path.pop()
        state[p] = 2
        return None

    for p in sorted(graph):
        if p not in state and (found := visit(p)):
            return found
    return None


def test_megarl_packages_import_each_other_one_way_only():
    graph = package_graph()
    assert {"controller", "config", "backends", "convert", "rollout", "weight_sync"} <= set(graph)
    cycle = find_cycle(graph)
    if cycle:
        lines = [f"{a} -> {b}: {', '.join(graph[a][b][:4])}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("megarl packages import each other in a cycle "
                    f"({' -> '.join(cycle)}):\n  " + "\n  ".join(lines))


def test_the_check_finds_a_cycle_a_lazy_import_closes(tmp_path):
    """The reader sees function-level and relative imports: a two-package tree where `a`
    imports `b` at module level and `b` imports `a` inside a function is a cycle."""
    for pkg in ("a", "b"):
        (tmp_path / "megarl" / pkg).mkdir(parents=True)
        (tmp_path / "megarl" / pkg / "__init__.py").write_text("")
    (tmp_path / "megarl" / "a" / "x.py").write_text("from ..b import y\n")
    (tmp_path / "megarl" / "b" / "y.py").write_text(
        "def f():\n    from megarl.a import x\n    return x\n")
    graph = package_graph(tmp_path / "megarl")
    assert graph["a"]["b"] == ["megarl/a/x.py:1"]
    assert graph["b"]["a"] == ["megarl/b/y.py:2"]
    assert find_cycle(graph) == ["a", "b", "a"]
    (tmp_path / "megarl" / "b" / "y.py").write_text("def f():\n    return 1\n")
    assert find_cycle(package_graph(tmp_path / "megarl")) is None


def test_the_torchrun_path_never_imports_ray():
    """Everything a torchrun run loads (the CLI, the driver, the worker groups, the torchrun
    transport, the per-rank objects) imports without Ray: it must run where Ray is missing.
    A fresh interpreter, as this one may have imported Ray for other tests."""
    import subprocess
    import sys

    mods = ["megarl.cli", "megarl.controller.setup", "megarl.controller.driver",
            "megarl.cluster.group", "megarl.cluster.actors", "megarl.cluster.torchrun",
            "megarl.cluster.transport", "megarl.backends.megatron.worker",
            "megarl.rollout.engine", "megarl.rollout.server"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=ROOT.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", p.stdout
    # ... and the Ray transport is where Ray is: the check sees it when it is there
    p = subprocess.run([sys.executable, "-c", code.replace("megarl.cli\n",
                                                           "megarl.cluster.placement\n")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert "'ray'" in p.stdout, p.stdout + p.stderr[-2000:]
