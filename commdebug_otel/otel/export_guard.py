"""Exporter guards: requests sized under receivers' limits, failures counted, one warning per endpoint.

Part of the SDK set-up (``otel/telemetry.py``); SDK internals go through ``otel/_sdk.py``.

* ``SizedSpanExporter`` splits each batch so that no OTLP request exceeds
  ``max_request_bytes`` (default 3.5 MiB, under the 4 MiB default of gRPC
  receivers: Collector, Jaeger, Tempo). Sizes are upper bounds computed from
  the spans' strings and protobuf's worst-case framing; only a span whose bound
  is over the limit is encoded to measure it (so spans are encoded once, by the
  exporter). A single span over the limit is dropped and counted; an oversized
  batch is never sent to be rejected, retried for ~10 s and lost.
* Failed exports are counted in ``commdebug.telemetry.dropped`` (``span``,
  ``metric_export``) and produce exactly one warning naming the endpoint;
  the SDK exporters' own retry logs are folded into that warning.
* ``CountingBatchSpanProcessor`` counts spans the SDK drops when its queue
  is full (the SDK drops silently apart from one log line).
* ``WholeLineFile`` is the stream the OTLP-JSON file exporters write to: a
  batch's line reaches the file whole or not at all (disk full, ``ulimit -f``),
  and the file is created owner-only.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from commdebug_otel import semconv
from commdebug_otel.core.redact import describe, hide_credentials, valid_text
from commdebug_otel.otel._sdk import (
    BATCH_PROCESSOR_LOGGER,
    HTTP_EXPORTER_LOGGER,
    batch_queue,
    batch_takes_spans,
    exporter_preferences,
    replace_batch_queue,
    wake_batch_worker,
)

_logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 3_584 * 1024  # 3.5 MiB: room under gRPC's 4 MiB for request framing
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.json.file.trace_exporter",  # a traceback per failed file write
    "opentelemetry.exporter.otlp.json.file.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    HTTP_EXPORTER_LOGGER,
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
)

DropCounter = Callable[[str, int], None]


class _ExporterLogFold(logging.Filter):
    """Keeps the SDK exporters' retry warnings out of the training log; remembers the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.last_message = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            message = record.getMessage()
            self.last_message = message[:300]
            _say_if_wrong_protocol(record.name, message)
            return False
        return True


# What an exporter's first failed try says when the endpoint speaks the other OTLP transport:
# (exporter logger prefix, markers in its message, what the endpoint speaks, the protocol that fits, its port).
_OTHER_PROTOCOL = (
    ("opentelemetry.exporter.otlp.proto.grpc", ("http1.x server", "Expected SETTINGS frame"),  # grpc-core's words
     "OTLP/HTTP, not gRPC", "http/protobuf", "the gRPC port (4317 by default)"),
    ("opentelemetry.exporter.otlp.proto.http", ("BadStatusLine('\\x00\\x00",),  # an HTTP/2 SETTINGS frame
     "gRPC, not OTLP/HTTP", "grpc", "the OTLP/HTTP port (4318 by default)"),
)


def _say_if_wrong_protocol(logger_name: str, message: str) -> None:
    """At the first failed try (the exporter retries for up to its timeout, often past the job's end), say once
    per signal when the endpoint answered in the other transport: a protocol that does not match the port."""
    for prefix, markers, speaks, protocol, port in _OTHER_PROTOCOL:
        if logger_name.startswith(prefix) and any(marker in message for marker in markers):
            signal = "metrics" if "metric" in logger_name or "exporting metrics" in message else "traces"
            if claim_warning(f"protocol for {signal}"):
                _logger.warning("commdebug-otel: the OTLP endpoint for %s speaks %s: set "
                                "OTEL_EXPORTER_OTLP_PROTOCOL=%s (or OTEL_EXPORTER_OTLP_%s_PROTOCOL), or send to %s; "
                                "until then its exports fail and are dropped (counted)",
                                signal, speaks, protocol, signal.upper(), port)


_fold = _ExporterLogFold()
_fold_installed = False
_warned: set[str] = set()
_warned_lock = threading.Lock()


