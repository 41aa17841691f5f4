"""Module-tracking hard cases, each with exact expected spans, and a long run."""

import gc
import threading

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from commdebug_otel import semconv

from models import Block, Checkpointed


def step(model, optimizer, x, **backward_kwargs):
    model(x).sum().backward(**backward_kwargs)
    optimizer.step()


class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, depth=2):
        x = self.lin(x)
        return self(x, depth - 1) if depth else x


def test_recursive_module(telemetry, tracer_factory):
    model = Recursive()
    with tracer_factory():
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(1, 2, requires_grad=True))
    forward = [(depth, name) for depth, name in telemetry.tree() if name.endswith("forward")]
    assert forward == [(1, "Recursive forward"), (2, "Recursive.lin forward"),
                       (2, "Recursive forward"), (3, "Recursive.lin forward"),
                       (3, "Recursive forward"), (4, "Recursive.lin forward")]
    calls = [s.attributes[semconv.MODULE_CALL_INDEX] for s in telemetry.by_name("Recursive forward")]
    assert sorted(calls) == [0, 1, 2]
    backward = [(depth, name) for depth, name in telemetry.tree() if name.endswith("backward")]
    assert backward == [(1, "Recursive backward"), (2, "Recursive backward"), (3, "Recursive backward"),
                        (4, "Recursive.lin backward"), (3, "Recursive.lin backward"),
                        (2, "Recursive.lin backward")]


def test_two_roots_of_the_same_class(telemetry, tracer_factory):
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with tracer_factory():
        (first(torch.ones(1, 2)) + second(torch.ones(1, 2))).sum().backward()
        optimizer.step()
    assert telemetry.tree() == [(0, "train_step"), (1, "Linear forward"), (1, "Linear forward"),
                                (1, "Linear backward"), (1, "Linear backward")]
    assert sorted(s.attributes[semconv.MODULE_CALL_INDEX] for s in telemetry.by_name("Linear forward")) == [0, 1]


class PartlyFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.side = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        x = self.frozen(x)
        with torch.no_grad():
            self.side(x)
        return self.head(x)


def test_frozen_and_no_grad_submodules_have_no_backward(telemetry, tracer_factory):
    model = PartlyFrozen()
    with tracer_factory():
        step(model, torch.optim.SGD(model.head.parameters(), lr=0.1), torch.ones(1, 2))
    assert telemetry.tree() == [
        (0, "train_step"),
        (1, "PartlyFrozen forward"), (2, "PartlyFrozen.frozen forward"),
        (2, "PartlyFrozen.side forward"), (2, "PartlyFrozen.head forward"),
        (1, "PartlyFrozen backward"), (2, "PartlyFrozen.head backward")]
    assert not any(semconv.SPAN_UNMATCHED in s.attributes for s in telemetry.spans())


def test_backward_twice_on_one_graph(telemetry, tracer_factory):
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        loss = model(torch.ones(1, 4, requires_grad=True)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        optimizer.step()
    backward = telemetry.by_name("Block backward")
    assert [s.attributes[semconv.MODULE_CALL_INDEX] for s in backward] == [0, 1]
    assert len(telemetry.by_name("Block.a backward")) == 2
    assert [telemetry.parent_name(s) for s in telemetry.by_name("Block.a backward")] == ["Block backward"] * 2


def test_reentrant_checkpoint_on_a_plain_model(telemetry, tracer_factory):
    model = Checkpointed(reentrant=True)
    with tracer_factory():
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(1, 4, requires_grad=True))
    recompute = telemetry.one("Checkpointed.block recompute")
    assert telemetry.parent_name(recompute) == "Checkpointed backward"
    assert [telemetry.parent_name(s) for s in telemetry.by_name("Checkpointed.block.a recompute")] == [
        "Checkpointed.block recompute"]
    assert len(telemetry.by_name("Checkpointed.block forward")) == 1
    assert not any(semconv.SPAN_UNMATCHED in s.attributes for s in telemetry.spans())


class Ephemeral(nn.Module):
    def forward(self, x):
        return nn.Linear(2, 2)(x)  # freed as soon as forward returns


def test_module_deleted_before_its_backward(telemetry, tracer_factory):
    model = Ephemeral()
    with tracer_factory():
        out = model(torch.ones(1, 2, requires_grad=True))
        gc.collect()
        out.sum().backward()
    assert [name for _, name in telemetry.tree()] == [
        "train_step", "Ephemeral forward", "Linear forward", "Ephemeral backward", "Linear backward"]


def test_meta_tensor_collectives_are_marked_not_counted(telemetry, tracer_factory, single_rank_group):
    class Meta(nn.Module):
        def forward(self, x):
            return funcol.all_reduce(torch.empty(4, 4, device="meta"), "sum", single_rank_group) + 0 * x.sum()

    with tracer_factory():
        Meta()(torch.ones(1))
    [event] = telemetry.one("Meta forward").events
    assert event.attributes[semconv.COLLECTIVE_FAKE] is True
    assert telemetry.metric_points(semconv.METRIC_OPERATIONS) == []


