"""Module spans on one process: exact trees, parent links, errors, recompute, unmatched hooks."""

import time

import pytest
import torch

from commdebug_otel import semconv

from models import Block, Boom, Checkpointed, MaybeBoom, TwoBlocks

FORWARD_TREE = [
    (1, "TwoBlocks forward"),
    (2, "TwoBlocks.l0 forward"),
    (3, "TwoBlocks.l0.a forward"),
    (3, "TwoBlocks.l0.act forward"),
    (3, "TwoBlocks.l0.b forward"),
    (3, "TwoBlocks.l0.act forward"),
    (2, "TwoBlocks.l1 forward"),
    (3, "TwoBlocks.l1.a forward"),
    (3, "TwoBlocks.l1.act forward"),
    (3, "TwoBlocks.l1.b forward"),
    (3, "TwoBlocks.l1.act forward"),
]
BACKWARD_TREE = [
    (1, "TwoBlocks backward"),
    (2, "TwoBlocks.l1 backward"),
    (3, "TwoBlocks.l1.act backward"),
    (3, "TwoBlocks.l1.b backward"),
    (3, "TwoBlocks.l1.act backward"),
    (3, "TwoBlocks.l1.a backward"),
    (2, "TwoBlocks.l0 backward"),
    (3, "TwoBlocks.l0.act backward"),
    (3, "TwoBlocks.l0.b backward"),
    (3, "TwoBlocks.l0.act backward"),
    (3, "TwoBlocks.l0.a backward"),
]


def train(model, steps=1, tracer=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()


def test_forward_and_backward_nest_by_module_tree(telemetry, tracer_factory):
    model = TwoBlocks()
    with tracer_factory():
        train(model, steps=2)
    tree = telemetry.tree()
    one_step = [(0, "train_step"), *FORWARD_TREE, *BACKWARD_TREE]
    assert tree == one_step + one_step
    step_spans = telemetry.by_name("train_step")
    assert [span.attributes[semconv.STEP] for span in step_spans] == [0, 1]
    assert all(span.parent is None for span in step_spans)


def test_backward_parent_covers_child_whose_hook_fired_first(telemetry, tracer_factory):
    # Block returns act's output, so act's backward hook (registered first) fires before Block's.
    with tracer_factory():
        train(TwoBlocks())
    block = telemetry.one("TwoBlocks.l1 backward")
    first_act = min(telemetry.by_name("TwoBlocks.l1.act backward"), key=lambda s: s.start_time)
    assert first_act.parent.span_id == block.context.span_id
    assert block.start_time <= first_act.start_time and first_act.end_time <= block.end_time


def test_span_attributes(telemetry, tracer_factory):
    with tracer_factory():
        train(TwoBlocks())
    forward = telemetry.one("TwoBlocks.l0.a forward")
    assert dict(forward.attributes) == {
        semconv.MODULE_FQN: "TwoBlocks.l0.a",
        semconv.MODULE_TYPE: "torch.nn.modules.linear.Linear",
        semconv.MODULE_PASS: "forward",
        semconv.MODULE_DEPTH: 2,
        semconv.MODULE_CALL_INDEX: 0,
        semconv.MODULE_PARAMETERS: ("weight [4, 4]", "bias [4]"),
    }
    backward = telemetry.one("TwoBlocks.l0.a backward")
    assert backward.attributes[semconv.MODULE_PASS] == "backward"
    assert semconv.SPAN_UNMATCHED not in backward.attributes


def test_module_called_twice_gives_two_spans_where_torch_raises(telemetry, tracer_factory):
    model = Block()
    with tracer_factory():
        train(model)
    acts = telemetry.by_name("Block.act forward")
    assert [span.attributes[semconv.MODULE_CALL_INDEX] for span in acts] == [0, 1]
    assert len(telemetry.by_name("Block.act backward")) == 2
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    with pytest.raises(IndexError):
        with TorchCommDebugMode():
            model(torch.randn(2, 4)).sum().backward()


def test_forward_error_marks_span_and_next_step_is_clean(telemetry, tracer_factory):
    model = MaybeBoom()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 4), explode=True)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    failed = telemetry.one("MaybeBoom.boom forward")
    assert failed.status.status_code.name == "ERROR"
    assert [event.name for event in failed.events] == ["exception"]
    assert failed.events[0].attributes["exception.type"] == "ValueError"
    outer = [span for span in telemetry.by_name("MaybeBoom forward")]
    assert outer[0].status.status_code.name == "ERROR"
    assert outer[1].status.status_code.name == "UNSET"
    # The failed forward and the retry are in one step (no optimizer step between them).
    assert telemetry.tree() == [
        (0, "train_step"),
        (1, "MaybeBoom forward"), (2, "MaybeBoom.lin forward"), (2, "MaybeBoom.boom forward"),
        (1, "MaybeBoom forward"), (2, "MaybeBoom.lin forward"),
        (1, "MaybeBoom backward"), (2, "MaybeBoom.lin backward"),
    ]