class _SdkLogGuard(logging.Filter):
    """The SDK's own lines that we replace or repeat: one per dropped span, malformed header entries (printed
    verbatim: secrets; we name the variable ourselves), and resource lines said once per provider."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _HEADER_LOGGER:
            return False  # ExportEnv.exporter_arguments names the variable, without its value
        if record.name == _RESOURCE_LOGGER:
            message = record.getMessage()
            if message in self._said:
                return False  # the tracer and the meter provider each parse OTEL_RESOURCE_ATTRIBUTES
            self._said.add(message)
            return True
        return not str(record.msg).startswith("Queue full")  # counted, and said once, by us


_HEADER_LOGGER = "opentelemetry.util.re"  # parse_env_headers logs a malformed entry verbatim
_RESOURCE_LOGGER = "opentelemetry.sdk.resources"
_SDK_LOGGERS = (BATCH_PROCESSOR_LOGGER, _HEADER_LOGGER, _RESOURCE_LOGGER)


def fold_exporter_logs() -> None:
    """Install the log fold on the exporters' loggers and our guard on the SDK's (once per process)."""
    global _fold_installed
    if not _fold_installed:
        _fold_installed = True
        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(_fold)
        guard = _SdkLogGuard()
        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(guard)


def claim_warning(endpoint: str) -> bool:
    """True the first time ``endpoint`` is named in a warning; later calls get False."""
    with _warned_lock:
        if endpoint in _warned:
            return False
        _warned.add(endpoint)
        return True


def warn_once(endpoint: str, what: str) -> None:
    """One warning per endpoint for the life of the process."""
    if not claim_warning(endpoint):
        return
    detail = f" ({_fold.last_message})" if _fold.last_message else ""
    _logger.warning("commdebug-otel: cannot export %s to %s%s; dropped telemetry is counted in "
                    "commdebug.telemetry.dropped and training continues", what, hide_credentials(endpoint),
                    hide_credentials(detail))


def _span_bytes(span: ReadableSpan) -> int:
    """A span's exact OTLP protobuf size, in bytes (the SDK's encoder: slow, used near the limit)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans([span]).ByteSize()


# Upper bounds on protobuf framing, in bytes: a field's tag and length prefix take at most
# 1 + 5 bytes (tags of fields 1-15 are 1 byte, Span.flags' 2; lengths are varints), a varint
# at most 10 and a fixed64 8.
_FIELD = 6
_SPAN_FIXED = 128  # ids, trace state framing, kind, times, flags, status code, dropped counts
_EVENT_FIXED = 32  # time, dropped count, framing
_LINK_FIXED = 64   # ids, flags, dropped count, framing
_SCOPE_FIXED = 64  # ResourceSpans and ScopeSpans framing


def _text_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _value_bound(value: Any) -> int:
    if isinstance(value, str):
        return _text_bytes(value) + _FIELD
    if isinstance(value, (bool, int, float)):
        return 11 + _FIELD  # varint or fixed64, in an AnyValue
    if isinstance(value, bytes):
        return len(value) + _FIELD
    if isinstance(value, Mapping):
        return _attributes_bound(value) + _FIELD
    if isinstance(value, Sequence):
        return sum(_value_bound(item) + _FIELD for item in value) + 2 * _FIELD
    return _text_bytes(str(value)) + _FIELD


def _attributes_bound(attributes: Any) -> int:
    if not attributes:
        return 0
    return sum(_text_bytes(str(key)) + _value_bound(value) + 3 * _FIELD for key, value in attributes.items())


def span_bytes_bound(span: ReadableSpan) -> int:
    """An upper bound on ``span``'s OTLP protobuf size, in bytes, without encoding it.

    Sums UTF-8 lengths and worst-case framing (varint tags and lengths as the
    protobuf wire format defines them), so it is never below the encoder's
    ``ByteSize()``. About 20x cheaper than encoding: the exporter then encodes
    each span once, not twice.
    """
    size = _SPAN_FIXED + _text_bytes(span.name) + _attributes_bound(span.attributes)
    status = span.status.description if span.status is not None else None
    if status:
        size += _text_bytes(status) + _FIELD
    for event in span.events:
        size += _EVENT_FIXED + _text_bytes(event.name) + _attributes_bound(event.attributes)
    for link in span.links:
        size += _LINK_FIXED + _attributes_bound(link.attributes)
        trace_state = link.context.trace_state
        if trace_state:
            size += _text_bytes(trace_state.to_header()) + _FIELD
    trace_state = span.context.trace_state if span.context is not None else None  # type: ignore[assignment]
    if trace_state:
        size += _text_bytes(trace_state.to_header()) + _FIELD
    return size


