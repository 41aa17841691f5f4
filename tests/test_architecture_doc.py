"""docs/architecture.md's call paths name files and functions that exist (parsed, not imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "commdebug_otel"
DOC = ROOT / "docs" / "architecture.md"
# `file.py:Qualified.name`: a module-level function or class, or a method of one (nested defs too).
_NAMED = re.compile(r"`((?:[\w]+/)*[\w]+\.py):([\w.]+)`")
QUESTIONS = "abcdefg"


def _call_paths() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Call paths")
    return text[start:text.index("\n## ", start + 1)]


def _names(tree: ast.AST) -> set[str]:
    """Every qualified name defined in ``tree``: ``f``, ``C``, ``C.m``, ``C.m.inner``."""
    found: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                found.add(name)
                walk(child, name + ".")
            elif not isinstance(child, ast.expr):
                walk(child, prefix)  # defs under if/try at the same level

    walk(tree, "")
    return found


def test_every_file_and_function_the_call_paths_name_exists():
    section = _call_paths()
    named = _NAMED.findall(section)
    assert len(named) >= 40  # the parse found the paths, not nothing
    defined: dict[str, set[str]] = {}
    missing = []
    for path, name in named:
        source = PACKAGE / path
        if not source.is_file():
            missing.append(f"{path} (no such file)")
            continue
        if path not in defined:
            defined[path] = _names(ast.parse(source.read_text(encoding="utf-8")))
        if name not in defined[path]:
            missing.append(f"{path}:{name}")
    assert missing == []


def test_every_question_has_a_path():
    section = _call_paths()
    for letter in QUESTIONS:
        answer = re.search(rf"\*\*\({letter}\) [^*]+\*\*(.*?)(?=\n\*\*\(|\Z)", section, re.S)
        assert answer is not None, letter
        assert "→" in answer.group(1) and _NAMED.search(answer.group(1)), letter


def test_the_check_catches_a_name_that_is_gone(tmp_path):
    """The parse is not vacuous: a function that does not exist is reported."""
    tree = ast.parse((PACKAGE / "core/recorder.py").read_text(encoding="utf-8"))
    names = _names(tree)
    assert "Recorder.stall_snapshot" in names and "Recorder.emit" not in names
