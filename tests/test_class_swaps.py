"""Module names as the user wrote them where torch swaps a module's class (``fully_shard``'s ``FSDPNet``,
composable ``replicate``'s ``DDPNet``, its FSDP-based form's ``ReplicateNet``): spans, ``torch.module.type``,
metric labels and ``commdebug-otel signature`` say ``Net``; the CommDebugMode drop-in keeps torch's keys."""

import glob
import json
import os

import pytest
import torch
from torch import nn

from commdebug_otel import semconv
from commdebug_otel.capture._torch import user_class, user_class_name

from distributed import run_ranks


class Net(nn.Module):
    """Two blocks and a head: ``Net.blocks.0``, ``Net.blocks.1``, ``Net.head``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


NET_TYPE = f"{__name__}.Net"
LINEAR_TYPE = "torch.nn.modules.linear.Linear"
FORWARD = ["Net forward", "Net.blocks.0 forward", "Net.blocks.1 forward", "Net.head forward"]
BACKWARD = ["Net backward", "Net.head backward", "Net.blocks.1 backward", "Net.blocks.0 backward"]


def _step(model, optimizer):
    def step():
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def _spans(telemetry):
    """``[(name, parent name, torch.module.type)]`` of the module spans, depth first."""
    by_name = {span.name: span for span in telemetry.spans()}
    return [(name, telemetry.parent_name(by_name[name]), by_name[name].attributes.get(semconv.MODULE_TYPE))
            for _, name in telemetry.tree() if name in by_name and " " in name]


def _swapped(rank, world_size, out_dir):
    """Each class swap on the same model; under ``fully_shard`` also a run written to files."""
    from test_distributed import counted_by_both
    from torch.distributed._composable import replicate
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commdebug_otel import CommTracer, Settings

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    results = {}
    for name in ("fully_shard", "replicate", "fsdp_replicate"):
        torch.manual_seed(0)
        model = Net()
        if name == "fully_shard":
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif name == "replicate":
            replicate(model)
        else:
            fsdp_replicate(model, mesh=mesh)
        step = _step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step()  # lazy initialisation before counting; DDP rebuilds its buckets (a broadcast) on the second
        step()
        if name == "fully_shard":
            tracer = CommTracer(Settings(output_dir=out_dir, metric_module_depth=3))
            with tracer:
                for _ in range(3):
                    step()
            tracer.telemetry.shutdown()
        ours, theirs, telemetry = counted_by_both(step)
        results[name] = {"class": type(model).__name__, "ours": ours, "torch": theirs, "spans": _spans(telemetry)}
    return results


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("fsdp2"))
    return out_dir, run_ranks(_swapped, 2, out_dir)


def _walk_labels(node, key, found):
    """Every value of the attribute ``key`` anywhere in an OTLP-JSON document."""
    if isinstance(node, dict):
        if node.get("key") == key:
            found.add(node["value"]["stringValue"])
        for value in node.values():
            _walk_labels(value, key, found)
    elif isinstance(node, list):
        for value in node:
            _walk_labels(value, key, found)
    return found


def test_fsdp2_spans_name_the_users_class(swapped):
    _, results = swapped
    for result in results:
        fsdp2 = result["fully_shard"]
        assert fsdp2["class"] == "FSDPNet"  # what fully_shard made of it
        assert fsdp2["spans"] == [
            ("Net forward", "train_step", NET_TYPE),
            *[(name, "Net forward", LINEAR_TYPE) for name in FORWARD[1:]],
            ("Net backward", "train_step", NET_TYPE),
            *[(name, "Net backward", LINEAR_TYPE) for name in BACKWARD[1:]],
        ]


def test_fsdp2_files_metrics_and_signature_name_the_users_class(swapped, tmp_path, capsys):
    from commdebug_otel.cli import main
    from commdebug_otel.offline.summary import load_spans, module_counts

    out_dir, _ = swapped
    (run,) = glob.glob(os.path.join(out_dir, "run-*"))
    spans = load_spans(sorted(glob.glob(os.path.join(run, "traces-rank*.jsonl"))))
    module_spans = sorted({span["name"] for span in spans if span["name"] != "train_step"})
    assert module_spans == sorted(FORWARD + BACKWARD)
    assert sorted(module_counts(spans)) == ["Global", "Net", "Net.blocks.0", "Net.blocks.1", "Net.head"]
    for rank in (0, 1):
        with open(os.path.join(run, f"metrics-rank{rank}.jsonl")) as lines:
            labels = set()
            for line in lines:
                _walk_labels(json.loads(line), semconv.MODULE_FQN, labels)
        # The module label (depth 3): the modules that issued collectives, as the spans name them.
        assert labels == {"Net", "Net.blocks.0", "Net.blocks.1", "Net.head"}
    out = tmp_path / "signature.json"
    assert main(["signature", run, "-o", str(out)]) == 0
    entries = json.loads(out.read_text())["entries"]
    assert sorted({(entry["module"], entry["pass"], entry["op"]) for entry in entries}) == [
        ("Net", "backward", "reduce_scatter"), ("Net", "forward", "all_gather"),
        ("Net.blocks.0", "forward", "all_gather"), ("Net.blocks.1", "backward", "all_gather"),
        ("Net.blocks.1", "backward", "reduce_scatter"), ("Net.blocks.1", "forward", "all_gather"),
        ("Net.head", "backward", "all_gather")]


# torch's counts on this model, and ours: keyed the same (torch's names: type(root).__name__), the counts apart
# from the documented bookings (docs/comparison.md): torch books an FSDP unit's post-backward reduce-scatter
# (and the FSDP-based replicate's all_reduce) to the last module whose backward began (blocks.0), we to the unit
# (blocks.0's, whose input needs no gradient, runs in the root's final callback: the root's); the root's
# backward prefetch all-gather we book to the root's last module (head), whose output the root returns as is.
_AG, _RS, _AR = "c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allreduce_"
_FSDP_ROOT = {"backward": {_AG: 2, _RS: 3}, "forward": {_AG: 3}}
_FSDP_BLOCK_1 = {"backward": {_AG: 1, _RS: 1}, "forward": {_AG: 1}}
_EXPECTED_COUNTS = {
    "fully_shard": (
        {"Global": _FSDP_ROOT, "FSDPNet": _FSDP_ROOT, "FSDPNet.blocks.0": {"backward": {}, "forward": {_AG: 1}},
         "FSDPNet.blocks.1": _FSDP_BLOCK_1, "FSDPNet.head": {"backward": {_AG: 1}, "forward": {}}},
        {"Global": _FSDP_ROOT, "FSDPNet": _FSDP_ROOT,
         "FSDPNet.blocks.0": {"backward": {_RS: 2}, "forward": {_AG: 1}}, "FSDPNet.blocks.1": _FSDP_BLOCK_1}),
    "replicate": (
        {"Global": {"backward": {_AR: 1}, "forward": {}}, "DDPNet": {"backward": {_AR: 1}, "forward": {}},
         "DDPNet.blocks.0": {"backward": {_AR: 1}, "forward": {}}},
        {"Global": {"backward": {_AR: 1}}, "DDPNet": {"backward": {_AR: 1}},
         "DDPNet.blocks.0": {"backward": {_AR: 1}}}),
    "fsdp_replicate": (
        {"Global": {"backward": {_AR: 1}, "forward": {}}, "ReplicateNet": {"backward": {_AR: 1}, "forward": {}}},
        {"Global": {"backward": {_AR: 1}}, "ReplicateNet": {"backward": {_AR: 1}},
         "ReplicateNet.blocks.0": {"backward": {_AR: 1}}}),
}


@pytest.mark.parametrize("swap", ["fully_shard", "replicate", "fsdp_replicate"])
def test_drop_in_keys_are_torchs_while_its_spans_name_the_users_class(swapped, swap):
    _, results = swapped
    for result in results:
        found = result[swap]
        assert (found["ours"], found["torch"]) == _EXPECTED_COUNTS[swap]
        assert found["class"] == next(iter(found["torch"].keys() - {"Global"})).split(".")[0]
        assert [name for name, _, _ in found["spans"]] == FORWARD + BACKWARD
        assert {module_type for _, _, module_type in found["spans"]} == {NET_TYPE, LINEAR_TYPE}


class _Mixin:
    pass


class _OtherMixin:
    pass


class FSDPLike(_Mixin, Net):
    """A user's own subclass shaped like torch's swaps: it keeps its name."""


def test_user_classes_keep_their_names(tracer_factory, telemetry):
    made = type("FSDPNet", (_Mixin, Net), {})  # made by type() like fully_shard's, but in the user's code
    with tracer_factory():
        for cls in (made, FSDPLike):
            cls()(torch.randn(3, 4))
    roots = [name for depth, name in telemetry.tree() if depth == 0]
    assert roots == ["FSDPNet forward", "FSDPLike forward"]
    assert telemetry.one("FSDPNet.blocks.0 forward").attributes[semconv.MODULE_TYPE] == LINEAR_TYPE
    assert telemetry.one("FSDPNet forward").attributes[semconv.MODULE_TYPE] == f"{__name__}.FSDPNet"
    assert telemetry.one("FSDPLike forward").attributes[semconv.MODULE_TYPE] == f"{__name__}.FSDPLike"


def test_user_class_walks_past_torch_generated_classes_only():
    # Made as torch's swaps make them: by type() inside torch's package, over the user's class.
    generated = type("FSDPNet", (_Mixin, Net), {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"})
    stacked = type("DDPFSDPNet", (_OtherMixin, generated), {"__module__": "torch.distributed._composable.replicate"})
    assert user_class(generated) is Net and user_class(stacked) is Net
    assert user_class_name(stacked) == NET_TYPE
    # torch's own classes of the same shape, defined by class statements, stay as they are.
    for cls in (nn.LazyLinear, nn.LazyConv2d, nn.Linear, FSDPLike, Net):
        assert user_class(cls) is cls
    renamed = type("Net", (_Mixin, Net), {"__module__": "torch.nn"})  # no prefix: not a swap
    assert user_class(renamed) is renamed


class _AllReduceNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        torch.distributed.all_reduce(out.detach())
        return out


def test_compiled_root_spans_name_the_users_class_and_the_drop_in_torchs(single_rank_group):
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from commdebug_otel import CommDebugMode
    from commdebug_otel.testing import InMemoryTelemetry

    model = torch.compile(_AllReduceNet(), backend="eager")
    model(torch.randn(3, 4))
    theirs = TorchCommDebugMode()
    with theirs:
        model(torch.randn(3, 4))
    telemetry = InMemoryTelemetry()
    ours = CommDebugMode(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    with ours:
        model(torch.randn(3, 4))
    forward = {"forward": {"c10d.allreduce_": 1}, "backward": {}}

    def counts(mode):
        return {fqn: {key: {str(op): n for op, n in ops.items()} for key, ops in by_pass.items()}
                for fqn, by_pass in mode.comm_module_counts.items()}

    # torch names the root OptimizedModule and runs it eagerly under its mode (dynamo skips the frame), with
    # _orig_mod one level down; the drop-in keys its root the same, with nothing inside (docs/comparison.md).
    assert counts(theirs) == {"Global": forward, "OptimizedModule": forward, "OptimizedModule._orig_mod": forward}
    assert counts(ours) == {"Global": forward, "OptimizedModule": forward}
    assert [name for _, name in telemetry.tree()] == ["_AllReduceNet forward"]
    assert telemetry.one("_AllReduceNet forward").attributes[semconv.MODULE_TYPE] == f"{__name__}._AllReduceNet"


def test_parametrized_modules_name_the_users_class(tracer_factory, telemetry):
    from torch.nn.utils import parametrize

    root, model = nn.Linear(4, 4), Net()
    parametrize.register_parametrization(root, "weight", nn.Identity())  # ParametrizedLinear
    parametrize.register_parametrization(model.blocks[0], "weight", nn.Identity())
    assert (type(root).__name__, type(model.blocks[0]).__name__) == ("ParametrizedLinear", "ParametrizedLinear")
    with tracer_factory():
        root(torch.randn(3, 4))
        model(torch.randn(3, 4))
    spans = {span.name: span.attributes[semconv.MODULE_TYPE] for span in telemetry.spans()}
    # The parametrizations run as modules of their own when the weight is read.
    weight = {".parametrizations.weight forward": "torch.nn.utils.parametrize.ParametrizationList",
              ".parametrizations.weight.0 forward": "torch.nn.modules.linear.Identity"}
    assert spans == {"Linear forward": LINEAR_TYPE, **{f"Linear{name}": kind for name, kind in weight.items()},
                     "Net forward": NET_TYPE, **{name: LINEAR_TYPE for name in FORWARD[1:]},
                     **{f"Net.blocks.0{name}": kind for name, kind in weight.items()}}
