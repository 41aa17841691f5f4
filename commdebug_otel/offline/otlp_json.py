"""OTLP-JSON (the OTel file exporter's format) and OTLP protobuf requests as plain span and metric dicts.

The one reader of the offline views (``summarize``, ``diagnose``, ``perfetto``, and
``diagnose --jaeger/--tempo`` through :mod:`.backends`): :func:`read_spans` streams the spans
of files and folders, :func:`spans_from_otlp_json` decodes one object. Used too by the test
receiver (``commdebug_otel.testing.otlp_receiver`` re-exports the public names). OTLP/JSON
writes trace and span ids as hex, not base64 as protobuf's generic JSON mapping does, and
64-bit integers as strings.

Damaged input (see docs/offline.md, "What is skipped"): every field a span's line is read
for is checked (types, hex ids, integer ranges, finite numbers, the attributes the views
compute with); a line that fails is skipped whole, the other lines are kept, and each file
with skipped lines gets one message. Only regular files are opened (a FIFO or a device
named ``*.jsonl`` is skipped unopened), a line over :data:`MAX_LINE_BYTES` is skipped
without being held in memory, and a span read twice (same trace and span id) is kept once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import math
import os
import re
import stat
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as _mpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as _tpb

from commdebug_otel import semconv
from commdebug_otel.offline.model import process_of

try:  # faster than json; json reads what it refuses (see SpanReader._decode)
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency, but the stdlib reads the same
    _orjson = None  # type: ignore[assignment]

__all__ = ["ATTRIBUTE_TYPES", "MAX_LINE_BYTES", "MAX_RANKS", "BadData", "Fold", "SpanReader", "decode_any_value",
           "metric_dicts", "metrics_from_otlp_json", "parse_otlp_json", "ranked", "read_spans", "span_dicts",
           "spans_from_otlp_json", "to_otlp_json", "trace_files"]

_SIGNALS: dict[str, tuple[Any, Any]] = {
    "traces": (_tpb.ExportTraceServiceRequest, _tpb.ExportTraceServiceResponse),
    "metrics": (_mpb.ExportMetricsServiceRequest, _mpb.ExportMetricsServiceResponse),
}
_HEX_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def decode_any_value(any_value: Any) -> Any:
    """Turn an OTLP ``AnyValue`` into str/bool/int/float/bytes, a list, a dict or None."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [decode_any_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return _attrs(any_value.kvlist_value.values)
    return getattr(any_value, kind)


def _attrs(key_values: Any) -> dict[str, Any]:
    return {kv.key: decode_any_value(kv.value) for kv in key_values}


def _scoped_items(resources: Any, scopes_field: str, items_field: str) -> Iterator[tuple[dict, str, Any]]:
    """``(resource attributes, scope name, item)`` for every span or metric of an OTLP request."""
    for entry in resources:
        resource = _attrs(entry.resource.attributes)
        for scoped in getattr(entry, scopes_field):
            for item in getattr(scoped, items_field):
                yield resource, scoped.scope.name, item


def span_dicts(req: Any, transport: str) -> list[dict[str, Any]]:
    """Span dicts from an ``ExportTraceServiceRequest``; ids as lowercase hex, times in ns since the epoch."""
    out = []
    for resource, scope, s in _scoped_items(req.resource_spans, "scope_spans", "spans"):
        out.append({
            "name": s.name,
            "trace_id": s.trace_id.hex(),
            "span_id": s.span_id.hex(),
            "parent_span_id": s.parent_span_id.hex(),
            "kind": int(s.kind),
            "start_ns": int(s.start_time_unix_nano),
            "end_ns": int(s.end_time_unix_nano),
            "attributes": _attrs(s.attributes),
            "events": [
                {"name": e.name, "time_ns": int(e.time_unix_nano),
                 "attributes": _attrs(e.attributes)}
                for e in s.events
            ],
            "status_code": int(s.status.code),
            "status_message": s.status.message,
            "resource": resource,
            "scope": scope,
            "transport": transport,
            "dropped_events_count": int(s.dropped_events_count),
            "dropped_attributes_count": int(s.dropped_attributes_count),
        })
    return out


def _point_dicts(metric: Any) -> list[dict[str, Any]]:
    kind = metric.WhichOneof("data")
    if kind is None:
        return []
    data = getattr(metric, kind)
    out = []
    for p in data.data_points:
        d: dict[str, Any] = {
            "kind": kind,
            "attributes": _attrs(p.attributes),
            "time_ns": int(p.time_unix_nano),
            "start_ns": int(p.start_time_unix_nano),
            "is_monotonic": bool(getattr(data, "is_monotonic", False)),
        }
        if kind in ("sum", "gauge"):
            d["value"] = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
        else:  # histogram, exponential_histogram, summary
            d["count"] = int(p.count)
            d["sum"] = p.sum
            if kind == "histogram":
                d["bucket_counts"] = [int(c) for c in p.bucket_counts]
                d["explicit_bounds"] = list(p.explicit_bounds)
        out.append(d)
    return out


def metric_dicts(req: Any, transport: str) -> list[dict[str, Any]]:
    """One dict per data point of an ``ExportMetricsServiceRequest``, with its metric's name and unit."""
    out = []
    for resource, scope, m in _scoped_items(req.resource_metrics, "scope_metrics", "metrics"):
        for d in _point_dicts(m):
            out.append({"name": m.name, "unit": m.unit, **d, "resource": resource, "scope": scope,
                        "transport": transport})
    return out


