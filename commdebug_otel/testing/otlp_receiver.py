"""A small, real OTLP receiver (gRPC and HTTP) for tests and local debugging.

``OtlpReceiver`` listens on 127.0.0.1 (or ``host``) with two servers, on free ports unless
``grpc_port`` / ``http_port`` are given:

* OTLP/gRPC (grpcio): ``TraceService/Export`` and ``MetricsService/Export``, plain or
  gzip/deflate-compressed;
* OTLP/HTTP (stdlib ``ThreadingHTTPServer``): ``POST /v1/traces`` and
  ``POST /v1/metrics`` with protobuf (or OTLP-JSON) bodies, ``Content-Encoding``
  gzip, deflate or none, sized by ``Content-Length`` or sent chunked.

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
404/UNIMPLEMENTED), everything is held in memory until ``clear()`` (unless ``keep=False``).
Requests are bounded before they are parsed: a gRPC message over ``max_receive_message_bytes``
(4 MiB by default, the Collector's; after decompression) is refused by grpc-core with
RESOURCE_EXHAUSTED; an HTTP body over ``max_http_body_bytes`` (20 MiB by default, the Collector's),
as sent or as it decompresses, is answered 413 without holding more than that, and at most
``HTTP_BODIES_AT_ONCE`` (4) bodies are read at a time (the others wait). HTTP connections are bounded in time
and number: no request begun within ``HTTP_IDLE_TIMEOUT_S`` (60 s) or headers not in within
``HTTP_HEADER_TIMEOUT_S`` (10 s) of their first byte closes the connection, a body gets ``HTTP_BODY_DEADLINE_S``
(300 s), and at most ``HTTP_CONNECTIONS`` (64) are open (one more is closed at once). Answers follow the
OTLP specification: 400 (INVALID_ARGUMENT) for a body that does not parse, 415 for a content type
or encoding other than protobuf/JSON and gzip/deflate/identity, and a partial success
(``rejected_spans`` / ``rejected_data_points`` with an ``error_message``) for what ``on_request``
did not keep. Each refusal is logged as one warning line.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import mmap
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2

__all__ = [
    "OtlpReceiver",
    "ReceivedRequest",
    "Rejected",
    "decode_any_value",
    "metrics_from_otlp_json",
    "spans_from_otlp_json",
]

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC, decompressed: the Collector's default
DEFAULT_MAX_HTTP_BODY_BYTES = 20 * 1024 * 1024  # HTTP, as sent and decompressed: the Collector's default
MAX_LIMIT_BYTES = 2**31 - 1  # grpc-core's message limit is a C int
HTTP_BODY_TIMEOUT_S = 30.0  # a body that stops arriving (a Content-Length that promised more) is given up
HTTP_BODY_DEADLINE_S = 300.0  # a body still arriving this long after its headers (a trickle) is given up
HTTP_IDLE_TIMEOUT_S = 60.0  # a connection with no request begun this long is closed (the Collector's idle timeout)
HTTP_HEADER_TIMEOUT_S = 10.0  # from a request's first byte to the end of its headers; else the connection is closed
HTTP_CONNECTIONS = 64  # open HTTP connections at most (a thread each); one more is closed at once
HTTP_BODIES_AT_ONCE = 4  # HTTP requests read and parsed at a time; the others wait (memory: this many limits)
LINGER_S = 2.0  # after an error answer: how long, and how much, of the rest of the body is read and dropped
LINGER_BYTES = 4 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024  # read from the socket at a time
_CHUNK_OUT_BYTES = 1024 * 1024  # decompressed at a time
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


@dataclass(frozen=True)
class Rejected:
    """What ``on_request`` did not keep of a request, for the sender's OTLP partial-success answer.

    ``count``: spans (traces) or data points (metrics) not kept; ``error_message``: why, one line.
    """

    count: int
    error_message: str


from commdebug_otel.offline.otlp_json import (  # noqa: E402  (re-exported: part of this module's API)
    _SIGNALS,
    decode_any_value,
    metrics_from_otlp_json,
    spans_from_otlp_json,
)
from commdebug_otel.offline.otlp_json import metric_dicts as _metric_dicts  # noqa: E402
from commdebug_otel.offline.otlp_json import parse_otlp_json as _parse_otlp_json  # noqa: E402
from commdebug_otel.offline.otlp_json import span_dicts as _span_dicts  # noqa: E402


class _Refused(Exception):
    """A request answered with an error as a whole: its HTTP status, gRPC code and a one-line reason."""

    def __init__(self, status: int, code: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason = status, code, reason


_GRPC_SERVICES = {"traces": "opentelemetry.proto.collector.trace.v1.TraceService",
                  "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService"}
_CONTENT_TYPES = {"application/x-protobuf": False, "application/json": True}  # media type -> is JSON
_ENCODINGS = ("gzip", "deflate", "identity")


class _Unparsable:
    """A gRPC request whose bytes are not the service's message (answered INVALID_ARGUMENT)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _grpc_deserializer(signal: str) -> Callable[[bytes], Any]:
    parse = _SIGNALS[signal][0].FromString

    def deserialize(raw: bytes) -> Any:
        try:  # grpcio would log a traceback and answer INTERNAL
            return parse(raw)
        except Exception as error:
            return _Unparsable(_one_line(error))

    return deserialize


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class _Inflater:
    """Streaming gzip/deflate/identity decoding that never holds more than ``limit`` decoded bytes.

    The bytes go to an anonymous mapping of ``limit`` bytes: memory is taken only as it is written,
    and never copied to grow (a growing buffer's realloc can hold two copies at once). :meth:`close` frees it.
    """

    def __init__(self, encoding: str, limit: int) -> None:
        self.encoding, self.limit = encoding, limit
        self.size = 0
        self._out = mmap.mmap(-1, limit)
        self._zlib: Any = None
        self._first = True
        self._head = b""

    def feed(self, data: bytes) -> None:
        if self.encoding == "identity":
            self._keep(data)
            return
        if self._first:  # the framing is chosen from the first two bytes
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = bytes(self._head), b""
        while data:
            if self._zlib is None:
                if self._first or self.encoding == "gzip":  # gzip bodies may be several members
                    self._zlib = zlib.decompressobj(self._wbits(data))
                    self._first = False
                else:
                    raise _Refused(400, code_pb2.INVALID_ARGUMENT, "bad deflate body: data after its end")
            try:
                # a MiB at a time: one call's output is built in blocks and then joined (twice its size)
                self._keep(self._zlib.decompress(data, min(self.limit - self.size + 1, _CHUNK_OUT_BYTES)))
            except zlib.error as error:
                raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"bad {self.encoding} body: {error}") from None
            data = self._zlib.unconsumed_tail
            if self._zlib.eof:
                data, self._zlib = self._zlib.unused_data, None

    def _wbits(self, data: bytes) -> int:
        if self.encoding == "gzip":
            return 16 + zlib.MAX_WBITS
        # "deflate" is zlib-wrapped (RFC 9110); some senders send the raw stream
        zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS

    def _keep(self, data: bytes) -> None:
        if self.size + len(data) > self.limit:
            raise _Refused(413, code_pb2.RESOURCE_EXHAUSTED,
                           f"body larger than {self.limit} bytes once decompressed ({self.encoding})")
        self._out.write(data)
        self.size += len(data)

    def finish(self) -> None:
        if self._zlib is not None or (self._first and self.encoding != "identity"):
            raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"bad {self.encoding} body: cut short")

    @contextlib.contextmanager
    def view(self) -> Iterator[memoryview]:
        """The decoded bytes, without a copy; valid inside the ``with`` only."""
        with memoryview(self._out) as whole, whole[:self.size] as part:
            yield part

    def close(self) -> None:
        self._zlib = None
        self._out.close()


