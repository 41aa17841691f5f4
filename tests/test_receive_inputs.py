"""`commdebug-otel receive` against hostile and odd requests, over real HTTP and gRPC: bounded memory (a gzip bomb
is answered 413 / RESOURCE_EXHAUSTED with the process's peak RSS grown by about the cap), the OTLP answers (400,
411, 413, 415, partial success) and one log line per refusal, never a traceback."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from commdebug_otel import semconv
from commdebug_otel.offline import summary
from commdebug_otel.offline.otlp_json import metrics_from_otlp_json, to_otlp_json

from tools import default_signal_actions

_CLI = [sys.executable, "-m", "commdebug_otel.cli"]
_MIB = 1 << 20
_HTTP_CAP = 20 * _MIB  # receive's defaults
_GRPC_CAP = 4 * _MIB
_SLACK = 12 * _MIB  # allocator and thread-stack noise on top of the cap
_TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_METRICS = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


class _Receiver:
    """`commdebug-otel receive` on free ports, its stderr in a file."""

    def __init__(self, root):
        self.root = root
        self.err_path = root / "stderr.txt"
        self._err = open(self.err_path, "w")
        self.process = subprocess.Popen([*_CLI, "receive", "--grpc-port", "0", "--http-port", "0", "-o",
                                         str(root / "out")], env=_env(), cwd=root, stdout=subprocess.PIPE,
                                        stderr=self._err, text=True, preexec_fn=default_signal_actions)
        first = self.process.stdout.readline()
        ports = re.match(r"receiving OTLP/gRPC on http://127.0.0.1:(\d+) and OTLP/HTTP on http://127.0.0.1:(\d+)",
                         first)
        assert ports, first + self.err_path.read_text()
        self.grpc_port, self.http_port = int(ports[1]), int(ports[2])

    def peak_rss(self) -> int:
        """The receiver process's peak resident set (bytes), from /proc/PID/status VmHWM."""
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

    def log(self) -> list[str]:
        return self.err_path.read_text().splitlines()

    def stop(self) -> str:
        self.process.terminate()
        out, _ = self.process.communicate(timeout=60)
        self._err.close()
        return out


@pytest.fixture
def receiver(tmp_path):
    started = _Receiver(tmp_path)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def bombed(tmp_path_factory):
    """A receiver for the HTTP bombs, and its peak RSS before the first: each must keep the peak near it."""
    started = _Receiver(tmp_path_factory.mktemp("receive-bombs"))
    started.baseline = started.peak_rss()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    started = _Receiver(tmp_path_factory.mktemp("receive-inputs"))
    yield started
    started.stop()


# ------------------------------------------------------------------ requests


def _resource(request, rank, name="train_step", value=None):
    """A ResourceSpans (or ResourceMetrics, for a metrics request) of one span (one gauge point) on ``rank``."""
    resource = (request.resource_spans if isinstance(request, ExportTraceServiceRequest)
                else request.resource_metrics).add()
    rank_value = AnyValue(int_value=rank) if isinstance(rank, int) else AnyValue(string_value=rank)
    resource.resource.attributes.extend([KeyValue(key=semconv.RANK, value=rank_value),
                                         KeyValue(key="service.name", value=AnyValue(string_value="job"))])
    if isinstance(request, ExportTraceServiceRequest):
        span_id = hashlib.blake2b(name.encode(), digest_size=8).digest()  # one span per name
        resource.scope_spans.add().spans.add(name=name, trace_id=b"\1" * 16, span_id=span_id)
    else:
        metric = resource.scope_metrics.add().metrics.add(name=name)
        metric.gauge.data_points.add(as_int=value or 1, time_unix_nano=1)
        metric.gauge.data_points.add(as_int=value or 1, time_unix_nano=2)
    return request


def _spans(rank="zero"):
    """A trace request: one good resource (rank 0) and one whose rank is ``rank``."""
    request = _resource(ExportTraceServiceRequest(), 0, "kept")
    return _resource(request, rank, "dropped")


