"""torch's Flight Recorder dumped beside a stall snapshot, so ``diagnose`` reads both together.

torch 2.13 records by default (2,000 entries per process); a job that asks for it, with
``TORCH_FR_BUFFER_SIZE`` (or NCCL's older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) above 0 or with a dump
prefix (``TORCH_FR_DUMP_TEMP_FILE``, NCCL's older ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``), gets each stall
snapshot's dump too: the rank's buffer, in torch's JSON form, in ``commdebug-flight-recorder-rank<N>.json``,
in the prefix's folder (where torch's own dumps go) or else the run folder
(``OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR/run-<job id>``). Without either variable no file is written: a run
that never mentioned Flight Recorder gets no files of it. A later snapshot of the stall replaces the
file. The name holds no torch dump prefix, so torch's ``fr_trace`` (which reads its pickles by prefix)
never picks it up.

Runs on the watchdog's thread, never the training thread's; a failure costs one message and
the snapshot goes on without a dump.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from commdebug_otel import semconv
from commdebug_otel.capture._torch import flight_recorder_json
from commdebug_otel.config import FR_BUFFER_VARIABLES, FR_DUMP_PREFIX_VARIABLES, FlightRecorderEnv
from commdebug_otel.core.redact import describe

_logger = logging.getLogger(__name__)

BUFFER_VARIABLES = FR_BUFFER_VARIABLES  # read in config.py, as every variable
DUMP_PREFIX_VARIABLES = FR_DUMP_PREFIX_VARIABLES
FILE_PREFIX = semconv.FLIGHT_RECORDER_FILE_PREFIX

_failed = False


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the job asked for torch's Flight Recorder: a buffer size above 0, or a dump prefix with the
    size left at torch's default. A size that is not an integer >= 0 is said once and means no."""
    return FlightRecorderEnv.from_env(environ).enabled


def dump_path(rank: int, run_folder: str, environ: Mapping[str, str] | None = None) -> str:
    """Where rank ``rank``'s dump goes: the dump prefix's folder if set, else ``run_folder``."""
    prefix = FlightRecorderEnv.from_env(environ).dump_prefix
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(prefix))) if prefix else run_folder
    return os.path.join(folder, f"{FILE_PREFIX}{rank}.json")


def dump_beside_snapshot(rank: int, run_folder: Callable[[], str]) -> str | None:
    """Write this rank's Flight Recorder buffer (torch's JSON) where :func:`dump_path` says.

    ``run_folder()``: the run's output folder (asked only when no dump prefix is set).
    Returns the file written, or None: not asked for (:func:`enabled`), torch cannot dump, or writing
    failed (said once per process). Never raises. The file is replaced whole (written aside,
    then renamed).
    """
    global _failed
    if _failed or not enabled():
        return None
    try:
        path = dump_path(rank, "" if FlightRecorderEnv.from_env().dump_prefix else run_folder())
        data = flight_recorder_json()
        if data is None:
            raise RuntimeError("this torch has no JSON Flight Recorder dump")
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
