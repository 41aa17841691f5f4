"""The offline commands read every name of the data contract through ``semconv`` (or ``core/fact.py``): no
module under ``offline/`` writes an attribute key, event name or resource key as a string literal of its own, so
each name lives in one place and a renamed one cannot leave a reader behind."""

from __future__ import annotations

import ast
import pathlib

from commdebug_otel import semconv

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"
# Dotted names (attribute and resource keys); event and span names such as "exception" or "stalled" are also
# plain words in messages and column headers.
NAMES = {value: key for key, value in vars(semconv).items()
         if key.isupper() and isinstance(value, str) and "." in value}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _literals(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r} (semconv.{NAMES[node.value]})"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and node.value in NAMES]


def test_offline_reads_the_contract_through_semconv():
    assert [found for path in sorted((PACKAGE / "offline").rglob("*.py")) for found in _literals(path)] == []


def test_the_check_finds_a_literal_key(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Doc: torch.step."""\n\ndef f(span):\n    return span["attributes"].get("torch.step")\n')
    assert _literals(sample, tmp_path) == ["sample.py:4: 'torch.step' (semconv.STEP)"]


def test_the_exception_event_is_written_and_read_by_the_same_names():
    from commdebug_otel.core.redact import exception_attributes

    try:
        raise ValueError("bad")
    except ValueError as error:
        attributes = exception_attributes(error, "none")
    assert sorted(attributes) == sorted([semconv.EXCEPTION_TYPE, semconv.EXCEPTION_STACKTRACE,
                                         semconv.EXCEPTION_ESCAPED])
    assert attributes[semconv.EXCEPTION_TYPE] == "ValueError"