def test_checkpoint_recompute_sits_under_the_backward_that_caused_it(telemetry, tracer_factory):
    with tracer_factory():
        train(Checkpointed())
    recompute = telemetry.one("Checkpointed.block recompute")
    # ReLU's backward is the first to unpack a saved tensor of the checkpointed block.
    assert telemetry.parent_name(recompute) == "Checkpointed.block.act backward"
    assert telemetry.parent_name(telemetry.by_name("Checkpointed.block.act backward")[0]) == (
        "Checkpointed.block backward")
    assert recompute.attributes[semconv.MODULE_PASS] == "recompute"
    assert [telemetry.parent_name(s) for s in telemetry.by_name("Checkpointed.block.a recompute")] == [
        "Checkpointed.block recompute"]
    assert len(telemetry.by_name("Checkpointed.block forward")) == 1


def test_backward_that_never_reaches_inputs_is_closed_and_marked(telemetry, tracer_factory):
    model = torch.nn.Linear(4, 4)
    with tracer_factory():
        out = model(torch.randn(2, 4, requires_grad=True) * 2)  # a non-leaf input gets the end hook
        torch.autograd.grad(out.sum(), [model.weight])  # input grad never computed
        backward_done = time.time_ns()
    backward = telemetry.one("Linear backward")
    assert backward.attributes[semconv.SPAN_UNMATCHED] is True
    # Closed when the backward pass ended, not later when tracing stopped.
    assert backward.start_time < backward.end_time <= backward_done


def test_inference_without_optimizer_makes_each_top_level_forward_a_root(telemetry, tracer_factory):
    model = Block()
    with tracer_factory(), torch.no_grad():
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    roots = [span for span in telemetry.spans() if span.parent is None]
    assert [span.name for span in roots] == ["Block forward", "Block forward"]
    assert roots[0].context.trace_id != roots[1].context.trace_id


def test_gradient_accumulation_lands_in_one_step(telemetry, tracer_factory):
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        for _ in range(3):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    assert len(telemetry.by_name("train_step")) == 1
    forwards = telemetry.by_name("Block forward")
    assert [span.attributes[semconv.MODULE_CALL_INDEX] for span in forwards] == [0, 1, 2]
    assert {telemetry.parent_name(span) for span in telemetry.by_name("Block backward")} == {"train_step"}


def test_trace_every_exports_only_sampled_steps(telemetry, tracer_factory):
    with tracer_factory(trace_every=2):
        train(Block(), steps=5)
    steps = telemetry.by_name("train_step")
    assert [span.attributes[semconv.STEP] for span in steps] == [0, 2, 4]


def test_stop_removes_every_hook(telemetry, tracer_factory):
    model = Block()
    tracer = tracer_factory()
    with tracer:
        train(model)
    before = len(telemetry.spans())
    assert all(not module._forward_hooks for module in model.modules())
    train(model)
    assert len(telemetry.spans()) == before
    from torch.nn.modules import module as module_globals

    assert not module_globals._global_forward_pre_hooks
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_evaluation_between_steps_is_its_own_root_and_keeps_step_numbers(telemetry, tracer_factory):
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = tracer_factory()
    with tracer:
        for _ in range(2):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
            optimizer.step()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(2, 4))
    roots = [span.name for span in telemetry.spans() if span.parent is None]
    assert roots == ["train_step", "Block forward", "Block forward", "Block forward"] * 2
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 1]
    assert not tracer.recorder.step_open  # nothing left open to grow


class Fallback(torch.nn.Module):
    """The fallback-kernel pattern: ``fast`` raises, ``slow`` runs inside the ``except`` block."""

    def __init__(self):
        super().__init__()
        self.fast = Boom()
        self.slow = torch.nn.Linear(4, 4)

    def forward(self, x):
        try:
            return self.fast(x)
        except ValueError:
            return self.slow(x)


class Reraise(torch.nn.Module):
    """A bare ``raise`` of the exception its caller is handling: its own forward raised."""

    def forward(self, x):
        raise


def _status(span):
    return span.status.status_code.name


def test_only_the_module_whose_forward_raised_is_error(telemetry, tracer_factory):
    model = Fallback()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    fast = telemetry.one("Fallback.fast forward")
    assert _status(fast) == "ERROR"
    assert [(e.name, e.attributes["exception.type"]) for e in fast.events] == [("exception", "ValueError")]
    # slow ran inside the except block, and Fallback caught fast's exception: both succeeded.
    for name in ("Fallback.slow forward", "Fallback forward", "Fallback.slow backward", "Fallback backward"):
        assert (_status(telemetry.one(name)), telemetry.one(name).events) == ("UNSET", ())
    assert telemetry.tree() == [
        (0, "train_step"),
        (1, "Fallback forward"), (2, "Fallback.fast forward"), (2, "Fallback.slow forward"),
        (1, "Fallback backward"), (2, "Fallback.slow backward"),
    ]