@functools.cache
def _zeros_gzip(size: int, wbits: int = 31) -> bytes:
    """``size`` zero bytes compressed (gzip by default; 15: zlib-wrapped deflate), made a MiB at a time."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(_MIB)
    return b"".join(compressor.compress(zeros) for _ in range(size // _MIB)) + compressor.flush()


_BOMB = 512 * _MIB


def _post(port, path, body, content_type="application/x-protobuf", encoding=None, chunked=False, headers=()):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = {"Content-Type": content_type, **dict(headers)}
    if encoding:
        sent["Content-Encoding"] = encoding
    if chunked:  # an iterable body goes out chunked, with no Content-Length
        body = iter([body[start:start + 65536] for start in range(0, len(body), 65536)])
    connection.request("POST", path, body=body, headers=sent)
    response = connection.getresponse()
    answer = SimpleNamespace(status=response.status, type=response.getheader("Content-Type"), body=response.read())
    connection.close()
    return answer


def _status(answer) -> status_pb2.Status:
    if answer.type == "application/json":
        return json_format.Parse(answer.body, status_pb2.Status())
    assert answer.type == "application/x-protobuf"
    return status_pb2.Status.FromString(answer.body)


def _raw_http(port, head: bytes, body: bytes = b"", shut=True) -> bytes:
    """What the receiver answers to bytes written on a plain socket (write side closed after them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + body)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _grpc_call(port, method, payload: bytes, response_class, compression=None):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method, request_serializer=lambda raw: raw,
                                   response_deserializer=response_class.FromString)
        return call(payload, timeout=60, compression=compression)


def _span_names(receiver) -> set[str]:
    out = receiver.root / "out"
    return {span["name"] for span in summary.load_spans([out])} if out.exists() else set()


def _no_traceback(receiver):
    assert not any("Traceback" in line for line in receiver.log()), receiver.log()


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("form", ["gzip", "gzip-chunked", "deflate"])
def test_an_http_decompression_bomb_is_413_and_memory_stays_near_the_cap(bombed, form):
    bomb = _zeros_gzip(_BOMB, 15 if form == "deflate" else 31)
    assert len(bomb) < 600 * 1024
    answer = _post(bombed.http_port, "/v1/traces", bomb, encoding=form.split("-")[0],
                   chunked=form.endswith("chunked"))
    grown = bombed.peak_rss() - bombed.baseline
    assert answer.status == 413
    reason = f"body larger than {_HTTP_CAP} bytes once decompressed ({form.split('-')[0]})"
    assert _status(answer) == status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=reason)
    assert grown < _HTTP_CAP + _SLACK, f"peak RSS grew by {grown / _MIB:.1f} MiB"
    assert bombed.log()[-1] == f"OTLP receiver: refused a traces request over HTTP from 127.0.0.1: {reason}"
    _no_traceback(bombed)


def test_bombs_at_once_hold_at_most_four_caps(receiver):
    """Eight clients each send a bomb's first 18 MiB (decompressed), wait, then the rest: the receiver reads four
    bodies at a time, so no more than four are held at once."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    head = b"".join(compressor.compress(bytes(_MIB)) for _ in range(18)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    tail = b"".join(compressor.compress(bytes(_MIB)) for _ in range(64)) + compressor.flush()
    request = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
               f"Content-Encoding: gzip\r\nContent-Length: {len(head) + len(tail)}\r\n\r\n").encode()
    answers = []

    def client():
        with socket.create_connection(("127.0.0.1", receiver.http_port), timeout=60) as sock:
            sock.sendall(request + head)
            time.sleep(1.5)
            sock.sendall(tail)
            answers.append(sock.makefile("rb").readline())

    before = receiver.peak_rss()
    clients = [threading.Thread(target=client) for _ in range(8)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(120)
    grown = receiver.peak_rss() - before
    assert answers == [b"HTTP/1.1 413 Request Entity Too Large\r\n"] * 8
    assert grown < 4 * _HTTP_CAP + _SLACK, f"peak RSS grew by {grown / _MIB:.1f} MiB"


def test_a_grpc_decompression_bomb_is_refused_before_it_is_held(receiver):
    payload = bytes(100 * _MIB)  # gzip makes ~100 KiB of it on the wire
    before = receiver.peak_rss()
    with pytest.raises(grpc.RpcError) as raised:
        _grpc_call(receiver.grpc_port, _TRACES, payload, ExportTraceServiceResponse, grpc.Compression.Gzip)
    grown = receiver.peak_rss() - before
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grown < _GRPC_CAP + _SLACK, f"peak RSS grew by {grown / _MIB:.1f} MiB"
    _no_traceback(receiver)


def test_grpc_refuses_a_message_over_its_limit_uncompressed_and_takes_one_under_it(shared):
    big = _resource(ExportTraceServiceRequest(), 0, "x" * (_GRPC_CAP + 1))
    with pytest.raises(grpc.RpcError) as raised:
        _grpc_call(shared.grpc_port, _TRACES, big.SerializeToString(), ExportTraceServiceResponse)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    fits = _resource(ExportTraceServiceRequest(), 0, "y" * (_GRPC_CAP - 1000))
    answer = _grpc_call(shared.grpc_port, _TRACES, fits.SerializeToString(), ExportTraceServiceResponse,
                        grpc.Compression.Gzip)
    assert answer == ExportTraceServiceResponse()
    assert {len(name) for name in _span_names(shared) if name.startswith("y")} == {_GRPC_CAP - 1000}


def test_the_http_limit_is_a_flag(tmp_path):
    done = subprocess.run([*_CLI, "receive", "--http-max-mib", "0"], env=_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.endswith("argument --http-max-mib: expected a number of MiB > 0 and < 2048, got '0'\n")


# ------------------------------------------------------------------ HTTP framing and encodings


def test_a_content_length_over_the_cap_is_413_before_the_body_is_read(shared):
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n").encode()
    answer = _raw_http(shared.http_port, head, shut=False)  # the 1 GiB never comes
    assert answer.startswith(b"HTTP/1.1 413 ")
    message = f"body of {1 << 30} bytes, larger than {_HTTP_CAP} bytes"
    assert answer.endswith(status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message).SerializeToString())
    assert b"\r\nConnection: close\r\n" in answer


def test_a_body_shorter_than_its_content_length_is_400_not_kept(shared):
    body = _resource(ExportTraceServiceRequest(), 0, "short").SerializeToString()
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n").encode()
    answer = _raw_http(shared.http_port, head, body)
    assert answer.startswith(b"HTTP/1.1 400 ")
    message = f"body ended after {len(body)} of the {len(body) + 100} bytes of its Content-Length"
    assert answer.endswith(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message).SerializeToString())
    assert "short" not in _span_names(shared)


def test_a_client_that_resets_mid_body_is_one_line(shared):
    head = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 1000\r\n\r\n")
    said = len(shared.log())
    with socket.create_connection(("127.0.0.1", shared.http_port), timeout=20) as sock:
        sock.sendall(head + b"\x0a" * 10)
        time.sleep(0.5)  # the receiver is reading the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    deadline = time.monotonic() + 20
    while not any("HTTP connection from" in line for line in shared.log()[said:]):
        assert time.monotonic() < deadline, shared.log()[said:]
        time.sleep(0.05)
    # The reset is seen reading the body, or (the read having ended) answering it.
    refused = "OTLP receiver: refused a traces request over HTTP from 127.0.0.1: body ended after 10 of the 1000 bytes"
    assert shared.log()[said:-1] in ([], [refused + " of its Content-Length"])
    assert re.fullmatch(r"OTLP receiver: HTTP connection from 127.0.0.1 ended: (BrokenPipe|ConnectionReset)Error: .*",
                        shared.log()[-1])
    _no_traceback(shared)


def test_no_content_length_and_not_chunked_is_411(shared):
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n\r\n"
    assert _raw_http(shared.http_port, head).startswith(b"HTTP/1.1 411 ")


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate", "identity"])
@pytest.mark.parametrize("chunked", [False, True])
def test_each_encoding_and_framing_is_received(shared, encoding, chunked):
    name = f"{encoding}-{chunked}"
    raw = _resource(ExportTraceServiceRequest(), 0, name).SerializeToString()
    body = {"gzip": lambda: gzip.compress(raw), "deflate": lambda: zlib.compress(raw),
            "raw-deflate": lambda: zlib.compress(raw, wbits=-15), "identity": lambda: raw}[encoding]()
    answer = _post(shared.http_port, "/v1/traces", body, encoding=encoding.replace("raw-", ""), chunked=chunked)
    assert (answer.status, answer.body) == (200, b"")
    assert name in _span_names(shared)


@pytest.mark.parametrize("content_type, encoding, reason", [
    ("application/x-protobuf", "br", "Content-Encoding 'br' is not gzip, deflate or identity"),
    ("text/plain", None, "Content-Type 'text/plain' is not application/x-protobuf or application/json"),
])
def test_an_unsupported_type_or_encoding_is_415(shared, content_type, encoding, reason):
    body = _resource(ExportTraceServiceRequest(), 0, "unsupported").SerializeToString()
    answer = _post(shared.http_port, "/v1/traces", body, content_type=content_type, encoding=encoding)
    assert answer.status == 415
    assert _status(answer) == status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=reason)
    assert "unsupported" not in _span_names(shared)


@pytest.mark.parametrize("content_type, body, encoding, reason", [
    ("application/x-protobuf", b"\xff\xff\xff", None, "body is not an OTLP traces request (protobuf): DecodeError"),
    ("application/json", b'{"resourceSpans": [', None, "body is not an OTLP traces request (JSON): JSONDecodeError"),
    ("application/json", b"[" * 100_000 + b"]" * 100_000, None,
     "body is not an OTLP traces request (JSON): RecursionError"),
    ("application/x-protobuf", gzip.compress(b"x" * 1000, mtime=0)[:-12], "gzip", "bad gzip body: cut short"),
    ("application/x-protobuf", b"not gzip", "gzip", "bad gzip body: Error -3 while decompressing data: incorrect "
                                                    "header check"),
])
def test_a_body_that_does_not_parse_is_400_with_one_line(shared, content_type, body, encoding, reason):
    answer = _post(shared.http_port, "/v1/traces", body, content_type=content_type, encoding=encoding)
    assert answer.status == 400
    status = _status(answer)
    assert status.code == code_pb2.INVALID_ARGUMENT and status.message.startswith(reason)
    line = shared.log()[-1]
    assert line.startswith(f"OTLP receiver: refused a traces request over HTTP from 127.0.0.1: {reason}")
    _no_traceback(shared)


# ------------------------------------------------------------------ partial success


def test_http_protobuf_spans_of_a_resource_without_an_integer_rank_are_a_partial_success(shared):
    answer = _post(shared.http_port, "/v1/traces", _spans("zero").SerializeToString())
    assert answer.status == 200
    response = ExportTraceServiceResponse.FromString(answer.body)
    assert response.partial_success.rejected_spans == 1
    assert response.partial_success.error_message == (
        "not written: resource attribute torch.distributed.rank is not an integer ('zero')")
    names = _span_names(shared)
    assert "kept" in names and "dropped" not in names
    _no_traceback(shared)


def test_http_json_metrics_with_a_rank_out_of_range_are_a_partial_success(shared):
    request = _resource(ExportMetricsServiceRequest(), 0, "kept.gauge", 7)
    _resource(request, 1 << 20, "dropped.gauge")
    answer = _post(shared.http_port, "/v1/metrics", to_otlp_json(request).encode(), content_type="application/json")
    assert (answer.status, answer.type) == (200, "application/json")
    assert json.loads(answer.body) == {"partialSuccess": {
        "rejectedDataPoints": "2",
        "errorMessage": "not written: resource attribute torch.distributed.rank 1048576 is out of range"}}
    names = {point["name"] for path in (shared.root / "out").rglob("metrics-rank*.jsonl")
             for line in path.read_text().splitlines() for point in metrics_from_otlp_json(line)}
    assert "kept.gauge" in names and "dropped.gauge" not in names


def test_grpc_spans_of_a_resource_without_an_integer_rank_are_a_partial_success(shared):
    answer = _grpc_call(shared.grpc_port, _TRACES, _spans("1.5").SerializeToString(), ExportTraceServiceResponse)
    assert answer.partial_success.rejected_spans == 1
    assert answer.partial_success.error_message.startswith(
        "not written: resource attribute torch.distributed.rank is not an integer")


def test_grpc_metrics_partial_success_counts_data_points(shared):
    request = _resource(ExportMetricsServiceRequest(), "rank-one", "dropped.gauge")
    answer = _grpc_call(shared.grpc_port, _METRICS, request.SerializeToString(), ExportMetricsServiceResponse,
                        grpc.Compression.Gzip)
    assert answer.partial_success.rejected_data_points == 2


def test_grpc_bytes_that_do_not_parse_are_invalid_argument_with_one_line(shared):
    with pytest.raises(grpc.RpcError) as raised:
        _grpc_call(shared.grpc_port, _TRACES, b"\xff\xff\xff", ExportTraceServiceResponse)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("message is not an OTLP traces request (protobuf): DecodeError")
    line = shared.log()[-1]
    assert line.startswith("OTLP receiver: refused a traces request over gRPC from ipv4:127.0.0.1:")
    assert line.endswith(raised.value.details())
    _no_traceback(shared)


def test_logs_are_not_received(shared):
    answer = _post(shared.http_port, "/v1/logs", b"")
    assert answer.status == 404
    assert _status(answer).message == "no OTLP signal at '/v1/logs' (/v1/traces and /v1/metrics are received)"


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_request_that_cannot_be_kept_is_an_error_answer_not_a_silent_ok(transport, caplog):
    from commdebug_otel.testing.otlp_receiver import OtlpReceiver

    def full_disk(received):
        raise OSError(28, "No space left on device")

    body = _resource(ExportTraceServiceRequest(), 0, "lost").SerializeToString()
    reason = "not kept: OSError: [Errno 28] No space left on device"
    with OtlpReceiver(on_request=full_disk, keep=False) as receiver:
        if transport == "http":
            answer = _post(receiver.http_port, "/v1/traces", body)
            assert answer.status == 500
            assert _status(answer) == status_pb2.Status(code=code_pb2.INTERNAL, message=reason)
        else:
            with pytest.raises(grpc.RpcError) as raised:
                _grpc_call(receiver.grpc_port, _TRACES, body, ExportTraceServiceResponse)
            assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INTERNAL, reason)
    assert receiver.refused == 1
    [record] = caplog.records
    assert record.getMessage().endswith(f": {reason}") and record.exc_info is None


@pytest.fixture
def quick_limits(monkeypatch):
    """An in-process receiver whose idle, header and connection limits are short enough for a test."""
    from commdebug_otel.testing import otlp_receiver

    monkeypatch.setattr(otlp_receiver, "HTTP_IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(otlp_receiver, "HTTP_HEADER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(otlp_receiver, "HTTP_CONNECTIONS", 3)
    with otlp_receiver.OtlpReceiver() as receiver:
        yield receiver


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the receiver closes ``sock`` (recv gives b""), writing ``trickle`` a byte every 0.1 s."""
    start = time.monotonic()
    sock.settimeout(0.1)
    for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""] * 200:
        try:
            if byte:
                sock.sendall(byte)
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            return time.monotonic() - start
    return float("inf")


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(quick_limits):
    with socket.create_connection(("127.0.0.1", quick_limits.http_port), timeout=20) as sock:
        assert 0.9 <= _closed_after(sock) <= 5.0
    assert quick_limits.refused == 0  # an idle connection is closed quietly, as a Collector closes it


