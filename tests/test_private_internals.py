"""torch's and OpenTelemetry's private names are touched in two modules only (as test_lint.py holds ruff).

``commdebug_otel/capture/_torch.py`` holds every use of torch's private modules and attributes and
``commdebug_otel/otel/_sdk.py`` every use of OpenTelemetry's: a release that moves one breaks those
files only, and each touch there has a name that says what it is for and where the library keeps
it. Everything else in ``commdebug_otel/`` goes through them or the public APIs. "Private" is a
dotted-name segment that starts with ``_`` (not a ``__dunder__``) under ``torch`` or
``opentelemetry``: an import (``from torch._ops import ...``, ``import
torch.distributed._functional_collectives``), an attribute (``torch._C``, ``dist._x`` after
``import torch.distributed as dist``, ``Module._call_impl`` after ``from torch.nn import Module``),
``getattr``/``hasattr``/``setattr`` with such a name, or a module name in a string
(``sys.modules.get("torch._dynamo.eval_frame")``, ``importlib.import_module(...)``).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"
ALLOWED = {"capture/_torch.py", "otel/_sdk.py"}
ROOTS = ("torch", "opentelemetry")
_PRIVATE_PATH = re.compile(r"^(?:torch|opentelemetry)(?:\.\w+)*\._")


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in ROOTS and any(_private(part) for part in parts[1:])


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def private_touches(source: str, filename: str = "<source>") -> list[str]:
    """``"line: what"`` for each private torch/OpenTelemetry touch in ``source``."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> the dotted torch/opentelemetry path it stands for
    found = []
    # Imports first (a function-level import binds a name the whole file may then use: over-strict is fine).
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] not in ROOTS:
                    continue
                if _private_path(name.name):
                    found.append(f"{node.lineno}: import {name.name}")
                if name.asname:
                    aliases[name.asname] = name.name
                else:
                    root = name.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ROOTS:
                continue
            for name in node.names:
                dotted = f"{node.module}.{name.name}"
                if _private_path(dotted):
                    found.append(f"{node.lineno}: from {node.module} import {name.name}")
                aliases[name.asname or name.name] = dotted
    docstrings = _docstrings(tree)

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = dotted(node.value)
            if base is not None:
                found.append(f"{node.lineno}: {base}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            base, name = dotted(node.args[0]), node.args[1]
            if base is not None and isinstance(name, ast.Constant) and isinstance(name.value, str) \
                    and _private(name.value):
                found.append(f"{node.lineno}: {node.func.id}({base}, {name.value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and _PRIVATE_PATH.match(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return sorted(set(found), key=lambda text: int(text.split(":")[0]))


# The standard library's private names the package uses (sys, argparse, multiprocessing.Process, urllib's
# HTTPSHandler): not torch's nor the SDK's.
STDLIB_PRIVATE = {"_getframe", "_current_frames", "_SubParsersAction", "_target", "_context",
                  # NamedTuple's public methods, underscored so that they cannot clash with a field
                  "_replace", "_asdict", "_make", "_fields", "_field_defaults"}


def _own_names(trees: list[ast.AST]) -> set[str]:
    """The names the package itself defines: functions, classes, module and class variables, its
    objects' attributes (``self.x = ``, ``__slots__``), arguments and the names it imports."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == "__slots__"
                                                      for target in node.targets):
                names.update(item.value for item in ast.walk(node.value)
                             if isinstance(item, ast.Constant) and isinstance(item.value, str))
    return names


def foreign_private_attributes(source: str, own: set[str]) -> list[str]:
    """``"line: what"`` for each ``x._name``/``getattr(x, "_name")`` of a name the package does not
    define: another library's private attribute on an object (``module._forward_hooks``,
    ``getattr(mode, "_mode_key")``), which the import-based check cannot trace to torch or the SDK."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        if name and _private(name) and name not in own and name not in STDLIB_PRIVATE:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _checked_files() -> list[pathlib.Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).as_posix() not in ALLOWED]


def test_no_foreign_private_attribute_outside_the_two_modules():
    """An attribute the package never defines, read or written on some object, is a library's: torch's
    and the SDK's belong in capture/_torch.py and otel/_sdk.py (a name the package also uses for its own attribute
    passes unseen: this check is a net, the import-based one the rule)."""
    files = _checked_files()
    own = _own_names([ast.parse(path.read_text()) for path in files])
    touches = [f"{path.relative_to(PACKAGE.parent)}:{touch}" for path in files
               for touch in foreign_private_attributes(path.read_text(), own)]
    assert not touches, ("another library's private attributes outside capture/_torch.py and otel/_sdk.py:\n"
                         + "\n".join(touches))


def test_private_torch_and_opentelemetry_only_in_their_two_modules():
    touches = [f"{path.relative_to(PACKAGE.parent)}:{touch}" for path in _checked_files()
               for touch in private_touches(path.read_text(), str(path))]
    assert not touches, ("private torch/OpenTelemetry names outside capture/_torch.py and otel/_sdk.py:\n"
                         + "\n".join(touches))


@pytest.mark.parametrize("source", [
    "import torch\ntorch._C._current_graph_task_id()",
    "import torch.distributed._functional_collectives",
    "import torch.distributed as dist\ndist._x",
    "from torch.utils._python_dispatch import TorchDispatchMode",
    "from torch.distributed import _functional_collectives",
    "from torch.nn import Module\nModule._call_impl",
    "import torch\ngetattr(torch, '_x')",
    "import opentelemetry.sdk.trace as trace\nhasattr(trace, '_y')",
    "from opentelemetry.sdk import trace\ntrace._x",
    "import sys\nsys.modules.get('torch._dynamo.eval_frame')",
    "def f():\n    import torch\n    return torch.ops._c10d_functional",
])
def test_the_check_finds_each_kind(source):
    assert private_touches(source)


@pytest.mark.parametrize("source", [
    "import torch\ntorch.__version__\ntorch.distributed.all_reduce",
    "import torch\nx = object()\nx._private",
    "from opentelemetry import trace\ntrace.get_tracer(__name__)",
    "'''torch._C in a docstring'''",
])
def test_the_check_leaves_public_names_alone(source):
    assert not private_touches(source)


def test_the_attribute_net_finds_a_library_attribute_and_not_ours():
    source = "class A:\n    def __init__(self):\n        self._mine = 1\n\ndef f(a, module):\n" \
             "    return a._mine, module._forward_hooks, getattr(module, '_mode_key', None)\n"
    own = _own_names([ast.parse(source)])
    assert [touch.split(":")[0] for touch in foreign_private_attributes(source, own)] == ["6", "6"]
