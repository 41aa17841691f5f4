"""OTLP protobuf span encoding that reuses the attribute messages spans repeat.

Usage::

    from commdebug_otel.encoding import encode_spans

    request = encode_spans(spans)        # an ExportTraceServiceRequest
    body = request.SerializeToString()   # the same bytes as the SDK's encode_spans gives

Our spans repeat the same attributes step after step (module names and types, pass,
depth, op names, dtypes, group names, placements), yet the SDK's ``encode_spans``
builds a fresh ``KeyValue`` for every attribute of every span and event, and hashes the
span's ``Resource`` (a ``json.dumps`` of all its attributes) once per span. Here encoded
``KeyValue`` messages of repeating values are kept in a bounded per-process memo and
resources are grouped by identity, which about halves the encoding time.

The OTLP/gRPC span exporter built by :mod:`commdebug_otel.telemetry` uses it. Not
done here: the OTLP/HTTP and OTLP-JSON file exporters still encode with the SDK's code.

This module is the one door to the exporter package's private encoding helpers
(``opentelemetry.exporter.otlp.proto.common._internal``): if they cannot be imported
(another SDK version), :func:`encode_spans` is the SDK's public one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MEMO_ENTRIES", "encode_spans"]

# Most encoded attribute messages kept. A training job repeats a few hundred (key, value)
# pairs; when the memo is full it is emptied and refilled with what still repeats.
MEMO_ENTRIES = 4096
# Longest string (characters, all elements of a tuple together) and tuple kept: longer
# values (exception messages, stack traces) rarely repeat, and this bounds the memo's
# memory to a few MB.
_MEMO_MAX_CHARS = 256
_MEMO_MAX_ITEMS = 16

try:
    from opentelemetry.exporter.otlp.proto.common._internal import (
        _encode_attributes,
        _encode_instrumentation_scope,
        _encode_key_value,
        _encode_resource,
        _encode_span_id,
        _encode_trace_id,
    )
    from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
        _SPAN_KIND_MAP,
        _encode_parent_id,
        _encode_status,
        _encode_trace_state,
        _span_flags,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as PBSpan
except ImportError:  # another exporter version: its public encoder, unmemoized
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
else:
    # Values whose exact type keys the memo. Ints are kept: depth, call index, byte and
    # element counts, group sizes repeat every step (on the demo step 18.5 us per span with
    # them, 21.8 without; sequence numbers do not repeat: about 19 new entries a step).
    # Floats are left out: durations never repeat (memoizing them gained nothing and added
    # 18 entries a step), and 0.0 == -0.0 (two encodings) would share an entry.
    _SCALARS = frozenset({str, bool, int, bytes, type(None)})
    # Tuple elements, all of one type: the OTel attribute sequences.
    _ITEMS = frozenset({str, bool, int, bytes})
    _memo: dict[tuple, Any] = {}

    def _memo_key(key: str, value: Any) -> tuple | None:
        """The memo key of one attribute, or None when its value is not worth keeping.

        The value's exact type is part of the key: ``True == 1 == 1.0`` with one hash in
        Python, but each encodes differently.
        """
        kind = type(value)
        if kind in _SCALARS:
            if (kind is str or kind is bytes) and len(value) > _MEMO_MAX_CHARS:
                return None
            return key, kind, value
        if kind is tuple and len(value) <= _MEMO_MAX_ITEMS:
            item = type(value[0]) if value else None
            if value and (item not in _ITEMS or not all(type(v) is item for v in value)):
                return None
            if item in (str, bytes) and sum(map(len, value)) > _MEMO_MAX_CHARS:
                return None
            return key, tuple, item, value
        return None

    def _attributes(attributes: Mapping[str, Any] | None) -> list:
        """``KeyValue`` messages for ``attributes``, shared with earlier calls where memoized.

        Shared messages are safe: a repeated message field copies what it is given.
        """
        if not attributes:
            return []
        memo = _memo
        encoded = []
        for key, value in attributes.items():
            memo_key = _memo_key(key, value)
            if memo_key is not None:
                message = memo.get(memo_key)
                if message is not None:
                    encoded.append(message)
                    continue
            try:
                message = _encode_key_value(key, value)
            except Exception:
                # The SDK's own path: it logs the failure and leaves the attribute out.
                encoded.extend(_encode_attributes({key: value}))
                continue
            if memo_key is not None:
                if len(memo) >= MEMO_ENTRIES:
                    memo.clear()
                memo[memo_key] = message
            encoded.append(message)
        return encoded

    def _span(span: Any) -> PBSpan:
        context = span.get_span_context()
        events = None
        if span.events:
            events = [PBSpan.Event(name=event.name, time_unix_nano=event.timestamp,
                                   attributes=_attributes(event.attributes),
                                   dropped_attributes_count=event.dropped_attributes)
                      for event in span.events]
        links = None
        if span.links:
            links = [PBSpan.Link(trace_id=_encode_trace_id(link.context.trace_id),
                                 span_id=_encode_span_id(link.context.span_id),
                                 attributes=_attributes(link.attributes),
                                 dropped_attributes_count=link.dropped_attributes,
                                 flags=_span_flags(link.context))
                     for link in span.links]
        return PBSpan(
            trace_id=_encode_trace_id(context.trace_id),
            span_id=_encode_span_id(context.span_id),
            trace_state=_encode_trace_state(context.trace_state),
            parent_span_id=_encode_parent_id(span.parent),
            name=span.name,
            kind=_SPAN_KIND_MAP[span.kind],
            start_time_unix_nano=span.start_time,
            end_time_unix_nano=span.end_time,
            attributes=_attributes(span.attributes),
            events=events,
            links=links,
            status=_encode_status(span.status),
            dropped_attributes_count=span.dropped_attributes,
            dropped_events_count=span.dropped_events,
            dropped_links_count=span.dropped_links,
            flags=_span_flags(span.parent),
        )

    def encode_spans(spans: Sequence[Any]) -> ExportTraceServiceRequest:
        """One OTLP export request for ``spans``, as the SDK's ``encode_spans`` builds it.

        ``spans``: SDK ``ReadableSpan`` objects. ``SerializeToString()`` of the result is
        byte for byte the SDK's: spans grouped by equal resource, then by instrumentation
        scope, both in order of first appearance. An attribute the SDK cannot encode is
        logged and left out, as there.

        Raises:
            KeyError: a span kind the SDK does not know (as the SDK's encoder).
            ValueError, TypeError: a span field protobuf rejects (as the SDK's encoder).
        """
        # Resources are looked up by identity first: the SDK's per-span hash of a Resource
        # dumps all its attributes to JSON. Equal resources still share one group.
        by_id: dict[int, dict] = {}
        by_resource: dict[Any, dict] = {}
        for span in spans:
            resource = span.resource
            scopes = by_id.get(id(resource))
            if scopes is None:
                scopes = by_resource.get(resource)
                if scopes is None:
                    scopes = by_resource[resource] = {}
                by_id[id(resource)] = scopes
            scope = span.instrumentation_scope or None
            encoded = _span(span)
            group = scopes.get(scope)
            if group is None:
                scopes[scope] = [encoded]
            else:
                group.append(encoded)
        return ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(
                resource=_encode_resource(resource),
                scope_spans=[ScopeSpans(scope=_encode_instrumentation_scope(scope), spans=group,
                                        schema_url=scope.schema_url if scope else None)
                             for scope, group in scopes.items()],
                schema_url=resource.schema_url,
            )
            for resource, scopes in by_resource.items()
        ])
