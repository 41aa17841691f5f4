"""Never break or stall training; lose nothing silently; refuse bad input clearly."""

import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from commdebug_otel import CommTracer, Settings, semconv
from commdebug_otel.config import otlp_endpoint
from commdebug_otel.testing.otlp_receiver import OtlpReceiver

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


class BlackHole:
    """Accepts TCP connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def run_script(args, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(env_extra)
    start = time.time()
    result = subprocess.run([sys.executable, str(SCRIPTS / args[0]), *args[1:]], env=env,
                            capture_output=True, text=True, timeout=timeout)
    return result, time.time() - start


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("collector", ["black-holed", "unreachable"])
def test_bad_collector_costs_one_warning_and_a_bounded_exit(protocol, collector):
    hole = BlackHole() if collector == "black-holed" else None
    port = hole.port if hole else closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        result, _ = run_script(["one_rank.py", "3"], {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT": "2", "OTEL_EXPORTER_OTLP_TIMEOUT": "30"})
    finally:
        if hole:
            hole.close()
    assert result.returncode == 0, result.stderr
    done = float(result.stdout.split("TRAINING DONE ")[1].split()[0])
    exited = time.time()
    # One bounded flush-and-shutdown of 2 s at exit (not ~10 s per provider), plus interpreter
    # and process-group teardown.
    assert exited - done < 2 + 6, result.stderr
    warnings = [line for line in result.stderr.splitlines() if endpoint in line]
    assert len(warnings) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_oversized_batches_are_split_under_the_grpc_limit(tmp_path, monkeypatch, single_rank_group):
    monkeypatch.setenv("OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR", str(tmp_path))
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")

        class Chatty(torch.nn.Module):
            def forward(self, x):
                for _ in range(2000):
                    torch.distributed.all_reduce(x)
                return x

        from commdebug_otel.telemetry import Telemetry

        settings = Settings(max_events_per_span=2000, shutdown_timeout_s=20)
        tracer = CommTracer(settings)
        tracer.telemetry = Telemetry(settings, tracer.recorder.rank)  # a private SDK set-up
        tracer.recorder._emit_step = tracer.telemetry.emit
        with tracer:
            for _ in range(6):
                Chatty()(torch.ones(1))
        tracer.telemetry.shutdown()
        spans = receiver.spans()
    assert len(spans) == 6 and all(len(span["events"]) == 2000 for span in spans)
    assert receiver.rejected_grpc == 0
    assert max(request.size_bytes for request in receiver.requests("traces")) < 4 * 1024 * 1024
    assert len(receiver.requests("traces")) >= 2


def test_span_size_bound_is_never_below_the_encoded_size():
    """The guard sizes requests without encoding; its bound must hold for every value type."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceState

    from commdebug_otel.export_guard import SizedSpanExporter, span_bytes_bound

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bound-test", "1.0")
    values = ["", "ascii" * 50, "é中😀" * 40, "x" * 70_000, b"\x00\xff" * 300, True, 0, -2**63,
              2**63 - 1, -1.5e300, (), (-2**63, 7), ("a", "é😀"), (True, False), (0.1, -1e308)]
    linked = SpanContext(0x1234, 0x5678, is_remote=True, trace_state=TraceState([("vendor", "v" * 40)]))
    for index, value in enumerate(values):
        attributes = {f"key{index}": value, "k\u00e9\u4e2d": value}
        with tracer.start_as_current_span("span " + "é" * index, attributes=attributes,
                                          links=[Link(linked, attributes)]) as span:
            span.add_event("event 😀", attributes)
            span.set_status(Status(StatusCode.ERROR, "why 中" * index))
            try:
                raise ValueError("failure " * index)
            except ValueError as error:
                span.record_exception(error)
    with tracer.start_as_current_span("bare", links=[Link(linked)] * 20) as span:
        for _ in range(60):
            span.add_event("")  # attribute-less events and links: the fixed costs alone
    spans = exporter.get_finished_spans()
    guard = SizedSpanExporter(exporter, "unused", lambda kind, count: None)
    for span in spans:
        assert span_bytes_bound(span) + guard._framing_bound(span) >= encode_spans([span]).ByteSize(), span.name
    assert sum(map(span_bytes_bound, spans)) < 3 * encode_spans(spans).ByteSize()  # still a useful bound


