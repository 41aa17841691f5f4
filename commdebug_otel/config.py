"""Settings: the one place that reads ``OTEL_PYTHON_COMMDEBUG_*`` variables.

``Settings.from_env()`` builds a frozen :class:`Settings` from a mapping (by
default ``os.environ``). A bad value never raises: it logs one warning naming
the variable, the value and the accepted values, and the documented default is
used, so training goes on. Explicit arguments (``Settings(detail=...)``) beat
the environment; bad explicit arguments raise ``ValueError`` at once.

``OPTIONS`` is the single table behind the environment variables, the
``commdebug-otel run`` flags and ``docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

_logger = logging.getLogger(__name__)

ENV_PREFIX = "OTEL_PYTHON_COMMDEBUG_"


def job_log(logger: logging.Logger) -> Callable[..., None]:
    """``logger.warning`` on rank 0 (or outside torchrun), ``logger.debug`` on other ranks.

    The same configuration reaches every rank; saying it once per job is enough.
    """
    return logger.warning if os.environ.get("RANK", "0") in ("0", "") else logger.debug


class Detail(enum.IntEnum):
    """What becomes a span event, mirroring CommDebugMode's ``noise_level`` 0-3."""

    COLLECTIVES = 0  # collectives only
    DTENSOR = 1  # + DTensor ops other than trivial ones
    OPS = 2  # + all non-trivial ops
    ALL = 3  # + trivial ops

    @property
    def label(self) -> str:
        return self.name.lower()


class TraceScope(enum.Enum):
    JOB = "job"  # step N of every rank shares one trace id
    RANK = "rank"  # one trace per rank per step


def _parse_detail(text: str) -> Detail:
    try:
        return Detail[text.strip().upper()]
    except KeyError:
        raise ValueError(text) from None


def _parse_positive_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError(text)
    return value


def _parse_non_negative_int(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(text)
    return value


def _parse_positive_float(text: str) -> float:
    value = float(text.strip())
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


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


def _parse_patterns(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_dir(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


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
    Option("enabled", "ENABLED", _parse_bool, False, "true or false",
           "Start tracing in every Python process that imports torch (through the "
           "sitecustomize hook of `commdebug-otel run`), no wrapper needed."),
    Option("detail", "DETAIL", _parse_detail, Detail.COLLECTIVES,
           "collectives, dtensor, ops or all",
           "Which ops become span events, as CommDebugMode's noise levels 0-3."),
    Option("trace_every", "TRACE_EVERY", _parse_positive_int, 1, "an integer >= 1",
           "Trace one optimizer step in N (step % N == 0), and the collectives between it and the "
           "next step (`outside_step`); metrics cover every step. Untraced steps run without a "
           "dispatch mode (docs/performance.md)."),
    Option("completion_every", "COMPLETION_EVERY", _parse_positive_int, 10, "an integer >= 1",
           "Time c10d collectives to completion (torch.collective.completion_duration) on one step "
           "in N and on the steps TRACE_EVERY picks, on every rank; 1 = every step. Each timing is "
           "a Python callback on the backend's thread (docs/performance.md)."),
    Option("ranks", "RANKS", _parse_ranks, None, "all, or a comma list of ranks like 0,3",
           "Ranks that export spans; metrics come from every rank."),
    Option("trace_scope", "TRACE_SCOPE", _parse_scope, TraceScope.JOB, "job or rank",
           "job: step N of every rank shares one trace id; rank: one trace per rank per step."),
    Option("output_dir", "OUTPUT_DIR", _parse_dir, "./commdebug-otel-out", "a directory path",
           "Where the embedded default writes OTLP-JSON lines when no exporter is configured."),
    Option("max_events_per_span", "MAX_EVENTS_PER_SPAN", _parse_positive_int, 1024,
           "an integer >= 1",
           "Span events kept per span; the rest are counted on the span and in "
           "commdebug.telemetry.dropped."),
    Option("metric_module_depth", "METRIC_MODULE_DEPTH", _parse_non_negative_int, 0,
           "an integer >= 0",
           "Add torch.module.fqn to metrics, cut to this many levels (0 = no module label)."),
    Option("shutdown_timeout_s", "SHUTDOWN_TIMEOUT", _parse_positive_float, 5.0,
           "a number of seconds > 0",
           "Time the flush at exit may take, traces and metrics together."),
    Option("module_include", "MODULE_INCLUDE", _parse_patterns, (), "comma list of fnmatch patterns",
           "Only modules whose FQN matches get spans (empty = all)."),
    Option("module_exclude", "MODULE_EXCLUDE", _parse_patterns, (), "comma list of fnmatch patterns",
           "Modules whose FQN matches get no span; their collectives go to the enclosing span."),
)

_BY_FIELD = {option.field: option for option in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Frozen commdebug-otel settings. Field units: seconds for ``shutdown_timeout_s``.

    Raises:
        ValueError: at construction, when an explicit argument is out of range.
    """

    enabled: bool = False
    detail: Detail = Detail.COLLECTIVES
    trace_every: int = 1
    completion_every: int = 10
    ranks: frozenset[int] | None = None
    trace_scope: TraceScope = TraceScope.JOB
    output_dir: str = "./commdebug-otel-out"
    max_events_per_span: int = 1024
    metric_module_depth: int = 0
    shutdown_timeout_s: float = 5.0
    module_include: tuple[str, ...] = ()
    module_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.detail, str):
            object.__setattr__(self, "detail", _checked("detail", _parse_detail, self.detail))
        if isinstance(self.trace_scope, str):
            object.__setattr__(self, "trace_scope", _checked("trace_scope", _parse_scope, self.trace_scope))
        if isinstance(self.ranks, str):
            object.__setattr__(self, "ranks", _checked("ranks", _parse_ranks, self.ranks))
        for name in ("trace_every", "completion_every", "max_events_per_span"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.metric_module_depth < 0:
            raise ValueError(f"metric_module_depth must be >= 0, got {self.metric_module_depth!r}")
        if not self.shutdown_timeout_s > 0:
            raise ValueError(f"shutdown_timeout_s must be > 0, got {self.shutdown_timeout_s!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every ``OTEL_PYTHON_COMMDEBUG_*`` variable; ``overrides`` win.

        Never raises for bad environment values: each one logs a single warning
        and falls back to the default.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for option in OPTIONS:
            raw = environ.get(option.env)
            if raw is None:
                continue
            try:
                values[option.field] = option.parse(raw)
            except (ValueError, TypeError, OverflowError):
                job_log(_logger)(
                    "commdebug-otel: ignoring %s=%r: expected %s; using the default %s",
                    option.env, raw, option.accepted, _describe(option.default),
                )
        values.update(overrides)
        return cls(**values)

    def traces_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


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
