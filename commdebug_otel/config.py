"""Settings: the one module that reads environment variables.

Four frozen views, each built from a mapping (default ``os.environ``), so that
every other module can be tested from a plain dict:

* :class:`Settings` (``Settings.from_env()``): our ``OTEL_PYTHON_COMMDEBUG_*``
  variables, through ``OPTIONS``, the single table behind the environment
  variables, the ``commdebug-otel run`` flags and ``docs/configuration.md``.
  Explicit arguments (``Settings(detail=...)``) beat the environment; bad
  explicit arguments raise ``ValueError`` at once.
* :class:`ExportEnv` (``ExportEnv.from_env()``): the standard ``OTEL_*``
  variables that our own SDK set-up (``otel/telemetry.py``) reads, named through the
  SDK's constants, with the exporter and endpoint rules (``otlp_endpoint``).
  The SDK's exporters still read their headers, certificates, compression and
  timeouts themselves.
* :class:`RankEnv` (``RankEnv.from_env()``): torchrun's ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK`` and
  ``TORCHELASTIC_RUN_ID``.
* :class:`FlightRecorderEnv` (``FlightRecorderEnv.from_env()``): torch's Flight
  Recorder size and dump prefix (``TORCH_FR_BUFFER_SIZE``, ``TORCH_FR_DUMP_TEMP_FILE``
  and NCCL's older names), for ``stall/flight_recorder.py``.

A bad value never raises: it logs one warning naming the variable, the value and
the accepted values, and the default is used, so training goes on.

Booleans: ours (``OTEL_PYTHON_COMMDEBUG_*``) accept true/1/yes/on and
false/0/no/off (:func:`parse_bool`); the standard ``OTEL_*`` ones are true only
for ``true`` (:func:`otel_flag`), exactly as the SDK, which reads them too, so
that we and the SDK never disagree about them; any value but true, false or empty
is said once (the SDK says nothing).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, overload

from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.instrumentation.environment_variables import OTEL_PYTHON_DISABLED_INSTRUMENTATIONS
from opentelemetry.sdk.environment_variables import (
    OTEL_ATTRIBUTE_COUNT_LIMIT,
    OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT,
    OTEL_BSP_EXPORT_TIMEOUT,
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
    OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT,
    OTEL_EXPORTER_OTLP_CERTIFICATE,
    OTEL_EXPORTER_OTLP_COMPRESSION,
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_HEADERS,
    OTEL_EXPORTER_OTLP_INSECURE,
    OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE,
    OTEL_EXPORTER_OTLP_METRICS_COMPRESSION,
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_HEADERS,
    OTEL_EXPORTER_OTLP_METRICS_INSECURE,
    OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
    OTEL_EXPORTER_OTLP_METRICS_TIMEOUT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TIMEOUT,
    OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
    OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    OTEL_EXPORTER_OTLP_TRACES_INSECURE,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
    OTEL_EXPORTER_PROMETHEUS_HOST,
    OTEL_EXPORTER_PROMETHEUS_PORT,
    OTEL_LINK_ATTRIBUTE_COUNT_LIMIT,
    OTEL_METRIC_EXPORT_INTERVAL,
    OTEL_METRIC_EXPORT_TIMEOUT,
    OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED,
    OTEL_RESOURCE_ATTRIBUTES,
    OTEL_SDK_DISABLED,
    OTEL_SERVICE_NAME,
    OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT,
    OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT,
    OTEL_SPAN_EVENT_COUNT_LIMIT,
    OTEL_SPAN_LINK_COUNT_LIMIT,
)

from commdebug_otel import semconv
from commdebug_otel.core.redact import hide_credentials
from commdebug_otel.detail import Detail

_logger = logging.getLogger(__name__)

ENV_PREFIX = "OTEL_PYTHON_COMMDEBUG_"
# Our metric export interval under `commdebug-otel run` when OTEL_METRIC_EXPORT_INTERVAL is unset (OTel's
# default is 60 s): dashboards of a short job fill as it runs. Not put in the job's environment, where the
# script's own OTel SDK would read it too.
RUN_METRIC_EXPORT_INTERVAL_MS = 5000

# torchrun's variables (torch/distributed/elastic/agent/server/api.py).
RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
GROUP_RANK_ENV = "GROUP_RANK"  # the node's rank; NODE_RANK is the older launchers' name
NODE_RANK_ENV = "NODE_RANK"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def job_log(logger: logging.Logger, environ: Mapping[str, str] | None = None) -> Callable[..., None]:
    """``logger.warning`` on rank 0 (or outside torchrun), ``logger.debug`` on other ranks.

    The same configuration reaches every rank; saying it once per job is enough.
    """
    return logger.warning if RankEnv.from_env(environ).rank == 0 else logger.debug


class TraceScope(enum.Enum):
    JOB = "job"  # step N of every rank shares one trace id
    RANK = "rank"  # one trace per rank per step


class MetricRankLabel(enum.Enum):
    """Whether metric points carry the rank (``OTEL_PYTHON_COMMDEBUG_METRIC_RANK_LABEL``)."""

    AUTO = "auto"  # on up to METRIC_RANK_LABEL_AUTO_MAX_WORLD ranks, off past it
    ON = "on"
    OFF = "off"


def _parse_detail(text: str) -> Detail:
    try:
        return Detail[text.strip().upper()]
    except KeyError:
        raise ValueError(text) from None


class _Number:
    """A bounded number setting: parses its variable's text and checks explicit ``Settings`` arguments.

    Every number has an upper bound too: a huge value (``SHUTDOWN_TIMEOUT=1e10``, past
    ``threading.TIMEOUT_MAX``; ``MAX_EVENTS_PER_SPAN`` past 2**63, the SDK's deque limit)
    would otherwise fail later, inside exit or export, instead of here with one message.

    Args:
        low, high: the accepted range, both included (``low`` excluded when ``low_open``).
        integer: whole numbers only (bools are refused); otherwise any finite number.
        unit: a word after "a number of" in the accepted text ("seconds"), for floats.
    """

    def __init__(self, low: float, high: float, integer: bool = True, low_open: bool = False,
                 unit: str = "") -> None:
        self.low, self.high, self.integer, self.low_open = low, high, integer, low_open
        if integer:
            self.accepted = f"an integer from {low} to {high}"
        else:
            self.accepted = f"a number of {unit} > {low:g} and <= {high:g}"

    def _in_range(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high  # NaN fails both

    def __call__(self, text: str) -> int | float:
        value = int(text.strip()) if self.integer else float(text.strip())
        if not self._in_range(value):
            raise ValueError(text)
        return value

    def check(self, field: str, value: Any) -> int | float:
        """``value`` as given in code, or ``ValueError`` naming ``field`` and the accepted range."""
        kinds = numbers.Integral if self.integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kinds) or not self._in_range(float(value)):
            raise ValueError(f"{field} must be {self.accepted}, got {value!r}")
        return int(value) if self.integer else float(value)  # type: ignore[call-overload]


# The upper bounds (docs/configuration.md): far past any real use, far below what breaks.
MAX_STEP_PERIOD = 10**9  # TRACE_EVERY, COMPLETION_EVERY: steps
MAX_EVENTS_PER_SPAN = 10**6  # a span's events are kept in memory until the step ends
MAX_MODULE_DEPTH = 100
MAX_SPANS_PER_STEP = 10**6  # about 1 GB of records (docs/troubleshooting.md)
MAX_RANKS_PER_TRACE = 10**6  # past any job: one trace per step for the whole job
# Ranks per trace block by default: one 8-GPU node, which keeps tensor-parallel groups of up to 8
# ranks whole. A traced step costs about 16 KB of OTLP protobuf per transformer block per rank
# (docs/performance.md, scale phase), so a block's trace stays under Tempo's 5 MB for models of
# up to about 32 such blocks (docs/troubleshooting.md).
DEFAULT_RANKS_PER_TRACE = 8
# METRIC_RANK_LABEL=auto keeps the rank label up to this many ranks (docs/performance.md, metric series).
METRIC_RANK_LABEL_AUTO_MAX_WORLD = 256
MAX_SHUTDOWN_TIMEOUT_S = 600.0  # threading.TIMEOUT_MAX is ~9.2e9 s; ten minutes per rank at exit is plenty

_parse_step_period = _Number(1, MAX_STEP_PERIOD)
_parse_events_per_span = _Number(1, MAX_EVENTS_PER_SPAN)
_parse_module_depth = _Number(0, MAX_MODULE_DEPTH)
_parse_spans_per_step = _Number(1, MAX_SPANS_PER_STEP)
_parse_ranks_per_trace = _Number(1, MAX_RANKS_PER_TRACE)
_parse_timeout_s = _Number(0, MAX_SHUTDOWN_TIMEOUT_S, integer=False, low_open=True, unit="seconds")


MAX_STALL_AFTER_S = 86_400.0  # a day: past any step, below what a timer can hold
STALL_AUTO = "auto"  # Settings.stall_after_s: a threshold from the rank's recent step times
RECENT_STEPS = 32  # step times the auto threshold and the slow-step mark look at
AUTO_FACTOR = 10.0  # auto threshold: this many times the median recent step time...
AUTO_FLOOR_S = 30.0  # ...but at least this
AUTO_FIRST_S = 300.0  # until AUTO_MIN_STEPS steps have ended (compilation, warm-up)
AUTO_MIN_STEPS = 3
# auto, between steps with no collective in flight (data loading, a checkpoint save, an evaluation: no peer is
# waiting for this rank in a collective yet): at least this long. A hang there still shows on the other ranks,
# which wait in a collective and report it at the usual threshold.
AUTO_BETWEEN_STEPS_S = 600.0
# Until the first step has ended (imports, compilation, data set-up), a rank that is not communicating is setting up:
# a stall only past this many seconds, or the threshold if larger; one that waits in a collective, at the threshold.
SETUP_FLOOR_S = 300.0
STALL_ACCEPTED = f"auto, off (or 0), or a number of seconds > 0 and <= {MAX_STALL_AFTER_S:g}"


_parse_timeout_stall = _Number(0, MAX_STALL_AFTER_S, integer=False, low_open=True, unit="seconds")


def _parse_stall_after(text: str) -> float | str | None:
    value = text.strip().lower()
    if value == STALL_AUTO:
        return STALL_AUTO
    if value in ("off", "none", "0"):
        return None
    return _parse_timeout_stall(value)


def _parse_ranks(text: str) -> frozenset[int] | None:
    text = text.strip().lower()
    if text == "all":
        return None
    ranks = frozenset(int(part) for part in text.split(","))
    if not ranks or min(ranks) < 0:
        raise ValueError(text)
    return ranks


def _parse_scope(text: str) -> TraceScope:
    return TraceScope(text.strip().lower())


def _parse_rank_label(text: str) -> MetricRankLabel:
    return MetricRankLabel(text.strip().lower())


EXCEPTION_MESSAGES = ("redacted", "full", "none")


def _parse_exception_messages(text: str) -> str:
    value = text.strip().lower()
    if value not in EXCEPTION_MESSAGES:
        raise ValueError(text)
    return value


def _parse_patterns(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_dir(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


BOOL_ACCEPTED = "true, 1, yes or on; false, 0, no or off (any case)"


def parse_bool(text: str) -> bool:
    """Our booleans: true/1/yes/on or false/0/no/off, in any case.

    Raises:
        ValueError: for any other text.
    """
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


def otel_flag(text: str | None, variable: str | None = None) -> bool:
    """A standard ``OTEL_*`` boolean as the SDK reads it: ``true`` (any case) is true, anything else false.

    ``variable``: where ``text`` came from; a value other than true, false or empty (``1``, ``yes``) is
    then said once, as the OpenTelemetry specification asks, since the SDK takes it as false without a word.
    """
    value = (text or "").strip().lower()
    if variable is not None and value not in ("", "true", "false"):
        _warn_endpoint_once(variable, text or "", "is not true or false; taken as false, as OpenTelemetry reads it")
    return value == "true"


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: its field, variable, parser, default and documentation."""

    field: str
    suffix: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.suffix

    @property
    def flag(self) -> str:
        return "--" + self.suffix.lower().replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("enabled", "ENABLED", parse_bool, False, BOOL_ACCEPTED,
           "Start tracing in every Python process that imports torch, when it joins a process group or first "
           "calls a module (a process that only imports torch loads nothing more): through `commdebug_otel.pth`, "
           "which every install puts into site-packages, or the sitecustomize hook of `commdebug-otel run`; "
           "no wrapper needed."),
    Option("detail", "DETAIL", _parse_detail, Detail.COLLECTIVES,
           "collectives, dtensor, ops or all",
           "Which ops become span events, as CommDebugMode's noise levels 0-3."),
    Option("trace_every", "TRACE_EVERY", _parse_step_period, 1, _parse_step_period.accepted,
           "Trace one optimizer step in N (step % N == 0), and the collectives between it and the "
           "next step (its `train_step_tail`); metrics cover every step. Untraced steps run without a "
           "dispatch mode (docs/performance.md)."),
    Option("completion_every", "COMPLETION_EVERY", _parse_step_period, 10, _parse_step_period.accepted,
           "Time collectives on one step in N, on the steps TRACE_EVERY picks and between steps, on every rank: "
           "their issue time (torch.collective.duration) and, for c10d ones, their completion "
           "(torch.collective.completion_duration, a Python callback each on the backend's thread); "
           "1 = every step. Counts and bytes cover every step (docs/performance.md)."),
    Option("ranks", "RANKS", _parse_ranks, None, "all, or a comma list of ranks like 0,3",
           "Ranks that export spans; metrics come from every rank."),
    Option("trace_scope", "TRACE_SCOPE", _parse_scope, TraceScope.JOB, "job or rank",
           "job: step N of every rank shares one trace id (its `train_step_tail` too), and so does the "
           "`outside_step` set-up before the first step, within a block of RANKS_PER_TRACE ranks; rank: one "
           "trace per rank per step."),
    Option("ranks_per_trace", "RANKS_PER_TRACE", _parse_ranks_per_trace, DEFAULT_RANKS_PER_TRACE,
           _parse_ranks_per_trace.accepted,
           "Trace scope job: a job of more ranks is cut into blocks of this many consecutive ranks, "
           "one trace per step per block (`commdebug.trace.block` on `train_step`; find a step across "
           "blocks by `torch.step`), so a trace does not grow with the job (docs/troubleshooting.md). "
           "A job of at most this many ranks has one trace per step."),
    Option("output_dir", "OUTPUT_DIR", _parse_dir, "./commdebug-otel-out", "a directory path",
           "Where the embedded default writes OTLP-JSON lines when no exporter is configured."),
    Option("max_events_per_span", "MAX_EVENTS_PER_SPAN", _parse_events_per_span, 1024,
           _parse_events_per_span.accepted,
           "Span events kept per span; the rest are counted on the span and in "
           "commdebug.telemetry.dropped."),
    Option("metric_module_depth", "METRIC_MODULE_DEPTH", _parse_module_depth, 0,
           _parse_module_depth.accepted,
           "Add torch.module.fqn to metrics, cut to this many levels (0 = no module label)."),
    Option("metric_rank_label", "METRIC_RANK_LABEL", _parse_rank_label, MetricRankLabel.AUTO, "auto, on or off",
           "torch.distributed.rank on metric points (on), or not (off), so that label sets are the same "
           "on every rank; off also drops torch.process_group.name where torch.device_mesh.dim_name names "
           f"the group. auto: on up to {METRIC_RANK_LABEL_AUTO_MAX_WORLD} ranks, off past it. The rank "
           "stays a resource attribute, and exemplars still point at the rank's spans (docs/performance.md)."),
    Option("shutdown_timeout_s", "SHUTDOWN_TIMEOUT", _parse_timeout_s, 5.0, _parse_timeout_s.accepted,
           "Time the flush at exit may take, traces and metrics together."),
    Option("max_spans_per_step", "MAX_SPANS_PER_STEP", _parse_spans_per_step, 50_000,
           _parse_spans_per_step.accepted,
           "Module-pass spans one step may hold (about 1 KB each until the step ends). A step "
           "that reaches it (forward passes with grad that never reach `optimizer.step()`) is "
           "exported in parts, cut at its next top-level forward, each earlier part marked "
           "`commdebug.step.truncated`; the pass under way stays whole up to twice this. Cuts and "
           "passes not recorded are counted in commdebug.telemetry.dropped (docs/troubleshooting.md)."),
    Option("exception_messages", "EXCEPTION_MESSAGES", _parse_exception_messages, "redacted",
           "redacted, full or none",
           "What an `exception` event carries of the message: redacted (tensor and array reprs, numbers and "
           "bytes literals replaced by <values>), full (as raised: may hold tensor values), or none. Stack "
           "traces are code locations only in every case."),
    Option("stall_after_s", "STALL_AFTER", _parse_stall_after, STALL_AUTO, STALL_ACCEPTED,
           "When the current step (or, between steps, the time since the last one) has lasted this long, "
           "a watchdog thread exports a stall snapshot at once: the step's spans so far, a `stalled` span "
           "with the collectives in flight and the recent ones, and the metrics; again with back-off "
           "while it lasts. auto: 10 x the median of the rank's recent step times, at least 30 s "
           "(300 s until 3 steps have ended); between steps (data loading, checkpoints, evaluation) with no "
           "collective in flight, at least 600 s: a planned pause is not a stall, and a rank that waits for "
           "it in a collective still reports at the step threshold. A number applies everywhere but before the "
           "first step has ended: set-up (imports, compilation) is a stall only past 300 s unless the rank waits "
           "in a collective for a peer. off: no watchdog. Keep it below the process group's timeout, "
           "or a hang may end in that timeout before a snapshot (docs/diagnosis.md)."),
    Option("straggler", "STRAGGLER", parse_bool, False, BOOL_ACCEPTED,
           "The live straggler verdict: rank 0 names a rank that becomes persistently slow, from every step's "
           "busy time (wall time less collective waits), with the offline straggler model's significance test; a "
           "`straggler_verdict` span, one stderr line per change and the commdebug.straggler.lost metric; the module "
           "and pass where traced steps show it (while a suspicion is open, rank 0 asks for the next 4 steps "
           "traced, at most 3 times in a row). The ranks exchange under 200 bytes per step each (and traced "
           "steps' module times) through the job's c10d store, on the watchdog thread, "
           "never a collective (docs/diagnosis.md). Runs with the exporting ranks' watchdog, also when "
           "STALL_AFTER is off. Off by default until its cost on healthy steps is shown within the always-on "
           "budget (docs/performance.md)."),
    Option("module_include", "MODULE_INCLUDE", _parse_patterns, (), "comma list of fnmatch patterns",
           "Only modules whose FQN matches get spans (empty = all)."),
    Option("module_exclude", "MODULE_EXCLUDE", _parse_patterns, (), "comma list of fnmatch patterns",
           "Modules whose FQN matches get no span; their collectives go to the enclosing span."),
)

