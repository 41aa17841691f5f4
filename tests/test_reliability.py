"""Never break or stall training; lose nothing silently; refuse bad input clearly."""

import errno
import json
import logging
import os
import pathlib
import signal
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

from tools import default_signal_actions

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


def _dropped_spans(run_dir):
    from commdebug_otel.offline.otlp_json import metrics_from_otlp_json

    points = [point for line in (run_dir / "metrics-rank0.jsonl").read_text().splitlines()
              for point in metrics_from_otlp_json(line) if point["name"] == semconv.METRIC_DROPPED
              and point["attributes"][semconv.DROPPED_KIND] == semconv.DROPPED_KIND_SPAN]
    return max((point["value"] for point in points), default=0)


@pytest.fixture(scope="module")
def healthy_spans(tmp_path_factory):
    """``{ending: spans one_rank.py writes to files}``, each ending run once for every collector it is
    compared with."""
    from commdebug_otel.offline.summary import load_spans

    counts = {}
    for ending, stop in (("exit", []), ("stop", ["--stop"])):
        healthy = tmp_path_factory.mktemp(f"healthy-{ending}")
        result, _ = run_script(["one_rank.py", "3", *stop], {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(healthy)})
        assert result.returncode == 0, result.stderr
        counts[ending] = len(load_spans([str(next(healthy.glob("run-*")))]))
    return counts


@pytest.mark.parametrize("collector", ["black-holed", "unreachable"])
@pytest.mark.parametrize("ending", ["exit", "stop"])
def test_a_dead_trace_endpoint_costs_neither_the_metrics_nor_an_uncounted_span(tmp_path, healthy_spans, collector,
                                                                                ending):
    # The metrics went after the spans in one thread: a trace endpoint that never answered took the whole
    # budget, no metric reached its (working) file, and the spans left unsent were counted nowhere.
    stop = ["--stop"] if ending == "stop" else []
    spans = healthy_spans[ending]
    hole = BlackHole() if collector == "black-holed" else None
    try:
        result, _ = run_script(["one_rank.py", "3", *stop], {
            "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path / "dead"), "OTEL_EXPORTER_OTLP_TIMEOUT": "30",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{hole.port if hole else closed_port()}",
            "OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT": "3"})
    finally:
        if hole:
            hole.close()
    assert result.returncode == 0, result.stderr
    assert spans > 0 and _dropped_spans(next((tmp_path / "dead").glob("run-*"))) == spans, result.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("collector", ["black-holed", "unreachable"])
