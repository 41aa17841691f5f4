"""Untraced steps run no module hook of ours past their first module call: the step opens there, and the global
hooks come back when it closes. Step close, step time, collective metrics (their pass labels too) and traced steps
stay what they were with the hooks on."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module
from torch.utils.checkpoint import checkpoint

from commdebug_otel import semconv
from commdebug_otel.capture.tracker import ModuleTracker

GLOBAL_PRE_HOOKS: list[int] = []  # how many global forward pre-hooks exist inside Loss's forward, each step


class ReduceInBackward(torch.autograd.Function):
    """Identity whose backward all-reduces a copy of the gradient: a collective of the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad.detach().clone())
        return grad


class Reduce(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x.detach().clone())
        return x.tanh()  # saves its output: a checkpoint recomputes it


class Outer(torch.nn.Module):
    """A forward collective, one in a checkpointed block (again in its recompute), one in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.reduce = Reduce()
        self.ckpt = Reduce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ReduceInBackward.apply(self.reduce(self.lin(x)))
        return checkpoint(self.ckpt, x, use_reentrant=False)


class Loss(torch.nn.Module):
    """Called at top level after the model: a second outermost call of the step, with a forward collective."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        GLOBAL_PRE_HOOKS.append(len(nn_module._global_forward_pre_hooks))
        dist.all_reduce(x.detach().clone())
        return x.sum()


STEPS, TRACE_EVERY = 7, 3  # steps 0, 3 and 6 traced


def _train(tracer_factory, monkeypatch, steps: int = STEPS, **settings) -> list[int]:
    """Train ``steps`` steps; return how many calls our global pre-hook got in each."""
    calls = []
    pre_hook = ModuleTracker._pre_hook

    def counting(self, module, args):
        calls.append(module)
        return pre_hook(self, module, args)

    monkeypatch.setattr(ModuleTracker, "_pre_hook", counting)
    GLOBAL_PRE_HOOKS.clear()
    model, loss = Outer(), Loss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    per_step = []
    with tracer_factory(**settings):
        for _ in range(steps):
            before = len(calls)
            loss(model(torch.randn(2, 4))).backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(torch.ones(1))  # between steps (a logging all_reduce): pass none
            per_step.append(len(calls) - before)
    return per_step


def test_untraced_steps_run_one_module_hook_and_keep_their_metrics(telemetry, tracer_factory, monkeypatch,
                                                                   single_rank_group):
    before = len(nn_module._global_forward_pre_hooks)
    calls = _train(tracer_factory, monkeypatch, trace_every=TRACE_EVERY)
    # Traced: every module call (Outer, lin, reduce, ckpt, its recompute, Loss); untraced after the first
    # optimizer step: only the call that opens the step. Step 1 is the first that knows steps end at step().
    assert calls == [6, 1, 1, 6, 1, 1, 6]
    # Inside Loss (the step's second outermost call): ours are on only in traced steps.
    assert GLOBAL_PRE_HOOKS == [before + 1 if step % TRACE_EVERY == 0 else before for step in range(STEPS)]
    # The pass labels are the same on every step, traced or not.
    passes = Counter()
    for labels, count in telemetry.metric_points(semconv.METRIC_OPERATIONS):
        passes[labels[semconv.MODULE_PASS]] += count
    assert passes == {"forward": 3 * STEPS, "recompute": STEPS, "backward": STEPS, "none": STEPS}
    [(_, duration)] = telemetry.metric_points(semconv.METRIC_STEP_DURATION)
    assert duration.count == STEPS
    for name in ("Outer forward", "Outer.reduce forward", "Outer.ckpt forward", "Outer.ckpt recompute",
                 "Loss forward", "Outer.lin backward"):
        assert len(telemetry.by_name(name)) == 3, name
    assert [span.attributes[semconv.STEP] for span in telemetry.by_name("train_step")] == [0, 3, 6]


def test_module_depth_metrics_keep_the_hooks_on(telemetry, tracer_factory, monkeypatch, single_rank_group):
    """A module label in the metrics needs every call: no step goes hook-free."""
    assert _train(tracer_factory, monkeypatch, steps=4, trace_every=TRACE_EVERY, metric_module_depth=1) == [6] * 4


def test_hooks_come_back_when_the_tracer_stops_in_a_hook_free_step(telemetry, tracer_factory, single_rank_group):
    before = len(nn_module._global_forward_pre_hooks)
    model = Outer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = tracer_factory(trace_every=TRACE_EVERY)
    tracer.start()
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()  # step 2 (untraced) open, hooks off
    assert len(nn_module._global_forward_pre_hooks) == before
    tracer.stop()
    assert len(nn_module._global_forward_pre_hooks) == before
    tracer.start()  # the next step is seen from its first call
    assert len(nn_module._global_forward_pre_hooks) == before + 1
    tracer.stop()


class CompiledBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize("layout", ["whole", "in place"])
@pytest.mark.parametrize("trace_every", [2, 3])
def test_compiled_modules_do_not_recompile_across_traced_and_hook_free_steps(telemetry, tracer_factory,
                                                                            single_rank_group, layout, trace_every):
    """The global hooks come and go at step boundaries: compiled code keeps its graphs (``torch.compile(model)``, and
    a block's in-place ``compile()`` inside an eager model)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiles = []

    def backend(graph, inputs):  # counts every graph dynamo compiles: a recompile is one more
        compiles.append(graph)
        return graph.forward

    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), CompiledBlock())
        if layout == "whole":
            run = torch.compile(model, backend=backend)
        else:
            model[2].compile(backend=backend)
            run = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            run(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # compiled, untraced
        step()
        assert len(compiles) == 1
        with tracer_factory(trace_every=trace_every):
            for _ in range(6):
                step()
        assert len(compiles) == 1
        assert not torch._dynamo.utils.counters["graph_break"]
        name = "Sequential forward" if layout == "whole" else "Sequential.2 forward"
        assert len(telemetry.by_name(name)) == (3 if trace_every == 2 else 2)
    finally:
        torch._dynamo.reset()


def test_untraced_steps_wake_the_metrics_worker_at_most_once_a_second(telemetry, tracer_factory, monkeypatch,
                                                                      single_rank_group):
    """An untraced step's points wait for the worker's own take (or the next hand-over a second later); a traced
    step's close hands them over at once. None is lost: the stop drains them."""
    from commdebug_otel.core import step_lifecycle

    monkeypatch.setattr(step_lifecycle, "QUIET_FLUSH_NS", 10**15)  # no second passes within the test
    model = Reduce()
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.01)
    tracer = tracer_factory(trace_every=5)  # steps 0 and 5 traced
    handed = []
    flush = tracer._metrics.flush
    monkeypatch.setattr(tracer._metrics, "flush", lambda: handed.append(tracer.recorder.steps_taken) or flush())
    with tracer:
        for _ in range(8):
            model(torch.ones(2)).sum()
            optimizer.step()
    assert handed == [1, 6]  # at the close of steps 0 and 5 (steps_taken counts the closed step already)
    [(_, duration)] = telemetry.metric_points(semconv.METRIC_STEP_DURATION)
    assert duration.count == 8
    assert sum(count for _, count in telemetry.metric_points(semconv.METRIC_OPERATIONS)) == 8