class SizedSpanExporter(SpanExporter):
    """Wraps a span exporter: byte-sized requests, counted failures, one warning per endpoint.

    Args:
        inner: the real exporter.
        endpoint: where it sends, for the warning.
        count_dropped: ``count_dropped(kind, n)``.
        max_request_bytes: upper bound on one request's encoded size, in bytes;
            None: no bound (a file), one request per batch.
        closes: closed once ``inner`` shut down (its :class:`WholeLineFile`: the SDK's file
            exporter leaves a stream it was given open).
    """

    def __init__(self, inner: SpanExporter, endpoint: str, count_dropped: DropCounter,
                 max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, closes: Any = None) -> None:
        self._inner = inner
        self._closes = closes
        self._endpoint = endpoint
        self._count_dropped = count_dropped
        self._max_request_bytes = max_request_bytes
        self._framing: tuple[Any, Any, int] | None = None
        self._in_flight = 0  # spans of the request being sent
        self._abandoned = False  # what is unsent was counted already (exit ran out of time)

    def _framing_bound(self, span: ReadableSpan) -> int:
        """Resource and scope bytes a request carries for ``span`` (cached per resource)."""
        resource, scope = span.resource, span.instrumentation_scope
        cached = self._framing
        if cached is None or cached[0] is not resource or cached[1] is not scope:
            size = _SCOPE_FIXED + _attributes_bound(resource.attributes if resource else None)
            size += _text_bytes(getattr(resource, "schema_url", "") or "") + _FIELD
            if scope is not None:
                size += _text_bytes(scope.name) + _text_bytes(scope.version or "") + 2 * _FIELD
                size += _text_bytes(getattr(scope, "schema_url", "") or "") + _FIELD
                size += _attributes_bound(getattr(scope, "attributes", None))
            cached = self._framing = (resource, scope, size)
        return cached[2]

    def _chunks(self, spans: Sequence[ReadableSpan]) -> list[Sequence[ReadableSpan]]:
        if not spans:
            return []
        if self._max_request_bytes is None:
            return [spans]
        # Our gRPC encoder encodes the whole batch once and the export sends that encoding: its exact
        # size settles the common case (one request) for less than bounding every span's attributes.
        request_bytes = getattr(self._inner, "request_bytes", None)
        if request_bytes is not None:
            try:
                if request_bytes(spans, self._max_request_bytes) <= self._max_request_bytes:
                    return [spans]
            except Exception:  # a value the encoder cannot take: per span, as for any exporter
                pass
        chunks: list[list[ReadableSpan]] = [[]]
        size = 0
        for span in spans:
            # The resource and scope once per span, generously; exact encoding only near the limit.
            try:
                span_bytes = span_bytes_bound(span) + self._framing_bound(span)
            except Exception:  # a value the bound does not know: the encoder does
                span_bytes = self._max_request_bytes + 1
            if span_bytes > self._max_request_bytes:
                span_bytes = _span_bytes(span)  # a whole request: resource and scope included
            if span_bytes > self._max_request_bytes:
                self._count_dropped(semconv.DROPPED_KIND_SPAN, 1)
                _logger.warning("commdebug-otel: span %r is %d bytes, over the %d-byte request limit; "
                                "dropped (lower OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN)",
                                span.name, span_bytes, self._max_request_bytes)
                continue
            if chunks[-1] and size + span_bytes > self._max_request_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(span)
            size += span_bytes
        return [chunk for chunk in chunks if chunk]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = SpanExportResult.SUCCESS
        for chunk in self._chunks(spans):
            self._in_flight = len(chunk)
            try:
                outcome = self._inner.export(chunk)
            except Exception as error:  # an exporter bug must not kill the export thread
                _fold.last_message = describe(error, values=False)
                outcome = SpanExportResult.FAILURE
            finally:
                self._in_flight = 0
            if outcome is not SpanExportResult.SUCCESS:
                result = SpanExportResult.FAILURE
                if not self._abandoned:
                    self._count_dropped(semconv.DROPPED_KIND_SPAN, len(chunk))
                warn_once(self._endpoint, "spans")
        return result

    def abandon(self) -> int:
        """The process is leaving without waiting for this exporter: the spans of the request in flight,
        which the caller counts as dropped (a failure later is not counted again)."""
        self._abandoned = True
        return self._in_flight

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()
        finally:
            _close(self._closes)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