_BY_FIELD = {option.field: option for option in OPTIONS}
_NUMBERS = tuple(option for option in OPTIONS if isinstance(option.parse, _Number))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Frozen commdebug-otel settings. Field units: seconds for ``shutdown_timeout_s``; module-pass
    spans (records) for ``max_spans_per_step``.

    Each number has a lower and an upper bound (the ``accepted`` text of its ``OPTIONS`` entry, e.g.
    ``shutdown_timeout_s`` > 0 and <= 600); integers must be whole numbers.

    Raises:
        ValueError: at construction, when an explicit argument is out of range or of the wrong
            type; the message names the field and its accepted range.
    """

    enabled: bool = False
    detail: Detail = Detail.COLLECTIVES
    trace_every: int = 1
    completion_every: int = 10
    ranks: frozenset[int] | None = None
    trace_scope: TraceScope = TraceScope.JOB
    ranks_per_trace: int = DEFAULT_RANKS_PER_TRACE
    output_dir: str = "./commdebug-otel-out"
    max_events_per_span: int = 1024
    metric_module_depth: int = 0
    metric_rank_label: MetricRankLabel = MetricRankLabel.AUTO
    shutdown_timeout_s: float = 5.0
    max_spans_per_step: int = 50_000
    exception_messages: str = "redacted"
    stall_after_s: float | str | None = STALL_AUTO
    straggler: bool = False
    module_include: tuple[str, ...] = ()
    module_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.detail, str):
            object.__setattr__(self, "detail", _checked("detail", _parse_detail, self.detail))
        if isinstance(self.trace_scope, str):
            object.__setattr__(self, "trace_scope", _checked("trace_scope", _parse_scope, self.trace_scope))
        if isinstance(self.metric_rank_label, str):
            object.__setattr__(self, "metric_rank_label",
                               _checked("metric_rank_label", _parse_rank_label, self.metric_rank_label))
        if isinstance(self.ranks, str):
            object.__setattr__(self, "ranks", _checked("ranks", _parse_ranks, self.ranks))
        if self.stall_after_s is not None:
            object.__setattr__(self, "stall_after_s", _checked_stall(self.stall_after_s))
        object.__setattr__(self, "exception_messages",
                           _checked("exception_messages", _parse_exception_messages, self.exception_messages))
        for option in _NUMBERS:
            object.__setattr__(self, option.field,
                               option.parse.check(option.field, getattr(self, option.field)))  # type: ignore[attr-defined]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every ``OTEL_PYTHON_COMMDEBUG_*`` variable; ``overrides`` win.

        Never raises for bad environment values: each one logs a single warning
        and falls back to the default.
        """
        environ = _environ(environ)
        warn_unknown_variables(environ)
        values = {option.field: read_option(option.field, environ)
                  for option in OPTIONS if option.env in environ}
        values.update(overrides)
        return cls(**values)

    def traces_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def ranks_outside(self, world_size: int) -> list[int]:
        """The ranks ``ranks`` names that a job of ``world_size`` ranks does not have, sorted."""
        return sorted(rank for rank in self.ranks or () if rank >= world_size)

    def metric_rank_label_on(self, world_size: int) -> bool:
        """Whether metric points of a job of ``world_size`` ranks carry the rank (``metric_rank_label``)."""
        if self.metric_rank_label is MetricRankLabel.AUTO:
            return world_size <= METRIC_RANK_LABEL_AUTO_MAX_WORLD
        return self.metric_rank_label is MetricRankLabel.ON


