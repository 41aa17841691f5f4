"""Modules that return their input (Identity, Dropout(p=0) or in eval, a gate returning x) have no backward span.

Their output's gradient is their input's: it is ready only when the module's
backward would end, so a backward span opened then would never close
(``commdebug.span.unmatched``), stretch its ancestors to the end of backward and
take the collectives of the enclosing module (FSDP2's reduce-scatter).
"""

import torch
from torch import nn

from commdebug_otel import semconv

from distributed import run_ranks
from models import AllReduceInBackward


class Gate(nn.Module):
    def forward(self, x):
        return x


class WithAux(nn.Module):
    """Returns its input and a new tensor; the new one is not used by the caller."""

    def forward(self, x):
        return x, x * 2


class Scale(nn.Module):
    """Modifies its input in place and returns it: a new autograd node, so a real backward."""

    def forward(self, x):
        return x.mul_(2)


class AsView(nn.Module):
    def forward(self, x):
        return x.view(-1, 4)


class SecondHalf(nn.Module):
    """Takes one output of a split and returns a sibling output of the same autograd node."""

    def forward(self, first, second):
        return second


class PassThroughs(nn.Module):
    def __init__(self):
        super().__init__()
        self.entry = nn.Identity()  # on a leaf input
        self.a = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.0)
        self.ident = nn.Identity()
        self.gate = Gate()
        self.kw_gate = Gate()  # called with its input as a keyword argument
        self.eval_drop = nn.Dropout(0.5).eval()
        self.aux = WithAux()
        self.view = AsView()
        self.scale = Scale()
        self.pick = SecondHalf()
        self.b = nn.Linear(4, 4)
        self.no_grad_input = nn.Identity()

    def forward(self, x):
        h = self.a(self.entry(x))
        h = self.eval_drop(self.kw_gate(x=self.gate(self.ident(self.drop(h)))))
        h, _ = self.aux(h)
        first, second = h.split(4, dim=-1)
        h = self.pick(first, second)
        h = self.scale(self.view(h) + 0)
        return self.b(h) + self.no_grad_input(torch.ones(4))


FORWARD = [
    "entry", "a", "drop", "ident", "gate", "kw_gate", "eval_drop", "aux", "pick", "view", "scale", "b", "no_grad_input",
]
# Only modules that computed something have a backward: the linears, the view and the in-place scale.
BACKWARD = ["b", "scale", "view", "a"]


def _train(steps):
    model = PassThroughs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()


def test_pass_through_modules_have_no_backward_span_and_nothing_is_unmatched(telemetry, tracer_factory):
    with tracer_factory():
        _train(2)
    one_step = [(0, "train_step"), (1, "PassThroughs forward"),
                *[(2, f"PassThroughs.{name} forward") for name in FORWARD],
                (1, "PassThroughs backward"),
                *[(2, f"PassThroughs.{name} backward") for name in BACKWARD]]
    assert telemetry.tree() == one_step + one_step
    assert [s.name for s in telemetry.spans() if s.attributes.get(semconv.SPAN_UNMATCHED)] == []
    # The root's backward ends with its first module's (a's input is the leaf entry returns).
    for root, first in zip(telemetry.by_name("PassThroughs backward"), telemetry.by_name("PassThroughs.a backward")):
        assert first.end_time <= root.end_time


class Sibling(nn.Module):
    """Returns a tensor made outside the call: another output slot of its input's node."""

    def forward(self, first):
        return self.other


def test_an_output_gradient_after_the_input_gradient_opens_no_backward(telemetry, tracer_factory):
    # Both gradients reach the split's node at once, and the input's hook (registered
    # first) fires first: the call's backward has ended before its output's hook.
    sibling = Sibling()
    leaf = torch.randn(2, 8, requires_grad=True)
    optimizer = torch.optim.SGD([leaf], lr=0.1)
    with tracer_factory():
        first, sibling.other = (leaf * 2).split(4, dim=-1)
        (sibling(first) + first).sum().backward()
        optimizer.step()
    assert telemetry.tree() == [(0, "train_step"), (1, "Sibling forward")]