def test_a_slowloris_trickle_of_header_bytes_is_closed_at_the_header_deadline(quick_limits, caplog):
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n" + b"X-Pad: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", quick_limits.http_port), timeout=20) as sock:
        assert 0.9 <= _closed_after(sock, head) <= 5.0  # 200+ bytes at 10 a second would take 28 s
    assert quick_limits.refused == 1
    assert [record.getMessage().split(": ", 2)[2] for record in caplog.records if "refused" in record.getMessage()] \
        == ["connection closed: headers not in within 1 s of the request's first byte"]


def test_connections_past_the_bound_are_closed_at_once_and_a_later_request_is_received(quick_limits):
    held = [socket.create_connection(("127.0.0.1", quick_limits.http_port), timeout=20) for _ in range(3)]
    try:
        time.sleep(0.3)  # the three are accepted, each with its handler thread
        with socket.create_connection(("127.0.0.1", quick_limits.http_port), timeout=20) as extra:
            assert _closed_after(extra) < 0.9  # at once, not at the idle timeout
        assert quick_limits.refused == 1
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)  # their handlers see the close and free their slots
    answer = _post(quick_limits.http_port, "/v1/traces", _spans(0).SerializeToString())
    assert answer.status == 200
    assert sorted(span["name"] for span in quick_limits.spans()) == ["dropped", "kept"]