def _checked_stall(value: Any) -> float | str:
    if isinstance(value, str):
        return _checked("stall_after_s", _parse_stall_after, value)
    return _parse_timeout_stall.check("stall_after_s", value)


def read_option(field: str, environ: Mapping[str, str] | None = None) -> Any:
    """One option's value (named by its ``Settings`` field) from ``environ``, or its default.

    Reads that variable alone: ``_autostart`` asks for ``enabled`` only, so that a bad
    value of another option is reported once, by the tracer that reads them all. Never
    raises for bad values: one warning, then the default.
    """
    option = _BY_FIELD[field]
    raw = _environ(environ).get(option.env)
    if raw is None:
        return option.default
    try:
        return option.parse(raw)
    except (ValueError, TypeError, OverflowError):
        job_log(_logger, environ)(
            "commdebug-otel: ignoring %s=%r: expected %s; using the default %s",
            option.env, raw, option.accepted, _describe(option.default),
        )
        return option.default


_unknown_said: set[str] = set()


def unknown_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Each ``OTEL_PYTHON_COMMDEBUG_*`` name in ``environ`` (default ``os.environ``) that no option has,
    with the closest option's variable (``difflib`` on the part after the prefix), or None when none is close."""
    suffixes = [option.suffix for option in OPTIONS]
    found: dict[str, str | None] = {}
    for name in _environ(environ):
        if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] not in suffixes:
            close = difflib.get_close_matches(name[len(ENV_PREFIX):], suffixes, n=1, cutoff=0.6)
            found[name] = ENV_PREFIX + close[0] if close else None
    return found


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> None:
    """One warning per unknown ``OTEL_PYTHON_COMMDEBUG_*`` name per process (a typo is otherwise silent),
    naming the closest known variable; on rank 0 only, as for bad values."""
    for name, close in sorted(unknown_variables(environ).items()):
        if name in _unknown_said:
            continue
        _unknown_said.add(name)
        hint = f"did you mean {close}?" if close else "docs/configuration.md lists the variables"
        job_log(_logger, environ)("commdebug-otel: ignoring %s: no such variable (%s)", name, hint)


