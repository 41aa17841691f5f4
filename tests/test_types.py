"""The package type-checks clean under mypy, configured in pyproject.toml ([tool.mypy]).

The seams between the layers are typed Protocols (``core/protocols.py``, ``core/fact.py:MetricsSink``,
``offline/otlp_json.py:Fold``, ``otel/process_exit.py:ExitHost``): this is what holds each side to them.
mypy is in the ``test`` extra; without it the test is skipped with the install command, except under CI
(``CI`` set, as ``.ci/run`` does), where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from tools import in_ci

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mypy_finds_nothing():
    if importlib.util.find_spec("mypy") is None:
        message = "mypy is not installed: `pip install mypy` (the `test` extra has it)"
        if in_ci():
            pytest.fail(f"{message}; CI is set, so it is required")
        pytest.skip(message)
    # The checkout's package, whatever is installed; no cache left in the tree.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MYPY_CACHE_DIR": os.devnull}
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("Success: no issues found"), done.stdout
