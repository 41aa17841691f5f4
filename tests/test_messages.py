"""What a new user is told: mistyped variables, ranks the job lacks, that tracing is on and where it sends, a
protocol that does not match the port, the command's help and version, and the demo's progress and refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from commdebug_otel import cli, demo
from commdebug_otel.config import Settings, unknown_variables
from commdebug_otel.testing.otlp_receiver import OtlpReceiver

from distributed import run_ranks

_TRAIN = """
import torch
from commdebug_otel import CommTracer
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with CommTracer():
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
"""


def _python(code, tmp_path, **variables):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path / "out"), **variables)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


# ------------------------------------------------------------------ variables
def test_a_mistyped_variable_is_said_once_with_the_closest_name(caplog):
    environ = {"OTEL_PYTHON_COMMDEBUG_TRACE_EVRY": "4", "OTEL_PYTHON_COMMDEBUG_XYZZY": "1"}
    assert Settings.from_env(environ).trace_every == 1  # ignored, as before; now said
    Settings.from_env(environ)
    assert [record.getMessage() for record in caplog.records] == [
        "commdebug-otel: ignoring OTEL_PYTHON_COMMDEBUG_TRACE_EVRY: no such variable "
        "(did you mean OTEL_PYTHON_COMMDEBUG_TRACE_EVERY?)",
        "commdebug-otel: ignoring OTEL_PYTHON_COMMDEBUG_XYZZY: no such variable (docs/configuration.md lists the "
        "variables)"]


@pytest.mark.parametrize(("typed", "meant"), [("ENABLE", "ENABLED"), ("RANK", "RANKS"), ("OUTPUTDIR", "OUTPUT_DIR"),
                                              ("STALL", "STALL_AFTER"), ("TRACE_EVRY", "TRACE_EVERY")])
def test_the_closest_known_variable(typed, meant):
    prefix = "OTEL_PYTHON_COMMDEBUG_"
    assert unknown_variables({prefix + typed: "1", prefix + "DETAIL": "ops"}) == {prefix + typed: prefix + meant}


def test_enable_mistyped_is_said_where_torch_is_imported_and_nothing_starts(tmp_path):
    """Through commdebug_otel.pth: the variable alone, no code of ours in the script."""
    stderr = _python("import torch", tmp_path, OTEL_PYTHON_COMMDEBUG_ENABLE="true")
    assert stderr == ["commdebug-otel: ignoring OTEL_PYTHON_COMMDEBUG_ENABLE: no such variable "
                      "(did you mean OTEL_PYTHON_COMMDEBUG_ENABLED?)"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------- tracing is on, and where
def _two_ranks_train(rank, world_size):
    import torch.distributed as dist

    from commdebug_otel import CommTracer

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer() as tracer:
        model(torch.ones(1, 2)).sum().backward()
        dist.all_reduce(torch.ones(1))
        optimizer.step()
    tracer.telemetry.shutdown()
    return tracer.telemetry.file_directory


def test_one_line_per_job_says_tracing_is_on_and_where_and_ranks_outside_the_job(tmp_path, capfd):
    folder, _ = run_ranks(_two_ranks_train, 2, env={"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path),
                                                   "OTEL_PYTHON_COMMDEBUG_RANKS": "1,2,3"})
    lines = capfd.readouterr().err.splitlines()
    assert [line for line in lines if line.startswith("commdebug-otel")] == [
        f"commdebug-otel: tracing is on (2 rank(s), spans from rank(s) 1,2,3 only): writing traces and metrics as "
        f"OTLP-JSON lines to {folder} (no OTLP endpoint for traces and metrics: set OTEL_EXPORTER_OTLP_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to send to a collector)",
        "commdebug-otel: OTEL_PYTHON_COMMDEBUG_RANKS names rank(s) 2,3, outside this job's 2 rank(s) (0-1): "
        "they trace nothing"]


def test_the_line_names_an_otlp_endpoint_and_every_signal(tmp_path):
    with OtlpReceiver() as receiver:
        stderr = _python(_TRAIN, tmp_path, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.grpc_endpoint,
                         OTEL_METRICS_EXPORTER="console")
    assert [line for line in stderr if line.startswith("commdebug-otel")] == [
        f"commdebug-otel: tracing is on (1 rank(s)): sending traces as OTLP (grpc) to {receiver.grpc_endpoint}; "
        "exporting metrics to console"]


# ------------------------------------------------------------- wrong protocol or port
@pytest.mark.parametrize(("protocol", "port", "fix"), [
    ("grpc", "http", "speaks OTLP/HTTP, not gRPC: set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"),
    ("http/protobuf", "grpc", "speaks gRPC, not OTLP/HTTP: set OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
])
def test_a_protocol_that_does_not_match_the_port_is_said_at_the_first_failed_export(tmp_path, protocol, port, fix):
    """The exporter retries for OTEL_EXPORTER_OTLP_TIMEOUT (30 s here), past the job's end: before, the user saw
    only the flush timeout at exit."""
    with OtlpReceiver() as receiver:
        endpoint = receiver.http_endpoint if port == "http" else receiver.grpc_endpoint
        stderr = _python(_TRAIN, tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                         OTEL_EXPORTER_OTLP_TIMEOUT="30", OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT="2")
        assert receiver.requests() == []
    said = [line for line in stderr if fix in line]
    assert [line.split(" speaks")[0] for line in said] == [
        "commdebug-otel: the OTLP endpoint for traces", "commdebug-otel: the OTLP endpoint for metrics"]
    flush = next(index for index, line in enumerate(stderr) if "flush did not finish" in line)
    assert stderr.index(said[0]) < flush


# ------------------------------------------------------------------------ the command
def test_the_command_alone_prints_its_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: commdebug-otel") and "demo" in out and "summarize" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    from commdebug_otel.version import __version__

    assert capsys.readouterr().out == (f"commdebug-otel {__version__} (torch {torch.__version__}, opentelemetry-sdk "
                                       f"{__import__('importlib.metadata').metadata.version('opentelemetry-sdk')})\n")


def test_run_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert "examples:\n  # every worker traced" in out
    assert "  commdebug-otel run -- torchrun --nproc-per-node 8 train.py\n" in out


@pytest.mark.parametrize("ranks", [3, 5, 7])
def test_the_demo_refuses_a_rank_count_it_cannot_split_in_one_line(capsys, ranks):
    assert cli.main(["demo", "--ranks", str(ranks)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        f"commdebug-otel demo: --ranks {ranks} is not supported: tensor parallel must split the model's 4 attention "
        "heads evenly; use 1 or 2 (tensor parallel) or an even number from 4 (FSDP2 + tensor parallel)\n")


def test_the_demo_accepts_what_its_meshes_split():
    from commdebug_otel._demo_model import ModelArgs

    assert demo._DEMO_HEADS == ModelArgs().n_heads
    assert [ranks for ranks in range(1, 11) if demo.demo_refusal(ranks) is None] == [1, 2, 4, 6, 8, 10]


def _fsdp_tp_step(rank, world_size):
    """The demo's 4-rank layout, one step: FSDP2's warnings about a view it returned, and the loss."""
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import _demo_model as model_lib

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    args = model_lib.ModelArgs()
    model = model_lib.parallelize(model_lib.Transformer(args), mesh["tp"], mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model_lib.train_step(model, optimizer, *model_lib.make_batch(args, 4, 0))
    return [str(warning.message)[:120] for warning in caught if "view tensor" in str(warning.message)], loss


def test_the_fsdp2_demo_model_returns_no_view():
    """`demo --ranks 4` printed FSDP2's 'returned a view tensor ... wrong gradients' warning on every rank."""
    results = run_ranks(_fsdp_tp_step, 4)
    assert [messages for messages, _ in results] == [[]] * 4
    assert len({loss for _, loss in results}) == 1