def test_collectives_from_another_thread_are_counted_but_not_owned(telemetry, tracer_factory,
                                                                   single_rank_group):
    class Threaded(nn.Module):
        def forward(self, x):
            worker = threading.Thread(target=dist.all_reduce, args=(x.detach().clone(),))
            worker.start()
            worker.join()
            dist.all_reduce(x.detach())
            return x

    with tracer_factory():
        Threaded()(torch.ones(2))
    # The training thread's open span is not the worker's: no event, and the metric
    # point has pass "none" (docs/troubleshooting.md).
    assert [e.name for e in telemetry.one("Threaded forward").events] == ["all_reduce"]
    counts = {labels[semconv.MODULE_PASS]: count
              for labels, count in telemetry.metric_points(semconv.METRIC_OPERATIONS)}
    assert counts == {"forward": 1, "none": 1}


def test_a_thousand_traced_steps_leave_nothing_open_and_no_state_growth(telemetry, tracer_factory,
                                                                       single_rank_group):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block(2)

        def forward(self, x):
            out = self.block(x)
            dist.all_reduce(out.detach())
            return out

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = tracer_factory()

    def sizes():
        return tracer.state_sizes()

    with tracer:
        for index in range(1000):
            step(model, optimizer, torch.ones(1, 2, requires_grad=True))
            if index == 10:
                early = sizes()
            if index % 100 == 0:
                telemetry.clear()
        late = sizes()
    assert early == late
    assert late["open forward records"] == late["open backward records"] == 0
    assert telemetry.by_name("train_step")[-1].attributes[semconv.STEP] == 999
    assert not any(semconv.SPAN_UNMATCHED in s.attributes for s in telemetry.spans())


def test_a_model_copied_or_saved_while_traced(telemetry, tracer_factory):
    # copy.deepcopy(model) (an EMA copy) and torch.save(model) reached the tracer through our forward hook
    # and raised "cannot pickle '_thread.lock' object" into the script.
    import copy
    import io

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        ema = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        assert torch.equal(ema(torch.ones(1, 4)), loaded(torch.ones(1, 4)))
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert [span.attributes[semconv.STEP] for span in telemetry.by_name("train_step")] == [0, 1]
    assert len(telemetry.by_name("Sequential.1 backward")) == 2  # the model's own spans go on


def test_collectives_on_fake_tensors_are_neither_events_nor_numbered(telemetry, tracer_factory, single_rank_group):
    # AOTAutograd traces a compiled block's backward on FakeTensors at its first run: those collectives took
    # sequence numbers and became events (torch.collective.fake) on the block's backward span.
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Traced(nn.Module):
        def forward(self, x):
            with FakeTensorMode():
                funcol.all_reduce(torch.empty(4), "sum", single_rank_group)
            return funcol.all_reduce(x, "sum", single_rank_group)

    with tracer_factory():
        Traced()(torch.ones(2))
    [event] = telemetry.one("Traced forward").events
    assert event.attributes[semconv.COLLECTIVE_SEQ] == 0 and semconv.COLLECTIVE_FAKE not in event.attributes
    [(_, count)] = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert count == 1


class _ColwiseLike(nn.Linear):
    """A linear layer that all-reduces its input gradient, as ColwiseParallel does."""

    def forward(self, x):
        from models import AllReduceInBackward

        return super().forward(AllReduceInBackward.apply(x))


class _AllReducingBlock(nn.Module):
    """A checkpointed block whose second layer all-reduces its input gradient in backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = _ColwiseLike(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _reentrant_counts(rank, world_size):
    from test_distributed import _torch_nonzero, counted_by_both

    torch.manual_seed(0)
    model = Checkpointed(_AllReducingBlock(), reentrant=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()

    ours, theirs, telemetry = counted_by_both(step)
    return {"ours": _torch_nonzero(ours), "torch": theirs, "tree": telemetry.tree()}


def test_reentrant_checkpoint_books_inner_backward_collectives_as_commdebugmode_does():
    from distributed import run_ranks

    for result in run_ranks(_reentrant_counts, 2):
        assert result["ours"] == result["torch"]
        assert result["ours"]["Checkpointed.block.b"] == {"backward": {"c10d.allreduce_": 1}}
        backward = [(depth, name) for depth, name in result["tree"] if name.endswith("backward")]
        assert backward == [(1, "Checkpointed backward"), (2, "Checkpointed.head backward"),
                            (2, "Checkpointed.block backward"), (3, "Checkpointed.block.b backward"),
                            (3, "Checkpointed.block.a backward")]
