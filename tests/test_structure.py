"""The package's architecture, checked from the source: imports point down the layers only, with no cycles.

Every ``import`` statement of ``pipeline/`` and ``states/`` counts — at module level, inside functions and
under ``TYPE_CHECKING`` — and importing a package counts as importing its ``__init__``, except a module's own
packages (Python imports those before the module anyway; a package importing its modules is no cycle). Layers, bottom
to top: ``pipeline.core`` → ``pipeline.platforms`` / ``pipeline.backends`` → ``states`` → ``pipeline.memory`` →
``pipeline.setup`` (the setup machine's table and driver) → ``pipeline.runtime`` → ``pipeline.observe`` →
``pipeline.cli``; ``pipeline`` itself and ``pipeline.testing`` sit on top. Modules are cut by concept, not by size:
no line cap per module, one for functions (a long function is split along the steps it takes).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from conftest import ROOT

LAYERS = ["pipeline.core", "pipeline.platforms", "pipeline.backends", "states", "pipeline.memory", "pipeline.setup",
          "pipeline.runtime", "pipeline.observe", "pipeline.cli"]
# What each layer may import besides itself (a layer not listed: every layer before it). The states and the memory
# planner decide torch-free: of the backends they reach only the registry, its record types and package lookup.
ALLOWED: dict[str, tuple[str, ...]] = {
    "pipeline.core": (),
    "pipeline.platforms": ("pipeline.core",),
    "pipeline.backends": ("pipeline.core",),
    "states": ("pipeline.core", "pipeline.backends.registry", "pipeline.backends.capability",
               "pipeline.backends.packages"),
    "pipeline.memory": ("pipeline.core", "pipeline.backends.registry", "pipeline.backends.capability",
                        "pipeline.backends.packages", "states"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "states"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _targets(mod: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    out = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            head = ".".join(parts[:i])
            if head in mods and head != mod and not mod.startswith(head + "."):
                out.add(head)
    return out


def import_graph() -> dict[str, set[str]]:
    """``module → modules it imports`` over pipeline/ and states/ (every import statement)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            graph[m] |= _targets(m, p, node, mods)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layer(mod: str) -> str | None:
    return next((layer for layer in LAYERS if mod == layer or mod.startswith(layer + ".")), None)


def _within(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of ``b`` by ``a`` that :data:`LAYERS` / :data:`ALLOWED` do not allow (a package
    that only holds another target, ``pipeline.backends`` of ``pipeline.backends.registry``, is that target's)."""
    bad = []
    for mod, targets in graph.items():
        layer = _layer(mod)
        if layer is None:
            continue
        below = LAYERS[:LAYERS.index(layer)]
        allowed = ALLOWED.get(layer, tuple(below))
        bad += [f"{mod} -> {t}" for t in sorted(targets)
                if _layer(t) != layer and not (_layer(t) in below and _within(t, allowed))
                and not any(o.startswith(t + ".") for o in targets)]
    return bad


def test_imports_point_down_only():
    """Every import of a module stays in its layer or goes to a layer below that it may use (:data:`ALLOWED`)."""
    graph = import_graph()
    assert upward_imports(graph) == []
    assert sum(len(t) for t in graph.values()) > 300  # the check read the real import graph


def test_upward_import_finder_finds_them():
    """The check above can fail: a core module importing a command, a platform importing a backend, a state
    importing a backend module (not its registry) and the memory planner importing setup are each found."""
    g = {"pipeline.core.a": {"pipeline.cli.run"}, "pipeline.platforms.cpu": {"pipeline.backends.base"},
         "states.resolve": {"pipeline.backends.registry", "pipeline.backends.flashinfer.backend"},
         "pipeline.memory.pools": {"states.resolve", "pipeline.setup.table"},
         "pipeline.cli.run": {"pipeline.core.a", "states.resolve", "pipeline.memory.pools"}}
    assert upward_imports(g) == ["pipeline.core.a -> pipeline.cli.run",
                                 "pipeline.platforms.cpu -> pipeline.backends.base",
                                 "states.resolve -> pipeline.backends.flashinfer.backend",
                                 "pipeline.memory.pools -> pipeline.setup.table"]


def test_no_import_cycles():
    """No two modules import each other, directly or through others (function-level and TYPE_CHECKING imports
    included)."""
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a three-module ring and a self-contained pair are found, a chain is not."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set(), "f": {"g"}, "g": {"f"}}
    assert sorted(cycles(g)) == [["a", "b", "c"], ["f", "g"]]


def test_import_graph_reads_function_level_and_type_checking_imports(tmp_path, monkeypatch):
    """An import inside a function and one under TYPE_CHECKING both make edges."""
    pkg = tmp_path / "pipeline"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from pipeline.core import b\n")
    (pkg / "core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (tmp_path / "states").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert cycles(import_graph()) == [["pipeline.core.a", "pipeline.core.b"]]


def test_no_backend_name_outside_the_backends():
    """No module outside pipeline/backends/ spells a registered backend's name (as a string, or quoted in text):
    the rules live in each backend's registry entry, and everything else asks the entry."""
    from pipeline.backends import registry

    names = set(registry.names())
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("pipeline.backends"):
            continue
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() in names:
                bad.append(f"{mod}:{node.lineno}: {node.value!r}")
        for n, line in enumerate(src.splitlines(), 1):
            bad += [f"{mod}:{n}: {q}{name}{q}" for name in names for q in ('"', "'") if f"{q}{name}{q}" in line]
    assert bad == []


MAX_FUNCTION_LINES = 60  # Triton kernels (@triton.jit) excepted: a kernel body is one concept


def _function_sizes() -> list[tuple[int, str]]:
    """(lines, module:function) over pipeline/ and states/: first to last line, decorators excluded."""
    functions = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                functions.append((node.end_lineno - node.lineno + 1, f"{mod}:{node.name}"))
    return functions


def test_functions_stay_short():
    """No function over 60 lines: a longer one is split along the steps it takes."""
    functions = _function_sizes()
    assert [f for f in functions if f[0] > MAX_FUNCTION_LINES] == []
    assert max(functions)[0] > 50  # the count reads real files (not an empty walk)


def test_the_architecture_page_maps_every_module():
    """docs/architecture.md names every module of pipeline/ and states/ (by file name), and every ``*.py`` it names
    exists: the map cannot drift from the code."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    files = {p.name for top in ("pipeline", "states") for p in (ROOT / top).rglob("*.py")
             if p.name not in ("__init__.py", "__main__.py")}
    named = set(re.findall(r"`(?:[\w/]*/)?(\w+\.py)`", page)) | set(re.findall(r"[(`](\w+\.py)\b", page))
    assert sorted(files - named) == []
    tests = {p.name for p in (ROOT / "tests").glob("*.py")}
    assert sorted(n for n in named if n not in files | tests | {"__init__.py"}) == []


def test_every_package_ships():
    """pyproject.toml lists every package of pipeline/ and states/ (a folder with ``__init__.py``), so an install
    holds every module the source tree has."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("pipeline", "states")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed
