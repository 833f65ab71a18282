"""The package layout is a contract: which code runs in which process. Read from the source
(every import, at module level or inside a function), not from what happens to be loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pte_instrument"

# Modules that run in vLLM's engine-core process: the engine package and the scheduler hook.
ENGINE_PROCESS = ("pte_instrument.engine", "pte_instrument.vllm_adapter.scheduler")
ADAPTER = "pte_instrument.vllm_adapter"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Absolute names this module imports; ``from a import b`` names ``a.b`` when that is a module."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known)
    return {m for m in out if m}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Everything ``start`` imports, directly or through the project's own modules."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_graph_is_read(graph):
    # the reader itself must work: known edges of the tree
    assert "pte_instrument.engine.accumulator" in graph["pte_instrument.engine.accounting"]
    assert "vllm.config" in graph["pte_instrument.vllm_adapter.compat"]
    assert len(graph) > 30


def test_only_the_adapter_imports_vllm(graph):
    offenders = {m: sorted(d for d in deps if under(d, "vllm")) for m, deps in graph.items()}
    assert {m: d for m, d in offenders.items() if d and not under(m, ADAPTER)} == {}


# What the adapter may know of the API-server side: its facade and the records it hands over.
SERVER_FACADE = ("pte_instrument.server.api_server", "pte_instrument.server.records")


def test_the_adapter_knows_the_server_only_by_its_facade(graph):
    for module, deps in graph.items():
        if under(module, ADAPTER):
            bad = sorted(
                d
                for d in deps
                if under(d, "pte_instrument.server") and not any(under(d, f) for f in SERVER_FACADE)
            )
            assert bad == [], f"{module} imports {bad}"


def test_the_adapter_reaches_into_no_collaborator_of_the_facade():
    """``server.runtime`` (the collaborators) is the facade's own: no adapter code names it."""
    for path in sorted((PACKAGE / "vllm_adapter").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("runtime", "_models"), (
                    f"{path.name}:{node.lineno} reads .{node.attr}"
                )


def test_engine_process_never_reaches_the_server_side(graph):
    forbidden = (
        "pte_instrument.server",
        "prometheus_client",
        "pte_instrument.cli",
        "pte_instrument.offline",
        "pte_instrument.vllm_adapter.stat_logger",
        "pte_instrument.vllm_adapter.endpoints",
    )
    for module in graph:
        if any(under(module, p) for p in ENGINE_PROCESS):
            bad = sorted(d for d in reachable(graph, module) if any(under(d, f) for f in forbidden))
            assert bad == [], f"{module} reaches {bad}"


def test_cost_model_imports_only_itself(graph):
    for module, deps in graph.items():
        if under(module, "pte_instrument.cost"):
            own = sorted(
                d for d in deps if under(d, "pte_instrument") and not under(d, "pte_instrument.cost")
            )
            assert own == [], f"{module} imports {own}"


def test_runtime_code_never_imports_the_harness_or_the_cli(graph):
    for module, deps in graph.items():
        if not any(under(module, p) for p in ("pte_instrument.cli", "pte_instrument.devtools")):
            bad = sorted(
                d for d in deps if under(d, "pte_instrument.cli") or under(d, "pte_instrument.devtools")
            )
            assert bad == [], f"{module} imports {bad}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the project's modules, or None (iterative DFS)."""
    own = {m: sorted(d for d in deps if d in graph and d != m) for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in own:
        if state.get(root):
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        state[root] = 1
        while stack:
            node, i = stack[-1]
            if i < len(own[node]):
                stack[-1] = (node, i + 1)
                nxt = own[node][i]
                if state.get(nxt) == 1:
                    path = [n for n, _ in stack]
                    return [*path[path.index(nxt) :], nxt]
                if not state.get(nxt):
                    state[nxt] = 1
                    stack.append((nxt, 0))
            else:
                state[node] = 2
                stack.pop()
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_no_import_cycles(graph):
    assert find_cycle(graph) is None
