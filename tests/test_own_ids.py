"""Tracing never changes the script's random numbers: our ids come from a random source of our own.

A seeded script draws the same numbers traced or not (global ``random``, numpy, torch), ranks seeded
alike get distinct span ids inside their shared step trace, and a forked child's ids are not its parent's.
"""

import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from distributed import run_ranks
from models import AllReduceLinear


def _rng_state():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def _seeded_steps(tracer, steps=4):
    """A seeded job: every step draws a shuffle from each generator and all-reduces in forward."""
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    drawn = []
    with tracer if tracer is not None else _nothing():
        for _ in range(steps):
            drawn.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            torch.distributed.all_reduce(torch.ones(1))  # between steps: an outside_step span
        if tracer is not None:
            tracer.flush_metrics()
    state = _rng_state()
    return drawn, state, [random.random() for _ in range(3)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("provider", ["own", "injected"])
def test_tracing_leaves_every_random_generator_as_it_was(provider, tmp_path, single_rank_group):
    """Our own provider (direct span path, our metric reservoirs, exemplars) and an injected SDK provider with
    the SDK's stock RandomIdGenerator (the Tracer.start_span path): the same draws, the same state after."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commdebug_otel import CommTracer, Settings, semconv

    untraced = _seeded_steps(None)
    if provider == "own":
        tracer = CommTracer(Settings(output_dir=str(tmp_path)))
    else:
        exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
        stock = TracerProvider()  # the SDK's default generator: it draws from the global random
        stock.add_span_processor(SimpleSpanProcessor(exporter))
        # The SDK's default exemplar reservoir for sums draws from the global random too.
        tracer = CommTracer(tracer_provider=stock, meter_provider=MeterProvider(metric_readers=[reader]))
    traced = _seeded_steps(tracer)
    assert traced == untraced
    if provider == "own":
        [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
        names = [span["name"] for span in _spans(traces)]
    else:
        names = [span.name for span in exporter.get_finished_spans()]
        exemplars = {metric.name: sum(len(point.exemplars) for point in metric.data.data_points)
                     for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                     for metric in sm.metrics}
        # Sums go without exemplars there; explicit-bucket histograms (no draw) keep theirs.
        assert exemplars[semconv.METRIC_OPERATIONS] == 0 and exemplars[semconv.METRIC_STEP_DURATION] > 0
    assert names.count("train_step") == 4 and names.count("AllReduceLinear forward") == 4


def _spans(path):
    from commdebug_otel.offline.otlp_json import spans_from_otlp_json

    return [span for line in pathlib.Path(path).read_text().splitlines() for span in spans_from_otlp_json(line)]


ENV_STARTED = """
import json, random, sys
import torch
random.seed(7)
torch.manual_seed(7)
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.rand(1, 2) + random.random()).sum().backward()
    optimizer.step()
json.dump([random.random(), float(torch.rand(1))], sys.stdout)
"""


# numpy's and torch's global generators seeded, a shuffling DataLoader with two worker processes (each seeded
# from torch's generator, and numpy used inside them): the batch order, the workers' draws and the losses.
DATA_LOADER = """
import json, random, sys
import numpy as np, torch
from torch.utils.data import DataLoader, Dataset
class Noisy(Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, index):
        return torch.tensor([float(index), float(np.random.rand()), random.random()])
if __name__ == "__main__":
    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for batch in DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2):
        seen.append(batch.tolist())
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
    seen.append([float(loss), float(np.random.rand()), random.random(), float(torch.rand(1))])
    json.dump(seen, sys.stdout)
