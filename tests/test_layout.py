"""The package's shape: no import cycle, and beam search stays above the engine core."""
from __future__ import annotations

import ast
import pathlib

import pagedlm

ROOT = pathlib.Path(pagedlm.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """pagedlm modules this file imports, anywhere (in functions and under TYPE_CHECKING too:
    a cycle hidden there is still two modules that need each other)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: _imports(p, set(files)) - {m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "pagedlm.engine.beam_search" in graph and len(graph) > 30
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # The checker itself finds a planted cycle.
    assert find_cycle({**graph, "pagedlm.core.scheduler": {"pagedlm.engine.llm_engine"}})


def test_no_core_or_worker_module_mentions_beam_search():
    for folder in ("core", "worker"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "beam" not in path.read_text().lower(), path
