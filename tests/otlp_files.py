"""Hand-built span dicts, as ``summary.load_spans`` returns them, written back as OTLP-JSON files; and the
environment for a child process (``commdebug-otel summarize|diagnose``) that reads them with this checkout."""

import json
import os

import commdebug_otel
from commdebug_otel import semconv


def checkout_env():
    """This checkout first on the path of a child process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(commdebug_otel.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def span(rank, name, span_id, parent="", start=0, end=10**9, events=(), trace="t", world_size=4, **attributes):
    """One span of ``rank``; ``events``: ``(time_ns, attributes)`` pairs, each named by its collective op.

    The trace id is ``trace`` followed by the rank, so each rank's spans form their own trees.
    """
    return {"rank": rank, "trace_id": f"{trace}{rank}", "span_id": span_id, "parent_span_id": parent,
            "name": name, "start_ns": start, "end_ns": end, "attributes": attributes,
            "events": [{"name": attrs[semconv.COLLECTIVE_OP], "time_ns": time_ns, "attributes": attrs}
                       for time_ns, attrs in events],
            "resource": {semconv.RANK: rank, semconv.WORLD_SIZE: world_size}, "file": f"traces-rank{rank}.jsonl"}


def _value(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(item) for item in v]}}
    return {"stringValue": str(v)}


def _attrs(d):
    return [{"key": k, "value": _value(v)} for k, v in d.items()]


def _hex_id(text, width):
    return text.encode().hex().rjust(width, "0")[-width:]


def write_otlp(spans, path):
    """Span dicts as one OTLP-JSON line (an ``ExportTraceServiceRequest``) per rank; a span's ``status_code``
    (2: ERROR), when it has one, as its status."""
    lines = []
    for rank in sorted({span["rank"] for span in spans}):
        otlp = [{"traceId": _hex_id(span["trace_id"], 32), "spanId": _hex_id(span["span_id"], 16),
                 **({"parentSpanId": _hex_id(span["parent_span_id"], 16)} if span["parent_span_id"] else {}),
                 "name": span["name"], "startTimeUnixNano": str(span["start_ns"]),
                 "endTimeUnixNano": str(span["end_ns"]), "attributes": _attrs(span["attributes"]),
                 **({"status": {"code": span["status_code"]}} if span.get("status_code") else {}),
                 "events": [{"name": e["name"], "timeUnixNano": str(e["time_ns"]),
                             "attributes": _attrs(e["attributes"])} for e in span["events"]]}
                for span in spans if span["rank"] == rank]
        resource = next(span["resource"] for span in spans if span["rank"] == rank)
        lines.append(json.dumps({"resourceSpans": [{"resource": {"attributes": _attrs(resource)},
                                                    "scopeSpans": [{"spans": otlp}]}]}))
    path.write_text("\n".join(lines) + "\n")