def variable(field: str) -> str:
    """The environment variable of the option behind ``Settings`` field ``field``, for messages."""
    return _BY_FIELD[field].env


def run_environment(values: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``commdebug-otel run`` gives its command (``cli.py`` adds its start-up folder to
    ``PYTHONPATH``): a copy of ``environ`` (default ``os.environ``) with each option in ``values``
    (``Settings`` field -> text; None: not given) as its variable, and ``ENABLED=true``. Nothing else: a
    variable outside ours would be read by the script's own libraries too (:func:`launched_by_run` gives our
    metric interval its default instead)."""
    env = dict(_environ(environ))
    for option in OPTIONS:
        if values.get(option.field) is not None:
            env[option.env] = str(values[option.field])
    env[_BY_FIELD["enabled"].env] = "true"
    return env


BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def launched_by_run() -> bool:
    """Whether this process runs under ``commdebug-otel run``: its start-up folder (:data:`BOOTSTRAP_DIR`,
    which ``run`` puts on ``PYTHONPATH`` for every process of the job) is on ``sys.path``."""
    return any(entry and os.path.abspath(entry) == BOOTSTRAP_DIR for entry in sys.path)


def instrumentation_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` lists ``commdebug`` (our entry point's name)."""
    listed = _environ(environ).get(OTEL_PYTHON_DISABLED_INSTRUMENTATIONS, "")
    return "commdebug" in [name.strip() for name in listed.split(",")]


