"""Bounds: every number setting has a range, stop() never raises, and a step that never ends stays bounded."""

import gc
import logging
import os
import subprocess
import sys
import textwrap
import tracemalloc
import weakref

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from commdebug_otel import CommTracer, Settings, semconv
from commdebug_otel.config import OPTIONS, read_option

from models import Block

# Past each number's upper bound: the absurd values users set (1e10 s is past threading.TIMEOUT_MAX,
# 1e20 events past the SDK deque's 2**63), and the non-numbers a float parser takes.
OUT_OF_RANGE = {
    "TRACE_EVERY": ["1000000001", "99999999999999999999999"],
    "COMPLETION_EVERY": ["1000000001"],
    "MAX_EVENTS_PER_SPAN": ["1000001", "100000000000000000000"],
    "METRIC_MODULE_DEPTH": ["101"],
    "SHUTDOWN_TIMEOUT": ["1e10", "600.5", "inf", "nan", "1e400"],
    "MAX_SPANS_PER_STEP": ["1000001", "-1"],
    "RANKS_PER_TRACE": ["1000001", "0"],
}
NUMBERS = {"trace_every", "completion_every", "max_events_per_span", "metric_module_depth",
           "shutdown_timeout_s", "max_spans_per_step", "ranks_per_trace"}


def option(suffix):
    return next(option for option in OPTIONS if option.suffix == suffix)


def test_every_number_setting_has_an_upper_bound_in_the_table():
    numbers = {option.field for option in OPTIONS if type(option.default) in (int, float)}
    assert numbers == NUMBERS == {option(suffix).field for suffix in OUT_OF_RANGE}
    for field in numbers:
        [accepted] = [option.accepted for option in OPTIONS if option.field == field]
        assert "<=" in accepted or " to " in accepted, accepted


@pytest.mark.parametrize("suffix,text", [(s, t) for s, texts in OUT_OF_RANGE.items() for t in texts])
def test_out_of_range_environment_value_says_it_once_and_uses_the_default(suffix, text, caplog):
    opt = option(suffix)
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        settings = Settings.from_env({opt.env: text})
    assert getattr(settings, opt.field) == opt.default
    [record] = caplog.records
    message = record.getMessage()
    assert opt.env in message and opt.accepted in message and repr(text) in message
    assert message.endswith(f"using the default {opt.default}")


def test_the_bounds_themselves_are_accepted():
    environ = {option("TRACE_EVERY").env: "1000000000", option("MAX_EVENTS_PER_SPAN").env: "1000000",
               option("METRIC_MODULE_DEPTH").env: "100", option("SHUTDOWN_TIMEOUT").env: "600",
               option("MAX_SPANS_PER_STEP").env: "1000000", option("RANKS_PER_TRACE").env: "1000000"}
    settings = Settings.from_env(environ)
    assert (settings.trace_every, settings.max_events_per_span, settings.metric_module_depth,
            settings.shutdown_timeout_s, settings.max_spans_per_step,
            settings.ranks_per_trace) == (10**9, 10**6, 100, 600.0, 10**6, 10**6)
    assert read_option("max_spans_per_step", {}) == 50_000


@pytest.mark.parametrize("field,value", [
    ("shutdown_timeout_s", 1e10), ("shutdown_timeout_s", float("nan")), ("shutdown_timeout_s", float("inf")),
    ("shutdown_timeout_s", "5"), ("max_events_per_span", 2**64), ("trace_every", 2.5), ("trace_every", True),
    ("completion_every", 10**9 + 1), ("metric_module_depth", -1), ("metric_module_depth", 101),
    ("max_spans_per_step", 0), ("max_spans_per_step", 10**6 + 1), ("ranks_per_trace", 0), ("ranks_per_trace", 2.0),
])
def test_out_of_range_explicit_argument_raises_at_once(field, value):
    accepted = next(option.accepted for option in OPTIONS if option.field == field)
    with pytest.raises(ValueError) as raised:
        Settings(**{field: value})
    assert str(raised.value) == f"{field} must be {accepted}, got {value!r}"


