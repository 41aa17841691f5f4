"""`commdebug-otel receive` end to end: a real traced job exports OTLP to it (traces over gRPC, metrics over HTTP)
and to files at once; the received run folder reads as the file run does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.offline import summary
from commdebug_otel.offline.otlp_json import metrics_from_otlp_json
from commdebug_otel.offline.receive import RunFolders
from commdebug_otel.testing.otlp_receiver import OtlpReceiver

from distributed import run_ranks
from models import TwoBlocks
from prometheus_server import free_port_run
from tools import default_signal_actions

_CLI = [sys.executable, "-m", "commdebug_otel.cli"]
_STEPS = 3


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def _train(rank, world_size):
    from commdebug_otel import CommTracer

    torch.manual_seed(0)
    model = TwoBlocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer() as tracer:
        for _ in range(_STEPS):
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            for parameter in model.parameters():
                torch.distributed.all_reduce(parameter.grad)
            optimizer.step()
    tracer.telemetry.shutdown()  # run_ranks' workers leave without atexit
    return tracer.telemetry.file_directory


def _last_totals(folder):
    """torch.collective.operations per (rank, op): each series' last cumulative count, summed."""
    last = {}
    for path in sorted(folder.glob("metrics-rank*.jsonl")):
        for line in path.read_text().splitlines():
            for point in metrics_from_otlp_json(line):
                if point["name"] == semconv.METRIC_OPERATIONS:
                    last[(point["resource"][semconv.RANK], tuple(sorted(point["attributes"].items())))] = \
                        point["value"]
    totals = {}
    for (rank, attributes), value in last.items():
        key = (rank, dict(attributes)[semconv.COLLECTIVE_OP])
        totals[key] = totals.get(key, 0) + value
    return totals


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    root = tmp_path_factory.mktemp("receive")
    # Two distinct ports below the ephemeral range: two free_port() calls can return the same port, and the
    # ranks' own gloo connections can take an ephemeral one before the receiver binds it.
    grpc_port = free_port_run(2)
    http_port = grpc_port + 1
    receiver = subprocess.Popen([*_CLI, "receive", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                                 "-o", str(root / "received")], env=_env(), cwd=root, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=default_signal_actions)
    try:
        first = receiver.stdout.readline()
        assert first.startswith(f"receiving OTLP/gRPC on http://127.0.0.1:{grpc_port} and OTLP/HTTP on "
                                f"http://127.0.0.1:{http_port}"), first + receiver.stderr.read()
        files_run, _ = run_ranks(_train, 2, env={
            "OTEL_TRACES_EXPORTER": "otlp,file", "OTEL_METRICS_EXPORTER": "otlp,file",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://localhost:{grpc_port}",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://localhost:{http_port}/v1/metrics",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(root / "files")})
    finally:
        receiver.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = receiver.communicate(timeout=60)
    [folder] = (root / "received").iterdir()
    return SimpleNamespace(code=receiver.returncode, lines=[first.rstrip("\n"), *out.splitlines()], err=err,
                           folder=folder, files=root / "files" / os.path.basename(files_run), root=root)


def test_ctrl_c_stops_it_cleanly_with_a_line_per_batch(received):
    assert (received.code, received.err) == (0, "")
    batches = [line for line in received.lines if " over grpc, " in line or " over http, " in line]
    assert {line.split(" ", 2)[1:2][0] for line in batches} == {"traces", "metrics"}
    assert all(" over grpc, " in line for line in batches if " traces " in line)
    assert all(" over http, " in line for line in batches if " metrics " in line)
    spans = len(summary.load_spans([received.files]))
    stop = next(line for line in received.lines if line.startswith("stopped: "))
    assert stop.startswith(f"stopped: {len(batches)} batch(es), {spans} span(s), ")
    assert received.lines[-1] == f"  {os.path.relpath(received.folder, received.root)}"


def test_the_folder_has_the_file_runs_layout(received):
    assert sorted(os.listdir(received.folder)) == sorted(os.listdir(received.files)) == [
        "metrics-rank0.jsonl", "metrics-rank1.jsonl", "traces-rank0.jsonl", "traces-rank1.jsonl"]


@pytest.mark.parametrize("rank", [0, 1])
def test_summarize_reads_the_same_counts(received, rank):
    def summarized(folder, form):
        done = subprocess.run([*_CLI, "summarize", str(folder), "--rank", str(rank), "--format", form],
                              env=_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if form != "text" else done.stdout

    assert summarized(received.folder, "json") == summarized(received.files, "json")
    assert summarized(received.folder, "text") == summarized(received.files, "text")


def test_the_spans_and_metric_totals_are_the_file_runs(received):
    def spans(folder):
        return sorted((s["rank"], s["name"], s["span_id"], len(s["events"])) for s in summary.load_spans([folder]))

    assert spans(received.folder) == spans(received.files)
    totals = _last_totals(received.files)
    assert totals[(0, "all_reduce")] == len(list(TwoBlocks().parameters())) * _STEPS  # one per parameter per step
    assert _last_totals(received.folder) == totals


def _request(rank, pid):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.extend([KeyValue(key=semconv.RANK, value=AnyValue(int_value=rank)),
                                         KeyValue(key="process.pid", value=AnyValue(int_value=pid)),
                                         KeyValue(key="service.name", value=AnyValue(string_value="job"))])
    resource.scope_spans.add().spans.add(name="train_step", trace_id=b"\1" * 16, span_id=bytes([rank + 2]) * 8)
    return SimpleNamespace(signal="traces", transport="grpc", size_bytes=request.ByteSize(), request=request)


def test_a_rank_from_another_process_starts_a_new_run(tmp_path, capsys):
    folders = RunFolders(str(tmp_path))
    for rank, pid in [(0, 10), (1, 11), (0, 10), (0, 20), (1, 11), (1, 21)]:  # job 1, then job 2 (late rank 1 of 1)
        folders.write(_request(rank, pid))
    first, second = folders.totals.folders
    assert [len(open(os.path.join(first, f"traces-rank{rank}.jsonl")).readlines()) for rank in (0, 1)] == [2, 2]
    assert [len(open(os.path.join(second, f"traces-rank{rank}.jsonl")).readlines()) for rank in (0, 1)] == [1, 1]
    assert sorted(span["span_id"] for span in summary.load_spans([second])) == ["02" * 8, "03" * 8]
    assert len(capsys.readouterr().out.splitlines()) == 6


def test_a_port_in_use_is_one_line(tmp_path):
    with OtlpReceiver() as taken:
        done = subprocess.run([*_CLI, "receive", "--grpc-port", "0", "--http-port", str(taken.http_port)],
                              env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"commdebug-otel receive: cannot listen for OTLP/HTTP on 127.0.0.1:{taken.http_port}: "
                           "Address already in use; choose others with --grpc-port / --http-port\n")


def test_the_receiver_module_prints_the_commands_help():
    done = subprocess.run([sys.executable, "-m", "commdebug_otel.testing.otlp_receiver", "--help"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: commdebug-otel receive")


def test_grpc_port_in_use_too(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        done = subprocess.run([*_CLI, "receive", "--grpc-port", str(port), "--http-port", "0"], env=_env(),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == (f"commdebug-otel receive: cannot listen for OTLP/gRPC on 127.0.0.1:{port}: Address already "
                           "in use; choose others with --grpc-port / --http-port\n")
