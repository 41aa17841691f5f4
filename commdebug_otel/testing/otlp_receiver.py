"""A small, real OTLP receiver (gRPC and HTTP) for tests and local debugging.

``OtlpReceiver`` listens on 127.0.0.1 (or ``host``) with two servers, on free ports unless
``grpc_port`` / ``http_port`` are given:

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

``on_request`` is called with each accepted :class:`ReceivedRequest` (on a server thread);
with ``keep=False`` nothing is held in memory. ``commdebug-otel receive`` (also
``python -m commdebug_otel.testing.otlp_receiver``) is this receiver writing OTLP-JSON files.

Limits: plaintext only (no TLS), traces and metrics only (logs are answered
404/UNIMPLEMENTED), everything is held in memory until ``clear()`` (unless ``keep=False``).  The gRPC
size limit is checked on the decoded request's serialized size (what
grpc-core measures for uncompressed messages), so rejections can be counted;
the HTTP side accepts any size and records it.
"""

from __future__ import annotations

import gzip
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as _mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as _tgrpc

__all__ = [
    "OtlpReceiver",
    "ReceivedRequest",
    "decode_any_value",
    "metrics_from_otlp_json",
    "spans_from_otlp_json",
]

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024  # the collector's default
_logger = logging.getLogger(__name__)



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


from commdebug_otel.offline.otlp_json import (  # noqa: E402  (re-exported: part of this module's API)
    _SIGNALS,
    decode_any_value,
    metrics_from_otlp_json,
    spans_from_otlp_json,
)
from commdebug_otel.offline.otlp_json import metric_dicts as _metric_dicts  # noqa: E402
from commdebug_otel.offline.otlp_json import parse_otlp_json as _parse_otlp_json  # noqa: E402
from commdebug_otel.offline.otlp_json import span_dicts as _span_dicts  # noqa: E402


class _GrpcTraceService(_tgrpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._rx = receiver

    def Export(self, request, context):
        return self._rx._accept_grpc("traces", request, context)


class _GrpcMetricsService(_mgrpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._rx = receiver

    def Export(self, request, context):
        return self._rx._accept_grpc("metrics", request, context)


class _HttpHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def do_POST(self) -> None:
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
    receiver: OtlpReceiver


# ---------------------------------------------------------------- receiver


class OtlpReceiver:
    """OTLP/gRPC + OTLP/HTTP receiver on 127.0.0.1; use as a context manager.

    ``max_receive_message_bytes`` (bytes, default 4 MiB like the collector):
    larger gRPC requests are refused with RESOURCE_EXHAUSTED and counted in
    ``rejected_grpc``. ``host``: the address both servers bind; ``grpc_port`` and
    ``http_port``: 0 (default) for a free port each. ``on_request(request)``: called with
    each accepted request, on the server thread that took it; an exception it raises is
    logged and the request still answered. ``keep``: hold requests for ``requests()``.

    Raises:
        OSError: from :meth:`start`, when a port cannot be bound (in use, or no such address).
    """

    def __init__(self, max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, host: str = "127.0.0.1",
                 grpc_port: int = 0, http_port: int = 0,
                 on_request: Callable[[ReceivedRequest], None] | None = None, keep: bool = True) -> None:
        self.max_receive_message_bytes = max_receive_message_bytes
        self.host = host
        self._ports = (grpc_port, http_port)
        self._on_request = on_request
        self._keep = keep
        self._lock = threading.Lock()
        self._requests: list[ReceivedRequest] = []
        self.rejected_grpc = 0  # gRPC requests refused as too large
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port = 0
        self.http_port = 0

    # lifecycle
    def start(self) -> OtlpReceiver:
        """Start both servers (idempotent); returns self."""
        if self._grpc is not None:
            return self
        # grpc-core's own limit is lifted so that _accept_grpc can see and count refusals.
        # so_reuseport off: a second receiver on the same port fails to start instead of sharing it.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                 options=[("grpc.max_receive_message_length", -1), ("grpc.so_reuseport", 0)])
        _tgrpc.add_TraceServiceServicer_to_server(_GrpcTraceService(self), self._grpc)
        _mgrpc.add_MetricsServiceServicer_to_server(_GrpcMetricsService(self), self._grpc)
        address = f"[{self.host}]" if ":" in self.host else self.host
        if self._ports[0]:  # grpc-core would print its own error line first
            try:
                with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc-core binds
                    probe.bind((self.host, self._ports[0]))
            except OSError as error:
                self._grpc = None
                raise OSError(f"cannot listen for OTLP/gRPC on {address}:{self._ports[0]}: {error.strerror}") from None
        try:
            self.grpc_port = self._grpc.add_insecure_port(f"{address}:{self._ports[0]}")
        except RuntimeError:  # grpcio >= 1.63 raises where older ones returned 0
            self.grpc_port = 0
        if not self.grpc_port:
            self._grpc = None
            raise OSError(f"cannot listen for OTLP/gRPC on {address}:{self._ports[0]} (in use?)")
        self._grpc.start()
        try:
            self._http = _HttpServer((self.host, self._ports[1]), _HttpHandler)
        except OSError as error:
            self.stop()
            raise OSError(f"cannot listen for OTLP/HTTP on {address}:{self._ports[1]}: {error.strerror}") from None
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

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        """``http://HOST:PORT`` (127.0.0.1 by default) for OTLP/gRPC exporters (use insecure=True)."""
        return f"http://{self._client_host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """``http://HOST:PORT``; signal paths are ``/v1/traces`` and ``/v1/metrics``."""
        return f"http://{self._client_host}:{self.http_port}"

    @property
    def _client_host(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host

    # recording (shared by both transports)
    def _record(self, signal: str, transport: str, req: Any, size: int,
                wire: int | None, headers: dict[str, str]) -> Any:
        received = ReceivedRequest(signal, transport, size, wire, headers, req)
        if self._keep:
            with self._lock:
                self._requests.append(received)
        if self._on_request is not None:
            try:
                self._on_request(received)
            except Exception:  # the sender did its part: answer it, and say what went wrong here
                _logger.exception("OTLP receiver: handling a %s request failed", signal)
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

    def wait_for(self, predicate: Callable[[OtlpReceiver], bool], timeout_s: float = 10.0) -> bool:
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


if __name__ == "__main__":  # `python -m commdebug_otel.testing.otlp_receiver` is `commdebug-otel receive`
    from commdebug_otel.cli import main

    sys.exit(main(["receive", *sys.argv[1:]]))