def test_a_retry_inside_except_is_ok_and_a_reraise_there_is_error(telemetry, tracer_factory):
    model, reraise = MaybeBoom(), Reraise()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        try:
            model(torch.randn(2, 4), explode=True)
        except ValueError:
            model(torch.randn(2, 4)).sum().backward()  # the OOM-retry pattern
            with pytest.raises(ValueError, match="boom"):
                reraise(torch.randn(2, 4))
        optimizer.step()
    assert [_status(s) for s in telemetry.by_name("MaybeBoom forward")] == ["ERROR", "UNSET"]
    assert [_status(s) for s in telemetry.by_name("MaybeBoom.lin forward")] == ["UNSET", "UNSET"]
    assert _status(telemetry.one("MaybeBoom.boom forward")) == "ERROR"
    assert _status(telemetry.one("MaybeBoom backward")) == "UNSET"
    failed = telemetry.one("Reraise forward")
    assert _status(failed) == "ERROR" and [e.name for e in failed.events] == ["exception"]


def test_tensor_hooks_added_without_handles_behave_as_register_hooks():
    """``_torch.add_tensor_hook`` (the tracker's hooks on call outputs and inputs): the same dict entry, key
    and firing order as ``Tensor.register_hook``, removed by popping it; under a torch function mode (or a
    tensor subclass that overrides it) ``register_hook`` itself, which the mode sees."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.hooks import RemovableHandle

    from commdebug_otel.capture._torch import add_tensor_hook, run_tensor_hook_first

    calls = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2  # no hooks dict yet: the autograd node must learn the one made
    next_id = RemovableHandle.next_id
    hooks, key = add_tensor_hook(y, lambda grad: calls.append("ours"))
    assert hooks is y._backward_hooks and key == next_id and RemovableHandle.next_id == next_id + 1
    y.register_hook(lambda grad: calls.append("torch's"))
    y.sum().backward()
    assert calls == ["ours", "torch's"]

    calls.clear()
    y = x * 2
    y.register_hook(lambda grad: calls.append("torch's"))
    added = add_tensor_hook(y, lambda grad: calls.append("ours"))
    run_tensor_hook_first(y, added)
    y.sum().backward()
    assert calls == ["ours", "torch's"]
    calls.clear()
    y = x * 2
    hooks, key = add_tensor_hook(y, lambda grad: calls.append("ours"))
    hooks.pop(key)  # what the step's close does
    y.sum().backward()
    assert calls == []
    hooks, key = add_tensor_hook(x, lambda grad: calls.append("leaf"))  # a leaf: no node
    (x * 2).sum().backward()
    assert calls == ["leaf"] and hooks is x._backward_hooks

    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    y = x * 2
    with Seen():
        handle = add_tensor_hook(y, lambda grad: None)
    assert type(handle) is RemovableHandle and seen == [torch.Tensor.register_hook]
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        add_tensor_hook(torch.ones(1), lambda grad: None)


@pytest.mark.parametrize("patterns", [{}, {"module_include": ("TwoBlocks", "TwoBlocks.l0*")},
                                      {"module_exclude": ("*.act",)}])
def test_module_include_and_exclude_hide_spans_and_keep_the_tree(telemetry, tracer_factory, patterns):
    """Hidden modules (``module_include``/``module_exclude``) get no span; their children go to the nearest shown
    ancestor; call indexes count every call of a shown module."""
    with tracer_factory(**patterns):
        train(TwoBlocks())
    names = sorted({span.name.rsplit(" ", 1)[0] for span in telemetry.spans() if span.name != "train_step"})
    every = ["TwoBlocks", "TwoBlocks.l0", "TwoBlocks.l0.a", "TwoBlocks.l0.act", "TwoBlocks.l0.b",
             "TwoBlocks.l1", "TwoBlocks.l1.a", "TwoBlocks.l1.act", "TwoBlocks.l1.b"]
    if not patterns:
        assert names == every
    elif "module_include" in patterns:
        assert names == ["TwoBlocks", "TwoBlocks.l0", "TwoBlocks.l0.a", "TwoBlocks.l0.act", "TwoBlocks.l0.b"]
    else:
        assert names == [name for name in every if not name.endswith(".act")]
        root = telemetry.one("TwoBlocks forward")
        assert telemetry.one("TwoBlocks.l1.b forward").parent.span_id == telemetry.one(
            "TwoBlocks.l1 forward").context.span_id
        assert telemetry.one("TwoBlocks.l1 forward").parent.span_id == root.context.span_id
    if "module_exclude" not in patterns:
        assert [s.attributes[semconv.MODULE_CALL_INDEX] for s in telemetry.by_name("TwoBlocks.l0.act forward")] \
            == [0, 1]