def test_explicit_numbers_in_range_are_kept_with_their_type():
    settings = Settings(shutdown_timeout_s=20, trace_every=10**6, max_spans_per_step=7)
    assert settings.shutdown_timeout_s == 20.0 and isinstance(settings.shutdown_timeout_s, float)
    assert (settings.trace_every, settings.max_spans_per_step) == (10**6, 7)


# ------------------------------------------------------------------ stop() never raises
def test_stop_goes_on_past_each_failing_undo_and_never_raises(telemetry, tracer_factory, monkeypatch):
    tracer = tracer_factory()
    model = Block()

    def broken(*args, **kwargs):
        raise OverflowError("timestamp out of range for platform time_t")

    with tracer:
        model(torch.ones(1, 4)).sum().backward()
        monkeypatch.setattr(tracer.recorder, "finish", broken)
        monkeypatch.setattr(tracer.telemetry, "end", broken)  # the flush and end of our providers
    assert not tracer.started and tracer.state_sizes()["module hooks"] == 0  # the hooks went anyway
    tracer.flush_metrics()
    points = telemetry.metric_points(semconv.METRIC_DROPPED)
    assert [(labels[semconv.DROPPED_KIND], value) for labels, value in points] == [("hook_error", 2)]


_ABSURD_SCRIPT = textwrap.dedent("""
    import torch
    from commdebug_otel import CommTracer

    class Flaky(torch.nn.Module):
        def forward(self, x):
            raise ValueError("flaky")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    flaky = Flaky()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer():
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            try:
                flaky(torch.ones(1))  # an errored span in every step
            except ValueError:
                pass
            optimizer.step()
    print("script went on")
""")


