"""Every touch of the OpenTelemetry SDK's private attributes, in one place.

An SDK upgrade that renames one of these breaks this file only. Each reader
returns None (or does nothing) when the attribute is missing or has another
shape, and its caller then takes the SDK's public path: spans and points are
still exported, only our shortcuts or counts are lost.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


@contextlib.contextmanager
def warning_filters_kept() -> Iterator[None]:
    """The script's ``warnings.filters`` as they were, after the SDK ran inside: its ``get_tracer`` adds a filter
    on every call (``TracerProvider.get_tracer``), and importing its logs package adds one
    (``opentelemetry.sdk._logs``, which the OTLP exporters import). Those filters still apply inside."""
    with warnings.catch_warnings():
        yield


def span_limits(provider: Any) -> Any:
    """The ``SpanLimits`` a ``TracerProvider`` gives its spans (``TracerProvider._span_limits``)."""
    return getattr(provider, "_span_limits", None)


def instrumentation_scope(tracer: Any) -> Any:
    """The ``InstrumentationScope`` of an SDK ``Tracer`` (``Tracer._instrumentation_scope``)."""
    return getattr(tracer, "_instrumentation_scope", None)


def batch_queue(processor: Any) -> tuple[Any, collections.deque] | None:
    """``(holder, queue)``: the bounded deque a ``BatchSpanProcessor`` buffers spans in, or None.

    The SDK keeps it as ``BatchSpanProcessor._batch_processor._queue``; the
    holder is the object to assign a replacement queue to (:func:`replace_batch_queue`).
    """
    holder = getattr(processor, "_batch_processor", None)
    queue = getattr(holder, "_queue", None)
    if isinstance(queue, collections.deque) and queue.maxlen:
        return holder, queue
    return None


def replace_batch_queue(holder: Any, queue: collections.deque) -> None:
    """Put ``queue`` where :func:`batch_queue` found the processor's own."""
    holder._queue = queue


def batch_takes_spans(holder: Any) -> bool:
    """Whether the SDK's batch processor (``holder``, from :func:`batch_queue`) queues spans now as its ``emit``
    does with nothing to do first: not shut down, and in the process that made it (a forked child's resets
    first). False also where its internals have another shape."""
    try:
        return holder._shutdown is False and holder._pid == os.getpid() and holder._worker_awaken is not None
    except AttributeError:
        return False


def wake_batch_worker(holder: Any) -> None:
    """What ``emit`` does after queueing: wake the export thread once a full batch waits."""
    if len(holder._queue) >= holder._max_export_batch_size and not holder._worker_awaken.is_set():
        holder._worker_awaken.set()


def silence_inherited(span_processors: Any, metric_readers: Any) -> None:
    """In a forked child: the parent's batch processors and periodic readers, whose threads the SDK starts again
    there (``_at_fork_reinit``), end them at once and export nothing (the parent exports its own spans and
    points; the child's copies would go out again under the parent's resource). Never raises."""
    for processor in span_processors:
        holder: Any = getattr(processor, "_batch_processor", None)
        try:
            holder._shutdown = True  # its worker's loop condition
            holder._worker_awaken.set()
        except Exception:  # another SDK: its thread exports what the child holds (nothing: the queue is cleared)
            pass
    for reader in metric_readers:
        try:
            reader._exporter = _SilentMetricExporter(reader._exporter)
            reader._shutdown_event.set()  # its ticker's loop condition (then one collect, to the silent exporter)
        except Exception:
            pass


class _SilentMetricExporter:
    """Takes the inherited reader's last collect and exports nothing."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def exporter_preferences(exporter: Any) -> dict[str, Any]:
    """A ``MetricExporter``'s temporality and aggregation preferences, as constructor keywords."""
    return {"preferred_temporality": getattr(exporter, "_preferred_temporality", None),
            "preferred_aggregation": getattr(exporter, "_preferred_aggregation", None)}


def own_random_views(rng: Any) -> list[Any]:
    """A ``MeterProvider``'s ``views``: every instrument as by default, its exemplar sampling drawing from
    ``rng`` (:func:`exemplar_reservoir_factory`); empty where the SDK's shape differs."""
    from opentelemetry.sdk.metrics.view import View

    reservoirs = exemplar_reservoir_factory(rng)
    return [View(instrument_name="*", exemplar_reservoir_factory=reservoirs)] if reservoirs else []


