"""The only module that touches the OpenTelemetry SDK: resource, providers, exporters, shutdown.

Exporter choice follows the standard variables:

* ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``otlp``, ``console``,
  ``none`` or ``file`` (comma lists allowed). When unset, ``otlp`` is used if an
  OTLP endpoint variable is set, else the embedded default ``file``: OTLP-JSON
  lines (the format of ``opentelemetry-exporter-otlp-json-file``, readable by
  the Collector's ``otlpjsonfile`` receiver), one file per rank per signal in
  ``OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR``.
* ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL``: ``grpc`` (the default of
  OTel Python's ``otlp`` exporter) or ``http/protobuf``. Endpoint, headers,
  certificate, compression and timeout are read by the SDK's exporters.
* ``OTEL_SDK_DISABLED=true``: no-op providers.

These variables are read in ``config.py`` (:class:`~commdebug_otel.config.ExportEnv`,
which also holds the endpoint rules); a :class:`Telemetry` reads them from its
``environ`` when its providers start.

Providers start lazily, at the first span or metric, so a
``torch.multiprocessing.spawn`` child has its rank (from the initialized
process group) in its resource.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from . import semconv
from .config import ExportEnv, Settings
from .config import otel_flag as _truthy  # _DirectSpans.for_provider's read, until it takes ExportEnv
from .export_guard import (
    CountingBatchSpanProcessor,
    claim_warning,
    CountingMetricExporter,
    SizedSpanExporter,
    fold_exporter_logs,
)
from .steps import RankInfo
from .version import __version__

_logger = logging.getLogger(__name__)

SCOPE_NAME = "commdebug_otel"
# Span batches stay well under gRPC receivers' 4 MiB default (about 43 KB per
# span with 128 collective events): OTEL_BSP_MAX_EXPORT_BATCH_SIZE overrides.
DEFAULT_EXPORT_BATCH_SPANS = 64
# Longest string attribute value we export (exception messages and stack traces included).
MAX_ATTRIBUTE_CHARS = 4096


# (signal, kind) -> (module, class): imported only when chosen.
_EXPORTER_CLASSES = {
    ("traces", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("traces", "http"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
    ("traces", "file"): ("opentelemetry.exporter.otlp.json.file", "FileSpanExporter"),
    ("traces", "console"): ("opentelemetry.sdk.trace.export", "ConsoleSpanExporter"),
    ("metrics", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "http"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "file"): ("opentelemetry.exporter.otlp.json.file", "FileMetricExporter"),
    ("metrics", "console"): ("opentelemetry.sdk.metrics.export", "ConsoleMetricExporter"),
}


def _exporter_class(signal: str, kind: str) -> Any:
    import importlib

    module, name = _EXPORTER_CLASSES[(signal, kind)]
    return getattr(importlib.import_module(module), name)


class StepIdGenerator(IdGenerator):
    """Random ids, except that a ``train_step`` root span can be given its trace id."""

    def __init__(self, inner: IdGenerator | None = None) -> None:
        self._inner = inner or RandomIdGenerator()
        self._pending = threading.local()

    @contextlib.contextmanager
    def ids(self, trace_id: int | None, span_id: int = 0) -> Iterator[None]:
        """Ids for the span started inside: ``trace_id`` (root spans only) and ``span_id`` (0: random)."""
        self._pending.trace_id, self._pending.span_id = trace_id, span_id
        try:
            yield
        finally:
            self._pending.trace_id = self._pending.span_id = None

    def generate_span_id(self) -> int:
        pending = getattr(self._pending, "span_id", None)
        return pending if pending else self._inner.generate_span_id()

    def generate_trace_id(self) -> int:
        pending = getattr(self._pending, "trace_id", None)
        return pending if pending else self._inner.generate_trace_id()


def build_resource(rank: RankInfo, export: ExportEnv | None = None) -> Resource:
    """Rank facts plus host and pid; OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME still apply.

    ``export``: the standard variables (default: read now); without a service name there,
    ``service.name`` is ``torch-training``.
    """
    attributes: dict[str, Any] = {
        semconv.RANK: rank.rank,
        semconv.WORLD_SIZE: rank.world_size,
        semconv.LOCAL_RANK: rank.local_rank,
        semconv.NODE_RANK: rank.node_rank,
        semconv.RUN_ID: rank.run_id,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
    }
    if rank.backend:
        attributes[semconv.BACKEND] = rank.backend
    if not (export if export is not None else ExportEnv.from_env()).service_name_set:
        attributes["service.name"] = "torch-training"
    return Resource.create(attributes)


class Telemetry:
    """Tracer and meter for commdebug-otel, from injected providers or our own SDK set-up.

    Args:
        settings: frozen settings (output dir, event cap, shutdown timeout).
        rank: a callable returning :class:`RankInfo`, called when providers start.
        tracer_provider / meter_provider: injected providers; when given we
            never configure, flush or shut them down (their owner does).
        environ: where the standard ``OTEL_*`` variables are read (default
            ``os.environ``): ``OTEL_SDK_DISABLED`` now, the rest when our own
            providers start (``export_env``).
    """

    def __init__(self, settings: Settings, rank: Any, tracer_provider: Any = None,
                 meter_provider: Any = None, environ: Mapping[str, str] | None = None) -> None:
        self._settings = settings
        self._environ = environ
        self._rank = rank
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._own_tracer_provider: TracerProvider | None = None
        self._own_meter_provider: MeterProvider | None = None
        self._tracer = None
        self._meter = None
        self._ids: StepIdGenerator | None = None
        self._own_span_processors: list[Any] = []
        self._direct: _DirectSpans | None = None
        self._lock = threading.Lock()
        self._atexit = False
        self._said_where = False
        self.disabled = ExportEnv.from_env(environ).sdk_disabled
        # The variables as our own providers last read them when they started (None before).
        self.export_env: ExportEnv | None = None
        # Set by CommTracer to its metrics' drop counter: count_dropped(kind, n).
        self.count_dropped: Any = lambda kind, count: None
        # Called at exit before the providers shut down: tracers end their open spans there.
        self.before_shutdown: list[Any] = []
        self.endpoints: list[str] = []  # OTLP endpoints in use, for warnings
        self.file_directory: str | None = None  # where the embedded default writes, once known

    # ------------------------------------------------------------- providers
    def tracer(self) -> otel_trace.Tracer:
        if self._tracer is None:
            with self._lock:
                if self._tracer is None:
                    provider = self._tracer_provider
                    if provider is None:
                        try:
                            provider = self._make_tracer_provider()
                        except Exception as error:  # e.g. OUTPUT_DIR cannot be created
                            _logger.warning("commdebug-otel: spans are off: %s: %s",
                                            type(error).__name__, error)
                            provider = otel_trace.NoOpTracerProvider()
                    self._ids = self._attach_id_generator(provider)
                    self._tracer = otel_trace.get_tracer(SCOPE_NAME, __version__, provider)
                    if provider is self._own_tracer_provider:
                        self._direct = _DirectSpans.for_provider(provider, self._tracer,
                                                                 self._own_span_processors)
        return self._tracer

    def meter(self) -> otel_metrics.Meter:
        if self._meter is None:
            with self._lock:
                if self._meter is None:
                    provider = self._meter_provider
                    if provider is None:
                        try:
                            provider = self._make_meter_provider()
                        except Exception as error:
                            _logger.warning("commdebug-otel: metrics are off: %s: %s",
                                            type(error).__name__, error)
                            provider = otel_metrics.NoOpMeterProvider()
                    self._meter = otel_metrics.get_meter(SCOPE_NAME, __version__, provider)
        return self._meter

    @staticmethod
    def _attach_id_generator(provider: Any) -> StepIdGenerator | None:
        inner = getattr(provider, "id_generator", None)
        if inner is None:
            return None  # not an SDK provider (a proxy or no-op): trace ids stay random
        if not isinstance(inner, StepIdGenerator):
            provider.id_generator = StepIdGenerator(inner)
        return provider.id_generator

    def _read_export_env(self) -> ExportEnv:
        # Read as each provider starts, not at construction: a process may set OTEL_SERVICE_NAME
        # or an endpoint between creating a tracer and its first span (the benchmark does).
        self.export_env = ExportEnv.from_env(self._environ)
        return self.export_env

    def _make_tracer_provider(self) -> Any:
        if self.disabled:
            return otel_trace.NoOpTracerProvider()
        export = self._read_export_env()
        rank = self._rank()
        limits = SpanLimits(max_events=self._settings.max_events_per_span,
                            max_attribute_length=MAX_ATTRIBUTE_CHARS)
        # shutdown_on_exit=False: our own atexit shutdown is bounded; the SDK's waits ~10 s per provider.
        provider = TracerProvider(resource=build_resource(rank, export), span_limits=limits,
                                  id_generator=StepIdGenerator(), shutdown_on_exit=False)
        batch = None if export.batch_size_set else DEFAULT_EXPORT_BATCH_SPANS
        processors = [CountingBatchSpanProcessor(exporter, self._count, max_export_batch_size=batch)
                      for exporter in self._exporters("traces", rank, export)]
        for processor in processors:
            provider.add_span_processor(processor)
        self._own_tracer_provider = provider
        self._own_span_processors = processors
        self._register_atexit()
        return provider

    def _make_meter_provider(self) -> Any:
        if self.disabled:
            return otel_metrics.NoOpMeterProvider()
        export = self._read_export_env()
        rank = self._rank()
        readers: list[MetricReader] = [
            PeriodicExportingMetricReader(exporter) for exporter in self._exporters("metrics", rank, export)
        ]
        if "prometheus" in export.exporter_names("metrics"):
            reader = _prometheus_reader(rank, export)
            if reader is not None:
                readers.append(reader)
        provider = MeterProvider(resource=build_resource(rank, export), metric_readers=readers,
                                 shutdown_on_exit=False)
        self._own_meter_provider = provider
        self._register_atexit()
        return provider

    def _register_atexit(self) -> None:
        if not self._atexit:
            self._atexit = True
            atexit.register(self._exit)

    def _exit(self) -> None:
        for finish in list(self.before_shutdown):
            try:
                finish()
            except Exception as error:
                _logger.debug("commdebug-otel: closing spans at exit failed: %s", error)
        self.shutdown()

    # ------------------------------------------------------------- exporters
    def _file_path(self, signal: str, rank: RankInfo) -> str:
        """``OUTPUT_DIR/run-<job id>/<signal>-rank<N>.jsonl``: one folder per run, shared by its ranks."""
        if self.file_directory is None:
            from .steps import job_nonce

            self.file_directory = os.path.join(os.path.abspath(self._settings.output_dir),
                                               f"run-{job_nonce()}")
        directory = self.file_directory
        os.makedirs(directory, exist_ok=True)
        if not self._said_where:
            self._said_where = True
            log = _logger.warning if rank.rank == 0 else _logger.info
            log("commdebug-otel: no OTLP endpoint configured; writing OTLP-JSON lines to %s "
                "(set OTEL_EXPORTER_OTLP_ENDPOINT to send to a collector)", directory)
        return os.path.join(directory, f"{signal}-rank{rank.rank}.jsonl")

    def _exporters(self, signal: str, rank: RankInfo, export: ExportEnv) -> list[Any]:
        """The exporters ``OTEL_{signal}_EXPORTER`` names (after the embedded default)."""
        exporters: list[Any] = []
        for name in export.exporter_names(signal):
            if name == "otlp":
                fold_exporter_logs()
                endpoint = export.otlp_endpoint(signal)
                self.endpoints.append(endpoint)
                transport = "http" if export.otlp_protocol(signal).startswith("http") else "grpc"
                guard = SizedSpanExporter if signal == "traces" else CountingMetricExporter
                exporters.append(guard(_exporter_class(signal, transport)(endpoint=endpoint),
                                       endpoint, self._count))
            elif name == "file":
                exporters.append(_exporter_class(signal, "file")(self._file_path(signal, rank)))
            elif name == "console":
                exporters.append(_exporter_class(signal, "console")())
            elif name != "none" and not (signal == "metrics" and name == "prometheus"):
                extra = ", prometheus" if signal == "metrics" else ""
                _logger.warning("commdebug-otel: ignoring OTEL_%s_EXPORTER value %r: "
                                "expected otlp%s, file, console or none", signal.upper(), name, extra)
        return exporters

    # ---------------------------------------------------------------- spans
    def preassigned_ids(self) -> bool:
        """True when span ids chosen by the recorder are honoured (our id generator is in the provider)."""
        self.tracer()
        return self._ids is not None

    def emit(self, roots: list, children: dict[int, list], trace_id: int | None) -> None:
        """Turn finished records (``recorder.Record``) into spans with their own timestamps."""
        tracer = self.tracer()
        for root in roots:
            self._start(tracer, root, None, None, trace_id, children)

    def _start(self, tracer: Any, record: Any, parent: SpanContext | None, parent_span: Any,
               trace_id: int | None, children: dict[int, list]) -> None:
        """``parent``: the parent's context; ``parent_span``: the parent itself when the SDK built it."""
        attributes = _span_attributes(record)
        direct = self._direct
        prepared = direct.prepare(record, attributes) if direct is not None else None
        if prepared is not None:
            context = direct.context(record, parent, trace_id)
            for child in children.get(id(record), ()):
                self._start(tracer, child, context, None, None, children)
            direct.end(record, prepared, context, parent)
            return
        ids = self._ids
        chosen = ids.ids(trace_id, record.span_id) if ids is not None and (trace_id or record.span_id) \
            else contextlib.nullcontext()
        if parent_span is not None:  # processors and samplers see the live parent, as before
            parent_context = otel_trace.set_span_in_context(parent_span)
        elif parent is not None:
            parent_context = otel_trace.set_span_in_context(NonRecordingSpan(parent))
        else:
            parent_context = otel_context.Context()
        with chosen:
            span = tracer.start_span(record.name, context=parent_context, attributes=attributes,
                                     start_time=record.start_ns)
        for name, event_attributes, timestamp in record.events:
            span.add_event(name, event_attributes, timestamp)
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, type(record.error).__name__))
            span.record_exception(record.error, timestamp=record.end_ns)
        context = span.get_span_context()
        for child in children.get(id(record), ()):
            self._start(tracer, child, context, span, None, children)
        span.end(end_time=record.end_ns)

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's providers (their rank and pid are the parent's)."""
        self._tracer = self._meter = self._ids = self._direct = None
        self._own_tracer_provider = self._own_meter_provider = None
        self._own_span_processors = []
        self._lock = threading.Lock()

    def _count(self, kind: str, count: int) -> None:
        try:
            self.count_dropped(kind, count)
        except Exception:  # counting must never break export
            pass

    # -------------------------------------------------------------- shutdown
    def force_flush(self) -> None:
        """Export what our own providers buffer, within ``shutdown_timeout_s`` in all."""
        providers = [p for p in (self._own_tracer_provider, self._own_meter_provider) if p is not None]
        timeout_ms = int(self._settings.shutdown_timeout_s * 1000)
        _bounded("flush", [lambda p=p: p.force_flush(timeout_ms) for p in providers],
                 self._settings.shutdown_timeout_s, self.endpoints)

    def shutdown(self) -> None:
        """Flush and shut our providers down within ``shutdown_timeout_s``, traces and metrics together.

        Runs in a daemon thread joined with the timeout, so an unreachable or
        black-holed collector costs at most that long and never blocks exit.
        Injected providers are left to their owner.
        """
        providers = [p for p in (self._own_tracer_provider, self._own_meter_provider) if p is not None]
        self._own_tracer_provider = self._own_meter_provider = None
        timeout_s = self._settings.shutdown_timeout_s
        calls = []
        for provider in providers:
            if isinstance(provider, MeterProvider):
                calls.append(lambda p=provider: p.shutdown(timeout_millis=timeout_s * 1000))
            else:
                calls.append(provider.shutdown)
        _bounded("shutdown", calls, timeout_s, self.endpoints)


def _bounded(what: str, calls: list, timeout_s: float, endpoints: list[str] = ()) -> None:
    """Run ``calls`` in order in one daemon thread; wait at most ``timeout_s`` seconds for all of them."""
    if not calls:
        return

    def run() -> None:
        for call in calls:
            try:
                call()
            except Exception as error:  # exporter failures are counted by the guards
                _logger.debug("commdebug-otel: telemetry %s failed: %s", what, error)

    worker = threading.Thread(target=run, name=f"commdebug-otel-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        unnamed = [endpoint for endpoint in dict.fromkeys(endpoints) if claim_warning(endpoint)]
        where = f" to {', '.join(unnamed)}" if unnamed else ""
        _logger.warning("commdebug-otel: telemetry %s did not finish within %.1f s "
                        "(OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT); unsent telemetry%s is dropped",
                        what, timeout_s, where)


def _pull_reader_class() -> type:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class PullReader(PrometheusMetricReader):
        """Prometheus pulls: a flush has nothing to send. (The exporter's collect()
        yields every family once per queued batch, so a flush before a scrape
        would list each sample twice.)"""

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

    return PullReader


def _prometheus_reader(rank: RankInfo, export: ExportEnv) -> MetricReader | None:
    """A pull endpoint on ``OTEL_EXPORTER_PROMETHEUS_HOST``, at ``OTEL_EXPORTER_PROMETHEUS_PORT`` plus the
    local rank (one port per worker; needs the ``prometheus`` extra)."""
    try:
        import opentelemetry.exporter.prometheus  # noqa: F401  (the optional extra)
        from prometheus_client import start_http_server
    except ImportError:
        _logger.warning("commdebug-otel: OTEL_METRICS_EXPORTER=prometheus needs "
                        "`pip install commdebug-otel[prometheus]`; metrics are not exported")
        return None
    host = export.prometheus_host
    port = export.prometheus_port(rank.local_rank)
    try:
        start_http_server(port, addr=host)
    except OSError as error:
        _logger.warning("commdebug-otel: cannot serve Prometheus metrics on %s:%d (%s)", host, port, error)
        return None
    return _pull_reader_class()()


class _DirectSpans:
    """Our own provider's finished spans, built as ``ReadableSpan`` and handed to its processors.

    A record becomes a span only after it has ended, so the SDK's live ``Span``
    (locks, per-attribute validation in ``BoundedAttributes``, ``on_start``)
    buys nothing; it was 80% of the cost of a traced step's span building. The
    result is the span the SDK would build: same name, ids, parent, flags,
    resource, scope, times, attributes and events (a test compares both paths
    on the wire). Used only where that can be guaranteed: our own
    ``TracerProvider`` with its ``CountingBatchSpanProcessor``s, the SDK's
    default or ``always_on`` sampler (every span sampled), its internal metrics
    off, and a record without error whose attributes are plain values
    (``str``, ``bool``, ``int``, ``float``, or a tuple/list of one of those)
    within the span limits. Anything else goes through ``Tracer.start_span``.
    Strings are cut and lists made tuples, as ``BoundedAttributes`` does.
    """

    __slots__ = ("_provider", "_ids", "_scope", "_info", "_processors", "_span_chars", "_event_chars",
                 "_span_attributes", "_event_attributes", "_events", "_root_flags")

    def __init__(self, provider: Any, tracer: Any, processors: list[Any], limits: SpanLimits) -> None:
        self._provider = provider  # its resource is read per span: the SDK replaces it after a fork
        self._ids = provider.id_generator
        self._scope = tracer._instrumentation_scope
        self._info = getattr(tracer, "instrumentation_info", None)
        self._processors = tuple(processors)
        self._span_chars = limits.max_span_attribute_length
        self._event_chars = limits.max_attribute_length
        self._span_attributes = limits.max_span_attributes
        self._event_attributes = limits.max_event_attributes
        self._events = limits.max_events
        random_ids = getattr(self._ids, "is_trace_id_random", lambda: False)()
        # The SDK's root flags: sampled, and "random trace id" when the generator says so.
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if random_ids else 0))

    @classmethod
    def for_provider(cls, provider: Any, tracer: Any, processors: list[Any]) -> _DirectSpans | None:
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON

        limits = getattr(provider, "_span_limits", None)
        if (getattr(provider, "sampler", None) not in (ALWAYS_ON, DEFAULT_ON)
                or not isinstance(limits, SpanLimits) or not processors
                or getattr(tracer, "_instrumentation_scope", None) is None
                or _truthy(os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"))):
            return None  # another sampler, SDK shape or the SDK's own span metrics: its own path
        return cls(provider, tracer, processors, limits)

    def prepare(self, record: Any, attributes: dict[str, Any]) -> tuple[dict[str, Any], tuple] | None:
        """The span's attributes and events as the SDK would keep them, or None: use the SDK's path."""
        if record.error is not None or not _fits(len(record.events), self._events):
            return None
        attributes = _plain(attributes, self._span_chars, self._span_attributes)
        if attributes is None:
            return None
        events = []
        for name, event_attributes, timestamp in record.events:
            event_attributes = _plain(event_attributes, self._event_chars, self._event_attributes)
            if event_attributes is None:
                return None
            events.append(Event(name, event_attributes, timestamp))
        return attributes, tuple(events)

    def context(self, record: Any, parent: SpanContext | None, trace_id: int | None) -> SpanContext:
        """The span's context (ids as the SDK would choose them), known before its children."""
        ids = self._ids
        if parent is None:
            trace_id, flags = trace_id or ids.generate_trace_id(), self._root_flags
        else:
            trace_id, flags = parent.trace_id, parent.trace_flags
        return SpanContext(trace_id, record.span_id or ids.generate_span_id(), is_remote=False,
                           trace_flags=flags)

    def end(self, record: Any, prepared: tuple[dict[str, Any], tuple], context: SpanContext,
            parent: SpanContext | None) -> None:
        attributes, events = prepared
        span = ReadableSpan(name=record.name, context=context, parent=parent,
                            resource=self._provider.resource, attributes=attributes, events=events,
                            start_time=record.start_ns, end_time=record.end_ns,
                            instrumentation_info=self._info, instrumentation_scope=self._scope)
        for processor in self._processors:
            processor.on_end(span)


