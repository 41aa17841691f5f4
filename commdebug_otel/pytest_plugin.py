"""pytest plugin: hold a block's communication in a test, against a baseline kept beside the test.

Installed with commdebug-otel (entry point ``pytest11``); nothing to configure::

    def test_tp_step(comm_signature):
        model = parallelize_module(ToyModel(), mesh, plan)
        with comm_signature("tp_step"):
            model(batch).sum().backward()
            optimizer.step()

The block's signature (:mod:`commdebug_otel.testing.signatures`) is compared with
``comm_signatures/tp_step.json`` in the test file's folder; a difference fails the test with the
diff as its message (:func:`commdebug_otel.offline.signature.format_diff`). ``pytest --comm-update``
writes the baselines instead (rank 0 writes, in a job of several ranks); a missing baseline fails
and says so. Works in a job of one process and on every rank of a multi-rank test (each rank a
pytest process, e.g. under torchrun): every rank gets the job's signature and the same verdict.
Baselines are ordinary signature files: ``commdebug-otel compare`` reads them.

Importing this module imports neither torch nor the OTel SDK (pytest loads it in every run).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["BASELINE_FOLDER", "CommSignature", "comm_signature", "pytest_addoption"]

#: The folder, beside the test file, that holds the baselines.
BASELINE_FOLDER = "comm_signatures"
_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("commdebug-otel", "communication signatures (commdebug-otel)")
    group.addoption("--comm-update", action="store_true", default=False,
                    help="write the comm_signature fixture's baselines (comm_signatures/NAME.json beside each "
                         "test) instead of comparing with them")


class CommSignature:
    """What the ``comm_signature`` fixture gives a test: call it with a baseline name, use it as ``with``.

    Args:
        folder: where the baselines are (``comm_signatures`` beside the test file).
        update: write baselines instead of comparing (``--comm-update``).
    """

    def __init__(self, folder: Path, update: bool) -> None:
        self.folder = folder
        self.update = update
        #: The signature of the last block recorded (None before one has exited).
        self.last: dict[str, Any] | None = None

    def baseline(self, name: str) -> Path:
        """The baseline file of ``name``.

        Raises:
            ValueError: a name that is not letters, digits, ``_``, ``.`` and ``-``.
        """
        if not _NAME.match(name) or name.startswith("."):
            raise ValueError(f"comm_signature: name {name!r} must be letters, digits, '_', '.' and '-' "
                             "(it names a file)")
        return self.folder / f"{name}.json"

    @contextmanager
    def __call__(self, name: str, *, count_tolerance: float = 0.0, bytes_tolerance: float = 0.0,
                 gather: bool = True) -> Iterator[CommSignature]:
        """Record the block and compare its signature with the baseline ``name`` (or write it).

        Args:
            name: the baseline's name: ``comm_signatures/{name}.json``.
            count_tolerance, bytes_tolerance: as :func:`commdebug_otel.offline.signature.compare`.
            gather: as :class:`commdebug_otel.testing.signatures.SignatureRecording`.

        Raises:
            ValueError: a bad name, or a tolerance below 0 (before the block runs). The test fails
            (``pytest.fail``) when the signature differs from the baseline, or there is none.
        """
        from commdebug_otel.offline import signature
        from commdebug_otel.testing.signatures import record_signature

        path = self.baseline(name)
        for option, value in (("count_tolerance", count_tolerance), ("bytes_tolerance", bytes_tolerance)):
            if not value >= 0:  # NaN too; said before the block, and in --comm-update runs as well
                raise ValueError(f"comm_signature: {option} must be a number >= 0, got {value!r}")
        with record_signature(gather=gather) as recording:
            yield self
        found = recording.signature
        self.last = found
        if found is None:
            return
        if self.update:
            if _rank() == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(signature.to_json(found), encoding="utf-8")
            return
        shown = _shown(path)
        if not path.exists():
            pytest.fail(f"comm_signature: no baseline {shown}; run pytest --comm-update to write it", pytrace=False)
        try:
            base = signature.load(path)
        except signature.SignatureError as error:
            pytest.fail(f"comm_signature: {error}", pytrace=False)
        diff = signature.compare(base, found, count_tolerance=count_tolerance, bytes_tolerance=bytes_tolerance)
        if not diff["equal"]:
            pytest.fail(signature.format_diff(diff, shown, "this run") +
                        "\n(pytest --comm-update writes this run's signature as the baseline)", pytrace=False)


def _shown(path: Path) -> str:
    """``path`` as a message shows it: relative to the working folder when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _rank() -> int:
    """This process's rank in the default process group (0 outside one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@pytest.fixture
def comm_signature(request: pytest.FixtureRequest) -> CommSignature:
    """``with comm_signature("name"): ...`` holds the block's communication against
    ``comm_signatures/name.json`` beside the test (see :class:`CommSignature`)."""
    return CommSignature(Path(request.path).parent / BASELINE_FOLDER, request.config.getoption("comm_update"))
