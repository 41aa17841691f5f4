"""Standard OTEL_* export settings that are wrong or unusual: one message naming the variable, export goes on.

Each case runs a small training script in a fresh process, as a user would, and reads what it exported.
"""

import json
import os
import subprocess
import sys

import pytest

from commdebug_otel import semconv
from commdebug_otel.offline.otlp_json import spans_from_otlp_json
from commdebug_otel.testing.otlp_receiver import OtlpReceiver

_SCRIPT = """
import sys, torch
from commdebug_otel import CommTracer
modules = int(sys.argv[1])
model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(modules)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with CommTracer():
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
"""


def _train(tmp_path, modules=2, prelude="", **variables):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path), **variables)
    done = subprocess.run([sys.executable, "-c", prelude + _SCRIPT, str(modules)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def _file_spans(tmp_path):
    spans = []
    for path in tmp_path.glob("run-*/traces-rank0.jsonl"):
        for line in path.read_text().splitlines():
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    spans.extend(scope["spans"])
    return spans


def _said(stderr, text):
    return [line for line in stderr.splitlines() if text in line]


def test_a_step_of_thousands_of_spans_is_exported_whole_at_defaults(tmp_path):
    modules = 1500  # 1 + 2 + 1,500 * 2 = 3,003 spans per step, past the SDK's default queue of 2,048
    stderr = _train(tmp_path, modules, OTEL_METRICS_EXPORTER="none")
    assert len(_file_spans(tmp_path)) == 2 * (3 + 2 * modules)
    assert not _said(stderr, "queue")


def test_a_small_queue_alone_keeps_spans_on_and_a_full_one_names_the_variable(tmp_path):
    stderr = _train(tmp_path, 10, OTEL_METRICS_EXPORTER="none", OTEL_BSP_MAX_QUEUE_SIZE="10")
    spans = _file_spans(tmp_path)
    assert 0 < len(spans) < 2 * (3 + 2 * 10)  # exported, some dropped: the queue holds 10
    [full] = _said(stderr, "span export queue")
    assert "OTEL_BSP_MAX_QUEUE_SIZE" in full and not _said(stderr, "Queue full")


def test_bad_timeout_and_compression_cost_one_message_each_not_the_export(tmp_path):
    with OtlpReceiver() as receiver:
        stderr = _train(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
                        OTEL_EXPORTER_OTLP_TIMEOUT="garbage", OTEL_EXPORTER_OTLP_COMPRESSION="zstd-please")
        spans = receiver.spans()
    assert sorted(s["attributes"][semconv.STEP] for s in spans if s["name"] == "train_step") == [0, 1]
    assert not _said(stderr, "are off")  # both exporters were made (the script issues no collective)
    assert len(_said(stderr, "OTEL_EXPORTER_OTLP_TIMEOUT=garbage")) == 1
    assert len(_said(stderr, "OTEL_EXPORTER_OTLP_COMPRESSION=zstd-please")) == 1


@pytest.mark.parametrize("variable, value, default", [
    ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "abc", "128"),  # the SDK raised when imported: the script died
    ("OTEL_ATTRIBUTE_COUNT_LIMIT", "-3", "128"),  # the SDK refused its span limits: spans were off
    ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "many", "unset"),
    ("OTEL_BSP_SCHEDULE_DELAY", "1e20", "5000"),  # a traceback from the export thread
    ("OTEL_BSP_EXPORT_TIMEOUT", "soon", "30000"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "100000000000000000000", "60000"),  # past TIMEOUT_MAX: the reader died
    ("OTEL_METRIC_EXPORT_TIMEOUT", "0", "30000"),
])
def test_the_sdks_own_numbers_out_of_range_cost_one_message_not_the_export(tmp_path, variable, value, default):
    stderr = _train(tmp_path, **{variable: value})
    spans = [span for path in tmp_path.glob("run-*/traces-rank0.jsonl")
             for line in path.read_text().splitlines() for span in spans_from_otlp_json(line)]
    assert sorted(s["attributes"][semconv.STEP] for s in spans if s["name"] == "train_step") == [0, 1]
    assert not _said(stderr, "are off")
    [said] = _said(stderr, variable)
    assert f"{variable}={value} is not" in said and said.endswith(f"; using {default}")