def exemplar_reservoir_factory(rng: Any) -> Any:
    """A ``View``'s ``exemplar_reservoir_factory``: the SDK's default reservoirs, but the random draws of
    ``SimpleFixedSizeExemplarReservoir`` (sums, exponential histograms) come from ``rng``, not the global
    ``random`` (the SDK's module draws from it). None where the SDK's shape differs: the SDK's default then.
    """
    try:
        from opentelemetry.sdk.metrics import SimpleFixedSizeExemplarReservoir
        from opentelemetry.sdk.metrics._internal.exemplar.exemplar_reservoir import BucketIndexError
        from opentelemetry.sdk.metrics._internal.view import _default_reservoir_factory

        probe = SimpleFixedSizeExemplarReservoir()
        if not isinstance(probe._measurements_seen, int) or not isinstance(probe._size, int):
            return None
    except (ImportError, AttributeError):
        return None

    class OwnRandomReservoir(SimpleFixedSizeExemplarReservoir):
        """The SDK's uniformly-weighted reservoir (the same algorithm), drawing from ``rng``."""

        def _find_bucket_index(self, value: Any, time_unix_nano: int, attributes: Any, context: Any) -> int:
            self._measurements_seen += 1
            if self._measurements_seen <= self._size:
                return self._measurements_seen - 1
            index = rng.randrange(0, self._measurements_seen)
            if index < self._size:
                return index
            raise BucketIndexError("Unable to find the bucket index.")

    def factory(aggregation_type: type) -> Any:
        default = _default_reservoir_factory(aggregation_type)
        return OwnRandomReservoir if default is SimpleFixedSizeExemplarReservoir else default  # type: ignore[comparison-overlap]

    setattr(factory, "own_random", True)  # exemplar_draws tells our views by it  # noqa: B010
    return factory


def exemplar_draws(meter: Any) -> tuple[bool, bool]:
    """``(sums, histograms)``: whether offering ``meter``'s counters, resp. histograms, a measurement with a
    sampled span context (an exemplar) draws from the global ``random``.

    The SDK's ``SimpleFixedSizeExemplarReservoir`` does, on every point past the first of an export
    interval; it is the default of sums and exponential histograms (explicit-bucket histograms keep the
    last point per bucket: no draw). ``(False, False)`` where the reservoirs are ours
    (:func:`own_random_views`), exemplars are off (``OTEL_METRICS_EXEMPLAR_FILTER=always_off``) or
    ``meter`` is not an SDK meter; ``(True, True)`` where views of another kind may choose any reservoir.
    """
    consumer = getattr(meter, "_measurement_consumer", None)
    config = getattr(consumer, "_sdk_config", None)
    if config is None:
        return False, False
    try:
        from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, Histogram
        from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

        if isinstance(config.exemplar_filter, AlwaysOffExemplarFilter):
            return False, False
        views = list(config.views or ())
        if views:
            ours = all(getattr(view._exemplar_reservoir_factory, "own_random", False) for view in views)
            return (False, False) if ours else (True, True)
        exponential = False
        for reader in consumer._reader_storages:  # type: ignore[union-attr]  # (config is not None: it is set)
            preferred = reader._instrument_class_aggregation
            exponential |= any(isinstance(aggregation, ExponentialBucketHistogramAggregation)
                               for kind, aggregation in preferred.items() if issubclass(kind, Histogram))
        return True, exponential
    except Exception:  # another SDK shape: assume the worst
        return True, True


def jitter_from(exporter: Any, rng: Any) -> bool:
    """Have an OTLP exporter's retry back-off jitter drawn from ``rng``, not the global ``random``.

    The HTTP exporters' client draws it in ``_OTLPHTTPClient._compute_backoff`` (replaced on this
    exporter's client only); the gRPC exporter calls ``random.uniform`` inline, so the name ``random``
    of its module is pointed at ``rng``: every gRPC exporter of the process then jitters from ``rng``
    (the same numbers' distribution; only the script's own generator is left alone). False where
    neither shape is found.
    """
    import random
    import sys

    client = getattr(exporter, "_client", None)
    jitter = getattr(client, "_jitter", None)
    if callable(getattr(client, "_compute_backoff", None)) and isinstance(jitter, float):
        setattr(client, "_compute_backoff", lambda retry: 2**retry * rng.uniform(1 - jitter, 1 + jitter))  # noqa: B010
        return True
    for cls in type(exporter).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.startswith("opentelemetry.exporter.otlp") \
                and getattr(module, "random", None) is random:
            setattr(module, "random", rng)  # noqa: B010  (the exporter module's own name for it)
            return True
    return False


