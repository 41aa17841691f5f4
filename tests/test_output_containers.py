"""A module's outputs and inputs in any container: its backward span begins and ends as with plain tensors.

The module under test issues an all_reduce in its backward (an autograd function on its output, as
ColwiseParallel's input gradient): it is booked to the module's own backward span, as CommDebugMode
books it, whatever holds the output. Before, only tensors, tuples, lists and dicts were looked into:
a dataclass's tensor was not hooked and the collective went to the parent.
"""

import collections
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree

from models import AllReduceInBackward


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    steps: int = 1
    note: str = "plain fields are skipped"


@dataclasses.dataclass
class Outer:
    inner: Output
    extra: Any = None


class ModelOutputLike(collections.OrderedDict):
    """Hugging Face's ``ModelOutput``: an OrderedDict whose dataclass fields that are not None are its items."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


@dataclasses.dataclass
class CausalOutput(ModelOutputLike):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


Pair = collections.namedtuple("Pair", "hidden aux")


class Registered:
    """A custom container registered with torch's pytree (its tensor in a private attribute)."""

    def __init__(self, hidden):
        self._payload = hidden


_pytree.register_pytree_node(Registered, lambda r: ([r._payload], None), lambda values, _: Registered(values[0]))


class Slotted:
    __slots__ = ("hidden",)

    def __init__(self, hidden):
        self.hidden = hidden


class Plain:
    """Not registered anywhere: its tensors are in its ``__dict__``."""

    def __init__(self, hidden):
        self.parts = {"hidden": [hidden]}


try:
    import attrs
except ImportError:  # optional: its kinds are left out
    attrs = None
else:
    @attrs.define  # slots
    class AttrsOutput:
        hidden: torch.Tensor
        steps: int = 1

    @attrs.frozen(slots=False)  # a __dict__, frozen
    class AttrsFrozen:
        inner: AttrsOutput


# kind -> (wrap the module's output, take its tensor back out)
KINDS = {
    "dataclass": (lambda h: Output(h), lambda o: o.hidden),
    "dataclass in a dict": (lambda h: {"out": Outer(Output(h))}, lambda o: o["out"].inner.hidden),
    "ModelOutput-like": (lambda h: CausalOutput(logits=h), lambda o: o.logits),
    "namedtuple": (lambda h: Pair(h, None), lambda o: o.hidden),
    "pytree-registered": (lambda h: Registered(h), lambda o: o._payload),
    "slots": (lambda h: Slotted(h), lambda o: o.hidden),
    "plain object": (lambda h: Plain(h), lambda o: o.parts["hidden"][0]),
    "distribution": (lambda h: torch.distributions.Normal(h, 1.0), lambda o: o.mean),
}
if attrs is not None:
    KINDS["attrs class"] = (lambda h: AttrsOutput(h), lambda o: o.hidden)
    KINDS["frozen attrs class in an attrs class"] = (lambda h: AttrsFrozen(AttrsOutput(h)), lambda o: o.inner.hidden)


class Reduces(nn.Module):
    """Returns its output wrapped; the gradient of the output is all-reduced in its backward."""

    def __init__(self, wrap):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(AllReduceInBackward.apply(self.lin(x)))