def test_absurd_numbers_in_the_environment_leave_the_script_alone(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update({option(suffix).env: texts[-1] for suffix, texts in OUT_OF_RANGE.items()})
    env.update({option("SHUTDOWN_TIMEOUT").env: "1e10", option("MAX_EVENTS_PER_SPAN").env: "100000000000000000000",
                option("OUTPUT_DIR").env: str(tmp_path), "OTEL_METRICS_EXPORTER": "none"})
    done = subprocess.run([sys.executable, "-c", _ABSURD_SCRIPT], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0 and done.stdout == "script went on\n", done.stderr
    assert "Traceback" not in done.stderr and "Error" not in done.stderr.replace("ValueError", ""), done.stderr
    for suffix in OUT_OF_RANGE:
        assert done.stderr.count(f"ignoring {option(suffix).env}=") == 1, done.stderr
    [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
    text = traces.read_text()
    assert text.count('"name": "train_step"') + text.count('"name":"train_step"') == 3  # no step lost
    assert "exception" in text


# ------------------------------------------------------------------ a step that never ends
class _Counting(SpanExporter):
    """Keeps counts only, so that the exporter's memory does not hide the recorder's."""

    def __init__(self):
        self.spans = 0
        self.train_steps = []  # (torch.step, part, truncated)

    def export(self, spans):
        self.spans += len(spans)
        for span in spans:
            if span.name == semconv.SPAN_TRAIN_STEP:
                attributes = span.attributes
                self.train_steps.append((attributes[semconv.STEP], attributes.get(semconv.STEP_PART, 0),
                                         attributes.get(semconv.STEP_TRUNCATED, False)))
        return SpanExportResult.SUCCESS


def _dropped(telemetry, tracer):
    tracer.flush_metrics()
    return {labels[semconv.DROPPED_KIND]: value
            for labels, value in telemetry.metric_points(semconv.METRIC_DROPPED)}


def test_forward_passes_without_optimizer_step_stay_bounded_and_export_in_parts(telemetry):
    exporter = _Counting()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = CommTracer(Settings(max_spans_per_step=100), tracer_provider=provider,
                        meter_provider=telemetry.meter_provider)
    model = Block()  # 5 module passes per forward: Block, a, act, b, act
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    with tracer:
        model(x).sum().backward()
        optimizer.step()
        assert exporter.spans == 11  # step 0 whole: train_step, 5 forward, 5 backward
        largest, at_ends, memory = (0, 0), [], []  # nothing that grows per pass in the test itself
        tracemalloc.start()
        try:
            for index in range(1200):  # validation without no_grad: outputs with grad, never a backward
                model(x).sum()
                sizes = tracer.state_sizes()
                largest = max(largest, (sizes["step records"], sizes["step hooks"]))
                if index in (199, 1199):  # both at a part's end (20 passes of 5 records each)
                    gc.collect()
                    memory.append(tracemalloc.get_traced_memory()[0])
                    at_ends.append((sizes["step records"], sizes["step hooks"]))
        finally:
            tracemalloc.stop()
        assert largest == (100, 160) and at_ends == [(100, 160), (100, 160)]
        # Flat: the unbounded step grew ~1 KB per pass record, 5 MB over these 1,000 passes.
        assert memory[1] - memory[0] < 32 * 1024, memory  # measured: about 6 KB
        assert exporter.spans == 11 + 59 * 101  # 59 parts cut so far, 100 module spans each
        exported_before_stop = exporter.spans
        late = tracer.state_sizes()
    assert exporter.spans - exported_before_stop == 101  # stop() exports one part, not the 6,000 spans
    assert late["open forward records"] == late["open backward records"] == late["calls in flight"] == 0
    assert exporter.train_steps == [(0, 0, False)] + [(1, part, part < 59) for part in range(60)]
    assert _dropped(telemetry, tracer) == {semconv.DROPPED_KIND_STEP_SPLIT: 59}


def test_a_cut_removes_the_tensor_hooks_of_the_part_before_it(telemetry, tracer_factory, caplog):
    tracer = tracer_factory(max_spans_per_step=10)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer, caplog.at_level(logging.WARNING, logger="commdebug_otel.core.recorder"):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        kept = [model(torch.ones(1, 4)) for _ in range(2)]  # 10 records: the next forward cuts
        model(torch.ones(1, 4)).sum().backward()  # part 1: a whole pass, forward and backward
        kept[0].sum().backward()  # its hooks went with part 0: no span, nothing left open
        optimizer.step()
    parts = [(s.attributes[semconv.STEP], s.attributes.get(semconv.STEP_PART), s.attributes.get(semconv.STEP_TRUNCATED))
             for s in telemetry.by_name("train_step")]
    assert parts == [(0, None, None), (1, None, True), (1, 1, None)]
    part1 = telemetry.by_name("train_step")[2]
    in_part1 = [s.name for s in telemetry.spans() if s.context.trace_id == part1.context.trace_id
                and s.start_time >= part1.start_time and s.name != "train_step"]
    assert sorted(in_part1) == sorted(f"{name} {pass_}" for name in ("Block", "Block.a", "Block.act", "Block.b",
                                                                     "Block.act") for pass_ in ("forward", "backward"))
    assert not any(semconv.SPAN_UNMATCHED in s.attributes for s in telemetry.spans())
    assert _dropped(telemetry, tracer) == {semconv.DROPPED_KIND_STEP_SPLIT: 1}
    [warning] = caplog.records
    assert "OTEL_PYTHON_COMMDEBUG_MAX_SPANS_PER_STEP=10" in warning.getMessage()


def test_one_pass_past_twice_the_bound_is_recorded_up_to_it(telemetry, tracer_factory):
    tracer = tracer_factory(max_spans_per_step=5)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])  # 7 forward, 7 backward passes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    assert telemetry.tree() == [(0, "train_step"), (1, "Sequential forward")] + [
        (2, f"Sequential.{i} forward") for i in range(6)] + [
        (1, "Sequential backward"), (2, "Sequential.5 backward"), (2, "Sequential.4 backward")]
    assert _dropped(telemetry, tracer) == {semconv.DROPPED_KIND_STEP_FULL: 4}  # the 4 backward passes left


def test_a_real_steps_spans_are_whole_at_the_default():
    assert Settings().max_spans_per_step >= 2 * 10_000 + 10_000  # forward, backward and recompute of 10,000 calls


