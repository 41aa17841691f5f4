"""Every module logs under its own name (``logging.getLogger(__name__)``), so a user's logging configuration finds
a message under the module that says it; the only other loggers named are the OpenTelemetry SDK's own, which
``otel/export_guard.py`` filters (named by a variable, not a literal)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"


def _named_loggers(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[str]:
    """``getLogger("...")`` calls of ``path`` whose name is a string literal: another module's name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{node.lineno}: {node.args[0].value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)]


def test_every_module_logs_under_its_own_name():
    assert [found for path in sorted(PACKAGE.rglob("*.py")) for found in _named_loggers(path)] == []


def test_the_check_finds_a_logger_named_after_another_module(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import logging\n_logger = logging.getLogger("commdebug_otel.core.recorder")\n'
                      '_own = logging.getLogger(__name__)\n')
    assert _named_loggers(sample, tmp_path) == ["sample.py:2: 'commdebug_otel.core.recorder'"]
