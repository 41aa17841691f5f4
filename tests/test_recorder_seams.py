"""The recorder's public seams: the "why" scope, observers passed at construction, and state sizes."""

import logging

import pytest
import torch

from commdebug_otel import CommTracer, Settings, semconv
from commdebug_otel.capture.sinks import RecorderObserver
from commdebug_otel.capture.tracker import ModuleTracker
from commdebug_otel.core.collectives import Why
from commdebug_otel.core.recorder import Recorder


def test_why_scope_restores_what_was_there_and_local_op_ends_it():
    why = Why()
    outer, inner = object(), object()
    with why(outer, ("a",)):
        with why(inner, ("b",)):
            assert (why.op, why.args) == (inner, ("b",))
        assert (why.op, why.args) == (outer, ("a",))
    assert (why.op, why.args) == (None, ())
    assert why.attributes() is None
    why.until_local_op(outer, ())
    why.local_op_ran(inner)  # another op's local run leaves it
    assert why.op is outer
    why.local_op_ran(outer)
    assert why.op is None


def test_observer_sees_first_calls_with_their_callers_and_a_raising_one_is_counted(telemetry, caplog):
    class Seen(RecorderObserver):
        def __init__(self):
            self.calls = []

        def on_first_call(self, module, fqn, callers):
            self.calls.append((fqn, [record.fqn for record in callers]))

        def traced_step_changed(self, traced):
            raise RuntimeError("injected")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2))

        def forward(self, x):
            return self.inner(x)

    observer = Seen()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider, observer=observer)
    with caplog.at_level(logging.WARNING), tracer:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        assert tracer.state_sizes()["modules seen"] == 3
    assert observer.calls == [("Net", []), ("Net.inner", ["Net"]), ("Net.inner.0", ["Net", "Net.inner"])]
    assert [r.getMessage().count("dispatch mode switch failed") for r in caplog.records] == [1]
    # Two openings and two traced closings each raised; the steps are exported all the same.
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == [
        ({semconv.DROPPED_KIND: "hook_error", semconv.RANK: 0}, 4)]
    assert len(telemetry.by_name("train_step")) == 2
    assert not tracer.recorder.step_open


class _KeepingSink:
    """A span sink that keeps the records it is given (it does not say ``keeps_records = False``)."""

    exporting = True

    def __init__(self):
        self.steps, self.trees = [], []

    def start(self):
        return False

    def emit(self, roots, children, trace_id):
        self.steps.append(self.walk(roots, children))
        self.trees.append((roots, children))

    @staticmethod
    def walk(roots, children):
        kept, todo = [], list(roots)
        while todo:
            record = todo.pop()
            kept.append((record, record.name, record.start_ns))
            todo.extend(children.get(id(record), ()))
        return kept


class _ReadingSink(_KeepingSink):
    """One that reads them during emit() only, and says so."""

    keeps_records = False


@pytest.mark.parametrize("sink_type", [_KeepingSink, _ReadingSink])
def test_closed_steps_records_are_reused_only_where_the_sink_keeps_none(sink_type):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    sink = sink_type()
    recorder = Recorder(Settings(), sink, None)
    tracker = ModuleTracker(recorder)
    recorder.activate()
    tracker.install()
    try:
        for _ in range(3):
            model(torch.ones(1, 2, requires_grad=True)).sum().backward()
            recorder.optimizer_step_done()
    finally:
        tracker.remove()
    assert len(sink.steps) == 3
    for kept in sink.steps:  # every record as it was when its step was emitted: 4 modules, forward and backward
        assert sorted(name for _, name, _ in kept if name != "train_step") == sorted(
            f"Sequential{suffix} {pass_}" for suffix in ("", ".0", ".1", ".2") for pass_ in ("forward", "backward"))
    first, last = ({id(record) for record, _, _ in kept if record.name != "train_step"} for kept in
                   (sink.steps[0], sink.steps[-1]))
    if sink_type is _KeepingSink:
        assert not first & last
        assert all((record.name, record.start_ns) == (name, start) for record, name, start in sink.steps[0])
        assert sink.walk(*sink.trees[0]) == sink.steps[0]  # the children lists it kept are whole
    else:
        assert first == last  # the same eight record objects, reset for each step