@pytest.mark.parametrize("ending", ["exit", "stop"])
def test_bad_collector_costs_one_warning_and_a_bounded_exit(protocol, collector, ending):
    hole = BlackHole() if collector == "black-holed" else None
    port = hole.port if hole else closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    budget_s = 3
    try:
        result, _ = run_script(["one_rank.py", "3", *(["--stop"] if ending == "stop" else [])], {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT": str(budget_s), "OTEL_EXPORTER_OTLP_TIMEOUT": "30"})
    finally:
        if hole:
            hole.close()
    assert result.returncode == 0, result.stderr
    done = float(result.stdout.split("TRAINING DONE ")[1].split()[0])
    handlers_done = float(result.stdout.split("EXIT HANDLERS DONE ")[1].split()[0])
    exited = time.time()
    # One budget for stop()'s flush and the shutdown at exit together (not one each, not ~10 s per
    # provider); the interpreter and process-group teardown come on top.
    assert handlers_done - done < budget_s + 1, result.stderr
    assert exited - done < budget_s + 6, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("commdebug-otel: tracing is on (1 rank(s)): sending traces") and endpoint in lines[0]
    warnings = [line for line in lines[1:] if endpoint in line]  # after the start's line saying where it sends
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

        from commdebug_otel.otel.telemetry import Telemetry

        settings = Settings(max_events_per_span=2000, shutdown_timeout_s=20)
        tracer = CommTracer(settings, telemetry=Telemetry(settings))  # a private SDK set-up
        with tracer:
            for _ in range(6):
                Chatty()(torch.ones(1))
        tracer.telemetry.shutdown()
        spans = receiver.spans()
    assert len(spans) == 6 and all(len(span["events"]) == 2000 for span in spans)
    assert max(request.size_bytes for request in receiver.requests("traces")) < 4 * 1024 * 1024
    assert len(receiver.requests("traces")) >= 2


_MANY_LABELS_SCRIPT = """
import sys, torch, torch.distributed as dist
from commdebug_otel import CommTracer

dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)


class Reduce(torch.nn.Module):
    def forward(self, x):
        dist.all_reduce(x)
        return x


model = torch.nn.Sequential(*[Reduce() for _ in range(int(sys.argv[1]))])
with CommTracer():
    model(torch.ones(1))
"""


def test_metric_requests_stay_under_the_receivers_limit_with_many_module_labels():
    modules = 1900
    with OtlpReceiver(max_receive_message_bytes=1024 * 1024) as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_TRACES_EXPORTER="none",
                   OTEL_PYTHON_COMMDEBUG_METRIC_MODULE_DEPTH="3")
        result = subprocess.run([sys.executable, "-c", _MANY_LABELS_SCRIPT, str(modules)], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        points = [p for p in receiver.metrics() if p["name"] == semconv.METRIC_OPERATIONS]
        sizes = [request.size_bytes for request in receiver.requests("metrics")]
    assert sum(sizes) > 1024 * 1024 and max(sizes) < 1024 * 1024  # one request would not have fitted
    # Cumulative points: stop()'s flush and the exit shutdown each send every series.
    assert {p["attributes"][semconv.MODULE_FQN]: p["value"] for p in points} == {
        f"Sequential.{index}": 1 for index in range(modules)}


def test_cardinality_overflow_is_counted_and_said_once(caplog):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader

    from commdebug_otel.otel.export_guard import CountingMetricExporter

    class Keep(MetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    drops = []
    reader = PeriodicExportingMetricReader(CountingMetricExporter(Keep(), "unused", lambda kind, n: drops.append(
        (kind, n))), export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("overflow-test")
    fine, crowded = meter.create_counter("fine"), meter.create_counter("crowded")
    fine.add(1, {"rank": 0})
    for index in range(2_100):  # past the SDK's default limit of 2,000 series
        crowded.add(1, {"module": f"layers.{index}"})
    with caplog.at_level(logging.WARNING):
        provider.force_flush()
        provider.force_flush()
    provider.shutdown()
    assert drops[:2] == [("metric_overflow", 1), ("metric_overflow", 1)]  # per export, crowded only
    assert len([r for r in caplog.records if "cardinality limit" in r.getMessage()]) == 1


def test_grpc_batches_are_encoded_once_sized_exactly_and_split_when_over(monkeypatch):
    """The gRPC exporter's batch is encoded once to be sized, and that encoding is sent; a batch over
    the request limit is split by the per-span bounds, every span delivered."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commdebug_otel.otel import encoding
    from commdebug_otel.otel.export_guard import SizedSpanExporter
    from commdebug_otel.otel.exporters import memoized_encoding

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("encode-once")
    for index in range(40):
        with tracer.start_as_current_span(f"span {index}", attributes={"payload": "x" * 1000, "index": index}):
            pass
    spans = list(memory.get_finished_spans())
    encoded, real = [], encoding.encode_spans
    monkeypatch.setattr(encoding, "encode_spans", lambda batch: encoded.append(len(batch)) or real(batch))
    whole = real(spans).ByteSize()
    for limit in (whole, whole // 3):
        encoded.clear()
        with OtlpReceiver() as receiver:
            inner = memoized_encoding(OTLPSpanExporter)(endpoint=receiver.grpc_endpoint, insecure=True)
            guard = SizedSpanExporter(inner, receiver.grpc_endpoint, lambda kind, n: None, max_request_bytes=limit)
            assert guard.export(spans) is SpanExportResult.SUCCESS
            sizes = [request.size_bytes for request in receiver.requests("traces")]
            names = [span["name"] for span in receiver.spans()]
            inner.shutdown()
        assert names == [f"span {index}" for index in range(40)]
        assert max(sizes) <= limit
        if limit == whole:
            assert encoded == [40] and sizes == [whole]  # sized and sent from one encoding
        else:  # the whole batch, then each request once (bounds are generous: a few more requests than 3)
            assert len(sizes) > 3 and encoded[0] == 40 and sum(encoded[1:]) == 40 and len(encoded) == 1 + len(sizes)
    assert inner._encoded is None  # no request kept after its export
    with OtlpReceiver() as receiver:  # every span over the limit: dropped, and no request kept either
        inner = memoized_encoding(OTLPSpanExporter)(endpoint=receiver.grpc_endpoint, insecure=True)
        drops = []
        guard = SizedSpanExporter(inner, receiver.grpc_endpoint, lambda kind, n: drops.append(n), max_request_bytes=500)
        assert guard.export(spans) is SpanExportResult.SUCCESS
        inner.shutdown()
    assert sum(drops) == 40 and inner._encoded is None


def test_span_size_bound_is_never_below_the_encoded_size():
    """The guard sizes requests without encoding; its bound must hold for every value type."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceState

    from commdebug_otel.otel.export_guard import SizedSpanExporter, span_bytes_bound

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
    from commdebug_otel.core.collective_path import CollectivePath

    def broken(self, *args):
        raise RuntimeError("injected")

    monkeypatch.setattr(CollectivePath, "collective", broken)
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
    hook_errors = ({semconv.DROPPED_KIND: "hook_error", semconv.RANK: 0}, 3)
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == [hook_errors]
    assert len(telemetry.by_name("train_step")) == 3


def test_failing_exporter_is_counted(single_rank_group, monkeypatch):
    from opentelemetry.sdk.trace.export import SpanExporter

    from commdebug_otel.otel.export_guard import SizedSpanExporter
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


def test_shared_telemetry_counts_each_drop_once_and_keeps_no_tracer_alive(tmp_path):
    import gc
    import weakref

    from commdebug_otel.otel.telemetry import Telemetry
    from commdebug_otel.testing import InMemoryTelemetry

    settings = Settings(output_dir=str(tmp_path))
    tracers = [CommTracer(settings) for _ in range(3)]  # as three `with CommDebugMode()` would
    shared = tracers[0].telemetry
    assert all(tracer.telemetry is shared for tracer in tracers)
    first = weakref.ref(tracers.pop(0))
    gc.collect()
    assert first() is None

    memory = InMemoryTelemetry()
    telemetry = Telemetry(settings, meter_provider=memory.meter_provider)
    for _ in range(2):
        CommTracer(settings, meter_provider=memory.meter_provider)  # tracers do not take the counter over
        telemetry.count_dropped("span", 2)
    points = memory.metric_points(semconv.METRIC_DROPPED)
    assert [(labels[semconv.DROPPED_KIND], value) for labels, value in points] == [("span", 4)]


_FULL_DISK_SCRIPT = """
import json, resource, sys, torch
from commdebug_otel import CommTracer, Settings, semconv
from commdebug_otel.testing import InMemoryTelemetry

memory = InMemoryTelemetry()  # the drop count is read here, not from the failing files
# Our own tracer provider and its file exporter; the meter is injected.
tracer = CommTracer(Settings(output_dir=sys.argv[1]), meter_provider=memory.meter_provider)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # ulimit -f: EFBIG past 200 kB
with tracer:
    for _ in range(30):
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        tracer.telemetry.force_flush()  # one batch per step
tracer.telemetry.shutdown()
dropped = {labels[semconv.DROPPED_KIND]: value for labels, value in memory.metric_points(semconv.METRIC_DROPPED)}
print(json.dumps(dropped))
"""


def test_file_export_failures_are_counted_said_once_and_lines_stay_whole(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FULL_DISK_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OTEL_METRICS_EXPORTER": "none"})
    assert done.returncode == 0, done.stderr
    [run] = tmp_path.glob("run-*")
    lines = (run / "traces-rank0.jsonl").read_text().splitlines()
    written = sum(len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines)
    spans_per_step = 1 + 2 + 20 * 2  # train_step, Sequential and its 20 Linear, forward and backward
    assert written % spans_per_step == 0 and 0 < written < 30 * spans_per_step  # whole steps, not all
    assert json.loads(done.stdout) == {"span": 30 * spans_per_step - written}  # every other span counted
    warnings = [line for line in done.stderr.splitlines() if "cannot export spans" in line]
    assert len(warnings) == 1 and str(run / "traces-rank0.jsonl") in warnings[0]
    assert "File too large" in warnings[0] and "Traceback" not in done.stderr
    assert oct((run / "traces-rank0.jsonl").stat().st_mode & 0o777) == "0o600"
    assert oct(run.stat().st_mode & 0o777) == "0o700"




def _until_signal(signum: int, env: dict[str, str], *args: str) -> tuple[int, str]:
    """Run until_signal.py, send ``signum`` once it has trained, return its exit status and stderr."""
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "until_signal.py"), "3", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signal_actions)
    try:
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    return process.returncode, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_keeps_the_finished_steps_and_ends_the_process_as_before(tmp_path, signum):
    """The process ends with the status it has untraced. For SIGINT that is torch's: once ``torch._dynamo`` is
    imported (an optimizer imports it), an unhandled KeyboardInterrupt exits 1, not by SIGINT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    untraced, _ = _until_signal(signum, env, "untraced")
    env["OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR"] = str(tmp_path)  # files; metrics every 60 s by default
    returncode, stderr = _until_signal(signum, env)
    assert untraced == -signum or signum == signal.SIGINT  # killed by the signal
    assert returncode == untraced, stderr  # as without the tracer
    from commdebug_otel.offline.otlp_json import metrics_from_otlp_json
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    spans = load_spans([str(run)])
    steps = sorted(span["attributes"][semconv.STEP] for span in spans if span["name"] == "train_step")
    assert steps == [0, 1, 2, 3]  # the three finished steps, and the one under way, ended at the signal
    points = [point for line in (run / "metrics-rank0.jsonl").read_text().splitlines()
              for point in metrics_from_otlp_json(line) if point["name"] == semconv.METRIC_OPERATIONS]
    assert max(point["value"] for point in points) == 3


def test_a_rank_waiting_in_native_code_still_ends_at_sigterm(tmp_path):
    """A rank blocked in a collective (here a TCPStore wait) cannot run Python's signal handlers: without us
    SIGTERM kills it at once, and with us it must too (flushing first), not at the wait's timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR"] = str(tmp_path)
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "until_signal.py"), "3", "native"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "READY"
        time.sleep(0.5)  # inside the wait
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM, stderr
    assert took < 10, took  # the grace (0.5 s) and the flush, not the wait's 120 s
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    steps = sorted(span["attributes"][semconv.STEP] for span in load_spans([str(run)]) if span["name"] == "train_step")
    assert steps == [0, 1, 2, 3]


def test_spans_dropped_at_exit_are_counted_in_the_last_metrics(tmp_path):
    script = ("import torch\nfrom commdebug_otel import CommTracer\nCommTracer().start()\n"
              "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n")  # no collective: no metric before exit
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path), OTEL_METRICS_EXPORTER="file",
               OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
               OTEL_EXPORTER_OTLP_TRACES_TIMEOUT="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    from commdebug_otel.offline.otlp_json import metrics_from_otlp_json

    [run] = tmp_path.glob("run-*")
    points = [point for line in (run / "metrics-rank0.jsonl").read_text().splitlines()
              for point in metrics_from_otlp_json(line) if point["name"] == semconv.METRIC_DROPPED]
    dropped = [(point["attributes"][semconv.DROPPED_KIND], point["value"]) for point in points]
    assert dropped == [("span", 1)]  # the Linear forward


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

    from commdebug_otel.otel.export_guard import CountingBatchSpanProcessor

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
    from commdebug_otel.otel.telemetry import Telemetry

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
            if x.shape[0] == 3:  # the training script's own message, with the tensor in it
                raise ValueError(f"activation out of range: {x} (max {x.max().item()})")
            return out

    settings = Settings(detail=Detail.ALL, output_dir=str(tmp_path))
    tracer = CommTracer(settings, telemetry=Telemetry(settings))  # a private SDK set-up
    model = Leaky()
    with torch.no_grad():
        model.lin.weight.fill_(sentinel)
        model.lin.bias.fill_(sentinel)
    with tracer:
        model(torch.full((1, 3), sentinel))
        for rows in (2, 3):
            with pytest.raises(ValueError):
                model(torch.full((rows, 3), sentinel))
    tracer.telemetry.shutdown()
    [run] = tmp_path.glob("run-*")
    text = (run / "traces-rank0.jsonl").read_text() + (run / "metrics-rank0.jsonl").read_text()
    assert "aten.addmm.default" in text and "all_reduce" in text
    assert '"activation out of range: <values> (max <values>)"' in text  # the message, without values
    # The value as Python or torch prints it; a bare "8675" also turns up in timestamps and ids.
    assert "8675.3" not in text and "8.6753e+03" not in text
    assert "x" * 4096 in text and "x" * 4097 not in text


def test_unwritable_output_folder_costs_a_warning_not_the_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result, _ = run_script(["one_rank.py", "3"], {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(blocker / "sub")})
    assert result.returncode == 0, result.stderr
    assert "TRAINING DONE" in result.stdout
    said = [line for line in result.stderr.splitlines() if "commdebug-otel" in line]
    assert len(said) == 1 and "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR" in said[0], result.stderr  # one line, naming it
    assert "Traceback" not in result.stderr
    # Our own paths as they are (redaction is for the script's values): the run folder, and the error's file name.
    assert f"files to {blocker / 'sub'}{os.sep}run-" in said[0]
    assert f"NotADirectoryError: [Errno {errno.ENOTDIR}] Not a directory: '{blocker / 'sub'}'" in said[0]
    assert "<values>" not in said[0]


def test_a_forked_child_killed_by_sigterm_leaves_its_parent_alone(tmp_path):
    """DataLoader workers are forked and ended by SIGTERM: the parent's signal rescue must not take it as its own."""
    code = """
import os, signal, sys, time, torch
from commdebug_otel import CommTracer
tracer = CommTracer().start()
torch.nn.Linear(2, 2)(torch.ones(1, 2))
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
time.sleep(0.3)
os.kill(child, signal.SIGTERM)
_, status = os.waitpid(child, 0)
time.sleep(1.5)  # longer than the rescue's grace
print("ALIVE", os.WIFSIGNALED(status) and os.WTERMSIG(status), flush=True)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ALIVE", str(int(signal.SIGTERM))]


def test_span_hand_over_at_once_queues_as_on_end_does_and_counts_drops():
    """Our processors take a step's spans at once (``on_end_all``): the queue ends as ``on_end`` one by one
    leaves it (order, the export thread woken once a batch waits); where they do not all fit, or the
    processor is shut down, each goes through ``on_end`` (drops counted, as before)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, TraceFlags

    from commdebug_otel.otel.export_guard import CountingBatchSpanProcessor

    class Held(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    def spans(first, count):
        return [ReadableSpan(f"span {index}", SpanContext(1, index + 1, False, TraceFlags(TraceFlags.SAMPLED)))
                for index in range(first, first + count)]

    drops = []
    made = []

    def processor():
        made.append(CountingBatchSpanProcessor(Held(), lambda kind, n: drops.append((kind, n)), max_queue_size=8,
                                               max_export_batch_size=4, schedule_delay_millis=60_000))
        return made[-1]

    try:
        one_by_one, at_once, full = processor(), processor(), processor()
        held = [p._batch_processor._export_lock for p in made]  # the export threads take nothing meanwhile
        for lock in held:
            lock.acquire()
        try:
            for span in spans(0, 3):
                one_by_one.on_end(span)
            at_once.on_end_all(spans(0, 3))
            queues = [p._batch_processor._queue for p in (one_by_one, at_once)]
            assert [[s.name for s in q] for q in queues] == [["span 2", "span 1", "span 0"]] * 2
            assert not at_once._batch_processor._worker_awaken.is_set()  # under a batch: the thread sleeps on
            at_once.on_end_all(spans(3, 2))
            assert at_once._batch_processor._worker_awaken.is_set()
            assert drops == []
            full.on_end_all(spans(0, 6))
            full.on_end_all(spans(6, 5))  # 11 > 8: one by one, the 3 oldest dropped and counted
            assert [s.name for s in full._batch_processor._queue] == [f"span {i}" for i in range(10, 2, -1)]
            assert drops == [("span", 1)] * 3
        finally:
            for lock in held:
                lock.release()
        full.shutdown()
        full.on_end_all(spans(0, 2))  # shut down: on_end's path, which queues nothing
        assert len(full._batch_processor._queue) == 0 and drops == [("span", 1)] * 3
    finally:
        for made_one in made:
            made_one.shutdown()