"""


@pytest.mark.parametrize(("script", "steps"), [(ENV_STARTED, 3), (DATA_LOADER, 3)], ids=["plain", "data loader"])
def test_the_environment_start_leaves_the_random_numbers_alone(tmp_path, script, steps):
    bootstrap = pathlib.Path(__file__).parents[1] / "commdebug_otel" / "_bootstrap"
    results = []
    for enabled in ("", "true"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
        env.update(OTEL_PYTHON_COMMDEBUG_ENABLED=enabled, OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path),
                   PYTHONPATH=os.pathsep.join([str(bootstrap), str(bootstrap.parents[1])]))
        (tmp_path / "script.py").write_text(script)  # a file: spawn-started workers import it
        result = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        results.append(json.loads(result.stdout))
    [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
    assert [span["name"] for span in _spans(traces)].count("train_step") == steps  # traced indeed
    assert results[0] == results[1]


def _seeded_alike(rank, world_size, out_dir, provider):
    """Each rank seeds every generator alike (seed_everything) before each of 3 steps, then traces them."""
    import torch.distributed as dist
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commdebug_otel import CommTracer, Settings

    exporter = InMemorySpanExporter()
    if provider == "own":
        tracer = CommTracer(Settings(output_dir=out_dir))
    else:
        stock = TracerProvider()
        stock.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = CommTracer(tracer_provider=stock)
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer:
        for _ in range(3):
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    dist.barrier()
    if provider == "own":
        [path] = pathlib.Path(out_dir).glob(f"run-*/traces-rank{rank}.jsonl")
        return [(span["name"], span["trace_id"], span["span_id"]) for span in _spans(path)]
    return [(span.name, f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}")
            for span in exporter.get_finished_spans()]


def _seeded_alike_both(rank, world_size, out_dir):
    """``_seeded_alike`` with our own provider, then with an injected one, in one job (one spawn for both)."""
    return {provider: _seeded_alike(rank, world_size, out_dir, provider) for provider in ("own", "injected")}


@pytest.fixture(scope="module")
def seeded_alike(tmp_path_factory):
    """Per rank of one 2-rank gloo job: ``{"own" or "injected": [(span name, trace id, span id)]}``."""
    return run_ranks(_seeded_alike_both, 2, str(tmp_path_factory.mktemp("seeded-alike")))


@pytest.mark.parametrize("provider", ["own", "injected"])
def test_ranks_seeded_alike_get_distinct_span_ids_in_the_shared_step_trace(provider, seeded_alike):
    results = [jobs[provider] for jobs in seeded_alike]
    steps = [sorted(trace for name, trace, _ in spans if name == "train_step") for spans in results]
    assert steps[0] == steps[1] and len(set(steps[0])) == 3  # one shared trace per step
    span_ids = [[span_id for _, _, span_id in spans] for spans in results]
    assert [len(ids) for ids in span_ids] == [15, 15]  # train_step, 2 forwards, 2 backwards per step
    assert all(len(set(ids)) == len(ids) for ids in span_ids)  # no id repeats within a rank
    assert not set(span_ids[0]) & set(span_ids[1])


def test_a_forked_child_draws_ids_of_its_own():
    from commdebug_otel.core import ids
    from commdebug_otel.otel.spans import OwnIdGenerator, StepIdGenerator

    ids.span_id()  # the parent has drawn before forking
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, by every route
        try:
            drawn = [ids.span_id(), ids.trace_id(), OwnIdGenerator().generate_span_id(),
                     StepIdGenerator().own.generate_trace_id()]
            os.write(write, json.dumps(drawn).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    parent = [ids.span_id(), ids.trace_id(), OwnIdGenerator().generate_span_id(),
              StepIdGenerator().own.generate_trace_id()]
    assert len(child) == 4 and not set(child) & set(parent)


def test_a_user_chosen_id_generator_keeps_making_the_ids():
    """A generator of another kind (X-Ray's ids have a form of their own) stays the source of random ids;
    the SDK's stock one, which draws from the global random, is replaced for our spans."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    from commdebug_otel.otel.spans import OwnIdGenerator, StepIdGenerator

    class Counting(IdGenerator):
        def generate_span_id(self):
            return 5

        def generate_trace_id(self):
            return 7

    assert StepIdGenerator(Counting()).own.generate_span_id() == 5
    assert type(StepIdGenerator(RandomIdGenerator()).own) is OwnIdGenerator

    class Flagged(RandomIdGenerator):  # the SDK's draws, another flag
        def is_trace_id_random(self):
            return False

    assert type(StepIdGenerator(Flagged()).own) is OwnIdGenerator
    assert type(StepIdGenerator().own) is OwnIdGenerator


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_retries_leave_the_random_numbers_alone(protocol):
    """An unreachable collector: each retry's back-off jitter is drawn from our source, not the script's."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from commdebug_otel import Settings
    from commdebug_otel.otel.telemetry import Telemetry

    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_METRICS_EXPORTER": "none"}
    telemetry = Telemetry(Settings(), environ=environ)
    try:
        telemetry.tracer()
        [guard] = telemetry._span_guards
        span = ReadableSpan("s", SpanContext(1, 1, False), start_time=1, end_time=2)
        random.seed(3)
        state = random.getstate()
        assert guard.export([span]).name == "FAILURE"  # the exporter tried, and retried
        assert random.getstate() == state
    finally:
        telemetry.shutdown()