def test_http_endpoint_paths_are_never_doubled(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    for base in ("http://collector:4318", "http://collector:4318/", "http://collector:4318/v1/traces"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
        assert otlp_endpoint("traces") == "http://collector:4318/v1/traces"
        assert otlp_endpoint("metrics") == "http://collector:4318/v1/metrics"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:9999/custom")
    assert otlp_endpoint("traces") == "http://other:9999/custom"  # per-signal: verbatim


def test_grpc_endpoint_without_scheme_is_named_once(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")
    with caplog.at_level(logging.WARNING):
        assert otlp_endpoint("traces") == "collector:4317"
        otlp_endpoint("traces")
    [record] = [r for r in caplog.records if "collector:4317" in r.getMessage()]
    assert "TLS" in record.getMessage() and "http://collector:4317" in record.getMessage()


def test_endpoint_with_signal_path_reaches_a_receiver_over_http(tmp_path):
    with OtlpReceiver() as receiver:
        result, _ = run_script(["one_rank.py", "2"], {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint + "/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cr3t-token"})
        assert result.returncode == 0, result.stderr
        assert [s["name"] for s in receiver.spans() if s["parent_span_id"] == ""].count("train_step") == 2
        assert {r.headers.get("authorization") for r in receiver.requests()} == {"Bearer s3cr3t-token"}
    assert "s3cr3t" not in result.stdout + result.stderr


def test_failing_hook_is_logged_once_counted_and_training_goes_on(telemetry, tracer_factory,
                                                                   single_rank_group, caplog, monkeypatch):
    from commdebug_otel.recorder import Recorder

    def broken(self, *args):
        raise RuntimeError("injected")

    monkeypatch.setattr(Recorder, "collective", broken)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING), tracer_factory():
        for _ in range(3):
            out = model(torch.ones(1, 2))
            torch.distributed.all_reduce(out.detach())
            out.sum().backward()
            optimizer.step()
    failures = [r for r in caplog.records if "collective event failed" in r.getMessage()]
    assert len(failures) == 1
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == [({semconv.DROPPED_KIND: "hook_error", semconv.RANK: 0}, 3)]
    assert len(telemetry.by_name("train_step")) == 3


def test_failing_exporter_is_counted(single_rank_group, monkeypatch):
    from opentelemetry.sdk.trace.export import SpanExporter

    from commdebug_otel.export_guard import SizedSpanExporter
    from commdebug_otel.testing import InMemoryTelemetry

    class Broken(SpanExporter):
        def export(self, spans):
            raise ConnectionError("collector exploded")

    drops = []
    guard = SizedSpanExporter(Broken(), "http://nowhere:4317", lambda kind, n: drops.append((kind, n)))
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert guard.export(telemetry.spans()).name == "FAILURE"
    assert drops == [("span", 1)]


def test_fork_child_exports_its_own_spans(tmp_path):
    result, _ = run_script(["one_rank.py", "2", "--fork"], {
        "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), "OTEL_METRICS_EXPORTER": "none"})
    assert result.returncode == 0, result.stderr
    from commdebug_otel.testing.otlp_receiver import spans_from_otlp_json

    [run] = tmp_path.glob("run-*")  # parent and fork child share the run's files
    lines = (run / "traces-rank0.jsonl").read_text().splitlines()
    spans = [span for line in lines for span in spans_from_otlp_json(line)]
    child_pid = int(result.stdout.split("CHILD PID ")[1].split()[0])
    child_steps = [s for s in spans if s["name"] == "train_step" and s["resource"]["process.pid"] == child_pid]
    assert len(child_steps) == 2


def test_full_export_queue_drops_are_counted_and_memory_is_bounded():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from commdebug_otel.export_guard import CountingBatchSpanProcessor

    release = threading.Event()
    exported = []

    class Stuck(SpanExporter):
        def export(self, spans):
            release.wait(10)
            exported.extend(spans)
            return SpanExportResult.SUCCESS

    drops = []
    processor = CountingBatchSpanProcessor(Stuck(), lambda kind, n: drops.append((kind, n)),
                                           max_queue_size=8, max_export_batch_size=4,
                                           schedule_delay_millis=1)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    for index in range(100):
        tracer.start_span(f"span {index}").end()
    assert len(processor._batch_processor._queue) <= 8  # bounded
    release.set()
    provider.shutdown()
    dropped = sum(n for kind, n in drops if kind == "span")
    assert dropped > 0 and dropped + len(exported) == 100


def test_exported_files_hold_no_tensor_values_and_bounded_strings(tmp_path, monkeypatch, single_rank_group):
    from commdebug_otel import Detail
    from commdebug_otel.telemetry import Telemetry

    monkeypatch.setenv("OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR", str(tmp_path))
    sentinel = 8675.309

    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            out = self.lin(x)
            torch.distributed.all_reduce(out.detach())
            if x.shape[0] == 2:
                raise ValueError("x" * 20000)
            return out

    settings = Settings(detail=Detail.ALL, output_dir=str(tmp_path))
    tracer = CommTracer(settings)
    tracer.telemetry = Telemetry(settings, tracer.recorder.rank)  # a private SDK set-up
    tracer.recorder._emit_step = tracer.telemetry.emit
    model = Leaky()
    with torch.no_grad():
        model.lin.weight.fill_(sentinel)
        model.lin.bias.fill_(sentinel)
    with tracer:
        model(torch.full((1, 3), sentinel))
        with pytest.raises(ValueError):
            model(torch.full((2, 3), sentinel))
    tracer.telemetry.shutdown()
    [run] = tmp_path.glob("run-*")
    text = (run / "traces-rank0.jsonl").read_text() + (run / "metrics-rank0.jsonl").read_text()
    assert "aten.addmm.default" in text and "all_reduce" in text
    # The value as Python or torch prints it; a bare "8675" also turns up in timestamps and ids.
    assert "8675.3" not in text and "8.6753e+03" not in text
    assert "x" * 4096 in text and "x" * 4097 not in text


def test_unwritable_output_folder_costs_a_warning_not_the_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result, _ = run_script(["one_rank.py", "3"], {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(blocker / "sub")})
    assert result.returncode == 0, result.stderr
    assert "TRAINING DONE" in result.stdout
    assert "spans are off" in result.stderr and "Traceback" not in result.stderr