# ------------------------------------------------------------------ exporters' private parts
# Loggers of the exporters' and SDK's private modules (a logger's name is its module's path): what
# export_guard folds or guards.
HTTP_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http._common"  # the OTLP/HTTP exporters' retries
BATCH_PROCESSOR_LOGGER = "opentelemetry.sdk._shared_internal"  # the batch processors' "Queue full"


def otlp_proto_encoding() -> SimpleNamespace:
    """The OTLP protobuf exporter's private encoding helpers, under public names.

    ``encode_attributes``, ``encode_instrumentation_scope``, ``encode_key_value``, ``encode_resource``,
    ``encode_span_id``, ``encode_trace_id`` (``opentelemetry.exporter.otlp.proto.common._internal``) and
    ``SPAN_KIND_MAP``, ``encode_parent_id``, ``encode_status``, ``encode_trace_state``, ``span_flags``
    (its ``trace_encoder``). Raises ImportError where an exporter version keeps them elsewhere.
    """
    from opentelemetry.exporter.otlp.proto.common import _internal as common
    from opentelemetry.exporter.otlp.proto.common._internal import trace_encoder

    try:
        return SimpleNamespace(
            encode_attributes=common._encode_attributes,
            encode_instrumentation_scope=common._encode_instrumentation_scope,
            encode_key_value=common._encode_key_value, encode_resource=common._encode_resource,
            encode_span_id=common._encode_span_id, encode_trace_id=common._encode_trace_id,
            SPAN_KIND_MAP=trace_encoder._SPAN_KIND_MAP, encode_parent_id=trace_encoder._encode_parent_id,
            encode_status=trace_encoder._encode_status, encode_trace_state=trace_encoder._encode_trace_state,
            span_flags=trace_encoder._span_flags)
    except AttributeError as error:
        raise ImportError(str(error)) from error


def otlp_json_encoding() -> SimpleNamespace:
    """The OTLP-JSON exporter's private encoding helpers, under public names.

    ``encode_key_value``, ``encode_attributes``, ``encode_instrumentation_scope``, ``encode_resource``
    (``opentelemetry.exporter.otlp.json.common._internal``), ``SPAN_KIND_MAP``, ``encode_span``,
    ``encode_status``, ``span_flags`` (its ``trace_encoder``) and ``encode_float``
    (``opentelemetry.proto_json._json_codec``). Raises ImportError or AttributeError where an exporter
    version keeps them elsewhere.
    """
    from opentelemetry.exporter.otlp.json.common import _internal as common
    from opentelemetry.exporter.otlp.json.common._internal import trace_encoder
    from opentelemetry.proto_json._json_codec import encode_float

    return SimpleNamespace(
        encode_key_value=common._encode_key_value, encode_attributes=common._encode_attributes,
        encode_instrumentation_scope=common._encode_instrumentation_scope, encode_resource=common._encode_resource,
        SPAN_KIND_MAP=trace_encoder._SPAN_KIND_MAP, encode_span=trace_encoder._encode_span,
        encode_status=trace_encoder._encode_status, span_flags=trace_encoder._span_flags, encode_float=encode_float)


def translate_data_with(exporter_class: type, translate: Any) -> None:
    """Have an OTLP/gRPC exporter class (a subclass of the SDK's) build each request with
    ``translate(self, data)``: the SDK's seam for it, ``OTLPExporterMixin._translate_data``."""
    setattr(exporter_class, "_translate_data", translate)  # noqa: B010


def json_file_encoder(exporter: Any) -> tuple[Any, Any] | None:
    """``(holder, stream)`` of the SDK's OTLP-JSON file exporter, or None where its shape differs.

    It encodes with ``holder._encode`` (``exporter._exporter``) and dumps what that returns to
    ``stream``; :func:`replace_json_file_encoder` puts another encoder there.
    """
    holder = getattr(exporter, "_exporter", None)
    stream = getattr(holder, "_stream", None)
    if callable(getattr(holder, "_encode", None)) and callable(getattr(stream, "write", None)):
        return holder, stream
    return None


def replace_json_file_encoder(holder: Any, encode: Any) -> None:
    """Put ``encode`` where :func:`json_file_encoder` found the exporter's own."""
    holder._encode = encode
