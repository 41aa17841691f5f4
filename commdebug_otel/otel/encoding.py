"""OTLP span encoding (protobuf, and the OTLP-JSON file exporter's) that reuses the attributes spans repeat.

Usage::

    from commdebug_otel.otel.encoding import encode_spans, encode_spans_json

    request = encode_spans(spans)        # an ExportTraceServiceRequest
    body = request.SerializeToString()   # the same bytes as the SDK's encode_spans gives
    line = encode_spans_json(spans)      # the SDK file exporter's line, without its newline

Our spans repeat the same attributes step after step (module names and types, pass,
depth, op names, dtypes, group names, placements), yet the SDK's ``encode_spans``
builds a fresh ``KeyValue`` for every attribute of every span and event, and hashes the
span's ``Resource`` (a ``json.dumps`` of all its attributes) once per span. Here the request
is written as protobuf wire bytes, which protobuf parses (and so checks) into the request; the
serialized ``KeyValue``s of repeating values are kept in a bounded per-process memo, and
resources are grouped by identity: about 30% of the SDK's time (``benchmarks/encoding.py``).

The OTLP-JSON file exporter's encoder (``opentelemetry.exporter.otlp.json.common``) builds a
dataclass per message, then a dict per dataclass, then ``json.dumps`` of the whole:
:func:`encode_spans_json` writes the line's text directly, the texts of repeating attributes
(and the escaped texts of long strings) from bounded memos: on demo steps about 40% of the time
and no young garbage collection (``benchmarks/encoding.py``).

The OTLP/gRPC and file span exporters built by :mod:`commdebug_otel.otel.telemetry` use them. Not
done here: the OTLP/HTTP exporter still encodes with the SDK's code (no seam).

This module is the one user of the exporter packages' private encoding helpers
(``opentelemetry.exporter.otlp.proto.common._internal``, ``...otlp.json.common._internal``),
which :mod:`commdebug_otel.otel._sdk` fetches: if they cannot be imported (another SDK version),
:func:`encode_spans` is the SDK's public one and :func:`encode_spans_json` dumps the SDK's dict.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _json_string  # what json.dumps writes for a str
from typing import Any

__all__ = ["MEMO_ENTRIES", "encode_spans", "encode_spans_json"]

# The file exporters' separators: json.dumps(request, separators=(",", ":")) is the SDK's line.
_dumps = functools.partial(json.dumps, separators=(",", ":"))
# Most encoded attribute messages kept. A training job repeats a few hundred (key, value)
# pairs; when the memo is full it is emptied and refilled with what still repeats.
MEMO_ENTRIES = 4096
# Longest string (characters, all elements of a tuple together) and tuple kept: longer
# values (exception messages, stack traces) rarely repeat, and this bounds the memo's
# memory to a few MB.
_MEMO_MAX_CHARS = 256
_MEMO_MAX_ITEMS = 16

# Values whose exact type keys the memo. Ints are kept: depth, call index, byte and
# element counts, group sizes repeat every step (on the demo step 18.5 us per span with
# them, 21.8 without; sequence numbers do not repeat: about 19 new entries a step).
# Floats are left out: durations never repeat (memoizing them gained nothing and added
# 18 entries a step), and 0.0 == -0.0 (two encodings) would share an entry.
_SCALARS = frozenset({str, bool, int, bytes, type(None)})
# Tuple elements, all of one type: the OTel attribute sequences.
_ITEMS = frozenset({str, bool, int, bytes})


def _memo_key(key: str, value: Any) -> tuple | None:
    """The memo key of one attribute, or None when its value is not worth keeping.

    The value's exact type is part of the key: ``True == 1 == 1.0`` with one hash in
    Python, but each encodes differently. A string value (most are) is keyed ``(key, value)``
    in :func:`_memoized` itself: no other value equals a ``str``, and no other key has two items.
    """
    if type(key) is not str:  # 1, True and 1.0 are one dict key, but each encodes differently
        return None
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


def _memoized(attributes: Mapping[str, Any], memo: dict, encode: Any, encode_all: Any, inline: Any = None) -> list:
    """The encoded ``attributes``: from ``memo`` where kept, else ``encode(key, value)`` (then kept).

    ``inline(key, value)``: the encoding of a value not worth keeping, or None for ``encode``'s.
    A value ``encode`` fails on goes through ``encode_all({key: value})``: the SDK's own path,
    which logs the failure and leaves the attribute out.
    """
    encoded = []
    for key, value in attributes.items():
        if type(value) is str and type(key) is str and len(value) <= _MEMO_MAX_CHARS:
            memo_key: tuple | None = (key, value)
        else:
            memo_key = _memo_key(key, value)
        if memo_key is not None:
            entry = memo.get(memo_key)
            if entry is not None:
                encoded.append(entry)
                continue
        elif inline is not None:
            entry = inline(key, value)
            if entry is not None:
                encoded.append(entry)
                continue
        try:
            entry = encode(key, value)
        except Exception:
            encoded.extend(encode_all({key: value}))
            continue
        if memo_key is not None:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[memo_key] = entry
        encoded.append(entry)
    return encoded


def _grouped(spans: Sequence[Any], encode: Any) -> dict[Any, dict[Any, list]]:
    """``{resource: {scope: [encode(span), ...]}}``, both in order of first appearance, as the SDK groups.

    Resources are looked up by identity first: the SDK's per-span hash of a Resource dumps all
    its attributes to JSON. Equal resources still share one group (the first one's object).
    """
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
        encoded = encode(span)
        group = scopes.get(scope)
        if group is None:
            scopes[scope] = [encoded]
        else:
            group.append(encoded)
    return by_resource


try:
    from commdebug_otel.otel._sdk import otlp_proto_encoding

    _pb = otlp_proto_encoding()
    _encode_attributes, _encode_instrumentation_scope = _pb.encode_attributes, _pb.encode_instrumentation_scope
    _encode_key_value, _encode_resource = _pb.encode_key_value, _pb.encode_resource
    _encode_span_id, _encode_trace_id = _pb.encode_span_id, _pb.encode_trace_id
    _SPAN_KIND_MAP, _encode_parent_id = _pb.SPAN_KIND_MAP, _pb.encode_parent_id
    _encode_status, _encode_trace_state, _span_flags = _pb.encode_status, _pb.encode_trace_state, _pb.span_flags
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as _sdk_encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as PBSpan
    from opentelemetry.trace import SpanContext
except ImportError:  # another exporter version: its public encoder, unmemoized
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
else:
    import struct

    # Encoded KeyValue messages, each with its length prefix: a span's attributes field is its tag
    # (then the entry) per attribute, an event's another tag (_fields).
    _memo: dict[tuple, bytes] = {}
    _VARINT_1 = [bytes((n,)) for n in range(128)]
    _FIXED64, _FIXED32, _DOUBLE = struct.Struct("<Q").pack, struct.Struct("<I").pack, struct.Struct("<d").pack
    _KINDS = {kind: _VARINT_1[number] for kind, number in _SPAN_KIND_MAP.items()}
    # Span.flags (field 16, fixed32): the parent's is-remote bit is known (the SDK's _span_flags).
    _FLAGS = {remote: b"\x85\x01" + _FIXED32(_span_flags(SpanContext(1, 1, remote))) for remote in (False, True)}

    def _varint(value: int) -> bytes:
        if value < 128:
            return _VARINT_1[value]
        out = bytearray()
        while value > 127:
            out.append(value & 127 | 128)
            value >>= 7
        out.append(value)
        return bytes(out)

    def _prefixed(payload: bytes) -> bytes:
        return _varint(len(payload)) + payload

    def _count(value: Any) -> bytes:
        """A uint32 field's varint; raises for what protobuf would reject or convert (the SDK's path then)."""
        if type(value) is not int or not 0 <= value < 1 << 32:
            raise ValueError("not a uint32")
        return _varint(value)

    def _time(value: Any) -> bytes:
        """A fixed64 time field; raises for what protobuf would reject or convert (the SDK's path then)."""
        if type(value) is not int:
            raise TypeError("not an int")
        return _FIXED64(value)  # struct.error past 64 bits or below 0

    def _wire_key_value(key: str, value: Any) -> bytes:
        """One attribute as the SDK converts it (raises where it cannot), serialized and length-prefixed."""
        return _prefixed(_encode_key_value(key, value).SerializeToString())

    def _wire_attributes(attributes: Mapping[str, Any]) -> list:
        """What the SDK's ``_encode_attributes`` keeps of ``attributes`` (it logs what it leaves out)."""
        return [_prefixed(message.SerializeToString()) for message in _encode_attributes(attributes)]

    def _wire_inline(key: str, value: Any) -> bytes | None:
        """The entry of a value the memo does not keep (floats, long strings), or None: the SDK's conversion."""
        kind = type(value)
        if type(key) is not str or (kind is not float and kind is not str):
            return None
        try:
            name = key.encode("utf-8")
            if kind is float:  # AnyValue.double_value (field 4, fixed64)
                return _prefixed(b"\x0a" + _prefixed(name) + b"\x12\x09\x21" + _DOUBLE(value))
            text = value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the SDK's path, which refuses it as the SDK does
            return None
        return _prefixed(b"\x0a" + _prefixed(name) + b"\x12" + _prefixed(b"\x0a" + _prefixed(text)))

    def _fields(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
        """``attributes`` as repeated KeyValue fields of ``tag``, from the memo where kept."""
        if not attributes:
            return b""
        entries = _memoized(attributes, _memo, _wire_key_value, _wire_attributes, _wire_inline)
        return tag + tag.join(entries) if entries else b""

    def _message_span(span: Any) -> PBSpan:
        """The SDK's ``Span`` message for ``span`` (links and trace state: rare, the SDK's helpers)."""
        context = span.get_span_context()
        return PBSpan(
            trace_id=_encode_trace_id(context.trace_id), span_id=_encode_span_id(context.span_id),
            trace_state=_encode_trace_state(context.trace_state), parent_span_id=_encode_parent_id(span.parent),
            name=span.name, kind=_SPAN_KIND_MAP[span.kind], start_time_unix_nano=span.start_time,
            end_time_unix_nano=span.end_time, attributes=_encode_attributes(span.attributes),
            events=[PBSpan.Event(name=event.name, time_unix_nano=event.timestamp,
                                 attributes=_encode_attributes(event.attributes),
                                 dropped_attributes_count=event.dropped_attributes) for event in span.events],
            links=[PBSpan.Link(trace_id=_encode_trace_id(link.context.trace_id),
                               span_id=_encode_span_id(link.context.span_id),
                               attributes=_encode_attributes(link.attributes),
                               dropped_attributes_count=link.dropped_attributes, flags=_span_flags(link.context))
                   for link in span.links],
            status=_encode_status(span.status), dropped_attributes_count=span.dropped_attributes,
            dropped_events_count=span.dropped_events, dropped_links_count=span.dropped_links,
            flags=_span_flags(span.parent))

    def _wire_span(span: Any) -> bytes:
        """``span`` as a serialized ``Span`` message (fields in any order: protobuf parses them back)."""
        try:
            return _fast_span(span)
        except Exception:  # an odd field: the SDK's message, which raises what the SDK's encoder raises
            return _message_span(span).SerializeToString()

    def _fast_span(span: Any) -> bytes:
        context = span.get_span_context()
        if span.links or context.trace_state:
            raise LookupError("links and trace state take the SDK's message")
        parent, status = span.parent, span.status
        parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
        if parent:
            parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
        parts += (b"\x2a", _prefixed(span.name.encode("utf-8")), b"\x30", _KINDS[span.kind],
                  b"\x39", _time(span.start_time), b"\x41", _time(span.end_time),
                  _fields(b"\x4a", span.attributes))
        for event in span.events:
            body = b"\x09" + _time(event.timestamp) + b"\x12" + _prefixed(event.name.encode("utf-8")) + \
                _fields(b"\x1a", event.attributes)
            if event.dropped_attributes:
                body += b"\x20" + _count(event.dropped_attributes)
            parts += (b"\x5a", _prefixed(body))
        for tag, count in ((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                           (b"\x70", span.dropped_links)):
            if count:
                parts += (tag, _count(count))
        # Status (field 15) is always there, as the SDK sets it: its code, and its description if any.
        description = status.description
        body = b"\x18" + _varint(status.status_code.value) if status.status_code.value else b""
        if description is not None:
            body = b"\x12" + _prefixed(description.encode("utf-8")) + body
        parts += (b"\x7a", _prefixed(body), _FLAGS[bool(parent and parent.is_remote)])
        return b"".join(parts)

    def _field(tag: bytes, payload: bytes) -> bytes:
        return tag + _prefixed(payload)

    def encode_spans(spans: Sequence[Any]) -> ExportTraceServiceRequest:  # type: ignore[misc]  # (any span objects)
        """One OTLP export request for ``spans``, as the SDK's ``encode_spans`` builds it.

        ``spans``: SDK ``ReadableSpan`` objects. ``SerializeToString()`` of the result is
        byte for byte the SDK's: spans grouped by equal resource, then by instrumentation
        scope, both in order of first appearance. An attribute the SDK cannot encode is
        logged and left out, as there. Built as protobuf wire bytes (spans with links or a
        trace state: the SDK's message), which protobuf parses into the request: on demo steps
        about 55% of the time of building the messages field by field, 30% of the SDK's.

        Raises:
            KeyError: a span kind the SDK does not know (as the SDK's encoder).
            ValueError, TypeError: a span field protobuf rejects (as the SDK's encoder).
        """
        request = []
        for resource, scopes in _grouped(spans, _wire_span).items():
            body = [_field(b"\x0a", _encode_resource(resource).SerializeToString())]
            for scope, group in scopes.items():
                scope_spans = [_field(b"\x0a", _encode_instrumentation_scope(scope).SerializeToString())]
                scope_spans += [_field(b"\x12", span) for span in group]
                if scope is not None and scope.schema_url:
                    scope_spans.append(_field(b"\x1a", scope.schema_url.encode("utf-8")))
                body.append(_field(b"\x12", b"".join(scope_spans)))
            if resource.schema_url:
                body.append(_field(b"\x1a", resource.schema_url.encode("utf-8")))
            request.append(_field(b"\x0a", b"".join(body)))
        try:
            return ExportTraceServiceRequest.FromString(b"".join(request))
        except Exception:  # protobuf's nesting limit counts from the request: an attribute deep enough
            return _sdk_encode_spans(spans)  # for it alone is the SDK's to encode, or to refuse


try:
    from commdebug_otel.otel._sdk import otlp_json_encoding

    _js = otlp_json_encoding()
    _json_key_value, _json_attributes = _js.encode_key_value, _js.encode_attributes
    _json_scope, _json_resource = _js.encode_instrumentation_scope, _js.encode_resource
    _JSON_KINDS, _json_span, _json_float = _js.SPAN_KIND_MAP, _js.encode_span, _js.encode_float
    _json_status, _json_flags = _js.encode_status, _js.span_flags
except (ImportError, AttributeError):  # another exporter version: the SDK's own dict
    def encode_spans_json(spans: Sequence[Any]) -> str | None:
        """The SDK file exporter's OTLP-JSON line for ``spans``, without its newline (None when there are none)."""
        from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as sdk

        data = sdk(spans)
        return _dumps(data.to_dict()) if data.resource_spans else None
else:
    _json_memo: dict[tuple, str] = {}  # KeyValue texts
    # Long strings (an FQN deep in a model, 1,800 characters at 300 levels) repeat step after step too:
    # their escaped text is kept apart, up to this many characters in all (then emptied).
    _LONG_TEXT_CHARS = 4 * 2**20
    _long_texts: dict[str, str] = {}
    _long_chars = 0
    _status_texts: dict[Any, str] = {}

    def _escaped(text: str) -> str:
        """``json.dumps(text)``; long strings from their memo."""
        global _long_chars
        if len(text) <= _MEMO_MAX_CHARS or type(text) is not str:
            return _json_string(text)
        escaped = _long_texts.get(text)
        if escaped is None:
            escaped = _json_string(text)
            if len(escaped) > _LONG_TEXT_CHARS // 16:  # a huge name or key: not kept
                return escaped
            if _long_chars + len(escaped) > _LONG_TEXT_CHARS:
                _long_texts.clear()
                _long_chars = 0
            _long_texts[text] = escaped
            _long_chars += len(escaped)
        return escaped

    def _json_key_value_text(key: str, value: Any) -> str:
        return _dumps(_json_key_value(key, value).to_dict())

    def _json_attribute_texts(attributes: Mapping[str, Any]) -> list:
        return [_dumps(key_value.to_dict()) for key_value in _json_attributes(attributes)]

    def _json_inline(key: str, value: Any) -> str | None:
        """Long strings and floats (durations), as ``KeyValue.to_dict()`` gives them; None for other values."""
        kind = type(value)
        if type(key) is not str or (kind is not str and kind is not float):
            return None
        inner = '{"stringValue":' + _escaped(value) + "}" if kind is str else \
            '{"doubleValue":' + _dumps(_json_float(value)) + "}"
        return '{"key":' + _escaped(key) + ',"value":' + inner + "}" if key else '{"value":' + inner + "}"

    def _json_attribute_list(attributes: Mapping[str, Any]) -> str:
        """``attributes`` as the text of a ``KeyValue`` list, from the memo where kept ("" when empty)."""
        texts = _memoized(attributes, _json_memo, _json_key_value_text, _json_attribute_texts, _json_inline)
        return "[" + ",".join(texts) + "]" if texts else ""

    def _int_text(value: Any) -> str:
        """An int field's text; raises for another type (the SDK's dict writes it as it is)."""
        if type(value) is not int:
            raise TypeError("not an int")
        return str(value)

    def _json_span_text(span: Any) -> str:
        """``span`` as the text of the SDK's ``Span.to_dict()`` (its own code where a field is rare or odd)."""
        try:
            return _fast_json_span(span)
        except Exception:  # raises what the SDK's encoder raises, if anything
            return _dumps(_json_span(span).to_dict())

    def _fast_json_span(span: Any) -> str:
        context, status = span.get_span_context(), span.status
        if (span.links or span.dropped_attributes or span.dropped_events or span.dropped_links or context is None
                or context.trace_state or status is None):
            raise LookupError("a rare field: the SDK's dict")
        # The keys in the SDK's order. Ids are fixed-size bytes in its message: always present, zero too.
        parts = ['{"traceId":"', context.trace_id.to_bytes(16, "big").hex(),
                 '","spanId":"', context.span_id.to_bytes(8, "big").hex(), '"']
        parent = span.parent
        if parent is not None:
            parts += (',"parentSpanId":"', parent.span_id.to_bytes(8, "big").hex(), '"')
        flags = _json_flags(parent)
        if flags:
            parts += (',"flags":', str(int(flags)))
        if span.name:
            parts += (',"name":', _escaped(span.name))
        kind = int(_JSON_KINDS[span.kind])
        if kind:
            parts += (',"kind":', str(kind))
        if span.start_time:
            parts += (',"startTimeUnixNano":"', _int_text(span.start_time), '"')
        if span.end_time:
            parts += (',"endTimeUnixNano":"', _int_text(span.end_time), '"')
        listed = _json_attribute_list(span.attributes) if span.attributes else ""
        if listed:
            parts += (',"attributes":', listed)
        if span.events:
            events = []
            for event in span.events:
                entry = []
                if event.timestamp:
                    entry.append('"timeUnixNano":"' + _int_text(event.timestamp) + '"')
                if event.name:
                    entry.append('"name":' + _escaped(event.name))
                listed = _json_attribute_list(event.attributes) if event.attributes else ""
                if listed:
                    entry.append('"attributes":' + listed)
                if event.dropped_attributes:
                    entry.append('"droppedAttributesCount":' + _int_text(event.dropped_attributes))
                events.append("{" + ",".join(entry) + "}")
            parts += (',"events":[', ",".join(events), "]")
        if status.description is None:  # the usual: one text per status code
            status_text = _status_texts.get(status.status_code)
            if status_text is None:
                status_text = _status_texts[status.status_code] = _dumps(_json_status(status).to_dict())
        else:
            status_text = _dumps(_json_status(status).to_dict())
        parts += (',"status":', status_text, "}")
        return "".join(parts)

    def encode_spans_json(spans: Sequence[Any]) -> str | None:
        """One OTLP-JSON export request for ``spans``: the SDK file exporter's line, without its newline.

        ``spans``: SDK ``ReadableSpan`` objects. Returns ``json.dumps(..., separators=(",", ":"))``
        of the SDK's ``encode_spans(spans).to_dict()`` (``opentelemetry.exporter.otlp.json.common``),
        the same characters, written directly: the texts of repeating attributes (and of long
        strings) come from bounded memos; None when ``spans`` is empty.

        Raises:
            KeyError: a span kind the SDK does not know (as the SDK's encoder).
        """
        if not spans:
            return None
        resource_texts = []
        for resource, scopes in _grouped(spans, _json_span_text).items():
            # The SDK's resource and scope messages are always set (empty ones too): always written.
            scope_texts = []
            for scope, group in scopes.items():
                schema = f',"schemaUrl":{_escaped(scope.schema_url)}' if scope is not None and scope.schema_url else ""
                scope_texts.append(f'{{"scope":{_dumps(_json_scope(scope).to_dict())},"spans":[{",".join(group)}]'
                                   f"{schema}}}")
            schema = f',"schemaUrl":{_escaped(resource.schema_url)}' if resource.schema_url else ""
            resource_texts.append(f'{{"resource":{_dumps(_json_resource(resource).to_dict())},'
                                  f'"scopeSpans":[{",".join(scope_texts)}]{schema}}}')
        return '{"resourceSpans":[' + ",".join(resource_texts) + "]}"
