"""Imports flow one way (docs/architecture.md, "Map"): no module imports a layer above its own, and
no two modules import each other, directly or round a loop, lazy imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lychee_rtc"

# Top to bottom. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("lychee_rtc.cli", "lychee_rtc.__main__")),
    ("benches and cluster", ("lychee_rtc.bench", "lychee_rtc.cluster")),
    ("HTTP edge", ("lychee_rtc.server",)),
    ("transports", ("lychee_rtc.gateway", "lychee_rtc.telephony", "lychee_rtc.rtc", "lychee_rtc.ws")),
    ("call registry", ("lychee_rtc.calls",)),
    ("transport-neutral audio", ("lychee_rtc.media",)),
    ("session", ("lychee_rtc.session",)),
    ("engine", ("lychee_rtc.engine",)),
    ("vocoder model", ("lychee_rtc.vocoder",)),
    ("shared values and helpers", ("lychee_rtc.config", "lychee_rtc.pcm", "lychee_rtc.aio", "lychee_rtc.resources",
                                   "lychee_rtc.jsonio", "lychee_rtc")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project's modules that ``path`` imports (``from pkg import mod`` resolves to the module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "lychee_rtc":
                found.add(name)
    found.discard(module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    # A package's __init__ is not a dependency of its own modules' imports of each other.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, deps in import_graph().items():
        for dep in deps:
            if layer_of(dep) < layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_layer_map_knows_every_module():
    for module in import_graph():
        layer_of(module)
