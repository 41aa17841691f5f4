"""Module calls on other threads (inference, EMA, evaluation) never touch the training thread's steps.

The training thread is the tracer's, or another thread that trains (a backward pass,
then optimizer.step) before the tracer's thread calls a module. Other threads' module
calls and optimizer steps are ignored: no spans, no effect on the training steps; their
collectives are counted in metrics only.
"""

import json
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
from test_module_spans import BACKWARD_TREE, FORWARD_TREE

from commdebug_otel import semconv
from commdebug_otel.core.recorder import NO_OPTIMIZER_CYCLES

from models import AllReduceLinear, TwoBlocks

STEPS = 30


def _train(model, during_first_forward=lambda: None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for index in range(STEPS):
        out = model(torch.randn(2, 4, requires_grad=True))
        if index == 0:
            during_first_forward()
        out.sum().backward()
        optimizer.step()


def _one_step():
    return [(0, "train_step"), *FORWARD_TREE, *BACKWARD_TREE]


def _check(telemetry, trace_every=1, dropped=()):
    spans = telemetry.spans()
    tree = telemetry.tree()
    traced = list(range(0, STEPS, trace_every))
    assert tree == _one_step() * len(traced)
    assert len(tree) == len(spans)  # every span is in the tree: no orphans
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == traced
    assert not any(s.attributes.get(semconv.SPAN_UNMATCHED) for s in spans)
    assert [attrs[semconv.DROPPED_KIND] for attrs, _ in telemetry.metric_points(semconv.METRIC_DROPPED)] == [*dropped]


@pytest.mark.parametrize("trace_every", [1, 3])
def test_training_alone(telemetry, tracer_factory, trace_every):
    from torch.nn.modules import module

    before = len(module._global_forward_hooks_with_kwargs)
    with tracer_factory(trace_every=trace_every):
        _train(TwoBlocks())
        # Untraced steps remove and add the global hooks again: torch's handle leaves an entry each time.
        assert len(module._global_forward_hooks_with_kwargs) == before + 1
    assert len(module._global_forward_hooks_with_kwargs) == before
    _check(telemetry, trace_every)


def _run_with_threads(model, make_worker, count=2):
    stop = threading.Event()
    calls = [0] * count
    threads = [threading.Thread(target=make_worker(index, stop, calls), daemon=True) for index in range(count)]
    try:
        _train(model, during_first_forward=lambda: [thread.start() for thread in threads])
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return calls


@pytest.mark.parametrize("trace_every", [1, 3])  # 3: untraced steps run with the global hooks off
def test_a_concurrent_inference_thread_leaves_the_training_steps_as_they_are(
        telemetry, tracer_factory, single_rank_group, trace_every):
    model = TwoBlocks()
    # The same model object (a serving thread), and another model that all-reduces in forward.
    other = AllReduceLinear()

    def make_worker(index, stop, calls):
        target = model if index == 0 else other
        own_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)  # an EMA-style update on its thread

        def work():
            while not stop.is_set():
                with torch.no_grad():
                    target(torch.randn(2, 4))
                calls[index] += 1
                target(torch.randn(2, 4, requires_grad=True)).sum()  # with grad, never backward
                calls[index] += 1
                own_optimizer.step()
        return work

    with tracer_factory(trace_every=trace_every) as tracer:
        calls = _run_with_threads(model, make_worker)
        tracer.flush_metrics()
    assert all(calls)  # the threads really ran during training
    _check(telemetry, trace_every)
    # The other thread's collectives: in the metrics, owned by no module and no span.
    operations = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert [(attrs[semconv.MODULE_PASS], value) for attrs, value in operations] == [("none", calls[1])]


