"""No class in the package is over about 350 lines (issue 28): a large one is split along a seam, as
``core/recorder.py`` is a facade over its parts and ``otel/telemetry.py`` sets providers up while
``otel/process_exit.py`` ends them. Read from the source (parsed, not imported)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"
MAX_CLASS_LINES = 350  # from the ``class`` line to the last line of its body


def _class_lines() -> dict[str, int]:
    """``{"file.py:Class": lines}`` for every class of the package, nested ones too."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_no_class_is_over_350_lines():
    lines = _class_lines()
    assert len(lines) > 100  # the walk found the package's classes, not nothing
    assert {name: count for name, count in lines.items() if count > MAX_CLASS_LINES} == {}
