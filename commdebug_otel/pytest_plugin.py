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
and says so. A baseline name is one test's: when a second test (another parametrization) records
under a name another test of the same run wrote, or one test records two different signatures
under one name, ``--comm-update`` fails the second rather than overwrite the first, also across
pytest-xdist workers (``-n``). Works in a job of one process and on every rank of a multi-rank test (each rank a
pytest process, e.g. under torchrun): every rank gets the job's signature and the same verdict.
Baselines are ordinary signature files: ``commdebug-otel compare`` reads them.

Importing this module imports neither torch nor the OTel SDK (pytest loads it in every run).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
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


def pytest_configure(config: pytest.Config) -> None:
    # One id per run, the same in every pytest-xdist worker (its testrunuid), so that workers see each other's
    # claims on baseline names (_claim).
    if hasattr(config, "workerinput"):
        config.stash[_RUN_ID] = str(config.workerinput["testrunuid"])
        return
    run_id = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
    if hasattr(config.option, "testrunuid"):
        config.option.testrunuid = run_id  # xdist's controller hands it to its workers
    config.stash[_RUN_ID] = run_id


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and _RUN_ID in config.stash:
        shutil.rmtree(_claims_folder(config.stash[_RUN_ID]), ignore_errors=True)


_RUN_ID = pytest.StashKey[str]()


def _claims_folder(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"commdebug-otel-comm-update-{run_id}"


class CommSignature:
    """What the ``comm_signature`` fixture gives a test: call it with a baseline name, use it as ``with``.

    Args:
        folder: where the baselines are (``comm_signatures`` beside the test file).
        update: write baselines instead of comparing (``--comm-update``).
        test: the test's node id: who writes a baseline, said when two tests would write one.
        run_id: this pytest run's id (one for all xdist workers): claims on baseline names are per run;
            None: no claims (each write stands alone).
    """

    def __init__(self, folder: Path, update: bool, test: str = "", run_id: str | None = None) -> None:
        self.folder = folder
        self.update = update
        self.test = test
        self.run_id = run_id
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
                 typical_only: bool = False, gather: bool = True) -> Iterator[CommSignature]:
        """Record the block and compare its signature with the baseline ``name`` (or write it).

        Args:
            name: the baseline's name: ``comm_signatures/{name}.json``.
            count_tolerance, bytes_tolerance, typical_only: as :func:`commdebug_otel.offline.signature.compare`
                (``typical_only``: the first and last steps' differences from the typical step are not held).
            gather: as :class:`commdebug_otel.testing.signatures.SignatureRecording`.

        Raises:
            ValueError: a bad name, or a tolerance below 0 (before the block runs). The test fails
            (``pytest.fail``) when the signature differs from the baseline, there is none, or the
            baseline cannot be read (another format, one key twice for a rank: the message names
            them); with ``--comm-update``, when another test of this run wrote ``name`` already, or
            this test wrote a different signature under it.
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
                text = signature.to_json(found)
                self._claim(path, text)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            return
        shown = _shown(path)
        if not path.exists():
            pytest.fail(f"comm_signature: no baseline {shown}; run pytest --comm-update to write it", pytrace=False)
        try:
            base = signature.load(shown)  # its messages name the file as shown
        except signature.SignatureError as error:
            unreadable: str | None = str(error)
        else:
            unreadable = None
        if unreadable is not None:
            pytest.fail(f"comm_signature: {unreadable}", pytrace=False)
        diff = signature.compare(base, found, count_tolerance=count_tolerance, bytes_tolerance=bytes_tolerance,
                                 typical_only=typical_only)
        if not diff["equal"]:
            pytest.fail(signature.format_diff(diff, shown, "this run") +
                        "\n(pytest --comm-update writes this run's signature as the baseline)", pytrace=False)


    def _claim(self, path: Path, text: str) -> None:
        """Make ``path`` this test's baseline for this run, or fail: another test claimed it (a second
        parametrization under one name would overwrite the first's baseline), or this test wrote another
        signature there. Claims are files (linked into place, so only one wins) in a folder of the run, so
        pytest-xdist workers see each other's."""
        if self.run_id is None:
            return
        folder = _claims_folder(self.run_id)
        folder.mkdir(parents=True, exist_ok=True)
        claim = folder / hashlib.sha256(str(path.resolve()).encode()).hexdigest()
        mine = f"{self.test}\n{hashlib.sha256(text.encode()).hexdigest()}"
        # Written aside, then linked into place: a claim is never seen half-written, and only one link wins.
        draft = folder / f".{uuid.uuid4().hex}"
        draft.write_text(mine, encoding="utf-8")
        try:
            os.link(draft, claim)
        except FileExistsError:
            owner, _, written = claim.read_text(encoding="utf-8").partition("\n")
            if owner != self.test:
                pytest.fail(f"comm_signature: --comm-update: {owner} wrote {_shown(path)} in this run already; "
                            f"{self.test} would overwrite it: give each test its own name (e.g. "
                            "comm_signature(f\"tp_{param}\") in a parametrized test)", pytrace=False)
            if written != mine.partition("\n")[2]:
                pytest.fail(f"comm_signature: --comm-update: {self.test} records two different signatures "
                            f"under {_shown(path)}: give each block its own name", pytrace=False)
        finally:
            draft.unlink()


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
    config = request.config
    return CommSignature(Path(request.path).parent / BASELINE_FOLDER, config.getoption("comm_update"),
                         request.node.nodeid, config.stash.get(_RUN_ID, None))
