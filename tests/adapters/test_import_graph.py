"""kvcore's import graph: no circles, and each layer imports only the layers below it.

Every module under ``kvcore/`` is parsed with ``ast`` (nothing is imported), and every import
counts: module level, inside functions, under ``if TYPE_CHECKING:``. An import of a name
from a package counts as an import of the submodule when the name is one
(``from kvcore.adapters.sglang import eviction``), else of the package's ``__init__``.

The layers, bottom up, and what each may import (besides itself and ``kvcore.errors``, the
one exception hierarchy every layer raises):

``kvcore.vmm``
    nothing else: the VMM backends are the bottom.
``kvcore.budget``
    ``vmm`` (a ledger gate reads its backend's device id and free memory).
``kvcore.memory``
    ``vmm``, ``budget`` (a page allocator charges a ``budget.gate.MemoryGate``).
``kvcore.parallel``
    ``vmm``, ``budget``, ``memory`` (the channel coordinator is a ``memory.mapper.PageMapper``;
    agreement wraps a ``memory.blocks.BlockLedger``).
``kvcore.adapters``
    every core layer above; never ``cli`` or ``metrics``.
``kvcore.metrics``, ``kvcore.cli``
    the control plane, over the ledgers: ``budget`` and below (``cli`` may use ``metrics``);
    never ``adapters``.

So the core (vmm, budget, memory, parallel) never imports ``kvcore.adapters`` or
``kvcore.cli``, and adapters never import the control plane.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvcore"

ALWAYS = {"kvcore", "kvcore.errors"}  # the package root (its version) and the error types
LAYERS: dict[str, set[str]] = {
    "kvcore.errors": set(),
    "kvcore.vmm": set(),
    "kvcore.budget": {"kvcore.vmm"},
    "kvcore.memory": {"kvcore.vmm", "kvcore.budget"},
    "kvcore.parallel": {"kvcore.vmm", "kvcore.budget", "kvcore.memory"},
    "kvcore.adapters": {"kvcore.vmm", "kvcore.budget", "kvcore.memory", "kvcore.parallel"},
    "kvcore.metrics": {"kvcore.vmm", "kvcore.budget"},
    "kvcore.cli": {"kvcore.vmm", "kvcore.budget", "kvcore.metrics"},
    "kvcore": set(),
}
"""Each layer and the other layers it may import (module docstring)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The kvcore module ``name`` is, or lies in (``None``: not kvcore's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported kvcore module)`` for every import statement of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _owner(alias.name)
                if target is not None:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base != "kvcore" and not base.startswith("kvcore."):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in MODULES else _owner(base)
                if target is not None:
                    yield node.lineno, target


def _graph() -> dict[str, set[str]]:
    return {m: {t for _, t in _imports(m) if t != m} for m in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_the_parser_sees_function_level_and_type_checking_imports() -> None:
    """The graph is only as good as its edges: a lazy import inside a function and one under
    ``TYPE_CHECKING`` both count (runtime imports ``pool`` lazily; mamba names the config
    only for typing)."""
    graph = _graph()
    assert "kvcore.adapters.vllm.pool" in graph["kvcore.adapters.vllm.runtime"]
    assert "kvcore.adapters.config" in graph["kvcore.adapters.sglang.mamba"]
    assert "kvcore.adapters.sglang.eviction" in graph["kvcore.adapters.sglang.scope"]
    assert len(MODULES) > 50


def test_there_is_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_every_layer_imports_only_the_layers_below_it() -> None:
    unknown = sorted({_layer(m) for m in MODULES} - set(LAYERS))
    assert unknown == [], f"a layer the test does not know: {unknown} (add it to LAYERS)"
    wrong = []
    for module in sorted(MODULES):
        layer = _layer(module)
        allowed = LAYERS[layer] | ALWAYS | {layer}
        for line, target in _imports(module):
            if _layer(target) not in allowed and target not in ALWAYS:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}")
    assert wrong == []


def test_the_core_never_imports_adapters_or_the_cli() -> None:
    core = ("kvcore.vmm", "kvcore.budget", "kvcore.memory", "kvcore.parallel")
    above = ("kvcore.adapters", "kvcore.cli")
    for layer in core:
        assert not LAYERS[layer] & set(above)
    offending = [
        f"{m} imports {t}"
        for m in MODULES
        if _layer(m) in core
        for _, t in _imports(m)
        if _layer(t) in above
    ]
    assert offending == []
