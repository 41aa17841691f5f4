"""Settings from the environment, and docs that stay true to the code."""

import logging
import pathlib
import random
import string

import pytest

import commdebug_otel
from commdebug_otel import Detail, Settings, TraceScope, semconv
from commdebug_otel.config import (
    OPTIONS,
    ExportEnv,
    RankEnv,
    instrumentation_disabled,
    job_log,
    markdown_table,
    parse_bool,
    read_option,
    run_environment,
)
from commdebug_otel.core.job_identity import rank_info
from commdebug_otel.demo import describe_destination

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

GARBAGE = {
    "ENABLED": "maybe", "DETAIL": "verbose", "TRACE_EVERY": "0", "COMPLETION_EVERY": "0", "RANKS": "1,x",
    "TRACE_SCOPE": "cluster", "OUTPUT_DIR": "  ", "MAX_EVENTS_PER_SPAN": "-3",
    "METRIC_MODULE_DEPTH": "two", "SHUTDOWN_TIMEOUT": "-1", "MODULE_INCLUDE": None, "MODULE_EXCLUDE": None,
    "RANKS_PER_TRACE": "0", "METRIC_RANK_LABEL": "sometimes",
}


def test_environment_values_are_parsed():
    settings = Settings.from_env({
        "OTEL_PYTHON_COMMDEBUG_DETAIL": "DTensor", "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": "10",
        "OTEL_PYTHON_COMMDEBUG_RANKS": "0,3", "OTEL_PYTHON_COMMDEBUG_TRACE_SCOPE": "rank",
        "OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT": "2.5",
        "OTEL_PYTHON_COMMDEBUG_MODULE_EXCLUDE": "*.norm, *.act",
    })
    assert settings.detail is Detail.DTENSOR and settings.trace_every == 10
    assert settings.ranks == frozenset({0, 3}) and settings.trace_scope is TraceScope.RANK
    assert settings.shutdown_timeout_s == 2.5 and settings.module_exclude == ("*.norm", "*.act")
    assert settings.traces_rank(3) and not settings.traces_rank(1)


@pytest.mark.parametrize("suffix", [name for name, value in GARBAGE.items() if value is not None])
def test_bad_environment_value_warns_once_and_uses_the_default(suffix, caplog):
    option = next(option for option in OPTIONS if option.suffix == suffix)
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        settings = Settings.from_env({option.env: GARBAGE[suffix]})
    assert getattr(settings, option.field) == option.default
    [record] = caplog.records
    assert option.env in record.getMessage() and option.accepted in record.getMessage()
    assert repr(GARBAGE[suffix]) in record.getMessage()


def test_fuzzed_environment_never_raises():
    rng = random.Random(1234)
    alphabet = string.ascii_letters + string.digits + ",.-_ /*\x00é"
    for _ in range(500):
        environ = {option.env: "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
                   for option in OPTIONS if rng.random() < 0.7}
        Settings.from_env(environ)


def test_bad_explicit_arguments_raise():
    with pytest.raises(ValueError, match="trace_every"):
        Settings(trace_every=0)
    with pytest.raises(ValueError, match="completion_every"):
        Settings(completion_every=0)
    with pytest.raises(ValueError, match="detail"):
        Settings(detail="loud")


def test_configuration_reference_is_generated_from_the_options_table():
    assert markdown_table() in (DOCS / "configuration.md").read_text()


def test_every_name_in_the_data_contract_is_documented():
    text = (DOCS / "semantic-conventions.md").read_text()
    names = {value for key, value in vars(semconv).items() if key.isupper() and isinstance(value, str)}
    missing = sorted(name for name in names if f"`{name}`" not in text)  # as code: "span" is in any text
    assert not missing


def test_every_public_name_is_documented():
    text = "".join(path.read_text() for path in DOCS.glob("*.md")) + (DOCS.parent / "README.md").read_text()
    missing = [name for name in commdebug_otel.__all__ if name != "__version__" and name not in text]
    assert not missing


def test_enabled_is_parsed_by_the_options_table():
    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_ENABLED": " Yes "}).enabled is True
    assert read_option("enabled", {"OTEL_PYTHON_COMMDEBUG_ENABLED": "off"}) is False
    assert read_option("enabled", {}) is False
    assert [parse_bool(text) for text in ("true", "1", "ON", "false", "0", "No")] == [True] * 3 + [False] * 3


def test_a_bad_enabled_value_names_every_accepted_spelling(caplog):
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        assert read_option("enabled", {"OTEL_PYTHON_COMMDEBUG_ENABLED": "ture"}) is False
    [record] = caplog.records
    assert record.getMessage() == (
        "commdebug-otel: ignoring OTEL_PYTHON_COMMDEBUG_ENABLED='ture': expected true, 1, yes or on; "
        "false, 0, no or off (any case); using the default false")


def test_standard_variables_from_a_plain_dict():
    export = ExportEnv.from_env({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRICS_EXPORTER": "Prometheus, console", "OTEL_SDK_DISABLED": "1",
        "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "TRUE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512",
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=llama", "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "9000",
    })
    assert export.exporter_names("traces") == ["otlp"] and export.exporter_names("metrics") == ["prometheus", "console"]
    assert export.otlp_endpoint("traces") == "http://collector:4318/v1/traces"
    assert export.otlp_endpoint("metrics") == "http://collector:4318/v1/metrics"
    assert not export.sdk_disabled  # the SDK's rule: only "true" is true
    assert export.sdk_internal_metrics and export.batch_size_set and export.service_name_set
    assert (export.prometheus_host, export.prometheus_port(3)) == ("0.0.0.0", 9003)
    empty = ExportEnv.from_env({})
    assert empty == ExportEnv() and empty.exporter_names("traces") == ["file"]
    assert empty.otlp_protocol("metrics") == "grpc" and empty.otlp_endpoint("traces") == "http://localhost:4317"
    assert not (empty.sdk_disabled or empty.batch_size_set or empty.service_name_set)


