"""Every touch of the OpenTelemetry SDK's private attributes, in one place.

An SDK upgrade that renames one of these breaks this file only. Each reader
returns None (or does nothing) when the attribute is missing or has another
shape, and its caller then takes the SDK's public path: spans and points are
still exported, only our shortcuts or counts are lost.
"""

from __future__ import annotations

import collections
from typing import Any


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


def exporter_preferences(exporter: Any) -> dict[str, Any]:
    """A ``MetricExporter``'s temporality and aggregation preferences, as constructor keywords."""
    return {"preferred_temporality": getattr(exporter, "_preferred_temporality", None),
            "preferred_aggregation": getattr(exporter, "_preferred_aggregation", None)}