def _fits(count: int, limit: int | None) -> bool:
    return limit is None or count <= limit


_PLAIN = (str, bool, int, float)


def _plain(attributes: dict[str, Any], chars: int | None, limit: int | None) -> dict[str, Any] | None:
    """``attributes`` (changed in place) as ``BoundedAttributes`` keeps them, or None if they are not plain.

    Strings, also inside sequences, are cut at ``chars``; lists become tuples. None when
    a value is of another type or a sequence mixes types (the SDK would convert or drop
    it, with a warning), or there are more than ``limit`` attributes.
    """
    if not _fits(len(attributes), limit):
        return None
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:
            if chars is not None and len(value) > chars:
                attributes[key] = value[:chars]
        elif kind is tuple or kind is list:
            if value:
                first = type(value[0])
                if first not in _PLAIN or any(type(item) is not first for item in value):
                    return None
                if first is str and chars is not None:
                    value = tuple(item[:chars] for item in value)
            if kind is list:
                value = tuple(value)
            attributes[key] = value
        elif kind not in _PLAIN:
            return None
    return attributes


def _span_attributes(record: Any) -> dict[str, Any]:
    attributes = dict(record.attrs)
    if record.fqn:
        attributes[semconv.MODULE_FQN] = record.fqn
        attributes[semconv.MODULE_TYPE] = record.module_type
        attributes[semconv.MODULE_PASS] = record.pass_
        attributes[semconv.MODULE_DEPTH] = record.fqn.count(".")
        attributes[semconv.MODULE_CALL_INDEX] = record.call_index
    if record.params:
        attributes[semconv.MODULE_PARAMETERS] = record.params
    if record.unmatched:
        attributes[semconv.SPAN_UNMATCHED] = True
    if record.dropped_events:
        attributes[semconv.SPAN_DROPPED_EVENTS] = record.dropped_events
    return attributes