def test_a_standard_boolean_that_is_neither_true_nor_false_is_said_once_and_is_false(caplog):
    """The SDK takes ``OTEL_SDK_DISABLED=1`` as false without a word; the OTel specification asks for a warning."""
    environ = {"OTEL_SDK_DISABLED": "on", "OTEL_EXPORTER_OTLP_INSECURE": "yes",
               "OTEL_EXPORTER_OTLP_METRICS_INSECURE": "False", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "TRUE",
               "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "enabled"}
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        export = ExportEnv.from_env(environ)
        assert ExportEnv.from_env(environ) == export
    assert (export.sdk_disabled, export.insecure, export.sdk_internal_metrics) == (False, False, False)
    assert (export.traces.insecure, export.metrics.insecure) == (True, False)
    reason = "is not true or false; taken as false, as OpenTelemetry reads it"
    assert sorted(record.getMessage() for record in caplog.records) == [
        f"commdebug-otel: OTEL_EXPORTER_OTLP_INSECURE=yes {reason}",
        f"commdebug-otel: OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=enabled {reason}",
        f"commdebug-otel: OTEL_SDK_DISABLED=on {reason}"]


def test_the_signal_insecure_variable_beats_the_generic_one_as_in_the_sdk(caplog):
    def warned(environ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
            ExportEnv.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **environ}).otlp_endpoint("traces")
        return [r.getMessage() for r in caplog.records if "uses TLS" in r.getMessage()]

    for index, (environ, expected) in enumerate([
            ({"OTEL_EXPORTER_OTLP_INSECURE": "true"}, 0),
            ({"OTEL_EXPORTER_OTLP_INSECURE": "false"}, 1),
            ({"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"}, 1),
            ({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "True"}, 0)]):
        endpoint = f"insecure-case-{index}:4317"  # a fresh endpoint: each warning is said once
        assert len(warned(environ)) == expected, environ


@pytest.mark.parametrize("port", ["http", "99999", "-5", "65535"])  # 65535: the local rank 1 is past the last port
def test_bad_prometheus_port_warns_and_uses_9464(caplog, port):
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        assert ExportEnv.from_env({"OTEL_EXPORTER_PROMETHEUS_PORT": port}).prometheus_port(1) == 9465
    [record] = caplog.records
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" in record.getMessage() and f"'{port}'" in record.getMessage()


def test_rank_variables_from_a_plain_dict(caplog):
    assert RankEnv.from_env({}) == RankEnv(rank=0, world_size=1, local_rank=None, node_rank=0, run_id="none")
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2", "NODE_RANK": "7",
                "TORCHELASTIC_RUN_ID": "job-1"}
    assert RankEnv.from_env(torchrun) == RankEnv(5, 8, 1, 2, "job-1")
    info = rank_info(torchrun)  # rank and world size: torch.distributed's, once a test initialized it
    assert (info.local_rank, info.node_rank, info.run_id) == (1, 2, "job-1")
    spawned = rank_info({"RANK": "3", "NODE_RANK": "1"})
    assert spawned.local_rank == spawned.rank and spawned.node_rank == 1  # mp.spawn sets no LOCAL_RANK
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        assert RankEnv.from_env({"RANK": "two", "GROUP_RANK": "-1", "NODE_RANK": "4"}) == RankEnv(node_rank=4)
        RankEnv.from_env({"RANK": "two"})
    assert sorted(r.getMessage() for r in caplog.records) == [
        "commdebug-otel: ignoring GROUP_RANK='-1': expected an integer >= 0; using the default",
        "commdebug-otel: ignoring RANK='two': expected an integer >= 0; using 0"]


def test_job_log_says_it_once_per_job():
    logger = logging.getLogger("commdebug_otel.test")
    assert job_log(logger, {"RANK": "0"}) == logger.warning and job_log(logger, {}) == logger.warning
    assert job_log(logger, {"RANK": "1"}) == logger.debug


def test_run_command_environment():
    env = run_environment({"trace_every": "10", "detail": None},
                          {"PATH": "/bin", "OTEL_PYTHON_COMMDEBUG_ENABLED": "false"})
    # Only our own variables: a standard one (OTEL_METRIC_EXPORT_INTERVAL) would reach the script's own SDK too.
    assert env == {"PATH": "/bin", "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": "10", "OTEL_PYTHON_COMMDEBUG_ENABLED": "true"}
    assert run_environment({}, {"OTEL_METRIC_EXPORT_INTERVAL": "100"})["OTEL_METRIC_EXPORT_INTERVAL"] == "100"


def test_disabled_instrumentations():
    assert instrumentation_disabled({"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "requests, commdebug"})
    assert not instrumentation_disabled({"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "commdebug_x"})
    assert not instrumentation_disabled({})


def test_the_demo_names_the_endpoint_the_exporter_gets():
    export = ExportEnv.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
                                 "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert describe_destination(Settings(), export=export) == (
        "OTLP (http/protobuf) to http://collector:4318/v1/traces")
    files = ExportEnv.from_env({"OTEL_TRACES_EXPORTER": "file,console"})
    assert describe_destination(Settings(), "/out/run-1", export=files) == "OTLP-JSON files in /out/run-1, console"