def _checked(field: str, parse: Callable[[str], Any], text: str) -> Any:
    try:
        return parse(text)
    except (ValueError, TypeError):
        raise ValueError(
            f"{field} must be {_BY_FIELD[field].accepted}, got {text!r}"
        ) from None


def _describe(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.name.lower() if isinstance(value, Detail) else value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "all"
    if value == ():
        return "(none)"
    return str(value)


def markdown_table() -> str:
    """The configuration reference table of ``docs/configuration.md``, generated from ``OPTIONS``."""
    lines = ["| variable | `commdebug-otel run` flag | accepted values | default | meaning |",
             "|---|---|---|---|---|"]
    for option in OPTIONS:
        flag = "(set by `run`)" if option.field == "enabled" else f"`{option.flag}`"
        lines.append(f"| `{option.env}` | {flag} | {option.accepted} | "
                     f"`{_describe(option.default)}` | {option.help} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the standard OTEL_* variables
SIGNALS = ("traces", "metrics")
# signal -> its own exporter, protocol, endpoint and insecure variables
_SIGNAL_VARIABLES = {
    "traces": (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
               OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_INSECURE),
    "metrics": (OTEL_METRICS_EXPORTER, OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
                OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, OTEL_EXPORTER_OTLP_METRICS_INSECURE),
}
# Per signal, then generic: (timeout, compression, headers, certificate). The exporters read them
# themselves; we check them first, so a bad value costs one message naming it, not all export.
_EXPORTER_VARIABLES = {
    "traces": ((OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, OTEL_EXPORTER_OTLP_TIMEOUT),
               (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION),
               (OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_HEADERS),
               (OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, OTEL_EXPORTER_OTLP_CERTIFICATE)),
    "metrics": ((OTEL_EXPORTER_OTLP_METRICS_TIMEOUT, OTEL_EXPORTER_OTLP_TIMEOUT),
                (OTEL_EXPORTER_OTLP_METRICS_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION),
                (OTEL_EXPORTER_OTLP_METRICS_HEADERS, OTEL_EXPORTER_OTLP_HEADERS),
                (OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE, OTEL_EXPORTER_OTLP_CERTIFICATE)),
}
COMPRESSIONS = ("gzip", "deflate", "none")
DEFAULT_OTLP_TIMEOUT_S = 10.0  # the OTLP exporters' own default
MAX_OTLP_TIMEOUT_S = 600.0
MAX_SPAN_QUEUE = 10_000_000

# The SDK's own numeric variables. A value it cannot read turns spans or metrics off (SpanLimits raises), prints a
# traceback from its export thread, or (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT) makes `import opentelemetry.sdk.trace`
# raise; an interval past threading.TIMEOUT_MAX kills the metric reader's thread. We read them and hand the SDK
# numbers. Millisecond variables -> the SDK's default; each is from 1 to MAX_SDK_NUMBER.
SDK_MILLIS: dict[str, int] = {
    OTEL_BSP_SCHEDULE_DELAY: 5000,
    OTEL_BSP_EXPORT_TIMEOUT: 30000,
    OTEL_METRIC_EXPORT_INTERVAL: 60000,
    OTEL_METRIC_EXPORT_TIMEOUT: 30000,
}
SPAN_LIMITS_UNSET = -1  # opentelemetry.sdk.trace.SpanLimits.UNSET: no limit (the value "unset")
# SpanLimits argument -> (variable, the SDK's default): counts >= 0, or "unset".
SDK_SPAN_LIMITS: dict[str, tuple[str, int]] = {
    "max_attributes": (OTEL_ATTRIBUTE_COUNT_LIMIT, 128),
    "max_events": (OTEL_SPAN_EVENT_COUNT_LIMIT, 128),
    "max_links": (OTEL_SPAN_LINK_COUNT_LIMIT, 128),
    "max_span_attributes": (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT, 128),
    "max_event_attributes": (OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT, 128),
    "max_link_attributes": (OTEL_LINK_ATTRIBUTE_COUNT_LIMIT, 128),
    "max_attribute_length": (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, SPAN_LIMITS_UNSET),
    "max_span_attribute_length": (OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, SPAN_LIMITS_UNSET),
}
MAX_SDK_NUMBER = 10**9  # ms (11.6 days) or a count
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROMETHEUS_PORT = 9464  # OTel's


def _flag_or_none(environ: Mapping[str, str], variable: str) -> bool | None:
    text = environ.get(variable)
    return None if text is None else otel_flag(text, variable)


@dataclasses.dataclass(frozen=True)
class SignalEnv:
    """One signal's own ``OTEL_*`` variables as given (None: unset); ``insecure`` as the SDK reads it."""

    exporter: str | None = None
    protocol: str | None = None
    endpoint: str | None = None
    insecure: bool | None = None


@dataclasses.dataclass(frozen=True)
class ExportEnv:
    """The standard ``OTEL_*`` variables our own SDK set-up reads, and the rules that combine them.

    Values are kept as given; the methods apply OTel's rules (per-signal variables
    beat the generic ones) and our embedded default, warning once per bad value when
    asked, that is when an exporter is built.
    """

    traces: SignalEnv = SignalEnv()
    metrics: SignalEnv = SignalEnv()
    protocol: str | None = None  # OTEL_EXPORTER_OTLP_PROTOCOL
    endpoint: str | None = None  # OTEL_EXPORTER_OTLP_ENDPOINT
    insecure: bool | None = None  # OTEL_EXPORTER_OTLP_INSECURE
    sdk_disabled: bool = False  # OTEL_SDK_DISABLED: no-op providers
    sdk_internal_metrics: bool = False  # OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED: the SDK's own span metrics
    batch_size_set: bool = False  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE given: the SDK's reading wins over ours
    service_name_set: bool = False  # OTEL_SERVICE_NAME, or service.name in OTEL_RESOURCE_ATTRIBUTES
    prometheus_host: str = "localhost"  # OTEL_EXPORTER_PROMETHEUS_HOST
    prometheus_port_text: str | None = None  # OTEL_EXPORTER_PROMETHEUS_PORT, parsed by prometheus_port()
    span_queue_text: str | None = None  # OTEL_BSP_MAX_QUEUE_SIZE
    span_batch_text: str | None = None  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    # Timeout, compression, headers and certificate variables that are set, by name.
    exporter_values: tuple[tuple[str, str], ...] = ()
    # The SDK's numeric variables (SDK_MILLIS, SDK_SPAN_LIMITS) that are set, by name.
    sdk_numbers: tuple[tuple[str, str], ...] = ()
    # This process runs under `commdebug-otel run` (launched_by_run): its own metric interval default.
    under_run: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ExportEnv:
        """Read the variables from ``environ`` (default ``os.environ``). Never raises."""
        environ = _environ(environ)
        signals = {}
        for signal, (exporter, protocol, endpoint, insecure) in _SIGNAL_VARIABLES.items():
            signals[signal] = SignalEnv(environ.get(exporter), environ.get(protocol), environ.get(endpoint),
                                        _flag_or_none(environ, insecure))
        return cls(
            **signals,
            protocol=environ.get(OTEL_EXPORTER_OTLP_PROTOCOL),
            endpoint=environ.get(OTEL_EXPORTER_OTLP_ENDPOINT),
            insecure=_flag_or_none(environ, OTEL_EXPORTER_OTLP_INSECURE),
            sdk_disabled=otel_flag(environ.get(OTEL_SDK_DISABLED), OTEL_SDK_DISABLED),
            sdk_internal_metrics=otel_flag(environ.get(OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED),
                                           OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED),
            batch_size_set=bool(environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE)),
            service_name_set=bool(environ.get(OTEL_SERVICE_NAME))
            or semconv.SERVICE_NAME in environ.get(OTEL_RESOURCE_ATTRIBUTES, ""),
            prometheus_host=environ.get(OTEL_EXPORTER_PROMETHEUS_HOST, "localhost"),
            prometheus_port_text=environ.get(OTEL_EXPORTER_PROMETHEUS_PORT),
            span_queue_text=environ.get(OTEL_BSP_MAX_QUEUE_SIZE),
            span_batch_text=environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE),
            exporter_values=tuple((name, environ[name]) for name in sorted(
                {name for names in _EXPORTER_VARIABLES.values() for pair in names for name in pair})
                if environ.get(name) is not None),
            sdk_numbers=tuple((name, environ[name]) for name in _SDK_NUMBER_VARIABLES if environ.get(name) is not None),
            under_run=launched_by_run(),
        )

    def signal(self, signal: str) -> SignalEnv:
        """``signal``'s own variables ("traces" or "metrics")."""
        return self.traces if signal == "traces" else self.metrics

    def exporter_names(self, signal: str) -> list[str]:
        """The exporters for ``signal``: ``OTEL_{SIGNAL}_EXPORTER``, lowercased.

        Unset or blank: ``otlp`` if an OTLP endpoint (generic or the signal's) is set,
        else the embedded default ``file``.
        """
        raw = self.signal(signal).exporter
        if raw is None or not raw.strip():
            return ["otlp"] if self.endpoint or self.signal(signal).endpoint else ["file"]
        return [name.strip().lower() for name in raw.split(",") if name.strip()]

    def otlp_protocol(self, signal: str) -> str:
        """``grpc`` (the default) or ``http/protobuf``; anything else (``http/json``) warns once and
        means ``http/protobuf``."""
        value = (self.signal(signal).protocol or self.protocol or "grpc").strip().lower()
        if value not in PROTOCOLS:
            _warn_endpoint_once(OTEL_EXPORTER_OTLP_PROTOCOL, value,
                                "is not supported (grpc or http/protobuf); using http/protobuf")
            return "http/protobuf"
        return value

    def otlp_endpoint(self, signal: str) -> str:
        """The endpoint the OTLP exporter for ``signal`` ("traces" or "metrics") is given.

        Per-signal variables are used verbatim (as the OTel spec says). For HTTP,
        ``/v1/{signal}`` is appended to the generic endpoint exactly once, even when
        it already ends in a signal path. A gRPC endpoint without a scheme means TLS
        in OTel unless an insecure variable is true: we say so once.
        """
        own = self.signal(signal)
        http = self.otlp_protocol(signal).startswith("http")
        specific = own.endpoint
        variable = _SIGNAL_VARIABLES[signal][2] if specific else OTEL_EXPORTER_OTLP_ENDPOINT
        endpoint = (specific or self.endpoint
                    or ("http://localhost:4318" if http else "http://localhost:4317")).strip()
        if "://" not in endpoint:
            if http:
                _warn_endpoint_once(variable, endpoint, "has no scheme; using http://" + endpoint)
                endpoint = "http://" + endpoint
            elif not (own.insecure if own.insecure is not None else self.insecure):
                # The SDK's rule: the signal's insecure variable, when set, beats the generic one.
                _warn_endpoint_once(variable, endpoint,
                                    "has no scheme, so the OTLP gRPC exporter uses TLS; for a plaintext "
                                    f"collector write http://{endpoint} (or set "
                                    f"{OTEL_EXPORTER_OTLP_INSECURE}=true)")
        if http and not specific:
            base = endpoint.rstrip("/")
            for suffix in ("/v1/traces", "/v1/metrics", "/v1/logs"):
                base = base.removesuffix(suffix)
            endpoint = f"{base}/v1/{signal}"
        return endpoint

    def batch_sizes(self, default_queue: int, default_batch: int) -> tuple[int, int]:
        """``(max_queue_size, max_export_batch_size)`` for our batch span processors.

        ``OTEL_BSP_MAX_QUEUE_SIZE`` and ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` when valid, else
        the defaults; a batch is never larger than the queue (the SDK would refuse to start).
        """
        queue = _int_or(OTEL_BSP_MAX_QUEUE_SIZE, self.span_queue_text, default_queue, MAX_SPAN_QUEUE)
        batch = _int_or(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, self.span_batch_text, default_batch, MAX_SPAN_QUEUE)
        if batch > queue:
            if self.span_batch_text is not None:
                _warn_endpoint_once(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, str(batch),
                                    f"is larger than {OTEL_BSP_MAX_QUEUE_SIZE}={queue}; using {queue}")
            batch = queue
        return queue, batch

    def sdk_millis(self, variable: str) -> int:
        """A millisecond variable of ``SDK_MILLIS`` for the SDK: its value, or (said once) the SDK's default
        (``OTEL_METRIC_EXPORT_INTERVAL`` under ``commdebug-otel run``: ``RUN_METRIC_EXPORT_INTERVAL_MS``)."""
        default = SDK_MILLIS[variable]
        if variable == OTEL_METRIC_EXPORT_INTERVAL and self.under_run:
            default = RUN_METRIC_EXPORT_INTERVAL_MS
        return _int_or(variable, dict(self.sdk_numbers).get(variable), default, MAX_SDK_NUMBER,
                       "a number of milliseconds")

    def span_limit_arguments(self) -> dict[str, int]:
        """``SpanLimits`` arguments replacing the limit variables the SDK would refuse (said once each).

        The SDK reads the valid ones itself; an argument given here stops it reading its variable.
        """
        given = dict(self.sdk_numbers)
        arguments = {}
        for argument, (variable, default) in SDK_SPAN_LIMITS.items():
            text = given.get(variable)
            if text is not None and _sdk_number(text, 0, unset_allowed=True) is None:
                shown = "unset" if default == SPAN_LIMITS_UNSET else str(default)
                _warn_endpoint_once(variable, text, f"is not an integer from 0 to {MAX_SDK_NUMBER} or 'unset'; "
                                                    f"using {shown}")
                arguments[argument] = default
        return arguments

    def exporter_arguments(self, signal: str) -> dict[str, Any]:
        """Keyword arguments for ``signal``'s OTLP exporter that replace unusable variables.

        A timeout that is not a number of seconds, or a compression other than gzip, deflate or
        none, would make the exporter's constructor raise (no export at all): each gets one
        message naming the variable, and the default. A headers variable with an entry that is
        not ``name=value`` is named without its value (it may hold a secret), and a certificate
        file that does not exist is named at once rather than at the first export.
        """
        given = dict(self.exporter_values)
        timeout_vars, compression_vars, header_vars, certificate_vars = _EXPORTER_VARIABLES[signal]
        arguments: dict[str, Any] = {}
        variable = next((name for name in timeout_vars if name in given), None)
        if variable is not None:
            text = given[variable]
            try:
                timeout = float(text)
                if not 0 < timeout <= MAX_OTLP_TIMEOUT_S:
                    raise ValueError(text)
            except ValueError:
                _warn_endpoint_once(variable, text, f"is not a number of seconds from 0 to {MAX_OTLP_TIMEOUT_S:g}; "
                                                    f"using {DEFAULT_OTLP_TIMEOUT_S:g}")
                arguments["timeout"] = DEFAULT_OTLP_TIMEOUT_S
        variable = next((name for name in compression_vars if name in given), None)
        if variable is not None and given[variable].strip().lower() not in COMPRESSIONS:
            _warn_endpoint_once(variable, given[variable], f"is not one of {', '.join(COMPRESSIONS)}; using none")
            arguments["compression"] = "none"
        for variable in header_vars:
            entries = [entry for entry in given.get(variable, "").split(",") if entry.strip()]
            if any("=" not in entry or not entry.split("=", 1)[0].strip() for entry in entries):
                _warn_endpoint_once(variable, "(not shown)", "has an entry that is not name=value; the "
                                                             "exporter leaves it out (the value is not printed)")
        variable = next((name for name in certificate_vars if name in given), None)
        if variable is not None and not os.path.isfile(given[variable]):
            _warn_endpoint_once(variable, given[variable], "is not a file; a TLS connection to the collector "
                                                           "will fail")
        return arguments

    def prometheus_port(self, local_rank: int) -> int:
        """``OTEL_EXPORTER_PROMETHEUS_PORT`` (default 9464, as OTel) plus ``local_rank``: one port per worker."""
        base = DEFAULT_PROMETHEUS_PORT
        if self.prometheus_port_text is not None:
            try:
                base = int(self.prometheus_port_text)
                if not 1 <= base + local_rank <= 65535:
                    raise ValueError(base)
            except ValueError:
                _logger.warning("commdebug-otel: ignoring %s=%r: expected a port number from 1 to 65535 (less "
                                "the local rank); using %d", OTEL_EXPORTER_PROMETHEUS_PORT,
                                self.prometheus_port_text, DEFAULT_PROMETHEUS_PORT)
                base = DEFAULT_PROMETHEUS_PORT
        return base + local_rank