@pytest.mark.parametrize("side", ["inference", "grad forward and EMA step"])
def test_a_side_thread_that_calls_first_never_takes_the_training_threads_place(
        telemetry, tracer_factory, single_rank_group, side):
    """The side thread calls modules before the training thread's first forward (forced with an Event):
    the thread that trains (backward, optimizer.step) still gets every step, the side thread nothing."""
    model = TwoBlocks()
    calls = [0]
    called, stop = threading.Event(), threading.Event()

    def work():
        ema = AllReduceLinear()  # its all_reduce: counted in the metrics, pass none
        own_optimizer = torch.optim.SGD(ema.parameters(), lr=0.1)
        while not stop.is_set():
            with torch.no_grad():
                model(torch.randn(2, 4))  # the training model itself, as a serving thread would
                ema(torch.randn(2, 4))
            if side != "inference":
                model(torch.randn(2, 4, requires_grad=True)).sum()  # with grad, never backward: a step left open
                own_optimizer.step()  # an optimizer step without a backward of its own
            calls[0] += 1
            called.set()

    with tracer_factory() as tracer:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            assert called.wait(60)  # the side thread called first
            _train(model)
        finally:
            stop.set()
            thread.join()
        tracer.flush_metrics()
    assert calls[0]
    # Exactly the 30 steps, each the training thread's own tree. The side thread's spans recorded before the
    # training thread's first call were never exported: dropped, counted as such.
    _check(telemetry, dropped=[semconv.DROPPED_KIND_OTHER_THREAD])
    # Every side collective counted; those before the training thread's first call were labelled while the
    # side thread held the role (metric points are not held back).
    operations = dict((attrs[semconv.MODULE_PASS], value)
                      for attrs, value in telemetry.metric_points(semconv.METRIC_OPERATIONS))
    assert sum(operations.values()) == calls[0]
    assert set(operations) <= {"none", "forward"}


def test_training_on_a_thread_other_than_the_tracers(telemetry, tracer_factory):
    # The tracer starts here; the first module call on the worker, with no step open, makes it the training thread.
    with tracer_factory():
        worker = threading.Thread(target=_train, args=(TwoBlocks(),))
        worker.start()
        worker.join()
    _check(telemetry)


def test_training_without_an_optimizer_on_a_thread_other_than_the_tracers(telemetry, tracer_factory,
                                                                          no_optimizer_alive):
    """A worker that trains without optimizer.step() keeps the role after NO_OPTIMIZER_CYCLES backward passes
    (one backward on a side thread is not training): its steps are exported, nothing dropped."""
    def train():
        model = TwoBlocks()
        for _ in range(2 * NO_OPTIMIZER_CYCLES + 1):  # the last forward closes the second step
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()

    with tracer_factory() as tracer:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
        tracer.flush_metrics()
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 1, 2]
    assert telemetry.tree()[:1 + len(FORWARD_TREE)] == [(0, "train_step"), *FORWARD_TREE]
    assert len(telemetry.by_name("TwoBlocks backward")) == 2 * NO_OPTIMIZER_CYCLES + 1
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == []


SIDE_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "side_thread.py"
MAIN_SPANS = {name: STEPS for name in ("train_step", "Block forward", "Block.a forward", "Block.b forward",
                                        "Block backward", "Block.a backward", "Block.b backward")}


# (processes, rounds each). The serving loop started before or after the tracer: the hand-back race showed in
# about 1 round in 3 (an uncounted loss of step 0's forward spans or a train_step, or a side forward recorded),
# so 16 rounds all pass by chance at under 0.1 %.
@pytest.mark.parametrize(("layout", "processes", "rounds"), [
    ("before", 2, 8), ("after", 2, 8), ("eval_grad", 1, 4), ("pool", 1, 4), ("one_backward", 1, 4)])
def test_a_side_thread_never_takes_a_training_step_in_fresh_processes(layout, processes, rounds):
    """Training on the main thread while a side thread calls modules (tests/scripts/side_thread.py, its
    threads interleaving inside our hooks): every round's 30 train_step spans with all their module spans,
    no side span, and only the side thread's own spans dropped (counted as other_thread)."""
    runs = [subprocess.Popen([sys.executable, str(SIDE_SCRIPT), layout, str(rounds)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err
        results += [json.loads(line) for line in out.splitlines()]
    assert len(results) == processes * rounds
    for result in results:
        assert result["calls"] > 0  # the side thread really ran
        assert (result["steps"], result["spans"]) == (list(range(STEPS)), MAIN_SPANS)
        assert set(result["dropped"]) <= {semconv.DROPPED_KIND_OTHER_THREAD}
