"""torch's Flight Recorder dumped beside a stall snapshot, so ``diagnose`` reads both together.

Where the job runs with torch's Flight Recorder on (``TORCH_FR_BUFFER_SIZE``, or NCCL's older
``TORCH_NCCL_TRACE_BUFFER_SIZE``, above 0), each stall snapshot also writes the rank's Flight
Recorder buffer, in torch's JSON form, to ``commdebug-flight-recorder-rank<N>.json``: in the folder
of ``TORCH_FR_DUMP_TEMP_FILE`` when that is set (where torch's own dumps go), else in the run
folder (``OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR/run-<job id>``). A later snapshot of the stall replaces
the file (the buffer then holds the same entries and more). The name holds no torch dump prefix,
so torch's ``fr_trace`` (which reads its pickles by prefix) never picks it up.

Runs on the watchdog's thread, never the training thread's; a failure costs one message and
the snapshot goes on without a dump.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from . import semconv
from ._torch import flight_recorder_json
from .redact import describe

_logger = logging.getLogger(__name__)

#: torch's variables that turn the Flight Recorder on (the buffer's entries; the first set wins, as in c10d).
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: torch's prefix of its own dump files (``<prefix><rank>``, pickled): ours go to its folder.
DUMP_PREFIX_VARIABLE = "TORCH_FR_DUMP_TEMP_FILE"
FILE_PREFIX = semconv.FLIGHT_RECORDER_FILE_PREFIX

_failed = False


def enabled(environ: dict | None = None) -> bool:
    """Whether torch's Flight Recorder records in this process (a buffer size above 0)."""
    environ = os.environ if environ is None else environ
    for name in BUFFER_VARIABLES:
        text = environ.get(name)
        if text is not None:
            try:
                return int(text) > 0
            except ValueError:
                return False  # torch refuses it too
    return False


def dump_path(rank: int, run_folder: str, environ: dict | None = None) -> str:
    """Where rank ``rank``'s dump goes: ``TORCH_FR_DUMP_TEMP_FILE``'s folder if set, else ``run_folder``."""
    environ = os.environ if environ is None else environ
    prefix = environ.get(DUMP_PREFIX_VARIABLE)
    folder = (os.path.dirname(os.path.abspath(os.path.expanduser(prefix))) if prefix else run_folder)
    return os.path.join(folder, f"{FILE_PREFIX}{rank}.json")


def dump_beside_snapshot(rank: int, run_folder: Callable[[], str]) -> str | None:
    """Write this rank's Flight Recorder buffer (torch's JSON) where :func:`dump_path` says.

    ``run_folder()``: the run's output folder (asked only when ``TORCH_FR_DUMP_TEMP_FILE`` is unset).
    Returns the file written, or None: the recorder is off, torch cannot dump, or writing failed
    (said once per process). Never raises. The file is replaced whole (written aside, then renamed).
    """
    global _failed
    if _failed or not enabled():
        return None
    try:
        data = flight_recorder_json()
        if data is None:
            raise RuntimeError("this torch has no JSON Flight Recorder dump")
        path = dump_path(rank, "" if os.environ.get(DUMP_PREFIX_VARIABLE) else run_folder())
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        aside = f"{path}.{os.getpid()}.tmp"
        try:
            with open(aside, "wb") as handle:
                handle.write(data)
            os.replace(aside, path)
        except OSError:
            if os.path.exists(aside):
                os.unlink(aside)
            raise
        return path
    except Exception as error:
        _failed = True
        _logger.warning("commdebug-otel: could not write torch's Flight Recorder dump beside the stall snapshot "
                        "(%s); the snapshots go on without it", describe(error))
        return None