def _int_or(variable: str, text: str | None, default: int, maximum: int, what: str = "an integer") -> int:
    """``text`` as an integer from 1 to ``maximum``; unset or blank: ``default``; else ``default``, said once."""
    if text is None or not text.strip():
        return default
    value = _sdk_number(text, 1, maximum)
    if value is None:
        _warn_endpoint_once(variable, text, f"is not {what} from 1 to {maximum}; using {default}")
        return default
    return value


_SDK_NUMBER_VARIABLES = (*SDK_MILLIS, *(variable for variable, _ in SDK_SPAN_LIMITS.values()))


def _sdk_number(text: str | None, minimum: int, maximum: int = MAX_SDK_NUMBER,
                unset_allowed: bool = False) -> int | None:
    """``text`` as the SDK reads it (an integer), within [minimum, maximum]; None when unusable."""
    if text is None:
        return None
    text = text.strip().lower()
    if unset_allowed and text == "unset":
        return SPAN_LIMITS_UNSET
    try:
        value = int(text)
    except ValueError:
        return None
    return value if minimum <= value <= maximum else None


def _import_sdk_trace_despite_its_variable() -> None:
    """``import opentelemetry.sdk.trace`` reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT and raises on a bad value, which
    would make importing us raise in the training script: import it with the variable hidden for that moment.
    (Tracing then uses the SDK's default, said once by ``span_limit_arguments``; the variable stays as it was.)"""
    text = os.environ.get(OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT)
    if text is None or "opentelemetry.sdk.trace" in sys.modules or _sdk_number(text, 0, unset_allowed=True) is not None:
        return
    del os.environ[OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT]
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except Exception:
        pass  # whatever else is wrong is said where the tracer provider is made
    finally:
        os.environ[OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT] = text