# ------------------------------------------------------------------ FSDP2, two gloo ranks
class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = nn.Linear(dim, dim)
        self.resid_dropout = nn.Dropout(0.0)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Linear(dim, dim)
        self.ffn_dropout = nn.Dropout(0.0)

    def forward(self, x):
        h = x + self.resid_dropout(self.attention(self.attention_norm(x)))
        return h + self.ffn_dropout(self.ffn(self.ffn_norm(h)))


class DropoutTransformer(nn.Module):
    def __init__(self, dim=16, layers=2):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.embed_dropout = nn.Dropout(0.0)
        self.layers = nn.ModuleList(_Block(dim) for _ in range(layers))
        self.output = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.embed_dropout(self.embed(x))
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


def _fsdp_dropout(rank, world_size):
    from test_distributed import _span_view, counted_by_both
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = DropoutTransformer()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # FSDP2's lazy init before counting
    ours, theirs, telemetry = counted_by_both(step)
    return {"ours": ours, "torch": theirs, "spans": _span_view(telemetry), "tree": telemetry.tree()}


def _without_empty(counts):
    return {fqn: kept for fqn, by_pass in counts.items() if (kept := {k: v for k, v in by_pass.items() if v})}


def test_fsdp2_blocks_with_dropout_zero_book_their_reduce_scatter_to_the_block():
    root = "DropoutTransformer"  # the user's class, not fully_shard's FSDPDropoutTransformer
    torch_root = "FSDPDropoutTransformer"  # torch's CommDebugMode keys by type(root).__name__
    block = ["attention_norm", "attention", "resid_dropout", "ffn_norm", "ffn", "ffn_dropout"]
    for result in run_ranks(_fsdp_dropout, 2):
        spans = result["spans"]
        assert [s["name"] for s in spans if s["attributes"].get(semconv.SPAN_UNMATCHED)] == []
        backward = [(depth, name) for depth, name in result["tree"] if name.endswith("backward")]
        assert backward == [
            (1, f"{root} backward"), (2, f"{root}.output backward"),
            *[entry for index in (1, 0) for entry in [
                (2, f"{root}.layers.{index} backward"),
                (3, f"{root}.layers.{index}.ffn backward"), (3, f"{root}.layers.{index}.ffn_norm backward"),
                (3, f"{root}.layers.{index}.attention backward"),
                (3, f"{root}.layers.{index}.attention_norm backward")]],
            (2, f"{root}.embed backward"),
        ]
        forward = [(depth, name) for depth, name in result["tree"] if name.endswith("forward")]
        assert forward == [
            (1, f"{root} forward"), (2, f"{root}.embed forward"), (2, f"{root}.embed_dropout forward"),
            *[entry for index in (0, 1) for entry in [
                (2, f"{root}.layers.{index} forward"),
                *[(3, f"{root}.layers.{index}.{name} forward") for name in block]]],
            (2, f"{root}.output forward"),
        ]
        owners = {s["name"]: [name for name, _ in s["events"]] for s in spans if s["events"]}
        # Every collective's owner; none is on a dropout. Each FSDP unit's post-backward
        # reduce-scatter is on the unit's backward span, layer 1's after the all-gather it
        # prefetched for layer 0; the root's backward prefetch is on its last module.
        assert owners == {
            f"{root} forward": ["all_gather"],
            f"{root}.layers.0 forward": ["all_gather"],
            f"{root}.layers.1 forward": ["all_gather"],
            f"{root}.output backward": ["all_gather"],
            f"{root}.layers.1 backward": ["all_gather", "reduce_scatter"],
            f"{root}.layers.0 backward": ["reduce_scatter"],
            f"{root} backward": ["reduce_scatter"],
        }
        # torch books a unit's reduce-scatter to a leaf of the unit, and the root's prefetch
        # all-gather to the root (docs/comparison.md); every other count is the same.
        ours, theirs = result["ours"], result["torch"]
        assert ours[f"{torch_root}.output"]["backward"].pop("c10d._allgather_base_") == 1
        for leaf in (f"{torch_root}.layers.0.attention_norm", f"{torch_root}.layers.1.attention_norm",
                     f"{torch_root}.embed"):
            assert theirs.pop(leaf) == {"backward": {"c10d._reduce_scatter_base_": 1}}
        assert _without_empty(ours) == _without_empty(theirs)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y=None):
        return self.lin(x * y)


