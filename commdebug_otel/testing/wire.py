"""Bytes on the wire: finished spans and metric data as the OTLP exporters encode them.

Usage::

    from commdebug_otel.testing import InMemoryTelemetry
    from commdebug_otel.testing.wire import metric_wire, trace_wire

    telemetry = InMemoryTelemetry()
    ...  # run traced steps under CommTracer(tracer_provider=..., meter_provider=...)
    per_trace = trace_wire(telemetry.spans())      # {trace id: WireBytes}
    metrics = metric_wire(telemetry.metric_reader.get_metrics_data())

The encoders are the ones the OTLP exporters call (``opentelemetry.exporter.otlp.proto.common``'s
for metrics; for spans :func:`commdebug_otel.otel.encoding.encode_spans`, the OTLP/gRPC exporter's,
which gives the same bytes as the SDK's that OTLP/HTTP calls), so ``raw`` is the protobuf body of one
request holding exactly those spans (or that metric export), and ``gzip`` the same body
compressed as with ``OTEL_EXPORTER_OTLP_COMPRESSION=gzip``. The Python OTLP exporters
send uncompressed unless that variable (or ``compression=``) says otherwise.
A trace's bytes here are one rank's share of it; with trace scope ``job`` every rank of a
trace block adds about as much.
"""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import Iterable
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

from commdebug_otel.otel.encoding import encode_spans

__all__ = ["WireBytes", "metric_series", "metric_wire", "trace_wire"]


@dataclasses.dataclass(frozen=True)
class WireBytes:
    """One OTLP protobuf request body's size: ``raw`` bytes and ``gzip``'d bytes."""

    raw: int
    gzip: int

    @classmethod
    def of(cls, body: bytes) -> WireBytes:
        return cls(len(body), len(gzip.compress(body)))


def trace_wire(spans: Iterable[Any]) -> dict[int, WireBytes]:
    """Per trace id, the size of one export request holding exactly that trace's finished spans."""
    by_trace: dict[int, list[Any]] = {}
    for span in spans:
        by_trace.setdefault(span.context.trace_id, []).append(span)
    return {trace_id: WireBytes.of(encode_spans(group).SerializeToString())
            for trace_id, group in by_trace.items()}


def metric_wire(data: Any) -> WireBytes:
    """The size of one metric export request carrying ``data`` (a ``MetricsData``, e.g. from
    ``InMemoryMetricReader.get_metrics_data()``)."""
    return WireBytes.of(encode_metrics(data).SerializeToString())


def metric_series(data: Any) -> dict[str, int]:
    """Series per instrument in ``data``: its data points (one label set each); a histogram point
    is one series here and ``len(bounds) + 3`` in Prometheus (buckets with ``+Inf``, sum, count)."""
    series: dict[str, int] = {}
    if data is None:
        return series
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                series[metric.name] = series.get(metric.name, 0) + len(metric.data.data_points)
    return series