def otlp_endpoint(signal: str, environ: Mapping[str, str] | None = None) -> str:
    """``ExportEnv.from_env(environ).otlp_endpoint(signal)``: where OTLP for ``signal`` goes."""
    return ExportEnv.from_env(environ).otlp_endpoint(signal)


_endpoint_warnings: set[tuple[str, str]] = set()


def _warn_endpoint_once(variable: str, endpoint: str, message: str) -> None:
    if (variable, endpoint) not in _endpoint_warnings:
        _endpoint_warnings.add((variable, endpoint))
        job_log(_logger)("commdebug-otel: %s=%s %s", variable, hide_credentials(endpoint), hide_credentials(message))


# ------------------------------------------------------------------ torchrun's variables
@dataclasses.dataclass(frozen=True)
class RankEnv:
    """Where torchrun (or the user) says this process sits; torch.distributed, once initialized, wins
    (``job_identity.rank_info``).

    ``local_rank`` is None when ``LOCAL_RANK`` is unset (``torch.multiprocessing.spawn``: one host,
    so callers use the rank).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    node_rank: int = 0
    run_id: str = "none"  # what torchrun sets without --rdzv-id

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Read torchrun's variables; a value that is not an integer >= 0 warns once and is unset."""
        environ = _environ(environ)
        node_rank = _rank_int(environ, GROUP_RANK_ENV)
        return cls(
            rank=_rank_int(environ, RANK_ENV, 0),
            world_size=_rank_int(environ, WORLD_SIZE_ENV, 1),
            local_rank=_rank_int(environ, LOCAL_RANK_ENV),
            node_rank=node_rank if node_rank is not None else _rank_int(environ, NODE_RANK_ENV, 0),
            run_id=environ.get(RUN_ID_ENV, "none"),
        )


