"""The SDK set-up: resource, providers, exporters (how they end: ``process_exit.py``).

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
process group) in its resource. In a job of several ranks (torchrun's
``WORLD_SIZE`` above 1) they wait for the default process group
(:meth:`Telemetry.settled`): spans finished before it (a set-up step, a stall
snapshot) are held in memory and handed to the providers once it exists, with
the settled resource (rank, backend) and in the run folder every rank agreed
on; metric points wait in ``metrics.LazyCollectiveMetrics``. At exit or on a
flushing signal, what is held is exported with what is known by then.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_EXPORT_TIMEOUT,
    OTEL_BSP_SCHEDULE_DELAY,
    OTEL_METRIC_EXPORT_INTERVAL,
    OTEL_METRIC_EXPORT_TIMEOUT,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider

from commdebug_otel import semconv
from commdebug_otel.config import ExportEnv, Settings
from commdebug_otel.core.ids import RNG as OWN_RNG
from commdebug_otel.core.job_identity import RankCache, RankInfo, settled
from commdebug_otel.core.redact import describe
from commdebug_otel.core.thread_signals import signals_blocked
from commdebug_otel.otel._sdk import (
    batch_queue,
    own_random_views,
    silence_inherited,
    warning_filters_kept,
)
from commdebug_otel.otel.export_guard import CountingBatchSpanProcessor, SizedSpanExporter, fold_exporter_logs
from commdebug_otel.otel.exporters import Exporters
from commdebug_otel.otel.metrics import dropped_counter
from commdebug_otel.otel.process_exit import ProcessExit
from commdebug_otel.otel.signals import _SignalRescue  # noqa: F401  (tests read its grace)
from commdebug_otel.otel.spans import SpanBuilder, StepIdGenerator, TracerSetup, attach_id_generator
from commdebug_otel.version import __version__

_logger = logging.getLogger(__name__)

SCOPE_NAME = "commdebug_otel"
# Span batches stay well under gRPC receivers' 4 MiB default (about 43 KB per
# span with 128 collective events): OTEL_BSP_MAX_EXPORT_BATCH_SIZE overrides.
DEFAULT_EXPORT_BATCH_SPANS = 64
# A whole step's spans reach the batch processor at once (when the step ends): the SDK's queue of
# 2,048 dropped a quarter of a 2,700-span step. OTEL_BSP_MAX_QUEUE_SIZE overrides.
DEFAULT_SPAN_QUEUE = 65_536
# Longest string attribute value we export (exception messages and stack traces included).
MAX_ATTRIBUTE_CHARS = 4096
STALL_FLUSH_TIMEOUT_S = 10.0  # per provider, for a stall snapshot's flush (the watchdog's own thread)
# Spans finished before the process group exists, held until it does; more are dropped and counted.
MAX_HELD_SPANS = DEFAULT_SPAN_QUEUE


class _HashedResource(Resource):
    """A ``Resource`` whose hash is computed once: the SDK's span encoders hash a span's
    resource per span, and ``Resource.__hash__`` dumps all its attributes to JSON.

    A Resource is immutable, so the hash cannot go stale; it equals the plain
    ``Resource``'s hash, and equality and ``merge`` (which returns a plain ``Resource``)
    are the SDK's.
    """

    def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def build_resource(rank: RankInfo, export: ExportEnv | None = None) -> Resource:
    """Rank facts plus host and pid; OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME still apply.

    ``export``: the standard variables (default: read now); without a service name there,
    ``service.name`` is ``torch-training``.
    """
    fold_exporter_logs()  # the SDK's lines about OTEL_RESOURCE_ATTRIBUTES, once per process, not per provider
    attributes: dict[str, Any] = {
        semconv.RANK: rank.rank,
        semconv.WORLD_SIZE: rank.world_size,
        semconv.LOCAL_RANK: rank.local_rank,
        semconv.NODE_RANK: rank.node_rank,
        semconv.RUN_ID: rank.run_id,
        semconv.HOST_NAME: socket.gethostname(),
        semconv.PROCESS_PID: os.getpid(),
    }
    if rank.backend:
        attributes[semconv.BACKEND] = rank.backend
    if not (export if export is not None else ExportEnv.from_env()).service_name_set:
        attributes[semconv.SERVICE_NAME] = "torch-training"
    resource = Resource.create(attributes)
    return _HashedResource(resource.attributes, resource.schema_url)


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

    def __init__(self, settings: Settings, rank: Any = None, tracer_provider: Any = None,
                 meter_provider: Any = None, environ: Mapping[str, str] | None = None) -> None:
        self._settings = settings
        self._environ = environ
        self._rank = rank if rank is not None else RankCache()
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._own_tracer_provider: TracerProvider | None = None
        self._own_meter_provider: MeterProvider | None = None
        self._tracer: otel_trace.Tracer | None = None
        self._meter: otel_metrics.Meter | None = None
        self._tracer_setup: TracerSetup | None = None
        self._own_span_processors: list[Any] = []
        self._servers: list[tuple[Any, threading.Thread]] = []  # Prometheus pull endpoints of ours, and their threads
        self._own_metric_readers: list[Any] = []
        # The exporters each signal's provider gets, where they write, and that tracing is on (said once).
        self._exporters = Exporters(settings, self.count_dropped)
        self._lock = threading.Lock()
        # The recorder's span sink: finished records become spans on this telemetry's tracer.
        self.spans = SpanBuilder(self.tracer_setup, self._settings.exception_messages)
        # At exit and on a flushing signal, within the flush-and-shutdown budget (registered once our providers exist).
        self._exit_path = ProcessExit(self, settings.shutdown_timeout_s)
        self._signals = self._exit_path.signals
        # Called at exit before the providers shut down: tracers end their open spans there.
        self.before_shutdown: list[Any] = self._exit_path.before_shutdown
        self.disabled = ExportEnv.from_env(environ).sdk_disabled
        # The variables as our own providers last read them when they started (None before).
        self.export_env: ExportEnv | None = None
        self._dropped: Any = None  # the commdebug.telemetry.dropped counter, made at the first drop
        self._settle_state()

    def _settle_state(self) -> None:
        self._settled = False  # rank, nonce and run folder are final (or forced: exit, signal, stop)
        # Before that: a provider of our own that exports nothing, and the spans it finished.
        self._pending: tuple[TracerSetup, _HeldSpans] | None = None
        self._early_drops: dict[str, int] = {}

    @classmethod
    def silent(cls, settings: Settings) -> Telemetry:
        """A telemetry that exports nothing: no-op providers (a tracer that only feeds an observer)."""
        return cls(settings, tracer_provider=otel_trace.NoOpTracerProvider(),
                   meter_provider=otel_metrics.NoOpMeterProvider())

    # ------------------------------------------------------------- providers
    def tracer(self) -> otel_trace.Tracer:
        if self._tracer is None:
            with self._lock, warning_filters_kept():
                if self._tracer is None:
                    provider = _given_or_started(self._tracer_provider, self._make_tracer_provider, "spans",
                                                 otel_trace.NoOpTracerProvider)
                    ids = attach_id_generator(provider)  # before the tracer: it keeps the generator
                    tracer = otel_trace.get_tracer(SCOPE_NAME, __version__, provider)
                    own = provider is self._own_tracer_provider
                    self._tracer_setup = TracerSetup(
                        tracer, provider, ids, tuple(self._own_span_processors) if own else (),
                        own and self.export_env is not None and self.export_env.sdk_internal_metrics,
                        # OTEL_TRACES_EXPORTER=none (or nothing that could start): nothing to build spans for
                        (own and not self._own_span_processors)
                        or isinstance(provider, otel_trace.NoOpTracerProvider))
                    self._tracer = tracer
            if self._own_tracer_provider is not None:
                # Our own meter too, now: spans dropped at exit are counted there, and a meter
                # provider cannot be started once the interpreter is shutting down.
                self.meter()
            if self._pending is not None:
                self._hand_over_held()
        return self._tracer

    def tracer_setup(self) -> TracerSetup:
        """The tracer, its provider and our own processors; starts the provider if needed.

        Before the process group exists (:meth:`settled`), a provisional set-up whose
        spans are held until our own provider starts.
        """
        if self._tracer is None and self._tracer_provider is None and not self.disabled and not self.settled():
            return self._pending_setup()
        self.tracer()
        return self._tracer_setup  # type: ignore[return-value]  # (set by tracer())

    def settled(self) -> bool:
        """Whether our own providers may start: the rank, the job nonce and the run folder are final
        (``job_identity.settled``: torch.distributed is initialized, or the job is one process), or we
        export what we have now (exit, a flushing signal, ``CommTracer.stop``). Never raises."""
        if not self._settled:
            try:
                self._settled = settled(self._rank())
            except Exception:  # rank facts unreadable: nothing better will come
                self._settled = True
        return self._settled

    def metrics_ready(self) -> bool:
        """Whether metric points may be recorded in the meter now (an injected one, or :meth:`settled`)."""
        return self._meter_provider is not None or self.disabled or self.settled()

    def settle_now(self) -> None:
        """Settle with what is known now (exit, a flushing signal): held spans go to our own providers."""
        self._settled = True
        if self._pending is not None:
            self.tracer()

    def _pending_setup(self) -> TracerSetup:
        with self._lock, warning_filters_kept():
            if self._pending is None:
                export = ExportEnv.from_env(self._environ)
                provider = TracerProvider(resource=build_resource(self._rank(), export),
                                          span_limits=self._span_limits(export), id_generator=StepIdGenerator(),
                                          shutdown_on_exit=False)
                held = _HeldSpans(self.count_dropped)
                provider.add_span_processor(held)
                ids = attach_id_generator(provider)
                tracer = otel_trace.get_tracer(SCOPE_NAME, __version__, provider)
                discards = all(name == "none" for name in export.exporter_names("traces"))
                self._pending = (TracerSetup(tracer, provider, ids, (held,), False, discards), held)
            return self._pending[0]

    def _hand_over_held(self) -> None:
        """Our own provider started: the spans held before it go to its processors, with its resource."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        provider = self._own_tracer_provider
        pending[1].hand_over(provider, self._own_span_processors if provider is not None else [])

    def meter(self) -> otel_metrics.Meter:
        if self._meter is None:
            with self._lock, warning_filters_kept():
                if self._meter is None:
                    provider = _given_or_started(self._meter_provider, self._make_meter_provider, "metrics",
                                                 otel_metrics.NoOpMeterProvider)
                    self._meter = otel_metrics.get_meter(SCOPE_NAME, __version__, provider)
            drops, self._early_drops = self._early_drops, {}
            for kind, count in drops.items():
                self.count_dropped(kind, count)
        return self._meter

    def _read_export_env(self) -> ExportEnv:
        # Read as each provider starts, not at construction: a process may set OTEL_SERVICE_NAME
        # or an endpoint between creating a tracer and its first span (the benchmark does).
        self.export_env = ExportEnv.from_env(self._environ)
        return self.export_env

    @signals_blocked()  # the SDK's export threads start here
    def _make_tracer_provider(self) -> Any:
        if self.disabled:
            return otel_trace.NoOpTracerProvider()
        export = self._read_export_env()
        rank = self._rank()
        limits = self._span_limits(export)
        # shutdown_on_exit=False: our own atexit shutdown is bounded; the SDK's waits ~10 s per provider.
        provider = TracerProvider(resource=build_resource(rank, export), span_limits=limits,
                                  id_generator=StepIdGenerator(), shutdown_on_exit=False)
        queue, batch = export.batch_sizes(DEFAULT_SPAN_QUEUE, DEFAULT_EXPORT_BATCH_SPANS)
        processors = [CountingBatchSpanProcessor(exporter, self.count_dropped, max_queue_size=queue,
                                                 max_export_batch_size=batch,
                                                 schedule_delay_millis=export.sdk_millis(OTEL_BSP_SCHEDULE_DELAY),
                                                 export_timeout_millis=export.sdk_millis(OTEL_BSP_EXPORT_TIMEOUT))
                      for exporter in self._exporters.make("traces", rank, export)]
        self._exporters.say_where(rank, export)
        for processor in processors:
            provider.add_span_processor(processor)
        self._own_tracer_provider = provider
        self._own_span_processors = processors
        self._exit_path.register()
        return provider

    def _span_limits(self, export: ExportEnv) -> SpanLimits:
        return SpanLimits(**{**export.span_limit_arguments(), "max_events": self._settings.max_events_per_span,
                             "max_attribute_length": MAX_ATTRIBUTE_CHARS})

    @signals_blocked()  # the SDK's export threads start here
    def _make_meter_provider(self) -> Any:
        if self.disabled:
            return otel_metrics.NoOpMeterProvider()
        export = self._read_export_env()
        rank = self._rank()
        readers: list[MetricReader] = [
            PeriodicExportingMetricReader(exporter,
                                          export_interval_millis=export.sdk_millis(OTEL_METRIC_EXPORT_INTERVAL),
                                          export_timeout_millis=export.sdk_millis(OTEL_METRIC_EXPORT_TIMEOUT))
            for exporter in self._exporters.make("metrics", rank, export)
        ]
        if "prometheus" in export.exporter_names("metrics"):
            reader = _prometheus_reader(rank, export, self._servers)
            if reader is not None:
                readers.append(reader)
        self._exporters.say_where(rank, export)
        # Exemplar sampling draws from our own random source: the script's random numbers stay its own.
        provider = MeterProvider(resource=build_resource(rank, export), metric_readers=readers,
                                 shutdown_on_exit=False, views=own_random_views(OWN_RNG))
        self._own_meter_provider = provider
        self._own_metric_readers = readers
        self._exit_path.register()
        return provider

    def hold_signals(self) -> None:
        """Flush on SIGTERM, SIGHUP and SIGQUIT, then hand the signal on (``SignalFlush.hold``; not before ours)."""
        self._signals.hold()

    def keep_signals(self) -> None:
        """At a step boundary on the main thread: our flush again where a handler was reset to the default."""
        self._signals.keep()

    def release_signals(self) -> None:
        """Undo :meth:`hold_signals` (main thread only; never raises)."""
        self._signals.release()

    # ------------------------------------------------------------- exporters
    # The exporters' own state (exporters.Exporters), read here by name.
    @property
    def endpoints(self) -> list[str]:
        """OTLP endpoints in use, for warnings."""
        return self._exporters.endpoints

    @property
    def file_directory(self) -> str | None:
        """Where the embedded default writes (``OUTPUT_DIR/run-<job id>``), once known."""
        return self._exporters.file_directory

    @property
    def _span_guards(self) -> list[SizedSpanExporter]:
        return self._exporters.span_guards

    def run_directory(self) -> str:
        """``OUTPUT_DIR/run-<job id>``, the folder the run's OTLP-JSON files go to (not made here)."""
        return self._exporters.run_directory()

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's providers (its rank and pid) and end the SDK's restarted threads."""
        silence_inherited(self._own_span_processors, self._own_metric_readers)
        self._own_metric_readers = []
        self._tracer = self._meter = self._tracer_setup = self._dropped = None
        self._exit_path.reset()
        if isinstance(self._rank, RankCache):
            self._rank.reset()
        self._own_tracer_provider = self._own_meter_provider = None
        self._own_span_processors = []
        self._servers = []  # the parent's endpoints: its threads are not in this process
        self._exporters.span_guards = []
        self._lock = threading.Lock()
        self._settle_state()

    def count_dropped(self, kind: str, count: int) -> None:
        """Count ``count`` items of telemetry of ``kind`` that export dropped. Never raises.

        One counter per process and meter, whichever tracers share this telemetry.
        """
        try:
            counter = self._dropped
            if counter is None:
                if self._meter is None and not self.metrics_ready():  # counted once the meter starts
                    self._early_drops[kind] = self._early_drops.get(kind, 0) + count
                    return
                counter = self._dropped = dropped_counter(self.meter())
            counter.add(count, {semconv.DROPPED_KIND: kind, semconv.RANK: self._rank().rank})
        except Exception:  # counting must never break export
            pass

    # -------------------------------------------------------------- shutdown
    def force_flush(self) -> None:
        """Export what our own providers buffer, within what is left of the budget (see :meth:`shutdown`).

        Spans held for the process group are exported too, with what is known now (:meth:`settle_now`).
        """
        self.settle_now()
        timeout_ms = int(self._settings.shutdown_timeout_s * 1000)
        traces, metrics = self._own_tracer_provider, self._own_meter_provider
        self._exit_path.bounded("flush", None if traces is None else lambda: traces.force_flush(timeout_ms),
                      None if metrics is None else lambda: metrics.force_flush(timeout_ms))

    def flush_from_watchdog(self, timeout_s: float = STALL_FLUSH_TIMEOUT_S) -> None:
        """Export what our own providers buffer now, from a thread of ours that may wait (stall snapshots).

        Not part of the exit budget; each provider gets ``timeout_s``. Never raises.
        """
        for provider in (self._own_tracer_provider, self._own_meter_provider):
            if provider is not None:
                try:
                    provider.force_flush(int(timeout_s * 1000))
                except Exception as error:
                    _logger.debug("commdebug-otel: flush after a stall snapshot failed: %s", describe(error))

    def shutdown(self) -> None:
        """Flush and shut our providers down, traces and metrics together, within the budget.

        The budget is ``shutdown_timeout_s`` for a flush (``CommTracer.stop``) and the shutdown at
        exit that follows it, together (``process_exit.ProcessExit.bounded``: never blocks exit, one
        warning, spans still unsent counted as dropped). Injected providers are left to their owner.
        """
        traces, metrics = self._own_tracer_provider, self._own_meter_provider
        self._own_tracer_provider = self._own_meter_provider = None
        timeout_ms = self._settings.shutdown_timeout_s * 1000
        self._exit_path.bounded("shutdown", None if traces is None else traces.shutdown,
                      None if metrics is None else lambda: metrics.shutdown(timeout_millis=timeout_ms))

    def end(self) -> bool:
        """Tracing stopped (``CommTracer.stop``): flush, shut our own providers down within the budget (their threads
        and files go) and forget them; the next span or point starts new ones as in a new process (rank read again,
        the same run folder appended to, counters from zero: a reset to OTLP backends). A Prometheus pull endpoint's
        meter provider stays until exit; injected providers are their owner's. Returns True if our meter provider
        ended (make new instruments). Never raises."""
        traces = metrics = None
        try:
            self.settle_now()  # spans held for the process group: to our providers, with what is known now
            if self._own_tracer_provider is None and self._own_meter_provider is None:
                return False
            self.force_flush()
            traces, self._own_tracer_provider = self._own_tracer_provider, None
            if not self._servers:  # a pull endpoint is scraped after the last step: it stays
                metrics, self._own_meter_provider = self._own_meter_provider, None
            timeout_ms = self._settings.shutdown_timeout_s * 1000
            ending = metrics
            self._exit_path.bounded("shutdown", None if traces is None else traces.shutdown,
                                    None if ending is None else lambda: ending.shutdown(timeout_millis=timeout_ms))
        except Exception as error:
            _logger.debug("commdebug-otel: ending telemetry failed: %s", describe(error))
        with self._lock:
            self._tracer = self._tracer_setup = None
            self._own_span_processors = []
            self._exporters.span_guards = []
            if metrics is not None:
                self._meter = self._dropped = None
                self._own_metric_readers = []
            if isinstance(self._rank, RankCache):
                self._rank.reset()  # a later process group may give this process another rank
            self._settle_state()
        return metrics is not None

    def count_unsent_spans(self) -> int:
        """Count the spans still queued in our processors as dropped (before the last metrics go). Never raises."""
        unsent = sum(guard.abandon() for guard in self._span_guards)
        for processor in self._own_span_processors:
            found = batch_queue(processor)
            if found is not None:
                unsent += len(found[1])
        if unsent:
            self.count_dropped(semconv.DROPPED_KIND_SPAN, unsent)
        return unsent


class _HeldSpans(SpanProcessor):
    """The provisional provider's processor: keeps finished spans (at most ``MAX_HELD_SPANS``, the rest
    counted as dropped) until our own provider starts (:meth:`hand_over`). Starts no thread."""

    def __init__(self, count_dropped: Callable[[str, int], None]) -> None:
        self._spans: list[ReadableSpan] = []
        self._count_dropped = count_dropped

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._spans) < MAX_HELD_SPANS:
            self._spans.append(span)
        else:
            self._count_dropped(semconv.DROPPED_KIND_SPAN, 1)

    def hand_over(self, provider: TracerProvider | None, processors: list[Any]) -> None:
        """The spans held go to our own ``provider``'s ``processors``, with its resource (its rank, its
        backend); none: they are counted as dropped (``OTEL_TRACES_EXPORTER=none``: nothing is dropped)."""
        spans, self._spans = self._spans, []
        if not processors:
            if spans and provider is None:
                self._count_dropped(semconv.DROPPED_KIND_SPAN, len(spans))
            return
        resource = provider.resource  # type: ignore[union-attr]  # (processors: our own provider)
        for span in spans:
            settled_span = ReadableSpan(
                name=span.name, context=span.context, parent=span.parent, resource=resource,
                attributes=span.attributes, events=span.events, links=span.links, kind=span.kind,
                status=span.status, start_time=span.start_time, end_time=span.end_time,
                instrumentation_scope=span.instrumentation_scope)
            for processor in processors:
                processor.on_end(settled_span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _given_or_started(given: Any, make: Callable[[], Any], what: str, off: Callable[[], Any]) -> Any:
    """The provider the user gave, else ``make()``; one that cannot start (e.g. OUTPUT_DIR cannot be created)
    costs one warning and is ``off()``, a no-op provider: ``what`` ("spans", "metrics") are off."""
    if given is not None:
        return given
    try:
        return make()
    except Exception as error:
        _logger.warning("commdebug-otel: %s are off: %s", what, describe(error, values=False))
        return off()


def _pull_reader_class() -> type:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class PullReader(PrometheusMetricReader):
        """Prometheus pulls: a flush has nothing to send. (The exporter's collect()
        yields every family once per queued batch, so a flush before a scrape
        would list each sample twice.)"""

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

    return PullReader


def _prometheus_reader(rank: RankInfo, export: ExportEnv, servers: list) -> MetricReader | None:
    """A pull endpoint on ``OTEL_EXPORTER_PROMETHEUS_HOST``, at ``OTEL_EXPORTER_PROMETHEUS_PORT`` plus the
    local rank (one port per worker; needs the ``prometheus`` extra). The server and its thread are added to
    ``servers`` (closed when tracing stops)."""
    try:
        import opentelemetry.exporter.prometheus  # noqa: F401  (the optional extra)
        from prometheus_client import start_http_server
    except ImportError:
        _logger.warning("commdebug-otel: OTEL_METRICS_EXPORTER=prometheus needs "
                        "`pip install opentelemetry-exporter-prometheus` (the `prometheus` extra: "
                        "`pip install '.[prometheus]'` in a checkout); metrics are not exported")
        return None
    host = export.prometheus_host
    port = export.prometheus_port(rank.local_rank)
    try:
        started = start_http_server(port, addr=host)
        if isinstance(started, tuple):  # (server, thread); older prometheus_client returns nothing
            servers.append(started)
    except OSError as error:
        _logger.warning("commdebug-otel: cannot serve Prometheus metrics on %s:%d (%s)", host, port, describe(error))
        return None
    return _pull_reader_class()()
