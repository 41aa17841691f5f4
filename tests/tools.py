"""Programs from Debian packages that some tests run (``prometheus``, ``promtool``, ``chromium``).

On a developer's machine a missing program skips its tests with the install command, so
README's test command passes on a fresh machine. Under CI (the ``CI`` variable set, as
``.ci/run`` and hosted CI services do) a missing program fails them: CI installs every one.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest


def in_ci() -> bool:
    """True when ``CI`` is set to anything but an empty string, ``0`` or ``false``."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def find_program(*names: str, env: str | None = None) -> str | None:
    """The first executable of ``$env`` (when set), then ``names`` on PATH, then ``/usr/bin/NAME``; or None."""
    candidates = [os.environ.get(env) if env else None]
    for name in names:
        candidates += [shutil.which(name), f"/usr/bin/{name}"]
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def require_program(*names: str, package: str, env: str | None = None) -> str:
    """The program's path, as :func:`find_program` finds it.

    Raises:
        pytest.skip.Exception: when it is missing and CI is unset (the message has the install command).
        pytest.fail.Exception: when it is missing under CI.
    """
    path = find_program(*names, env=env)
    if path is not None:
        return path
    message = f"{names[0]} not found: install it with `apt-get install -y {package}` (.ci/run does)"
    if in_ci():
        pytest.fail(f"{message}; CI is set, so it is required")
    pytest.skip(message)


def default_signal_actions() -> None:
    """``preexec_fn`` for a child that must get the signals' default actions, however the tests were started: a
    shell's background job or ``nohup`` starts them with SIGINT, SIGQUIT or SIGHUP ignored, and a child inherits
    that (Python then installs no KeyboardInterrupt for Ctrl-C)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