_rank_warnings: set[tuple[str, str]] = set()


@overload
def _rank_int(environ: Mapping[str, str], name: str, default: int) -> int: ...


@overload
def _rank_int(environ: Mapping[str, str], name: str, default: None = None) -> int | None: ...


def _rank_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
        if value >= 0:
            return value
    except ValueError:
        pass
    if (name, raw) not in _rank_warnings:  # rank facts are read often: say it once
        _rank_warnings.add((name, raw))
        _logger.warning("commdebug-otel: ignoring %s=%r: expected an integer >= 0; using %s",
                        name, raw, "the default" if default is None else default)
    return default


# ------------------------------------------------------------------ torch's Flight Recorder variables
#: torch's variables that size the Flight Recorder's buffer (0: off; the first set wins, as in c10d).
FR_BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: torch's variables for the prefix of its own dump files (``<prefix><rank>``, pickled).
FR_DUMP_PREFIX_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@dataclasses.dataclass(frozen=True)
class FlightRecorderEnv:
    """torch's Flight Recorder variables, as ``stall/flight_recorder.py`` uses them (the first set of each
    pair wins, as in c10d).

    ``buffer_size``: entries per process; None when no size variable is set; 0 (off) for a value that is
    not an integer >= 0, said once (torch's own reading of such a value differs: ``abc`` stops gloo's
    process group from starting in torch 2.13, ``-5`` records). ``dump_prefix``: torch's dump prefix, or None.
    """

    buffer_size: int | None = None
    dump_prefix: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FlightRecorderEnv:
        """Read the variables from ``environ`` (default ``os.environ``). Never raises."""
        environ = _environ(environ)
        size = None
        name = next((name for name in FR_BUFFER_VARIABLES if environ.get(name)), None)
        if name is not None:
            size = _sdk_number(environ[name], 0, sys.maxsize)
            if size is None:
                _warn_endpoint_once(name, environ[name], "is not an integer >= 0 (Flight Recorder entries per "
                                                         "process; 0: off): stall snapshots get no Flight "
                                                         "Recorder dump")
                size = 0
        prefix = next((environ[name] for name in FR_DUMP_PREFIX_VARIABLES if environ.get(name)), None)
        return cls(size, prefix)

    @property
    def enabled(self) -> bool:
        """Whether the job asked for the Flight Recorder: a size above 0, or a dump prefix with the size
        left at torch's default."""
        return self.buffer_size > 0 if self.buffer_size is not None else self.dump_prefix is not None


_import_sdk_trace_despite_its_variable()
