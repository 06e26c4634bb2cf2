"""The package's import graph, read from its source (every ``import`` statement, those inside functions included):
no cycle between modules or between folders, and no module importing one of a higher layer. The layers follow the
data flow: the request and its errors at the bottom, then the RM in one process (``scoring``), an RM at an endpoint
(``remote``, whose engine the kinds of ``scoring`` read), the RM service (``service``), the run's settings and the
reward mix, verl's side (``integration``), and the entry points and tools on top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "verl_async_rm"
#: Each module's layer, by the longest matching name prefix; a module may import only its own layer or lower ones.
LAYERS = {
    "verl_async_rm.errors": 0, "verl_async_rm.options": 0, "verl_async_rm.request": 0, "verl_async_rm.vllm_cpu": 0,
    "verl_async_rm.cpu_platform": 0, "verl_async_rm.percentiles": 0, "verl_async_rm.step_counter": 0,
    "verl_async_rm.endpoint_urls": 0,
    "verl_async_rm.scoring": 1,
    "verl_async_rm.remote": 2,
    "verl_async_rm.service": 3,
    "verl_async_rm.reward_mix": 4, "verl_async_rm.config": 4,
    "verl_async_rm.integration": 5, "verl_async_rm.main_ppo": 5,
    "verl_async_rm": 6,  # the package itself, plugin, cli, demo, bench, testing: entry points and tools
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                               for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert "verl_async_rm.service.service" in graph["verl_async_rm.integration.manager_base"]
    assert "verl_async_rm.scoring.rm_config" in graph["verl_async_rm.scoring.scorer"]
    assert len(graph) > 50


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                    for a, targets in import_graph().items() for b in targets if layer(b) > layer(a))
    assert not upward, "\n".join(upward)


def folder(module: str) -> str:
    """The folder of a module (``verl_async_rm.scoring.judge`` -> ``verl_async_rm.scoring``); a top-level module is
    its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_there_is_no_import_cycle_between_folders():
    graph: dict[str, set[str]] = {}
    for a, targets in import_graph().items():
        graph.setdefault(folder(a), set()).update(folder(b) for b in targets if folder(b) != folder(a))
    assert not find_cycles(graph), "\n".join(" -> ".join(c) for c in find_cycles(graph))


def test_there_is_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles
