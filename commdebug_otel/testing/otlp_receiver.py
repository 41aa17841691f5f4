"""A small, real OTLP receiver (gRPC and HTTP) for tests and local debugging.

``OtlpReceiver`` listens on 127.0.0.1 with two servers on free ports:

* OTLP/gRPC (grpcio): ``TraceService/Export`` and ``MetricsService/Export``;
* OTLP/HTTP (stdlib ``ThreadingHTTPServer``): ``POST /v1/traces`` and
  ``POST /v1/metrics`` with protobuf (or OTLP-JSON) bodies, optionally
  ``Content-Encoding: gzip``.

Every accepted request is kept, with its transport, its size and the headers
(HTTP) or metadata (gRPC) it came with; ``spans()`` and ``metrics()`` flatten
what arrived into plain dicts.  ``spans_from_otlp_json`` and
``metrics_from_otlp_json`` read one line written by
``opentelemetry-exporter-otlp-json-file`` into the same dicts.

Usage::

    with OtlpReceiver() as rx:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.grpc_endpoint
        os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
        # ... or, for OTLP/HTTP: OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf
        # and OTEL_EXPORTER_OTLP_ENDPOINT=rx.http_endpoint
        run_code_that_exports()
        assert rx.wait_for(lambda r: any(s["name"] == "step" for s in r.spans()))

Limits: plaintext only (no TLS), traces and metrics only (logs are answered
404/UNIMPLEMENTED), everything is held in memory until ``clear()``.  The gRPC
size limit is checked on the decoded request's serialized size (what
grpc-core measures for uncompressed messages), so rejections can be counted;
the HTTP side accepts any size and records it.
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as _mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as _mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as _tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as _tgrpc

__all__ = [
    "OtlpReceiver",
    "ReceivedRequest",
    "decode_any_value",
    "metrics_from_otlp_json",
    "spans_from_otlp_json",
]

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024  # the collector's default

# signal -> (request class, response class)
_SIGNALS = {
    "traces": (_tpb.ExportTraceServiceRequest, _tpb.ExportTraceServiceResponse),
    "metrics": (_mpb.ExportMetricsServiceRequest, _mpb.ExportMetricsServiceResponse),
}
_HEX_ID_KEYS = ("traceId", "spanId", "parentSpanId")


@dataclass
class ReceivedRequest:
    """One accepted export request.

    ``size_bytes`` is the serialized protobuf size (uncompressed, bytes);
    ``wire_bytes`` the HTTP body length as received (compressed if gzip),
    ``None`` for gRPC. ``headers`` has lowercase keys (HTTP headers or gRPC
    metadata).
    """

    signal: str  # "traces" or "metrics"
    transport: str  # "grpc", "http" or "file"
    size_bytes: int
    wire_bytes: int | None
    headers: dict[str, str]
    request: Any  # ExportTraceServiceRequest or ExportMetricsServiceRequest
    received_at: float = field(default_factory=time.time)  # unix seconds


# ---------------------------------------------------------------- decoding


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


def _span_dicts(req: Any, transport: str) -> list[dict[str, Any]]:
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
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
                    "scope": ss.scope.name,
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


def _metric_dicts(req: Any, transport: str) -> list[dict[str, Any]]:
    out = []
    for rm in req.resource_metrics:
        resource = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for d in _point_dicts(m):
                    out.append({"name": m.name, "unit": m.unit, **d,
                                "resource": resource, "scope": sm.scope.name,
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


def _parse_otlp_json(obj: dict | str | bytes, signal: str) -> Any:
    if isinstance(obj, (str, bytes)):
        obj = json.loads(obj)
    msg = _SIGNALS[signal][0]()
    return json_format.ParseDict(_hex_ids_to_base64(obj), msg, ignore_unknown_fields=True)


def spans_from_otlp_json(obj: dict | str | bytes) -> list[dict[str, Any]]:
    """Span dicts (as ``OtlpReceiver.spans()``, transport "file") from one OTLP-JSON object/line."""
    return _span_dicts(_parse_otlp_json(obj, "traces"), "file")


def metrics_from_otlp_json(obj: dict | str | bytes) -> list[dict[str, Any]]:
    """Data-point dicts (as ``OtlpReceiver.metrics()``, transport "file") from one OTLP-JSON object/line."""
    return _metric_dicts(_parse_otlp_json(obj, "metrics"), "file")


# ---------------------------------------------------------------- transports


class _GrpcTraceService(_tgrpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self._rx = receiver

    def Export(self, request, context):  # noqa: N802 (grpc naming)
        return self._rx._accept_grpc("traces", request, context)


class _GrpcMetricsService(_mgrpc.MetricsServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self._rx = receiver

    def Export(self, request, context):  # noqa: N802
        return self._rx._accept_grpc("metrics", request, context)


class _HttpHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_HttpServer"

    def do_POST(self) -> None:  # noqa: N802
        signal = {"/v1/traces": "traces", "/v1/metrics": "metrics"}.get(self.path.split("?")[0])
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if signal is None:
            return self._reply(404, "text/plain", b"unknown OTLP path")
        is_json = (self.headers.get("Content-Type") or "").startswith("application/json")
        try:
            raw = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
            req = _parse_otlp_json(raw, signal) if is_json else _SIGNALS[signal][0].FromString(raw)
        except Exception as exc:  # bad gzip, protobuf or JSON
            return self._reply(400, "text/plain", f"bad OTLP request: {exc}".encode())
        headers = {k.lower(): v for k, v in self.headers.items()}
        resp = self.server.receiver._record(signal, "http", req, len(raw), len(body), headers)
        if is_json:
            return self._reply(200, "application/json", json_format.MessageToJson(resp).encode())
        self._reply(200, "application/x-protobuf", resp.SerializeToString())

    def _reply(self, code: int, ctype: str, payload: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    receiver: "OtlpReceiver"


# ---------------------------------------------------------------- receiver


class OtlpReceiver:
    """OTLP/gRPC + OTLP/HTTP receiver on 127.0.0.1; use as a context manager.

    ``max_receive_message_bytes`` (bytes, default 4 MiB like the collector):
    larger gRPC requests are refused with RESOURCE_EXHAUSTED and counted in
    ``rejected_grpc``.
    """

    def __init__(self, max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES) -> None:
        self.max_receive_message_bytes = max_receive_message_bytes
        self._lock = threading.Lock()
        self._requests: list[ReceivedRequest] = []
        self.rejected_grpc = 0  # gRPC requests refused as too large
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port = 0
        self.http_port = 0

    # lifecycle
    def start(self) -> "OtlpReceiver":
        """Start both servers (idempotent); returns self."""
        if self._grpc is not None:
            return self
        # grpc-core's own limit is lifted so that _accept_grpc can see and count refusals.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                 options=[("grpc.max_receive_message_length", -1)])
        _tgrpc.add_TraceServiceServicer_to_server(_GrpcTraceService(self), self._grpc)
        _mgrpc.add_MetricsServiceServicer_to_server(_GrpcMetricsService(self), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self._http = _HttpServer(("127.0.0.1", 0), _HttpHandler)
        self._http.receiver = self
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever,
                                             kwargs={"poll_interval": 0.05},
                                             name="otlp-http-receiver", daemon=True)
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop both servers at once (in-flight gRPC calls are cancelled)."""
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` for OTLP/gRPC exporters (use insecure=True)."""
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """``http://127.0.0.1:PORT``; signal paths are ``/v1/traces`` and ``/v1/metrics``."""
        return f"http://127.0.0.1:{self.http_port}"

    # recording (shared by both transports)
    def _record(self, signal: str, transport: str, req: Any, size: int,
                wire: int | None, headers: dict[str, str]) -> Any:
        with self._lock:
            self._requests.append(ReceivedRequest(signal, transport, size, wire, headers, req))
        return _SIGNALS[signal][1]()

    def _accept_grpc(self, signal: str, request: Any, context: grpc.ServicerContext) -> Any:
        size = request.ByteSize()
        if size > self.max_receive_message_bytes:
            with self._lock:
                self.rejected_grpc += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"received message larger than max ({size} vs. {self.max_receive_message_bytes})")
        headers = {k.lower(): v for k, v in context.invocation_metadata()}
        return self._record(signal, "grpc", request, size, None, headers)

    # reading
    def requests(self, signal: str | None = None) -> list[ReceivedRequest]:
        """Accepted requests, oldest first; ``signal`` is "traces", "metrics" or None for all."""
        with self._lock:
            return [r for r in self._requests if signal in (None, r.signal)]

    @property
    def trace_requests(self) -> list[Any]:
        """Received ``ExportTraceServiceRequest`` protos, oldest first."""
        return [r.request for r in self.requests("traces")]

    @property
    def metrics_requests(self) -> list[Any]:
        """Received ``ExportMetricsServiceRequest`` protos, oldest first."""
        return [r.request for r in self.requests("metrics")]

    def spans(self) -> list[dict[str, Any]]:
        """One dict per received span; times in ns since the Unix epoch, ids lowercase hex."""
        return [s for r in self.requests("traces") for s in _span_dicts(r.request, r.transport)]

    def metrics(self) -> list[dict[str, Any]]:
        """One dict per received metric data point; ``time_ns`` in ns since the Unix epoch."""
        return [p for r in self.requests("metrics") for p in _metric_dicts(r.request, r.transport)]

    def wait_for(self, predicate: Callable[["OtlpReceiver"], bool], timeout_s: float = 10.0) -> bool:
        """Poll ``predicate(self)`` every 20 ms for up to ``timeout_s`` seconds; True once it holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            if predicate(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def clear(self) -> None:
        """Forget every received request and reset ``rejected_grpc``."""
        with self._lock:
            self._requests.clear()
            self.rejected_grpc = 0
