"""One tracer exports per process: a second start is refused, the CommDebugMode drop-in joins and only counts."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from commdebug_otel import CommDebugMode, CommTracer, Settings, semconv


class _Reduce(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        dist.all_reduce(out.detach())
        return out


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _exported_once(telemetry) -> None:
    assert [span.name for span in telemetry.by_name("train_step")] == ["train_step"]
    assert sum(count for (_, event), count in telemetry.event_counts().items() if event == "all_reduce") == 1
    [(_, operations)] = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert operations == 1


def test_a_second_tracer_does_nothing_while_one_runs(telemetry, single_rank_group):
    model = _Reduce()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    providers = {"tracer_provider": telemetry.tracer_provider, "meter_provider": telemetry.meter_provider}
    with CommTracer(Settings(), **providers) as first:
        second = CommTracer(Settings(), **providers).start()
        assert first.started and not second.started
        _step(model, optimizer)
        second.stop()  # nothing to undo
        assert first.started
        first.flush_metrics()
    _exported_once(telemetry)


def test_the_drop_in_inside_a_running_tracer_counts_and_exports_nothing(telemetry, single_rank_group):
    model = _Reduce()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider) as tracer:
        with CommDebugMode() as outer, CommDebugMode() as inner:  # nested drop-ins count alike
            _step(model, optimizer)
        tracer.flush_metrics()
    for comm_mode in (outer, inner):
        assert comm_mode.get_total_counts() == 1
        assert comm_mode.comm_module_counts["_Reduce"]["forward"] == {torch.ops.c10d.allreduce_: 1}
    _exported_once(telemetry)


def test_a_tracer_inside_the_drop_in_does_nothing(telemetry, single_rank_group):
    model = _Reduce()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommDebugMode(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider) as mode:
        with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider) as tracer:
            assert not tracer.started
            _step(model, optimizer)
        mode.tracer.flush_metrics()
    assert mode.get_total_counts() == 1
    _exported_once(telemetry)


_SCRIPT = """
import torch, torch.distributed as dist
from commdebug_otel import CommDebugMode, CommTracer
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with CommTracer():  # tracing also started from the environment
    for _ in range(3):
        with CommDebugMode() as mode:
            dist.all_reduce(model(torch.ones(2, 4)).detach())
        assert mode.get_total_counts() == 1
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
"""


def test_environment_start_plus_the_scripts_own_tracers_export_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "run", "--", sys.executable, "-c", _SCRIPT],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    spans = load_spans([str(run)])
    assert sorted(s["attributes"][semconv.STEP] for s in spans if s["name"] == "train_step") == [0, 1, 2]
    assert sum(1 for s in spans for e in s["events"] if e["name"] == "all_reduce") == 3
    assert done.stderr.count("already exports this process's telemetry") == 1
