"""OTLP-JSON (the OTel file exporter's format) and OTLP protobuf requests as plain span and metric dicts.

Used by the offline views (``summary``, ``perfetto``) and by the test
receiver (``commdebug_otel.testing.otlp_receiver`` re-exports the public
names). OTLP/JSON writes trace and span ids as hex, not base64 as
protobuf's generic JSON mapping does, and 64-bit integers as strings.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as _mpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as _tpb

__all__ = ["decode_any_value", "metric_dicts", "metrics_from_otlp_json", "parse_otlp_json",
           "span_dicts", "spans_from_otlp_json", "to_otlp_json"]

_SIGNALS = {
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

    ``hex_ids``: as :func:`parse_otlp_json`.
    """
    return span_dicts(parse_otlp_json(obj, "traces", hex_ids), "file")


def metrics_from_otlp_json(obj: dict | str | bytes) -> list[dict[str, Any]]:
    """Data-point dicts (as ``OtlpReceiver.metrics()``, transport "file") from one OTLP-JSON object/line."""
    return metric_dicts(parse_otlp_json(obj, "metrics"), "file")