# The attribute the SDK gives the one series that takes every measurement past a metric's
# cardinality limit (2,000 series by default).
OVERFLOW_ATTRIBUTE = "otel.metric.overflow"


def overflowed_metrics(metrics_data: Any) -> list[str]:
    """Names of the metrics in ``metrics_data`` whose series went past the SDK's cardinality limit."""
    names = []
    for resource_metrics in getattr(metrics_data, "resource_metrics", ()):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = getattr(metric.data, "data_points", ())
                if any(point.attributes and point.attributes.get(OVERFLOW_ATTRIBUTE) for point in points):
                    names.append(metric.name)
    return names


class CountingMetricExporter(MetricExporter):
    """Wraps a metric exporter: failed exports and cardinality overflow are counted, and said once.

    A failed export counts one ``metric_export``; each metric whose series went
    past the SDK's cardinality limit counts one ``metric_overflow`` per export.
    ``closes``: closed once ``inner`` shut down (as for :class:`SizedSpanExporter`).
    """

    def __init__(self, inner: MetricExporter, endpoint: str, count_dropped: DropCounter, closes: Any = None) -> None:
        super().__init__(**exporter_preferences(inner))
        self._inner = inner
        self._closes = closes
        self._endpoint = endpoint
        self._count_dropped = count_dropped

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        overflowed = overflowed_metrics(metrics_data)
        if overflowed:
            self._count_dropped(semconv.DROPPED_KIND_METRIC_OVERFLOW, len(overflowed))
            if claim_warning("metric overflow"):
                _logger.warning("commdebug-otel: %s passed the SDK's cardinality limit; the excess series "
                                "are merged into one with otel.metric.overflow=true (lower "
                                "OTEL_PYTHON_COMMDEBUG_METRIC_MODULE_DEPTH)", ", ".join(overflowed))
        try:
            outcome = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as error:
            _fold.last_message = describe(error, values=False)
            outcome = MetricExportResult.FAILURE
        if outcome is not MetricExportResult.SUCCESS:
            self._count_dropped(semconv.DROPPED_KIND_METRIC_EXPORT, 1)
            warn_once(self._endpoint, "metrics")
        return outcome

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)
        finally:
            _close(self._closes)


def _close(stream: Any) -> None:
    """Close ``stream`` (None: nothing); a failure only loses what it still buffered, which export counted."""
    if stream is not None:
        try:
            stream.close()
        except OSError as error:
            _logger.debug("commdebug-otel: closing %s failed: %s", getattr(stream, "name", "a file"), describe(error))