class _Deadline(io.RawIOBase):
    """The connection's reads, each given what is left to a deadline (``until``; None: the socket's own
    timeout), so a slow trickle cannot stretch a wait that a per-read timeout would keep restarting."""

    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection
        self.until: float | None = None
        self.what = ""  # what the deadline is for, for TimeoutError's message

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError(self.what)
            self._connection.settimeout(left)
        return self._connection.recv_into(buffer)


class _HttpHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file: ours reads with deadlines
        self._reads = _Deadline(self.connection)
        self.rfile = io.BufferedReader(self._reads)

    def handle_one_request(self) -> None:
        """Wait at most ``HTTP_IDLE_TIMEOUT_S`` for a request to begin, then ``HTTP_HEADER_TIMEOUT_S`` for the
        rest of its headers (a client that connects and sends nothing, or trickles header bytes, is closed)."""
        reads = self._reads
        reads.until, reads.what = time.monotonic() + HTTP_IDLE_TIMEOUT_S, "idle"
        try:
            begun = self.rfile.peek(1)  # type: ignore[attr-defined]  # a BufferedReader (rbufsize -1)
        except TimeoutError:  # idle: closed, as the Collector closes an idle connection
            begun = b""
        if not begun:  # or the client closed it
            self.close_connection = True
            return
        reads.until, reads.what = time.monotonic() + HTTP_HEADER_TIMEOUT_S, "headers"
        super().handle_one_request()  # a read past the deadline raises TimeoutError: it closes the connection
        if reads.until is not None and time.monotonic() >= reads.until:
            self.close_connection = True
            self.server.receiver._say_refused("HTTP", None, self.client_address[0],
                                              f"connection closed: headers not in within "
                                              f"{HTTP_HEADER_TIMEOUT_S:g} s of the request's first byte")

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self._reads.until = None  # the headers are in: the body has its own bounds (_read_body)
        self.connection.settimeout(None)
        return parsed

    def do_POST(self) -> None:
        signal = {"/v1/traces": "traces", "/v1/metrics": "metrics"}.get(self.path.split("?")[0])
        media = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        is_json = media == "application/json"
        receiver = self.server.receiver
        try:
            if signal is None:
                raise _Refused(404, code_pb2.UNIMPLEMENTED, f"no OTLP signal at {self.path.split('?')[0]!r} "
                                                            "(/v1/traces and /v1/metrics are received)")
            if media not in _CONTENT_TYPES:
                raise _Refused(415, code_pb2.INVALID_ARGUMENT, f"Content-Type {media or '(none)'!r} is not "
                                                               "application/x-protobuf or application/json")
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            if encoding not in _ENCODINGS:
                raise _Refused(415, code_pb2.INVALID_ARGUMENT, f"Content-Encoding {encoding!r} is not gzip, "
                                                               "deflate or identity")
            with receiver._http_bodies:  # each body may hold up to the limit: so many at once
                inflater = _Inflater(encoding, receiver.max_http_body_bytes)
                try:
                    wire = self._read_body(inflater)  # a client gone raises OSError: _HttpServer.handle_error
                    try:
                        with inflater.view() as raw:
                            req = (_parse_otlp_json(bytes(raw), signal) if is_json
                                   else _SIGNALS[signal][0].FromString(raw))
                    except Exception as error:  # protobuf, JSON or its OTLP mapping; RecursionError: deep nesting
                        raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"body is not an OTLP {signal} request "
                                                                       f"({'JSON' if is_json else 'protobuf'}): "
                                                                       f"{_one_line(error)}") from None
                finally:  # freed before the answer, which may linger
                    inflater.close()
                headers = {k.lower(): v for k, v in self.headers.items()}
                resp = receiver._record(signal, "http", req, req.ByteSize(), wire, headers)
        except _Refused as refused:
            receiver._say_refused("HTTP", signal, self.client_address[0], refused.reason)
            return self._reply(refused.status, is_json, status_pb2.Status(code=refused.code, message=refused.reason))
        self._reply(200, is_json, resp)

    def _read_body(self, inflater: _Inflater) -> int:
        """Read the body into ``inflater``, by Content-Length or chunked framing; its length as sent (bytes)."""
        limit = inflater.limit
        framing = (self.headers.get("Transfer-Encoding") or "").strip().lower()
        length_text = self.headers.get("Content-Length")
        if framing and framing != "chunked":
            raise _Refused(415, code_pb2.INVALID_ARGUMENT, f"Transfer-Encoding {framing!r} is not chunked")
        if framing and length_text is not None:
            raise _Refused(400, code_pb2.INVALID_ARGUMENT, "both Content-Length and Transfer-Encoding")
        if not framing and length_text is None:
            raise _Refused(411, code_pb2.INVALID_ARGUMENT, "no Content-Length and not chunked")
        if length_text is not None and not length_text.strip().isdigit():  # (and not framing: said above)
            raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"Content-Length {length_text!r} is not a number")
        if length_text is not None and int(length_text) > limit:  # refused before a byte is read
            raise _Refused(413, code_pb2.RESOURCE_EXHAUSTED,
                           f"body of {int(length_text)} bytes, larger than {limit} bytes")
        wire = 0
        self.connection.settimeout(HTTP_BODY_TIMEOUT_S)
        self._reads.until, self._reads.what = time.monotonic() + HTTP_BODY_DEADLINE_S, "body"
        try:
            pieces = self._pieces(int(length_text)) if length_text is not None else self._chunks()
            for piece in pieces:
                wire += len(piece)
                if wire > limit:
                    raise _Refused(413, code_pb2.RESOURCE_EXHAUSTED, f"body larger than {limit} bytes as sent")
                inflater.feed(piece)
        except TimeoutError as error:
            slow = (f"still arriving {HTTP_BODY_DEADLINE_S:g} s after its headers" if str(error) == "body"
                    else f"stopped arriving for {HTTP_BODY_TIMEOUT_S:g} s")
            raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"body {slow} after {wire} bytes") from None
        finally:
            self._reads.until = None
            if not self.close_connection:
                self.connection.settimeout(None)  # the next request's wait is handle_one_request's
        inflater.finish()
        return wire

    def _pieces(self, length: int):
        left = length
        while left:
            piece = self.rfile.read(min(left, _CHUNK_BYTES))
            if not piece:
                raise _Refused(400, code_pb2.INVALID_ARGUMENT,
                               f"body ended after {length - left} of the {length} bytes of its Content-Length")
            left -= len(piece)
            yield piece

    def _chunks(self):
        while True:
            line = self.rfile.readline(1024)
            size_text = line.split(b";")[0].strip()
            try:
                size = int(size_text, 16)
                if size < 0 or not line.endswith(b"\n"):
                    raise ValueError
            except ValueError:
                raise _Refused(400, code_pb2.INVALID_ARGUMENT, f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailer fields
                    pass
                return
            yield from self._pieces(size)
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise _Refused(400, code_pb2.INVALID_ARGUMENT, "chunk not followed by CRLF")

    def _reply(self, code: int, is_json: bool, message: Any) -> None:
        if code != 200:  # the rest of a refused body may still be on its way: do not read it as a request
            self.close_connection = True
        payload = json_format.MessageToJson(message).encode() if is_json else message.SerializeToString()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if is_json else "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        if self.close_connection:
            self._linger()

    def _linger(self) -> None:
        """Read what the client still sends, a little while, before closing: closing a socket with unread
        bytes resets the connection, and the client may lose the answer before it reads it."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_S
            drained = 0
            while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                piece = self.connection.recv(_CHUNK_BYTES)
                if not piece:
                    break
                drained += len(piece)
        except OSError:  # the client is gone or slow: it has had its chance
            pass

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    receiver: OtlpReceiver

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connections = threading.BoundedSemaphore(HTTP_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):
            self.receiver._say_refused("HTTP", None, client_address[0],
                                       f"connection closed: {HTTP_CONNECTIONS} connections are open already")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # the client went away mid-request: one line, not socketserver's traceback
            _logger.warning("OTLP receiver: HTTP connection from %s ended: %s", client_address[0], _one_line(error))
            return
        super().handle_error(request, client_address)


# ---------------------------------------------------------------- receiver


class OtlpReceiver:
    """OTLP/gRPC + OTLP/HTTP receiver on 127.0.0.1; use as a context manager.

    Args:
        max_receive_message_bytes: the largest gRPC message (bytes, after decompression; default
            4 MiB like the Collector); grpc-core refuses a larger one with RESOURCE_EXHAUSTED before
            it is parsed (this receiver never sees it).
        host: the address both servers bind.
        grpc_port, http_port: 0 (default) for a free port each.
        on_request: ``on_request(request: ReceivedRequest) -> Rejected | None``, called with each
            parsed request on the server thread that took it. A :class:`Rejected` it returns becomes
            the answer's OTLP partial success (still HTTP 200 / gRPC OK); an exception it raises is
            logged as one line and answered HTTP 500 / gRPC INTERNAL (the sender learns it was not kept).
        keep: hold requests for ``requests()``.
        max_http_body_bytes: the largest HTTP body (bytes; default 20 MiB like the Collector), as sent
            and once decompressed; a larger one is answered 413 with no more than this held in memory.

    ``refused`` counts the requests this receiver answered with an error (HTTP 4xx/5xx, gRPC
    INVALID_ARGUMENT or INTERNAL), not those grpc-core refuses as too large.

    Raises:
        ValueError: a limit that is not an integer from 1 to 2**31 - 1.
        OSError: from :meth:`start`, when a port cannot be bound (in use, or no such address).
    """

    def __init__(self, max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, host: str = "127.0.0.1",
                 grpc_port: int = 0, http_port: int = 0,
                 on_request: Callable[[ReceivedRequest], Rejected | None] | None = None, keep: bool = True,
                 max_http_body_bytes: int = DEFAULT_MAX_HTTP_BODY_BYTES) -> None:
        for name, value in (("max_receive_message_bytes", max_receive_message_bytes),
                            ("max_http_body_bytes", max_http_body_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT_BYTES:
                raise ValueError(f"{name} must be an integer from 1 to {MAX_LIMIT_BYTES}, got {value!r}")
        self.max_receive_message_bytes = max_receive_message_bytes
        self.max_http_body_bytes = max_http_body_bytes
        self.host = host
        self._ports = (grpc_port, http_port)
        self._on_request = on_request
        self._keep = keep
        self._lock = threading.Lock()
        self._requests: list[ReceivedRequest] = []
        self.refused = 0  # requests answered with an error by this receiver
        self._http_bodies = threading.BoundedSemaphore(HTTP_BODIES_AT_ONCE)
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
        # grpc-core checks the limit as the message arrives and as it decompresses, before any parsing.
        # so_reuseport off: a second receiver on the same port fails to start instead of sharing it.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                 options=[("grpc.max_receive_message_length", self.max_receive_message_bytes),
                                          ("grpc.so_reuseport", 0)])
        self._grpc.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
            "Export": grpc.unary_unary_rpc_method_handler(
                functools.partial(self._accept_grpc, signal), request_deserializer=_grpc_deserializer(signal),
                response_serializer=_SIGNALS[signal][1].SerializeToString)})
            for signal, service in _GRPC_SERVICES.items()])
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
        """The answer to a parsed request, with the partial success ``on_request`` returned.

        Raises:
            _Refused: ``on_request`` raised (500 / INTERNAL).
        """
        received = ReceivedRequest(signal, transport, size, wire, headers, req)
        if self._keep:
            with self._lock:
                self._requests.append(received)
        response = _SIGNALS[signal][1]()
        if self._on_request is not None:
            try:
                rejected = self._on_request(received)
            except Exception as error:  # a full disk: the sender must not believe it was kept
                raise _Refused(500, code_pb2.INTERNAL, f"not kept: {_one_line(error)}") from None
            if rejected is not None and rejected.count:
                response.partial_success.error_message = rejected.error_message
                if signal == "traces":
                    response.partial_success.rejected_spans = rejected.count
                else:
                    response.partial_success.rejected_data_points = rejected.count
        return response

    def _accept_grpc(self, signal: str, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if isinstance(request, _Unparsable):
                raise _Refused(400, code_pb2.INVALID_ARGUMENT,
                               f"message is not an OTLP {signal} request (protobuf): {request.reason}")
            headers = {k.lower(): v for k, v in context.invocation_metadata()}
            return self._record(signal, "grpc", request, request.ByteSize(), None, headers)
        except _Refused as refused:
            self._say_refused("gRPC", signal, context.peer(), refused.reason)
            code = grpc.StatusCode.INTERNAL if refused.code == code_pb2.INTERNAL else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, refused.reason)

    def _say_refused(self, transport: str, signal: str | None, peer: str, reason: str) -> None:
        with self._lock:
            self.refused += 1
        _logger.warning("OTLP receiver: refused a %srequest over %s from %s: %s",
                        f"{signal} " if signal else "", transport, peer, reason)

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
        """Forget every received request and reset ``refused``."""
        with self._lock:
            self._requests.clear()
            self.refused = 0


if __name__ == "__main__":  # `python -m commdebug_otel.testing.otlp_receiver` is `commdebug-otel receive`
    from commdebug_otel.cli import main

    sys.exit(main(["receive", *sys.argv[1:]]))
