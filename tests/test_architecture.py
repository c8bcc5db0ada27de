"""The package's shape (ARCHITECTURE.md): no import cycle, and the build layer stays a leaf."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vllm_h20"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules a file imports, at the top or inside a function (both make a cycle)."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            hits = [n for n in names if n in modules] or ([target] if target in modules else [])
            out |= set(hits)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
    return out - {me, "vllm_h20"}


def _graph() -> dict[str, set[str]]:
    files = {_module(f): f for f in PKG.rglob("*.py")}
    return {m: _imports(f, set(files)) for m, f in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = _graph()
    assert "vllm_h20.moe.dispatch" in graph["vllm_h20.plugin"]  # imported inside register()
    assert "vllm_h20.moe.build" in graph["vllm_h20.moe.plan"]


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_leaves_import_only_leaves():
    """The toolchain layer decides nothing; settings and paths are read by everything."""
    graph = _graph()
    assert graph["vllm_h20.moe.build"] <= {
        "vllm_h20.moe.paths", "vllm_h20.moe.overlay", "vllm_h20.settings",
    }  # fmt: skip
    assert graph["vllm_h20.settings"] == set()
    assert graph["vllm_h20.moe.paths"] == {"vllm_h20.settings"}
