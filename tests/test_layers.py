"""The package's layers are its folders (docs/architecture.md), and the imports keep to them.

Read from the source (every import statement, at any depth, ``TYPE_CHECKING`` ones too: no layer rule is broken
and no two modules import each other round a circle), and for the
modules that promise to load neither torch nor the SDK, from a fresh interpreter's ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"
LAYERS = ("capture", "core", "stall", "otel", "compat", "offline", "testing")
# Command line and start-up: nothing under them imports these (compat's drop-in builds a CommTracer).
TOP = {"cli", "demo", "tracer", "instrumentor", "_autostart", "pytest_plugin", "_demo_model", "debug_page"}


def _imports(path: pathlib.Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the layer belongs in every import line)"
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _layer_imports(layer: str) -> dict[str, set[str]]:
    return {str(path.relative_to(PACKAGE)): _imports(path) for path in sorted((PACKAGE / layer).rglob("*.py"))}


def _offending(layer: str, forbidden) -> list[str]:
    return [f"{path}: {name}" for path, names in _layer_imports(layer).items()
            for name in sorted(names) if forbidden(name)]


def _under(name: str, *prefixes: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


@pytest.mark.parametrize("layer", ["capture", "core", "stall", "compat"])
def test_the_torch_side_names_no_opentelemetry(layer):
    """Spans, contexts and metric points are the OTel side's (``otel/``), reached through the recorder's sink."""
    assert _offending(layer, lambda name: _under(name, "opentelemetry", "commdebug_otel.otel")) == []


def test_the_otel_side_names_no_torch():
    assert _offending("otel", lambda name: _under(name, "torch", "commdebug_otel.capture")) == []


@pytest.mark.parametrize("layer", ["capture", "core", "stall", "otel", "compat", "offline"])
def test_no_layer_imports_the_command_line_or_start_up(layer):
    allowed = {"compat/debug_mode.py": ("commdebug_otel.tracer",)}  # the drop-in is a CommTracer
    found = [f"{path}: {name}" for path, names in _layer_imports(layer).items() for name in sorted(names)
             if any(_under(name, f"commdebug_otel.{top}") for top in TOP)
             and not _under(name, *allowed.get(path, ()))]
    assert found == []


def test_the_offline_tools_name_no_live_layer():
    """The offline commands read files: the report model, the fact's names and the settings' rules only."""
    live = ("torch", "commdebug_otel.capture", "commdebug_otel.stall", "commdebug_otel.otel",
            "commdebug_otel.compat.debug_mode", "commdebug_otel.tracer")
    core = {"commdebug_otel.core.fact"}  # parse: the one reader of the fact's names
    found = _offending("offline", lambda name: _under(name, *live) or (
        _under(name, "commdebug_otel.core") and not any(_under(name, allowed) for allowed in core)))
    assert found == []


def test_every_layer_folder_is_a_documented_package():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file()
        assert f"`{layer}/`" in doc
    stray = sorted(path.name for path in PACKAGE.glob("*.py")
                   if path.stem not in TOP | {"__init__", "config", "semconv", "detail", "version"})
    assert stray == []


@pytest.mark.parametrize(("module", "absent"), [
    ("commdebug_otel.compat.report", ("torch", "opentelemetry", "commdebug_otel.config")),
    ("commdebug_otel.detail", ("torch", "opentelemetry", "commdebug_otel.config")),
    ("commdebug_otel.core.fact", ("torch", "opentelemetry")),
    ("commdebug_otel.offline.hangs", ("torch", "opentelemetry")),  # the hang rule, live and offline
    ("commdebug_otel.offline.diagnose", ("torch", "opentelemetry.sdk.trace", "opentelemetry.sdk.metrics")),
])
def test_what_a_module_loads(module, absent):
    """A fresh interpreter that imports ``module`` holds none of ``absent`` (nor anything under them)."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert [name for name in loaded if _under(name, *absent)] == []


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (a function's lazy import and ``TYPE_CHECKING``
    ones too: a lazy import hides a circle from the interpreter, not from a reader). ``from a import b`` is an
    edge to ``a.b`` when that is a module, else to ``a``."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                               else node.module for alias in node.names)
        graph[name] = targets & modules.keys() - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    """No two modules import each other, directly or round a longer loop: each can be read below the other."""
    graph = _import_graph()
    assert graph["commdebug_otel.otel.telemetry"] >= {"commdebug_otel.otel.exporters"}  # the graph sees imports
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