class KeywordCalls(nn.Module):
    """Submodules called with keyword inputs (as Hugging Face layers call their attention)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.kw_only = Mix()
        self.mixed = Mix()

    def forward(self, x):
        h = self.kw_only(x=self.a(x), y=self.b(x))
        return self.mixed(h, y=self.b(x))


def test_a_backward_ends_when_its_keyword_inputs_gradients_are_computed(telemetry, tracer_factory):
    model = KeywordCalls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        model(torch.randn(2, 4, requires_grad=True) * 1).sum().backward()  # non-leaf: a and b have an end
        optimizer.step()
    spans = {(s.name, s.attributes[semconv.MODULE_CALL_INDEX]): s for s in telemetry.spans() if s.name != "train_step"}
    assert not any(s.attributes.get(semconv.SPAN_UNMATCHED) for s in spans.values())

    def end(name, index=0):
        return spans[(f"KeywordCalls.{name} backward", index)].end_time
    # b runs twice: call 0 feeds kw_only's keyword y, call 1 mixed's. A module's backward ends
    # (its input gradients are computed) before the modules that made its inputs end theirs,
    # not at the end of the backward pass.
    assert end("kw_only") < min(end("a"), end("b", 0))
    assert end("mixed") < min(end("kw_only"), end("b", 1))


def test_keyword_inputs_replaced_by_a_pre_hook_keep_the_hooks_backward_in_the_span(
        telemetry, tracer_factory, single_rank_group):
    outer = nn.Sequential()
    outer.inner = Mix()

    def wrap(module, args, kwargs):  # an FSDP2 / PrepareModuleInput-style pre-hook on keyword inputs
        return args, {name: AllReduceInBackward.apply(value) for name, value in kwargs.items()}

    outer.inner.register_forward_pre_hook(wrap, with_kwargs=True)
    outer.forward = lambda x: outer.inner(x=x * 1, y=x * 2)
    optimizer = torch.optim.SGD(outer.parameters(), lr=0.1)
    with tracer_factory():
        outer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    owners = [(s.name, e.name) for s in telemetry.spans() for e in s.events]
    assert owners == [("Sequential.inner backward", "all_reduce")] * 2


class FrozenWithAdapter(nn.Module):
    """A frozen layer whose own forward hook adds a trainable adapter to its output in place (LoRA-like)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.lora = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.base.register_forward_hook(lambda module, args, out: out.add_(self.lora(args[0])))

    def forward(self, x):
        return self.head(self.base(x))


def test_an_output_its_module_changes_in_place_after_our_early_hook_gets_its_backward(telemetry, tracer_factory):
    """The frozen layer's output needs no gradient when our early hook sees it; its own hook makes it
    one that does, in place (the same tensor object): the late hook must still hook it."""
    model = FrozenWithAdapter()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with tracer_factory():
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    one_step = [(0, "train_step"), (1, "FrozenWithAdapter forward"), (2, "FrozenWithAdapter.base forward"),
                (3, "FrozenWithAdapter.lora forward"), (2, "FrozenWithAdapter.head forward"),
                (1, "FrozenWithAdapter backward"), (2, "FrozenWithAdapter.head backward"),
                (2, "FrozenWithAdapter.base backward"), (3, "FrozenWithAdapter.lora backward")]
    assert telemetry.tree() == one_step + one_step