class _CountingQueue(collections.deque):
    """The SDK batch processor's queue: a full ``appendleft`` drops the oldest item; count it.

    The check and the append hold one lock (as does ``pop``), so the count is
    exact even while the export thread drains the queue.
    """

    def __init__(self, items: Any, maxlen: int | None, on_drop: Callable[[], None]) -> None:
        super().__init__(items, maxlen)
        self._on_drop = on_drop
        self._lock = threading.Lock()

    def appendleft(self, item: Any) -> None:
        with self._lock:
            full = len(self) == self.maxlen
            super().appendleft(item)
        if full:
            self._on_drop()

    def pop(self) -> Any:  # type: ignore[override]  # (deque's takes no index)
        with self._lock:
            return super().pop()

    def appendleft_all(self, items: list) -> bool:
        """``appendleft`` of each of ``items`` in order, under one lock, where they all fit without a drop;
        False (nothing added) where they do not."""
        with self._lock:
            if self.maxlen is not None and len(self) + len(items) > self.maxlen:
                return False
            self.extendleft(items)
            return True


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that counts the spans it drops when its queue is full.

    (The SDK drops the oldest span to make room and logs one line.) If the SDK's
    internals change shape, spans are still exported, just not counted.
    """

    def __init__(self, exporter: SpanExporter, count_dropped: DropCounter, **kwargs: Any) -> None:
        super().__init__(exporter, **kwargs)
        found = batch_queue(self)
        self._queue: _CountingQueue | None = None
        if found is not None:
            holder, queue = found

            def dropped() -> None:
                count_dropped(semconv.DROPPED_KIND_SPAN, 1)
                if claim_warning("span queue"):
                    _logger.warning("commdebug-otel: the span export queue (%d spans) is full; spans are "
                                    "dropped and counted (raise OTEL_BSP_MAX_QUEUE_SIZE, or trace fewer steps: raise "
                                    "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY)", queue.maxlen)

            self._queue = _CountingQueue(queue, queue.maxlen, dropped)
            replace_batch_queue(holder, self._queue)

    def on_end_all(self, spans: list[ReadableSpan]) -> None:
        """:meth:`on_end` of each of ``spans``, in order, sampled all (``spans._DirectSpans``' spans): queued
        under one lock, the export thread woken once, where the queue has room for them all; else one by one
        (the drops counted, as on_end counts them)."""
        found = batch_queue(self)  # still our queue (the SDK's fork handling could replace it)
        if found is not None and found[1] is self._queue and batch_takes_spans(found[0]):
            if self._queue.appendleft_all(spans):
                wake_batch_worker(found[0])
                return
        for span in spans:
            self.on_end(span)


# In JSON text as json.dumps writes it (ensure_ascii): an escaped backslash, a surrogate pair's escapes, or one
# surrogate's escape alone; only the last is invalid Unicode (a strict reader refuses the line).
_SURROGATE_ESCAPES = re.compile(r"\\\\|\\ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|(\\ud[89a-f][0-9a-f]{2})")


def valid_json(text: str) -> str:
    """JSON ``text`` with every lone surrogate, escaped (``\\udc80``) or raw, made U+FFFD: valid UTF-8 JSON.

    Module names, exception messages and file names decoded with ``surrogateescape`` can hold one;
    ``json.dumps`` escapes it, and strict readers (the Collector's, ``summarize``) then refuse the line.
    """
    if "\\ud" in text:
        text = _SURROGATE_ESCAPES.sub(lambda match: "\\ufffd" if match.group(1) else match.group(0), text)
    return valid_text(text)


class WholeLineFile:
    """A text stream over one append-only file, for ``FileSpanExporter(stream=...)`` and its metric twin.

    ``write`` only buffers; ``flush`` appends the buffered text in one go. If
    that fails part-way (``ENOSPC``, ``EFBIG`` under ``ulimit -f``), the file is
    cut back to its length before, so it never holds half a line, and the
    ``OSError`` reaches the exporter, which reports a failed export (counted by
    the guards above). The file is created with mode 0600 (owner only). What is
    written is valid UTF-8 JSON (:func:`valid_json`).

    Args:
        path: the file; created if missing, else appended to.

    Raises:
        OSError: at construction, if the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.name = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._pending: list[str] = []
        self.closed = False

    def write(self, text: str) -> int:
        self._pending.append(text)
        return len(text)

    def flush(self) -> None:
        if not self._pending:
            return
        data = valid_json("".join(self._pending)).encode("utf-8")
        self._pending.clear()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        try:
            while written < len(data):
                count = os.write(self._fd, data[written:])
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
                written += count
        except OSError:
            if written:
                try:
                    os.ftruncate(self._fd, start)
                except OSError:  # nothing more to do: the reader skips a line that is not JSON
                    pass
            raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending.clear()
            os.close(self._fd)
