"""Test helpers for users and for our own tests: in-memory telemetry and span-tree views.

Usage::

    from commdebug_otel import CommTracer
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    with CommTracer(tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        model(x).sum().backward()
    tree = telemetry.tree()           # [(depth, span name), ...] in start order
    counts = telemetry.event_counts() # {(span name, event name): n}

``otlp_receiver.OtlpReceiver`` is a real OTLP gRPC + HTTP receiver for tests
that check what arrives on the wire.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commdebug_otel.core.ids import RNG as OWN_RNG
from commdebug_otel.otel._sdk import own_random_views
from commdebug_otel.otel.spans import OwnIdGenerator

__all__ = ["InMemoryTelemetry"]


class InMemoryTelemetry:
    """A tracer provider and meter provider that keep everything in memory.

    Args:
        max_events: the SDK's span event limit (default 4096, above our own cap).
        resource: both providers' ``Resource`` (default: the SDK's), e.g. to measure
            request sizes with a job's real resource (``testing.wire``).
    """

    def __init__(self, max_events: int = 4096, resource: Any = None) -> None:
        extra = {} if resource is None else {"resource": resource}
        self.span_exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(span_limits=SpanLimits(max_events=max_events),
                                              id_generator=OwnIdGenerator(), **extra)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))
        self.metric_reader = InMemoryMetricReader()
        # Ids and exemplar sampling from our own random source, as in our own providers: a seeded test's
        # random numbers are the same with and without tracing.
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader],
                                            views=own_random_views(OWN_RNG), **extra)

    def spans(self) -> list[Any]:
        """Finished spans, sorted by start time then name."""
        return sorted(self.span_exporter.get_finished_spans(),
                      key=lambda span: (span.start_time, span.name))

    def by_name(self, name: str) -> list[Any]:
        return [span for span in self.spans() if span.name == name]

    def one(self, name: str) -> Any:
        found = self.by_name(name)
        if len(found) != 1:
            raise AssertionError(f"expected one span {name!r}, found {len(found)}")
        return found[0]

    def parent_name(self, span: Any) -> str | None:
        """The name of ``span``'s parent, or None for a root."""
        if span.parent is None:
            return None
        for candidate in self.span_exporter.get_finished_spans():
            if candidate.context.span_id == span.parent.span_id:
                return candidate.name
        return "<missing>"

    def tree(self) -> list[tuple[int, str]]:
        """``[(depth, name)]`` in depth-first order, children by start time."""
        spans = self.spans()
        by_parent: dict[int | None, list[Any]] = {}
        ids = {span.context.span_id for span in spans}
        for span in spans:
            parent = span.parent.span_id if span.parent is not None and span.parent.span_id in ids else None
            by_parent.setdefault(parent, []).append(span)
        out: list[tuple[int, str]] = []

        def walk(parent: int | None, depth: int) -> None:
            for span in by_parent.get(parent, []):
                out.append((depth, span.name))
                walk(span.context.span_id, depth + 1)

        walk(None, 0)
        return out

    def event_counts(self) -> Counter:
        """``{(span name, event name): count}`` over all finished spans."""
        counts: Counter = Counter()
        for span in self.spans():
            for event in span.events:
                counts[(span.name, event.name)] += 1
        return counts

    def metric_points(self, name: str) -> list[tuple[dict, Any]]:
        """``[(attributes, value or histogram point)]`` for the metric ``name``."""
        data = self.metric_reader.get_metrics_data()
        points = []
        for resource_metrics in (data.resource_metrics if data else []):
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            points.append((dict(point.attributes or {}), getattr(point, "value", point)))
        return points

    def clear(self) -> None:
        self.span_exporter.clear()