class Parent(nn.Module):
    def __init__(self, wrap, unwrap):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.reduces = Reduces(wrap)
        self.unwrap = unwrap

    def forward(self, x):
        return self.unwrap(self.reduces(self.first(x)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_backward_collective_is_booked_to_the_module_whatever_holds_its_output(
        kind, telemetry, tracer_factory, single_rank_group):
    model = Parent(*KINDS[kind])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    owners = [(span.name, event.name) for span in telemetry.spans() for event in span.events]
    assert owners == [("Parent.reduces backward", "all_reduce")] * 2
    one_step = [(0, "train_step"), (1, "Parent forward"), (2, "Parent.first forward"),
                (2, "Parent.reduces forward"), (3, "Parent.reduces.lin forward"),
                (1, "Parent backward"), (2, "Parent.reduces backward"), (3, "Parent.reduces.lin backward"),
                (2, "Parent.first backward")]
    assert telemetry.tree() == one_step + one_step


class Consumes(nn.Module):
    """Takes its input in a container; its backward ends when the input's gradient is computed."""

    def __init__(self, unwrap):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.unwrap = unwrap

    def forward(self, held):
        return self.lin(self.unwrap(held))


class Feeds(nn.Module):
    def __init__(self, wrap, unwrap):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.consumes = Consumes(unwrap)
        self.wrap = wrap

    def forward(self, x):
        # The all_reduce runs after consumes' input gradient is computed: outside its backward, in Feeds'.
        return self.consumes(self.wrap(AllReduceInBackward.apply(self.first(x))))


@pytest.mark.parametrize("kind", ["dataclass", "dataclass in a dict", "ModelOutput-like", "pytree-registered"])
def test_a_backward_ends_when_the_gradient_of_an_input_in_a_container_is_computed(
        kind, telemetry, tracer_factory, single_rank_group):
    model = Feeds(*KINDS[kind])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    owners = [(span.name, event.name) for span in telemetry.spans() for event in span.events]
    assert owners == [("Feeds backward", "all_reduce")]
    consumed = telemetry.one("Feeds.consumes backward")
    event = telemetry.one("Feeds backward").events[0]
    assert consumed.end_time <= event.timestamp


def test_the_walk_is_bounded_on_cycles_and_huge_graphs(telemetry, tracer_factory):
    from commdebug_otel.capture.tracker import _MAX_CONTAINERS, _grad_tensors, _TooLarge

    cycle = Plain(torch.ones(1, requires_grad=True))
    cycle.parts["self"] = cycle
    with pytest.raises(_TooLarge) as cut:
        _grad_tensors(cycle, [])
    assert len(cut.value.found) >= 1
    wide = [[torch.ones(1, requires_grad=True)] for _ in range(_MAX_CONTAINERS - 1)]
    assert len(_grad_tensors(wide, [])) == _MAX_CONTAINERS - 1  # within the bound: every tensor
    with pytest.raises(_TooLarge):
        _grad_tensors([*wide, [1], [2]], [])
    assert _grad_tensors((torch.ones(1), None, 3, "x", torch.float32, nn.Linear(1, 1)), []) == []


class Odd:
    """Its unset slot's lookup raises something other than AttributeError."""

    __slots__ = ("unset",)

    def __getattr__(self, name):
        raise RuntimeError(name)


def test_an_object_that_raises_when_looked_into_is_skipped():
    from commdebug_otel.capture.tracker import _grad_tensors

    hidden = torch.ones(1, requires_grad=True)
    assert _grad_tensors((Odd(), hidden), []) == [hidden]


class Cache:
    """A Hugging Face ``DynamicCache``-like object passed to every layer: each layer appends its keys."""

    def __init__(self):
        self.keys = []


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        out = self.lin(x)
        cache.keys.append(out)
        return out


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Layer()
        self.second = Layer()

    def forward(self, x):
        cache = Cache()
        h = AllReduceInBackward.apply(self.first(x, cache=cache))
        return self.second(h, cache=cache), cache


def test_an_object_passed_along_to_a_module_is_not_its_input(telemetry, tracer_factory, single_rank_group):
    # The cache holds the first layer's output when the second layer runs: were it the second layer's input, its
    # backward would end only with that gradient, after the all_reduce that comes between the layers.
    model = Stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        out, _ = model(torch.ones(2, 4))
        out.sum().backward()
        optimizer.step()
    owners = [(span.name, event.name) for span in telemetry.spans() for event in span.events]
    assert owners == [("Stack backward", "all_reduce")]
    assert telemetry.tree() == [
        (0, "train_step"), (1, "Stack forward"), (2, "Stack.first forward"), (3, "Stack.first.lin forward"),
        (2, "Stack.second forward"), (3, "Stack.second.lin forward"), (1, "Stack backward"),
        (2, "Stack.second backward"), (3, "Stack.second.lin backward"), (2, "Stack.first backward"),
        (3, "Stack.first.lin backward")]