@pytest.mark.parametrize("variables", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://bob:pa55w0rd@127.0.0.1:9"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "bob:pa55w0rd@127.0.0.1:9"},  # no scheme: named in the TLS hint too
    {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "bob:pa55w0rd@127.0.0.1:9"},
    {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/?key=pa55w0rd"},
])
def test_credentials_in_an_endpoint_are_never_printed(tmp_path, variables):
    stderr = _train(tmp_path, OTEL_EXPORTER_OTLP_TIMEOUT="1", OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT="2", **variables)
    assert "pa55w0rd" not in stderr and "bob" not in stderr
    assert _said(stderr, "<credentials>")  # the endpoint is still named


def test_a_malformed_header_is_named_without_its_secret(tmp_path):
    with OtlpReceiver() as receiver:
        stderr = _train(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
                        OTEL_EXPORTER_OTLP_HEADERS="authorization:Bearer s3cr3t-t0ken,x-team=ml")
        assert receiver.spans()
    assert "s3cr3t" not in stderr
    assert len(_said(stderr, "OTEL_EXPORTER_OTLP_HEADERS")) == 1
    assert not _said(stderr, "Header format invalid")  # the SDK's own line, once per exporter, said nothing more


def test_only_a_traces_endpoint_says_where_metrics_go(tmp_path):
    with OtlpReceiver() as receiver:
        stderr = _train(tmp_path, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.grpc_endpoint)
        assert receiver.spans()
    assert not _said(stderr, "no OTLP endpoint configured")
    [where] = _said(stderr, "writing metrics as OTLP-JSON lines")
    assert "(no OTLP endpoint for metrics: " in where
    assert "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" in where


def test_where_files_go_is_said_once_with_logging_at_info(tmp_path):
    # A script that sets logging to INFO used to see the line once per signal.
    stderr = _train(tmp_path, prelude="import logging; logging.basicConfig(level=logging.INFO)\n")
    [where] = _said(stderr, "OTLP-JSON lines")
    folder = next(tmp_path.glob("run-*"))
    assert where.endswith(f"writing traces and metrics as OTLP-JSON lines to {folder} (no OTLP endpoint for traces "
                          "and metrics: set OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                          "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to send to a collector)")


def test_a_malformed_resource_attribute_is_said_once(tmp_path):
    stderr = _train(tmp_path, OTEL_RESOURCE_ATTRIBUTES="team=ml,oops")  # the SDK says it per provider
    assert len(_said(stderr, "oops")) == 1


def test_a_missing_certificate_is_named_at_start(tmp_path):
    missing = str(tmp_path / "no-such-ca.pem")
    stderr = _train(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="https://127.0.0.1:9", OTEL_EXPORTER_OTLP_CERTIFICATE=missing,
                    OTEL_EXPORTER_OTLP_TIMEOUT="1", OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT="2")
    assert len(_said(stderr, f"OTEL_EXPORTER_OTLP_CERTIFICATE={missing} is not a file")) == 1


def test_a_provider_that_cannot_start_costs_one_warning_and_turns_its_signal_off(monkeypatch, caplog):
    from opentelemetry import metrics, trace

    from commdebug_otel.config import Settings
    from commdebug_otel.otel.telemetry import Telemetry

    def cannot_start():
        raise OSError("no room")

    telemetry = Telemetry(Settings())
    monkeypatch.setattr(telemetry, "_make_tracer_provider", cannot_start)
    monkeypatch.setattr(telemetry, "_make_meter_provider", cannot_start)
    try:
        assert isinstance(telemetry.tracer(), trace.NoOpTracer) and telemetry.tracer_setup().discards
        assert isinstance(telemetry.meter(), metrics.NoOpMeter)
    finally:
        telemetry.shutdown()
    assert [record.getMessage() for record in caplog.records] == [
        "commdebug-otel: spans are off: OSError: no room", "commdebug-otel: metrics are off: OSError: no room"]