@pytest.mark.parametrize("depth", [0, 1])
def test_untraced_steps_keep_bounded_state_and_count_nothing(telemetry, tracer_factory, depth):
    tracer = tracer_factory(trace_every=2, metric_module_depth=depth, max_spans_per_step=100)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer:
        for _ in range(1):  # step 0 traced; step 1, untraced, never ends
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
        sizes = set()
        for _ in range(1000):
            model(torch.ones(1, 4)).sum()
            sizes.add(tuple(sorted(tracer.state_sizes().items())))
        depth_now = tracer.recorder._ownership.depth
    records = {dict(size)["step records"] for size in sizes}
    assert max(records) == (100 if depth else 0) and depth_now == 0
    assert {dict(size)["calls in flight"] for size in sizes} == {0}
    assert {dict(size)["call counts"] for size in sizes} <= {0, 4, 5}
    assert max(dict(size)["step hooks"] for size in sizes) == (160 if depth else 0)
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0]
    assert semconv.DROPPED_KIND_STEP_SPLIT not in _dropped(telemetry, tracer)


def test_a_step_of_ten_thousand_module_calls_is_delivered_whole(monkeypatch, tmp_path):
    """Default settings, our own provider and its file exporter: every span of the step arrives."""
    from commdebug_otel.testing import InMemoryTelemetry
    from commdebug_otel.testing.otlp_receiver import spans_from_otlp_json

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    calls = 10_000  # the root and 9,999 layers
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(calls - 1)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tracer = CommTracer(Settings(output_dir=str(tmp_path)), meter_provider=InMemoryTelemetry().meter_provider)
    with tracer:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    tracer.telemetry.shutdown()
    spans = []
    for path in tmp_path.glob("run-*/traces-rank*.jsonl"):
        for line in path.read_text().splitlines():
            spans.extend(spans_from_otlp_json(line))
    passes = [span["attributes"][semconv.MODULE_PASS] for span in spans if span["name"] != "train_step"]
    assert len(spans) == 2 * calls + 1  # train_step, then a forward and a backward span per call
    assert passes.count("forward") == passes.count("backward") == calls
    [step] = [span["attributes"] for span in spans if span["name"] == "train_step"]
    assert step[semconv.STEP] == 0 and semconv.STEP_TRUNCATED not in step and semconv.STEP_PART not in step


def test_a_traced_step_keeps_few_objects_alive_per_module_call(telemetry, tracer_factory):
    """What a traced step keeps alive until it closes is what Python's collector promotes and later scans
    whole (docs/performance.md, "Per span, whatever the nesting"): per module call torch's tensor-hook
    dict of its output, nothing of ours (its records and their backward-end hooks are reused)."""
    calls = 40

    class Nest(torch.nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.inner = Nest(depth - 1) if depth > 1 else None

        def forward(self, x):
            x = self.lin(x)
            return self.inner(x) if self.inner is not None else x

    model = Nest(calls // 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tracer = tracer_factory()
    with tracer:
        for _ in range(2):  # first calls keep their parameter facts; hooks registered
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        gc.disable()
        try:
            model(torch.ones(1, 2)).sum().backward()
            alive = [o for o in gc.get_objects() if id(o) not in before]
        finally:
            gc.enable()
        optimizer.step()
    ours = [type(o).__name__ for o in alive if type(o).__module__.startswith("commdebug_otel")]
    # The module records, with their backward-end hooks, are the step before's, reused: the
    # train_step root and its step are all that is made anew.
    assert sorted(ours) == ["Record", "Step"]
    # Torch's own (its hook dicts) and a few lists: 28 measured; 6.5 per call, then 4, before.
    assert len(alive) <= calls


def test_a_reused_record_keeps_nothing_of_its_step_alive(telemetry, tracer_factory):
    """A forward that raised (an out-of-memory retry) keeps its exception, its traceback and the frames'
    tensors on its record until the span is built; a record reused for later steps must not keep them."""
    activations = []

    class Retried(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] > 2:
                big = torch.ones(1024)  # what the failed attempt had made when it raised
                activations.append(weakref.ref(big))
                raise torch.OutOfMemoryError("simulated")
            return self.lin(x)

    model = Retried()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alive = []
    with tracer_factory():
        for step in range(3):
            x = torch.ones(8 if step == 0 else 2, 4)
            try:
                out = model(x)
            except torch.OutOfMemoryError:
                out = model(x[:2])
            out.sum().backward()
            optimizer.step()
            gc.collect()
            alive.append(activations[0]() is not None)
    assert alive == [False, False, False]
    assert [span.status.is_ok for span in telemetry.by_name("Retried forward")] == [False, True, True, True]