def _hex_ids_to_base64(obj: Any) -> Any:
    """OTLP-JSON writes ids as hex; protobuf's JSON mapping expects base64."""
    if isinstance(obj, list):
        return [_hex_ids_to_base64(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    return {
        k: base64.b64encode(bytes.fromhex(v)).decode("ascii")
        if k in _HEX_ID_KEYS and isinstance(v, str) else _hex_ids_to_base64(v)
        for k, v in obj.items()
    }


def _base64_ids_to_hex(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_base64_ids_to_hex(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    return {k: base64.b64decode(v).hex() if k in _HEX_ID_KEYS and isinstance(v, str) else _base64_ids_to_hex(v)
            for k, v in obj.items()}


def to_otlp_json(request: Any) -> str:
    """One export request (protobuf) as one OTLP-JSON line, without its newline: ids hex, enums as
    integers, 64-bit integers as strings; :func:`parse_otlp_json` reads it back to an equal request."""
    obj = json_format.MessageToDict(request, use_integers_for_enums=True)
    return json.dumps(_base64_ids_to_hex(obj), separators=(",", ":"))


def parse_otlp_json(obj: dict | str | bytes, signal: str, hex_ids: bool = True) -> Any:
    """One OTLP-JSON object (or its text) as the ``signal`` ("traces"/"metrics") export request.

    ``hex_ids``: ids are hex, as OTLP/JSON writes them; False for protobuf's generic JSON
    mapping (base64), as Tempo's HTTP API returns them.

    Raises:
        json.JSONDecodeError, google.protobuf.json_format.ParseError: not OTLP-JSON.
    """
    if isinstance(obj, (str, bytes)):
        obj = json.loads(obj)
    msg = _SIGNALS[signal][0]()
    return json_format.ParseDict(_hex_ids_to_base64(obj) if hex_ids else obj, msg, ignore_unknown_fields=True)


def spans_from_otlp_json(obj: dict | str | bytes, hex_ids: bool = True) -> list[dict[str, Any]]:
    """Span dicts (as ``OtlpReceiver.spans()``, transport "file") from one OTLP-JSON object/line.

    ``hex_ids``: as :func:`parse_otlp_json`. Every field is checked as :func:`read_spans` checks it;
    the known attributes come back normalised (an integer written as a decimal string is an int).

    Raises:
        json.JSONDecodeError: text that is not JSON.
        BadData: an object that is not an OTLP-JSON trace request, or a field of the wrong type.
    """
    if isinstance(obj, (str, bytes)):
        obj = json.loads(obj)
    return _decode_traces(obj, hex_ids)


def metrics_from_otlp_json(obj: dict | str | bytes) -> list[dict[str, Any]]:
    """Data-point dicts (as ``OtlpReceiver.metrics()``, transport "file") from one OTLP-JSON object/line."""
    return metric_dicts(parse_otlp_json(obj, "metrics"), "file")



# ------------------------------------------------------------ the one reader

#: The longest line read (bytes); a longer one is skipped without being held. An OTLP-JSON line is
#: one export request: the embedded exporter's are a few MiB at most, a Collector's batch tens.
MAX_LINE_BYTES = 64 << 20
#: Ranks, world sizes and process group sizes read are below this: a larger one is damage, not a job.
MAX_RANKS = 1 << 20
#: The deepest nesting of attribute values (arrays and key-value lists in arrays) read.
MAX_VALUE_DEPTH = 16
_CHUNK = 1 << 20
#: Files holding at least this many bytes in all are read by one process per CPU (``SpanReader(workers=None)``).
PARALLEL_MIN_BYTES = 32 << 20
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (0, (1 << 64) - 1)
_HEX = re.compile(r"[0-9a-fA-F]+\Z")
_DECIMAL = re.compile(r"-?[0-9]+\Z")
# A \\uD800-\\uDFFF escape that is not half of a pair: json.loads would make a lone surrogate,
# which no UTF-8 output (print, json.dump) can write.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"


class BadData(ValueError):
    """One OTLP-JSON object that cannot be read as spans; ``str()`` says why, in a few words."""


_SNAKE: dict[str, str] = {}


def _get(obj: dict, camel: str) -> Any:
    """A field by its OTLP-JSON (lowerCamelCase) name or its proto name (snake_case), as protobuf reads both."""
    value = obj.get(camel)
    if value is None:
        snake = _SNAKE.get(camel)
        if snake is None:
            snake = _SNAKE[camel] = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), camel)
        value = obj.get(snake)
    return value


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadData(f"{what} is {type(value).__name__}, expected an object")
    return value


def _list(value: Any, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadData(f"{what} is {type(value).__name__}, expected a list")
    return value


def _str(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadData(f"{what} is {type(value).__name__}, expected a string")
    return value


def _int(value: Any, what: str, bounds: tuple[int, int] = _INT64) -> int:
    """An integer written as a JSON number or a decimal string (as OTLP-JSON writes 64-bit ones)."""
    kind = type(value)
    if kind is str and len(value) < 19 and value.isdigit() and value.isascii():  # the usual case, fast
        number = int(value)
    elif kind is int or (isinstance(value, int) and not isinstance(value, bool)):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _DECIMAL.match(value):
        if len(value) > 40:  # int() of a long digit string costs quadratic time
            raise BadData(f"{what} is out of range ({_brief(value)})")
        number = int(value)
    else:
        raise BadData(f"{what} is not an integer ({_brief(value)})")
    if not bounds[0] <= number <= bounds[1]:
        raise BadData(f"{what} {number} is out of range")
    return number


def _number(value: Any, what: str) -> float:
    """A finite number (an int or float; protobuf's "NaN"/"Infinity" strings are refused, as NaN is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str) and _DECIMAL.match(value) and len(value) <= 40:
            return float(int(value))
        raise BadData(f"{what} is not a number ({_brief(value)})")
    number = float(value)
    if not math.isfinite(number):
        raise BadData(f"{what} is not a finite number")
    return number


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _id(value: Any, what: str, size: int, hex_ids: bool, required: bool) -> str:
    """A trace (16 bytes) or span (8 bytes) id as lowercase hex; "" for an absent optional one."""
    if value is None or value == "":
        if required:
            raise BadData(f"a span has no {what}")
        return ""
    if not isinstance(value, str):
        raise BadData(f"{what} is {type(value).__name__}, expected a string")
    if hex_ids:
        if len(value) != 2 * size or not _HEX.match(value):
            raise BadData(f"{what} is not {2 * size} hex digits ({_brief(value)})")
        return value.lower()
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadData(f"{what} is not base64 ({_brief(value)})") from None
    if len(raw) != size:
        raise BadData(f"{what} is not {size} bytes ({_brief(value)})")
    return raw.hex()


def _any_value(value: Any, depth: int = 0) -> Any:
    """An OTLP-JSON ``AnyValue`` object as str/bool/int/float/bytes, a list, a dict or None."""
    if not isinstance(value, dict):
        raise BadData(f"an attribute value is {type(value).__name__}, expected an object")
    if depth > MAX_VALUE_DEPTH:
        raise BadData(f"an attribute value nested deeper than {MAX_VALUE_DEPTH}")
    for key, inner in value.items():  # one key: the oneof's field (unknown keys are passed over)
        kind = _ANY_KINDS.get(key)
        if kind is not None and inner is not None:
            return kind(inner, depth)
    return None


def _bool(flag: Any, depth: int) -> bool:
    if not isinstance(flag, bool):
        raise BadData(f"a boolValue is {type(flag).__name__}")
    return flag


def _bytes(raw: Any, depth: int) -> bytes:
    try:
        return base64.b64decode(_str(raw, "a bytesValue"), validate=True)
    except (binascii.Error, ValueError):
        raise BadData("a bytesValue is not base64") from None


def _array(array: Any, depth: int) -> list:
    return [_any_value(item, depth + 1)
            for item in _list(_object(array, "an arrayValue").get("values"), "an arrayValue's values")]


def _kvlist(kvlist: Any, depth: int) -> dict:
    return _attributes(_object(kvlist, "a kvlistValue").get("values"), depth + 1)


_ANY_KINDS: dict[str, Callable[[Any, int], Any]] = {}
for _name, _kind in (("stringValue", lambda text, depth: _str(text, "a stringValue")), ("boolValue", _bool),
                     ("intValue", lambda number, depth: _int(number, "an intValue")),
                     ("doubleValue", lambda number, depth: _number(number, "a doubleValue")),
                     ("arrayValue", _array), ("kvlistValue", _kvlist), ("bytesValue", _bytes)):
    _ANY_KINDS[_name] = _ANY_KINDS[re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), _name)] = _kind


def _attributes(key_values: Any, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fast = depth <= MAX_VALUE_DEPTH
    for item in _list(key_values, "attributes"):
        # The usual shapes inline (most of a file's bytes are attributes); anything else is checked in full.
        if fast and type(item) is dict:
            key, value = item.get("key"), item.get("value")
            if type(key) is str and type(value) is dict and len(value) == 1:
                (kind, inner), = value.items()
                key = _share(key, key)
                if kind == "stringValue" and type(inner) is str:
                    out[key] = _share(inner, inner)
                    continue
                if kind == "intValue" and type(inner) is str and len(inner) < 19 and inner.isdigit() \
                        and inner.isascii():
                    out[key] = int(inner)
                    continue
                if kind == "doubleValue" and type(inner) is float and -_HUGE < inner < _HUGE:
                    out[key] = inner
                    continue
                if kind == "arrayValue" and depth < MAX_VALUE_DEPTH and type(inner) is dict and len(inner) == 1:
                    plain = _plain_array(inner.get("values"))
                    if plain is not None:
                        out[key] = plain
                        continue
        item = _object(item, "an attribute")
        out[_str(item.get("key"), "an attribute key")] = _any_value(item.get("value", {}), depth)
    return out


def _plain_array(values: Any) -> list | None:
    """An ``arrayValue``'s values when each is a string or a decimal integer (shapes, names), else None."""
    if type(values) is not list:
        return None
    out: list[int | str] = []
    for value in values:
        if type(value) is not dict or len(value) != 1:
            return None
        (kind, inner), = value.items()
        if kind == "intValue" and type(inner) is str and len(inner) < 19 and inner.isdigit() and inner.isascii():
            out.append(int(inner))
        elif kind == "stringValue" and type(inner) is str:
            out.append(_share(inner, inner))
        else:
            return None
    return out


_HUGE = float("inf")
#: One copy of each attribute key, span name, trace id and short attribute text read (json.loads makes a new
#: string for each): a file's thousands of spans repeat a few hundred of them. Emptied when it grows past
#: _SHARED_MAX (cleared between lines only), so it stays bounded whatever the input.
_SHARED: dict[str, str] = {}
_SHARED_MAX = 1 << 16
_share = _SHARED.setdefault


def _seconds(value: Any, what: str) -> float:
    """A finite number of seconds within 30 years either way: a larger one is damage (and overflows ns)."""
    number = _number(value, what)
    if abs(number) > 1e9:
        raise BadData(f"{what} {number:g} is out of range")
    return number


def _int_in(low: int, high: int) -> Callable[[Any, str], int]:
    return lambda value, what: _int(value, what, (low, high))


def _int_list(value: Any, what: str) -> list[int]:
    return [_int(item, what) for item in _list(value, what)]


def _str_list(value: Any, what: str) -> list[str]:
    return [_str(item, what) for item in _list(value, what)]


def _scalar_list(value: Any, what: str) -> list:
    items = _list(value, what)
    if any(isinstance(item, (list, dict)) for item in items):
        raise BadData(f"{what} holds a list or map, expected plain values")
    return items


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise BadData(f"{what} is {type(value).__name__}, expected a string")
    return value


#: The attributes the offline views compute with, and how each is checked (and normalised: an integer
#: written as a decimal string, as ``OTEL_RESOURCE_ATTRIBUTES`` writes ranks, becomes an int).
ATTRIBUTE_TYPES: dict[str, Callable[[Any, str], Any]] = {
    **dict.fromkeys((semconv.STEP, semconv.MODULE_DEPTH, semconv.MODULE_CALL_INDEX, semconv.SPAN_DROPPED_EVENTS,
                     semconv.STEP_PART, semconv.STEP_STALLED, semconv.STALL_SNAPSHOT, semconv.COLLECTIVE_BYTES,
                     semconv.COLLECTIVE_INPUT_ELEMENTS, semconv.COLLECTIVE_OUTPUT_ELEMENTS,
                     semconv.COLLECTIVE_SEQ), _int),
    semconv.COLLECTIVE_PEER: _int_in(0, MAX_RANKS - 1),
    semconv.PROCESS_GROUP_SIZE: _int_in(1, MAX_RANKS),
    semconv.RANK: _int_in(0, MAX_RANKS - 1),
    semconv.WORLD_SIZE: _int_in(0, MAX_RANKS),
    **dict.fromkeys((semconv.COLLECTIVE_DURATION, semconv.STALL_AGE, semconv.STALL_THRESHOLD,
                     semconv.STEP_COLLECTIVE_WAIT, semconv.STEP_CPU_WAIT), _seconds),
    **dict.fromkeys((semconv.STALL_ISSUED_SEQ, semconv.STALL_COMPLETED_SEQ, semconv.STEP_COLLECTIVE_COUNTS,
                     semconv.STEP_COLLECTIVE_FIRST_SEQ, semconv.COLLECTIVE_SHAPE), _int_list),
    **dict.fromkeys((semconv.MODULE_PARAMETERS, semconv.STALL_STACK), _str_list),
    **dict.fromkeys((semconv.STALL_GROUPS, semconv.STEP_COLLECTIVE_GROUPS, semconv.STEP_COLLECTIVE_FINGERPRINTS,
                     semconv.DTENSOR_INPUT_SHAPES, semconv.DTENSOR_INPUT_PLACEMENTS, semconv.OP_INPUT_SHAPES),
                    _scalar_list),
    **dict.fromkeys((semconv.MODULE_FQN, semconv.MODULE_PASS, semconv.MODULE_TYPE, semconv.COLLECTIVE_OP,
                     semconv.OP_NAME, semconv.COLLECTIVE_DTYPE, semconv.COLLECTIVE_REDUCE_OP,
                     semconv.PROCESS_GROUP_NAME, semconv.STALL_MODULE, semconv.STALL_PASS,
                     semconv.COLLECTIVE_STATE, semconv.DEVICE_MESH), _text),
}


#: Per checked attribute, the values its check keeps as they are: (exact type, low, high); None bounds: any.
_KEPT: dict[str, tuple[type, Any, Any]] = {
    **{key: (int, *_INT64) for key, check in ATTRIBUTE_TYPES.items() if check is _int},
    semconv.COLLECTIVE_PEER: (int, 0, MAX_RANKS - 1), semconv.PROCESS_GROUP_SIZE: (int, 1, MAX_RANKS),
    semconv.RANK: (int, 0, MAX_RANKS - 1), semconv.WORLD_SIZE: (int, 0, MAX_RANKS),
    **{key: (float, -1e9, 1e9) for key, check in ATTRIBUTE_TYPES.items() if check is _seconds},
    **{key: (str, None, None) for key, check in ATTRIBUTE_TYPES.items() if check is _text},
}


def _checked(attributes: dict[str, Any]) -> dict[str, Any]:
    for key, value in attributes.items():
        if key not in ATTRIBUTE_TYPES:
            continue
        kept = _KEPT.get(key)
        if kept is not None and type(value) is kept[0] and (kept[1] is None or kept[1] <= value <= kept[2]):
            continue  # already what the check would make of it
        attributes[key] = ATTRIBUTE_TYPES[key](value, f"attribute {key}")
    return attributes


_SPAN_KINDS = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3,
               "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS_CODES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _enum(value: Any, names: dict[str, int], what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and value in names:
        return names[value]
    return _int(value, what, (0, max(names.values())))


def _span(s: Any, resource: dict, scope: str, hex_ids: bool) -> dict[str, Any]:
    s = _object(s, "a span")
    status = _object(s.get("status"), "a span's status")
    return {
        "name": _share(name := _str(s.get("name"), "a span's name"), name),
        "trace_id": _share(trace := _id(_get(s, "traceId"), "traceId", 16, hex_ids, True), trace),
        "span_id": _id(_get(s, "spanId"), "spanId", 8, hex_ids, True),
        "parent_span_id": _id(_get(s, "parentSpanId"), "parentSpanId", 8, hex_ids, False),
        "kind": _enum(s.get("kind"), _SPAN_KINDS, "a span's kind"),
        "start_ns": _int(_get(s, "startTimeUnixNano") or 0, "startTimeUnixNano", _UINT64),
        "end_ns": _int(_get(s, "endTimeUnixNano") or 0, "endTimeUnixNano", _UINT64),
        "attributes": _checked(_attributes(s.get("attributes"))),
        "events": [_event(event) for event in _list(s.get("events"), "a span's events")],
        "status_code": _enum(status.get("code"), _STATUS_CODES, "a status code"),
        "status_message": _str(status.get("message"), "a status message"),
        "resource": resource,
        "scope": scope,
        "transport": "file",
        "dropped_events_count": _int(_get(s, "droppedEventsCount") or 0, "droppedEventsCount", (0, 1 << 32)),
        "dropped_attributes_count": _int(_get(s, "droppedAttributesCount") or 0, "droppedAttributesCount",
                                         (0, 1 << 32)),
    }


def _event(event: Any) -> dict[str, Any]:
    event = _object(event, "an event")
    return {"name": _share(name := _str(event.get("name"), "an event's name"), name),
            "time_ns": _int(_get(event, "timeUnixNano") or 0, "an event's timeUnixNano", _UINT64),
            "attributes": _checked(_attributes(event.get("attributes")))}


def _decode_traces(request: Any, hex_ids: bool = True) -> list[dict[str, Any]]:
    """The spans of one ``ExportTraceServiceRequest`` (or ``TracesData``) object. Raises BadData."""
    request = _object(request, "the line")
    out = []
    for entry in _list(_get(request, "resourceSpans"), "resourceSpans"):
        entry = _object(entry, "a resourceSpans entry")
        resource = _checked(_attributes(_object(entry.get("resource"), "a resource").get("attributes")))
        for scoped in _list(_get(entry, "scopeSpans"), "scopeSpans"):
            scoped = _object(scoped, "a scopeSpans entry")
            scope = _str(_object(scoped.get("scope"), "a scope").get("name"), "a scope name")
            out += [_span(s, resource, scope, hex_ids) for s in _list(scoped.get("spans"), "spans")]
    return out


def ranked(spans: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """``spans`` with ``"rank"`` (the resource's ``torch.distributed.rank``, 0 when absent) and ``"file"`` added."""
    for span in spans:
        span["rank"] = span["resource"].get(semconv.RANK, 0)
        span["file"] = source
    return spans


def trace_files(paths: Iterable[str | os.PathLike], skipped: list[str] | None = None) -> list[str]:
    """The files to read: each path given, and every ``*.jsonl``/``*.json`` under each folder.

    Folders are walked through symbolic links (a run folder linked into another is read), each
    real folder once (a link back up does not loop). ``skipped``: messages about folders that
    cannot be listed are appended to it.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    for path in (os.fspath(path) for path in paths):
        if not os.path.isdir(path):
            if not os.path.lexists(path):
                raise FileNotFoundError(f"no such file or folder: {path}")
            found.append(path)  # even a FIFO or a dead link: read_spans says why it cannot be read
            continue

        def unlisted(error: OSError) -> None:
            if skipped is not None:
                skipped.append(f"skipped folder {error.filename}: {error.strerror}")

        for folder, dirs, names in os.walk(path, onerror=unlisted, followlinks=True):
            try:
                info = os.stat(folder)
            except OSError:
                dirs[:] = []
                continue
            if (info.st_dev, info.st_ino) in seen:
                dirs[:] = []
                continue
            seen.add((info.st_dev, info.st_ino))
            dirs.sort()
            found.extend(os.path.join(folder, name) for name in sorted(names) if name.endswith((".jsonl", ".json")))
    return found


class Fold(Protocol):
    """What a command reads of the files, as :class:`SpanReader`'s ``fold``; picklable (the reader's worker
    processes call it)."""

    def __call__(self, span: dict) -> bool:
        """Whether the command reads ``span`` itself (the others are counted into a kept ancestor)."""
        ...

    def digest(self, spans: list[dict]) -> dict[int, Any]:
        """What the command needs of one file's spans, all of them, before reducing: ``{rank: value}``
        (picklable values; :attr:`SpanReader.digests` gathers them)."""
        ...


class SpanReader:
    """The spans of OTLP-JSON trace files, streamed: iterate over it once.

    ``paths``: files and folders (:func:`trace_files`). Each span is a dict as
    :func:`spans_from_otlp_json` makes it (``start_ns``/``end_ns``/event ``time_ns`` in ns since
    the Unix epoch, ids as lowercase hex), with ``"rank"`` (int, the resource's
    ``torch.distributed.rank``, 0 when absent) and ``"file"``; in file order, each span once
    (a (trace id, span id) seen before is counted in :attr:`duplicates`, not yielded).

    A file is read line by line in chunks: one object per line, or, when its first line is not
    JSON and the file is at most :data:`MAX_LINE_BYTES`, the whole file as one (pretty-printed)
    object. Objects without ``resourceSpans`` (metrics, logs) are passed over. What cannot be read
    is skipped and said once per file in :attr:`messages`: a file that is no regular file (FIFO,
    device, socket: never opened), cannot be opened, or is gzip-compressed; lines that are not JSON
    (a line cut by a killed job, NUL bytes), nested too deep, longer than ``max_line_bytes``, or
    whose fields fail the checks (:class:`BadData`).

    Memory: one line (at most ``max_line_bytes``) and one 24-byte key per span yielded; with ``fold``, an
    8-byte print per span read instead.

    ``workers``: read that many files at once, each in a process of its own (None: one per CPU when the
    files hold over :data:`PARALLEL_MIN_BYTES`; with one file, or 1, the files are read here, one after
    the other). The spans, messages and counts are the same, in the same order. ``shared``: spans whose
    attributes are equal (the same module in every step) share one attribute dict (less memory: do not
    change a span's attributes).

    ``fold`` (a :class:`Fold`): what a command reads (picklable, for the workers). Each file's spans are
    reduced, where it is read, to those ``fold`` accepts, the roots (spans whose parent is not in the
    file), the first span of each (rank, host, process), and the ancestors of these where the tree's root
    has a parent id (another file may hold the rest of the trace); every other span is counted into
    ``"folded"`` (an int each span yielded gets) of the nearest ancestor kept, which is in the same
    training step (never a stall snapshot's span: a command may leave those out), and a 64-bit print of its
    key is kept for finding duplicates. Each span yielded gets ``"root_step"``: ``(own_step(root),)`` of its tree's root
    when that root has no parent id, else ``()``; :class:`.model.SpanIndex` takes it as the step of a
    span whose parent was folded. A file whose parent links form a loop is not reduced (where the loop is cut
    depends on every file). When reducing could change what the views see (a span read twice across
    files, or a span of another file whose parent was folded), :attr:`unfoldable` is True after the
    iteration: read again without ``fold``. (A span read twice across files is then yielded twice, and
    :attr:`duplicates` counts only those within a file.)

    The fold's ``digest(spans) -> {rank: value}`` (picklable values) is called where a file is
    read, with all its spans (each once, before reducing), for what a command needs of spans it folds (e.g.
    each rank's module timeline). :attr:`digests` gathers them; a rank with spans in two files makes the
    reader :attr:`unfoldable` (a digest holds one file's spans of the rank).

    Raises:
        FileNotFoundError: a path does not exist (when iteration begins).
    """

    def __init__(self, paths: Iterable[str | os.PathLike], max_line_bytes: int = MAX_LINE_BYTES,
                 hex_ids: bool = True, workers: int | None = 1, shared: bool = False,
                 fold: Fold | None = None) -> None:
        self.paths = list(paths)
        self.fold = fold
        self.max_line_bytes = max_line_bytes
        self.hex_ids = hex_ids
        self.workers = workers
        self.shared = shared
        self._shared_values: dict[Any, Any] = {}
        #: One line per file or folder with something skipped: ``skipped N lines in FILE: why``.
        self.messages: list[str] = []
        #: Spans read again (the same trace and span id): a file given twice, a linked copy, repeated lines.
        self.duplicates = 0
        #: Lines (objects) skipped, over all files.
        self.skipped_lines = 0
        #: Files that held at least one span.
        self.files: set[str] = set()
        #: With ``fold``: the spans yielded may not stand for the files (see the class docstring).
        self.unfoldable = False
        #: With a ``fold`` that has ``digest``: rank -> its digest (see the class docstring).
        self.digests: dict[int, Any] = {}
        self._file_ranks: dict[int, str] = {}  # rank -> the file that held it, with digest
        self._seen: set[bytes] = set()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        files = trace_files(self.paths, self.messages)
        workers = self.workers
        if workers is None:
            workers = _cpus() if sum(map(_size, files)) >= PARALLEL_MIN_BYTES else 1
        apart = workers >= 2 and len(files) >= 2
        if not apart and self.fold is None:
            for path in files:
                for span in self._file(path):
                    yield _compact(span) if self.shared else span
            return
        read = self._read_apart(files, workers) if apart else (
            (path, _read_file(path, self.max_line_bytes, self.hex_ids, self.shared, self.fold)) for path in files)
        # With fold, spans are told apart across files by 64-bit prints of their keys, 8 bytes each: a print
        # seen twice (a span read twice, or by chance once in 2**64 pairs) makes the reader unfoldable, and
        # reading again whole finds the duplicates by their full keys. The prints are looked at in 16 parts,
        # so no set of all of them is ever made.
        parts = [array("q") for _ in range(16)]
        folded, parents = array("q"), array("q")
        for path, (spans, messages, duplicates, skipped, prints, digests) in read:
            self._gather(path, digests)
            self.messages += messages
            self.duplicates += duplicates
            self.skipped_lines += skipped
            if prints is not None:
                for key in itertools.chain(prints[0], prints[1]):
                    parts[key & 15].append(key)
                folded.extend(prints[1])
                parents.extend(prints[2])
            for span in spans:
                if prints is not None or self._new(span):
                    self.files.add(path)
                    yield _compact(span) if self.shared else span
        if self.fold is not None:
            orphans = set(parents)
            self.unfoldable |= (any(len(set(part)) < len(part) for part in parts)
                                or any(key in orphans for key in folded))

    def _gather(self, path: str, digests: dict[int, Any] | None) -> None:
        if digests is None:
            return
        for rank, digest in digests.items():
            if self._file_ranks.setdefault(rank, path) != path:
                self.unfoldable = True  # the rank's spans are split across files: no digest holds them all
            self.digests[rank] = digest

    def _read_apart(self, files: list[str], workers: int) -> Iterator[tuple[str, tuple]]:
        """``(path, _read_file(...))`` of each file in order, read by ``workers`` processes; at most two
        files' spans per worker wait here, so memory does not grow with the files. Where processes
        cannot be started, or one dies, the files not yet read are read here."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        done = 0
        try:
            with ProcessPoolExecutor(min(workers, len(files)), mp_context=context) as pool:
                def submit(path: str) -> tuple[str, Any]:
                    return path, pool.submit(_read_file, path, self.max_line_bytes, self.hex_ids, self.shared,
                                             self.fold)

                ahead = iter(files)
                pending = deque(map(submit, itertools.islice(ahead, 2 * workers)))
                while pending:
                    path, future = pending.popleft()
                    pending.extend(map(submit, itertools.islice(ahead, 1)))
                    result = future.result()
                    done += 1
                    yield path, result
        except (OSError, BrokenProcessPool):
            for path in files[done:]:
                yield path, _read_file(path, self.max_line_bytes, self.hex_ids, self.shared, self.fold)

    def _file(self, path: str) -> Iterator[dict[str, Any]]:
        try:
            info = os.stat(path)
        except OSError as error:
            self.messages.append(f"skipped {path}: {error.strerror}")
            return
        if not stat.S_ISREG(info.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device" if stat.S_ISCHR(info.st_mode)
                    or stat.S_ISBLK(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a folder"
                    if stat.S_ISDIR(info.st_mode) else "not a regular file")
            self.messages.append(f"skipped {path}: {kind}, not a regular file (not opened)")
            return
        try:
            # O_NONBLOCK: a path swapped for a FIFO since the stat cannot block the open; fstat checks again.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            self.messages.append(f"skipped {path}: {error.strerror}")
            return
        with os.fdopen(fd, "rb", buffering=0) as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self.messages.append(f"skipped {path}: not a regular file (not read)")
                return
            bad: Counter = Counter()
            first_bad: dict[str, int] = {}
            spans = 0
            try:
                for number, line in self._lines(handle, info.st_size):
                    if line is None:
                        why = f"longer than {self.max_line_bytes} bytes"
                    else:
                        try:
                            found = self._decode(line)
                        except BadData as error:
                            why = str(error)
                        else:
                            for span in found:
                                if self._new(span):
                                    span["rank"] = span["resource"].get(semconv.RANK, 0)
                                    span["file"] = path
                                    if self.shared:
                                        self._share_values(span)
                                    spans += 1
                                    yield span
                            continue
                    bad[why] += 1
                    first_bad.setdefault(why, number)
            except _Gzip:
                self.messages.append(f"skipped {path}: gzip-compressed (gunzip it first)")
                return
            except OSError as error:
                bad[f"read error: {error.strerror}"] += 1
                first_bad.setdefault(f"read error: {error.strerror}", 0)
            if spans:
                self.files.add(path)
            if bad:
                total = sum(bad.values())
                self.skipped_lines += total
                shown = sorted(bad.most_common(3), key=lambda item: first_bad[item[0]])
                reasons = "; ".join(f"{'line' if n == 1 else f'{n} lines, the first'} {first_bad[why]}: {why}"
                                    for why, n in shown)
                more = total - sum(n for _, n in shown)
                self.messages.append(f"skipped {total} line{'s' if total != 1 else ''} in {path}: {reasons}"
                                     + (f"; {more} more for other reasons" if more else ""))

    def _share_values(self, span: dict) -> None:
        """Make equal values one object: parent ids, integers past the few Python keeps once, lists
        of plain values (shapes), and the attribute dicts of spans (a module's, step after step)."""
        shared = self._shared_values
        if len(shared) > _SHARED_MAX:
            shared.clear()
        parent = span["parent_span_id"]
        span["parent_span_id"] = shared.setdefault(parent, parent)
        for attributes in (span["attributes"], *[event["attributes"] for event in span["events"]]):
            for key, value in attributes.items():
                kind = type(value)
                if kind is int and not -5 <= value <= 256:
                    attributes[key] = shared.setdefault((int, value), value)
                elif kind is list:
                    try:  # the types too: 1, 1.0 and True are equal
                        attributes[key] = shared.setdefault((list, *map(type, value), *value), value)
                    except TypeError:  # a list holding a list or dict
                        pass
        attributes = span["attributes"]
        try:
            span["attributes"] = shared.setdefault(
                (dict, *attributes, *map(type, attributes.values()), *attributes.values()), attributes)
        except TypeError:  # a list value: not shared
            pass

    def _new(self, span: dict) -> bool:
        key = bytes.fromhex(span["trace_id"] + span["span_id"])  # 24 bytes: checked hex
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(key)
        return True

    def _decode(self, line: bytes) -> list[dict[str, Any]]:
        if b"\\u" in line and _LONE_SURROGATE.search(line):
            line = _LONE_SURROGATE.sub(rb"\\ufffd", line)
        if _orjson is not None:
            # orjson refuses some of what json reads (invalid UTF-8, NaN, 1e400, nesting past 1,024) and makes a
            # float of an integer past 64 bits (always out of range here): a line it refuses, or whose spans fail
            # the checks, is read again by json, so what is skipped and said is json's.
            try:
                return self._spans_of(_orjson.loads(line))
            except (_orjson.JSONDecodeError, BadData):
                pass
        try:
            obj = json.loads(line.decode("utf-8", "replace"))
        except json.JSONDecodeError as error:
            raise BadData(f"not JSON ({error.msg})") from None
        except RecursionError:
            raise BadData("JSON nested too deep") from None
        return self._spans_of(obj)

    def _spans_of(self, obj: Any) -> list[dict[str, Any]]:
        if not isinstance(obj, dict) or ("resourceSpans" not in obj and "resource_spans" not in obj):
            return []  # metrics, logs, other JSON
        if len(_SHARED) > _SHARED_MAX:
            _SHARED.clear()
        return _decode_traces(obj, self.hex_ids)

    def _lines(self, handle: Any, size: int) -> Iterator[tuple[int, bytes | None]]:
        """(line number, line without its end) of each non-blank line; None for a line over the limit,
        whose bytes are dropped as they come."""
        limit = self.max_line_bytes
        chunk = handle.read(_CHUNK)
        if chunk.startswith(_GZIP_MAGIC):
            raise _Gzip
        bom = len(_BOM) if chunk.startswith(_BOM) else 0
        chunk = chunk[bom:]
        pending: list[bytes] = []  # the start of the line the next chunk ends
        pending_bytes = 0
        overlong = False
        number = 0
        first = True  # the first non-blank line: is the file one (pretty-printed) object?
        while chunk:
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                number += 1
                piece = chunk[start:end]
                start = end + 1
                if overlong or pending_bytes + len(piece) > limit:
                    yield number, None
                else:
                    line = b"".join((*pending, piece)) if pending else piece
                    if line.strip(_BLANK):
                        if first and size <= limit and not _is_json(line):
                            whole = self._whole(handle, bom)
                            if whole is not None:
                                yield number, whole
                                return
                        first = False
                        yield number, line
                pending, pending_bytes, overlong = [], 0, False
            rest = chunk[start:]
            if rest and not overlong:
                pending.append(rest)
                pending_bytes += len(rest)
                if pending_bytes > limit:
                    pending, pending_bytes, overlong = [], 0, True
            chunk = handle.read(_CHUNK)
        if overlong:
            yield number + 1, None
        elif pending:
            line = b"".join(pending)
            if line.strip(_BLANK):
                yield number + 1, line

    def _whole(self, handle: Any, bom: int) -> bytes | None:
        """The whole file when it is one JSON object, else None (then it is read line by line)."""
        position = handle.tell()
        handle.seek(bom)
        text = handle.read(self.max_line_bytes + 1)
        handle.seek(position)
        return text if len(text) <= self.max_line_bytes and _is_json(text) else None


class _Fields:
    """Holds a dict's items as attributes: the ``__dict__`` of each instance is a plain dict, and CPython
    keeps those that got the same keys in the same order in about half the memory (one shared key table)."""

    def __init__(self, items: dict) -> None:
        for key, value in items.items():
            setattr(self, key, value)


class _SpanFields(_Fields):
    pass


class _EventFields(_Fields):
    pass


_ATTRIBUTE_FIELDS: dict[tuple, type] = {}  # one class per list of keys (an op's events all have the same)


def _fields(items: dict) -> dict:
    """``items`` in less memory, as :class:`_Fields` keeps it (as it is past 256 lists of keys)."""
    keys = tuple(items)
    kind = _ATTRIBUTE_FIELDS.get(keys)
    if kind is None:
        if len(_ATTRIBUTE_FIELDS) >= 256:
            return items
        kind = _ATTRIBUTE_FIELDS[keys] = type("_AttributeFields", (_Fields,), {})
    return kind(items).__dict__


def _compact(span: dict) -> dict:
    """An equal span dict, with its events and their attributes, in less memory: pickling (from a worker)
    undoes it, so it is done here. A span's own attributes are left as they are: modules share theirs."""
    events = span["events"]
    for number, event in enumerate(events):
        event["attributes"] = _fields(event["attributes"])
        events[number] = _EventFields(event).__dict__
    if not events:
        span["events"] = _NO_EVENTS  # most spans (modules without collectives)
    return _SpanFields(span).__dict__


_NO_EVENTS: list = []


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read_file(path: str, max_line_bytes: int, hex_ids: bool, shared: bool,
               fold: Fold | None = None) -> tuple[list, list, int, int, tuple | None, dict | None]:
    """One file as :class:`SpanReader` reads it, in a worker process: ``(spans, messages, duplicates,
    skipped lines, prints, the fold's digests or None)``, spans each once within the file. With ``fold``,
    the spans are reduced (:func:`_fold`) and ``prints`` holds the :func:`_print` of the keys of the spans
    kept, of those folded, and of the parents of roots not in the file (three ``array("q")``); else None."""
    # With fold, equal values are made one object in the spans kept only (most are folded: no need).
    reader = SpanReader([], max_line_bytes, hex_ids, 1, shared and fold is None)
    spans = list(reader._file(path))
    digests = fold.digest(spans) if fold is not None and spans else None
    if fold is None:
        return spans, reader.messages, reader.duplicates, reader.skipped_lines, None, digests
    spans, folded, parents = _fold(spans, fold)
    if shared:
        for span in spans:
            reader._share_values(span)
    kept = array("q", [_print(span["trace_id"], span["span_id"]) for span in spans])
    return spans, reader.messages, reader.duplicates, reader.skipped_lines, (kept, folded, parents), digests


def _print(trace_id: str, span_id: str) -> int:
    """A span key's 64-bit print (the same in every process: not ``hash``)."""
    return int.from_bytes(_blake2b(bytes.fromhex(trace_id + span_id), digest_size=8).digest(), "little",
                          signed=True)


def _fold(spans: list[dict], keep: Callable[[dict], bool]) -> tuple[list[dict], array, array]:
    """One file's spans reduced as :class:`SpanReader`'s ``fold`` says: ``(spans kept, each with "folded",
    prints (:func:`_print`) of the spans folded, prints of the parents of roots with a parent id)``."""
    from commdebug_otel.offline.model import is_snapshot, own_step

    by_id = {(span["rank"], span["trace_id"], span["span_id"]): span for span in spans}
    parent: dict[int, dict] = {}
    children: dict[int, list[dict]] = defaultdict(list)
    roots: list[dict] = []
    parents = array("q")
    for span in spans:
        parent_id = span["parent_span_id"]
        found = by_id.get((span["rank"], span["trace_id"], parent_id)) if parent_id else None
        if found is None or found is span:
            roots.append(span)
            if found is None and parent_id:  # its parent may be in another file
                parents.append(_print(span["trace_id"], parent_id))
        else:
            parent[id(span)] = found
            children[id(found)].append(span)
    top: dict[int, dict] = {}  # id(span) -> the root of its tree in this file
    stack = list(roots)
    while stack:
        span = stack.pop()
        top[id(span)] = top.get(id(parent.get(id(span))), span)
        stack.extend(children.get(id(span), ()))
    if len(top) < len(spans):  # parent links form a loop: where it is cut depends on every file
        for span in spans:
            span["folded"], span["root_step"] = 0, ()
        return spans, array("q"), parents
    kept = {id(root) for root in roots}
    processes = set()
    for span in spans:
        resource = span["resource"]
        process = (span["rank"], *process_of(resource))
        if process in processes and not keep(span):
            continue
        processes.add(process)
        settled = _true_root(top[id(span)])
        node: dict | None = span
        while node is not None and id(node) not in kept:  # ancestors only where another file may add some
            kept.add(id(node))
            node = None if settled else parent.get(id(node))
    folded: Counter = Counter()
    keys = array("q")
    walk = [(root, root) for root in roots]  # (span, the nearest ancestor kept)
    while walk:
        span, anchor = walk.pop()
        if id(span) in kept or is_snapshot(anchor):
            kept.add(id(span))
            anchor = span
        else:
            folded[id(anchor)] += 1
            keys.append(_print(span["trace_id"], span["span_id"]))
        walk.extend([(child, anchor) for child in children.get(id(span), ())])
    out = [span for span in spans if id(span) in kept]
    root_steps: dict = {}
    for span in out:
        step = own_step(top[id(span)])
        span["folded"] = folded[id(span)]
        span["root_step"] = root_steps.setdefault(step, (step,)) if _true_root(top[id(span)]) else ()
    return out, keys, parents


def _true_root(span: dict) -> bool:
    """A span with no parent in any file: no parent id, or its own."""
    return not span["parent_span_id"] or span["parent_span_id"] == span["span_id"]


def _is_json(text: bytes) -> bool:
    if _orjson is not None:
        try:
            _orjson.loads(text)
            return True
        except _orjson.JSONDecodeError:
            pass  # json may read it (see SpanReader._decode)
    try:
        json.loads(text.decode("utf-8", "replace"))
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


_BLANK = b" \t\r"
_blake2b = hashlib.blake2b


class _Gzip(Exception):
    pass


def read_spans(paths: Iterable[str | os.PathLike], max_line_bytes: int = MAX_LINE_BYTES) -> SpanReader:
    """A :class:`SpanReader` over ``paths``: iterate it for the spans, then read its ``messages``."""
    return SpanReader(paths, max_line_bytes)
