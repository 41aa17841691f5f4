"""torch.compile per block: a compiled block is one span under its own FQN, holding its compiled code's collectives.

Compile is slow on small CPUs: models here are tiny and each test compiles at most two blocks.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.utils.checkpoint import checkpoint

from commdebug_otel import semconv

from distributed import run_ranks
from models import Block, Net


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles fresh modules: without a reset, dynamo's per-code cache limit is reached."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # "unique_graphs": this test's compiles only
    yield
    torch._dynamo.reset()


class ReduceBlock(Block):
    """A block whose compiled code issues a functional all_reduce (of a detached copy: no backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + funcol.all_reduce(out.detach(), "sum", dist.group.WORLD)


REDUCE_BLOCK = f"{__name__}.ReduceBlock"


def train(model, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(1, 4, requires_grad=True)).sum().backward()
        optimizer.step()


EAGER_LAYER_1 = [(2, "Net.layers.1 forward"), (3, "Net.layers.1.a forward"), (3, "Net.layers.1.act forward"),
                 (3, "Net.layers.1.b forward"), (3, "Net.layers.1.act forward")]
EAGER_LAYER_1_BACKWARD = [(2, "Net.layers.1 backward"), (3, "Net.layers.1.act backward"),
                          (3, "Net.layers.1.b backward"), (3, "Net.layers.1.act backward"),
                          (3, "Net.layers.1.a backward")]
# layers.0 compiled, layers.1 eager: one step.
MIXED_TREE = [(0, "train_step"), (1, "Net forward"), (2, "Net.layers.0 forward"), *EAGER_LAYER_1,
              (1, "Net backward"), *EAGER_LAYER_1_BACKWARD, (2, "Net.layers.0 backward")]


def assert_compiled_spans(telemetry, fqn, module_type="models.Block", passes=("forward", "backward")):
    """Exactly ``fqn``'s passes are marked compiled, typed as the original module; no FQN has ``_orig_mod``."""
    for pass_ in passes:
        for span in telemetry.by_name(f"{fqn} {pass_}"):
            assert span.attributes[semconv.MODULE_COMPILED] is True
            assert span.attributes[semconv.MODULE_TYPE] == module_type
    assert not any("_orig_mod" in span.attributes.get(semconv.MODULE_FQN, "") for span in telemetry.spans())
    compiled = {span.name for span in telemetry.spans() if semconv.MODULE_COMPILED in span.attributes}
    assert compiled == {f"{fqn} {pass_}" for pass_ in passes}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_block_is_one_span_under_its_own_fqn(telemetry, tracer_factory, single_rank_group, backend):
    model = Net(ReduceBlock)
    model.layers[0] = torch.compile(model.layers[0], backend=backend)
    with tracer_factory():
        train(model)
    assert telemetry.tree() == MIXED_TREE * 2
    assert_compiled_spans(telemetry, "Net.layers.0", REDUCE_BLOCK)
    # The all_reduce its compiled code issues, as Inductor issues it (in place); none from compiling.
    op = "_c10d_functional.all_reduce_.default" if backend == "inductor" else "_c10d_functional.all_reduce.default"
    for span in telemetry.by_name("Net.layers.0 forward"):
        assert [(e.name, e.attributes[semconv.OP_NAME]) for e in span.events] == [("all_reduce", op)]
        assert not any(semconv.COLLECTIVE_FAKE in e.attributes for e in span.events)
    for span in telemetry.by_name("Net.layers.1 forward"):
        assert [e.name for e in span.events] == ["all_reduce"]
    assert [value for _, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)] == [4]
    # Our hooks are traced as no-ops: one graph, compiled once, for both steps.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not any(semconv.SPAN_UNMATCHED in span.attributes for span in telemetry.spans())


def test_a_block_compiled_in_place(telemetry, tracer_factory, single_rank_group):
    model = Net(ReduceBlock)
    model.layers[0].compile(backend="eager")
    with tracer_factory() as tracer:
        train(model)
        assert tracer.state_sizes()["compiled calls wrapped"] == 1
    assert telemetry.tree() == MIXED_TREE * 2
    assert_compiled_spans(telemetry, "Net.layers.0", REDUCE_BLOCK)
    for span in telemetry.by_name("Net.layers.0 forward"):
        assert [e.name for e in span.events] == ["all_reduce"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # Stopping puts torch's compiled call back: no span of ours afterwards.
    assert type(model.layers[0]._compiled_call_impl).__name__ != "_CompiledCall"
    assert tracer.state_sizes()["compiled calls wrapped"] == 0
    telemetry.clear()
    train(model, steps=1)
    assert telemetry.spans() == []


def test_whole_model_compile_keeps_the_root_span(telemetry, tracer_factory):
    compiled = torch.compile(Block(), backend="eager")
    with tracer_factory():
        train(compiled)
    assert telemetry.tree() == [(0, "train_step"), (1, "Block forward"), (1, "Block backward")] * 2
    assert_compiled_spans(telemetry, "Block")


def test_a_block_compiled_in_place_inside_a_compiled_model_is_traced_through(telemetry, tracer_factory):
    """Our wrapper of the block's compiled call is itself traced by dynamo: fullgraph holds, one graph."""
    net = Net()
    net.layers[0].compile(backend="eager")
    with tracer_factory() as tracer:
        train(torch.compile(net, backend="eager", fullgraph=True))
        assert tracer.state_sizes()["compiled calls wrapped"] == 1
    assert telemetry.tree() == [(0, "train_step"), (1, "Net forward"), (1, "Net backward")] * 2
    assert_compiled_spans(telemetry, "Net", "models.Net")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

def test_under_a_dispatch_mode_the_block_runs_eagerly_and_is_still_one_span(telemetry, tracer_factory):
    """Op events (detail dtensor and up) push a dispatch mode on traced steps: dynamo then runs the block eagerly."""
    model = Net()
    model.layers[0] = torch.compile(model.layers[0], backend="eager")
    with tracer_factory(detail="ops"):
        train(model)
    assert telemetry.tree() == MIXED_TREE * 2
    assert_compiled_spans(telemetry, "Net.layers.0")
    assert "unique_graphs" not in torch._dynamo.utils.counters["stats"]
    # The ops of the eager run of its inside are its own events.
    [forward, _] = telemetry.by_name("Net.layers.0 forward")
    assert [e.name for e in forward.events].count("aten.addmm.default") == 2


def test_the_commdebugmode_drop_in_books_a_compiled_blocks_collectives_to_it(telemetry, single_rank_group):
    """The drop-in keeps a dispatch mode on (the block runs eagerly); counts go to the block, never `_orig_mod`."""
    from commdebug_otel import CommDebugMode

    model = Net(ReduceBlock)
    model.layers[0] = torch.compile(model.layers[0], backend="eager")
    comm_mode = CommDebugMode(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    with comm_mode:
        model(torch.ones(1, 4, requires_grad=True)).sum().backward()
    counts = {fqn: {p: {str(op): n for op, n in ops.items()} for p, ops in by_pass.items() if ops}
              for fqn, by_pass in comm_mode.comm_module_counts.items()}
    one = {"forward": {"c10d_functional.all_reduce": 1}}
    assert counts == {"Global": {"forward": {"c10d_functional.all_reduce": 2}},
                      "Net": {"forward": {"c10d_functional.all_reduce": 2}},
                      "Net.layers.0": one, "Net.layers.1": one}

class Breaking(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # dynamo runs this call eagerly, its module hooks included
        return super().forward(x)


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.breaking = Breaking(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.breaking(self.inner(x)))


def test_modules_inside_a_compiled_block_get_no_spans_even_across_a_graph_break(telemetry, tracer_factory):
    model = nn.Sequential(torch.compile(GraphBreak(), backend="eager"), nn.Linear(4, 4))
    with tracer_factory():
        train(model)
    assert telemetry.tree() == [
        (0, "train_step"), (1, "Sequential forward"), (2, "Sequential.0 forward"), (2, "Sequential.1 forward"),
        (1, "Sequential backward"), (2, "Sequential.1 backward"), (2, "Sequential.0 backward")] * 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3  # the break splits the graphs


class Checkpointed(nn.Module):
    """Eager activation checkpointing around a compiled block: the block runs again in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = torch.compile(Block(), backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.stem(x), use_reentrant=False)


def test_checkpoint_around_a_compiled_block(telemetry, tracer_factory):
    with tracer_factory():
        train(Checkpointed(), steps=1)
    assert telemetry.tree() == [
        (0, "train_step"), (1, "Checkpointed forward"), (2, "Checkpointed.stem forward"),
        (2, "Checkpointed.block forward"), (1, "Checkpointed backward"), (2, "Checkpointed.block backward"),
        (3, "Checkpointed.block recompute"), (2, "Checkpointed.stem backward")]
    assert_compiled_spans(telemetry, "Checkpointed.block", passes=("forward", "backward", "recompute"))



def test_activation_checkpointing_inside_a_compiled_block(telemetry, tracer_factory):
    """torchtitan's order: wrap the block for checkpointing, then compile it. The recompute is compiled code."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Net()
    model.layers[0] = torch.compile(checkpoint_wrapper(model.layers[0]), backend="eager")
    with tracer_factory():
        train(model)
    assert telemetry.tree() == MIXED_TREE * 2
    [forward, _] = telemetry.by_name("Net.layers.0 forward")
    assert forward.attributes[semconv.MODULE_TYPE].endswith(".CheckpointWrapper")
    assert {s.name for s in telemetry.spans() if semconv.MODULE_COMPILED in s.attributes} == {
        "Net.layers.0 forward", "Net.layers.0 backward"}

# ------------------------------------------------------------------ two gloo ranks
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MlpNet(nn.Module):
    """An eager stem (so the first block's input has a gradient, as after an embedding) and two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8, bias=False)
        self.layers = nn.ModuleList([Mlp(), Mlp()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x


_TORCH_OPS = {"c10d_functional.all_reduce": "all_reduce", "c10d._allgather_base_": "all_gather",
              "c10d._reduce_scatter_base_": "reduce_scatter"}


def _compiled_parallel(rank, world_size, style, backend, in_place):
    """MlpNet with each block compiled, under tensor parallel ("tp") or FSDP2 ("dp"): one step to compile,
    one traced step, then one step under torch's CommDebugMode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=(style,))
    model = MlpNet()
    if style == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.layers:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for index, block in enumerate(model.layers):
        if in_place:
            block.compile(backend=backend)
        else:
            model.layers[index] = torch.compile(block, backend=backend)
    if style == "dp":  # torchtitan's order: compile each block, then shard it
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def step():
        model(x).sum().backward()
        optimizer.step()

    step()
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        step()
    theirs = TorchCommDebugMode()
    with theirs:
        step()
    spans = telemetry.spans()
    by_id = {span.context.span_id: span for span in spans}
    events = [(e, span) for span in spans for e in span.events]
    return {
        "spans": {span.name: (by_id[span.parent.span_id].name if span.parent is not None else None,
                              [(e.attributes[semconv.OP_NAME], e.attributes[semconv.COLLECTIVE_SEQ])
                               for e in span.events],
                              span.attributes.get(semconv.MODULE_COMPILED, False))
                  for span in spans},
        "ours": Counter((e.name, e.attributes[semconv.MODULE_PASS]) for e, _ in events),
        "metrics": {(labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS]): value
                    for labels, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)},
        "torch": {(_TORCH_OPS[str(op)], pass_): n for pass_, ops in theirs.comm_module_counts["Global"].items()
                  for op, n in ops.items() if n},
        "matching": sorted((e.attributes[semconv.PROCESS_GROUP_NAME], e.attributes[semconv.COLLECTIVE_SEQ], e.name)
                           for e, _ in events),
    }


def _check_counts(results):
    """Both ranks issue the same collectives (group, seq); counts equal the metrics and torch's totals."""
    assert results[0]["matching"] == results[1]["matching"]
    for result in results:
        assert dict(result["ours"]) == result["metrics"] == result["torch"]


def _tp_spans(op):
    return {
        "train_step": (None, [], False),
        "MlpNet forward": ("train_step", [], False),
        "MlpNet.stem forward": ("MlpNet forward", [], False),
        # RowwiseParallel's output all_reduce, inside the compiled code.
        "MlpNet.layers.0 forward": ("MlpNet forward", [(op, 0)], True),
        "MlpNet.layers.1 forward": ("MlpNet forward", [(op, 1)], True),
        "MlpNet backward": ("train_step", [], False),
        # ColwiseParallel's input-gradient all_reduce, inside the compiled backward.
        "MlpNet.layers.1 backward": ("MlpNet backward", [(op, 2)], True),
        "MlpNet.layers.0 backward": ("MlpNet backward", [(op, 3)], True),
        "MlpNet.stem backward": ("MlpNet backward", [], False),
    }


@pytest.mark.parametrize(("backend", "in_place", "op"), [
    ("eager", False, "_c10d_functional.all_reduce.default"),
    ("inductor", False, "_c10d_functional.all_reduce_.default"),  # Inductor's in-place all_reduce
    ("eager", True, "_c10d_functional.all_reduce.default"),
])
def test_compiled_blocks_under_tensor_parallel(backend, in_place, op):
    results = run_ranks(_compiled_parallel, 2, "tp", backend, in_place)
    assert results[0]["spans"] == _tp_spans(op)
    _check_counts(results)
    assert results[0]["torch"] == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}


@pytest.mark.parametrize(("backend", "in_place"), [("eager", False), ("inductor", False), ("eager", True)])
def test_compiled_blocks_under_fsdp2(backend, in_place):
    # In place, FSDP2's hooks run inside the compiled call and hook the outputs before ours do:
    # ours must still run first, or the pre-backward all-gathers would go to train_step.
    results = run_ranks(_compiled_parallel, 2, "dp", backend, in_place)
    gather, scatter = "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"
    root = "MlpNet"  # the user's class, not fully_shard's FSDPMlpNet
    assert results[0]["spans"] == {
        "train_step": (None, [], False),
        f"{root} forward": ("train_step", [(gather, 0)], False),  # the root unit (stem)
        f"{root}.stem forward": (f"{root} forward", [], False),
        # FSDP2's unshard, in the compiled block's own (eager) pre-forward hook.
        f"{root}.layers.0 forward": (f"{root} forward", [(gather, 1)], True),
        f"{root}.layers.1 forward": (f"{root} forward", [(gather, 2)], True),
        f"{root} backward": ("train_step", [(scatter, 7)], False),
        # Its own unshard, the prefetch of layers.0, and its post-backward reduce-scatter.
        f"{root}.layers.1 backward": (f"{root} backward", [(gather, 3), (gather, 4), (scatter, 5)], True),
        f"{root}.layers.0 backward": (f"{root} backward", [(scatter, 6)], True),
        f"{root}.stem backward": (f"{root} backward", [], False),
    }
    _check_counts(results)


def _why_in_compiled_blocks(rank, world_size, backend):
    """Tensor-parallel blocks compiled while the tracer runs (as with the environment start): the "why" of
    each collective the compiled code issues, over two steps (the first compiles)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = MlpNet()
    for index, block in enumerate(model.layers):
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        model.layers[index] = torch.compile(block, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
    keys = (semconv.DTENSOR_CAUSE, semconv.DTENSOR_SOURCE_PLACEMENTS, semconv.DTENSOR_TARGET_PLACEMENTS,
            semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES)
    return [(span.name, event.name, tuple(event.attributes.get(key) for key in keys))
            for span in telemetry.spans() for event in span.events]


def _why_with_both_backends(rank, world_size):
    """``_why_in_compiled_blocks`` with the eager backend, then with Inductor, in one job (one spawn for both):
    each compiles fresh modules, which dynamo compiles anew."""
    return {backend: _why_in_compiled_blocks(rank, world_size, backend) for backend in ("eager", "inductor")}


@pytest.fixture(scope="module")
def why_runs():
    """Per rank of one 2-rank gloo job: ``{backend: [(span name, event name, why)]}``."""
    # Spawned: after the Inductor jobs above, forked ranks compile the blocks' backward without tracing it anew.
    return run_ranks(_why_with_both_backends, 2, spawn=True)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_collectives_of_compiled_dtensor_code_keep_the_why_seen_when_it_was_traced(why_runs, backend):
    row = ("redistribute", "(Partial(sum),)", "(Replicate(),)", (2,), ("tp",))  # RowwiseParallel's output
    col = ("from_local", "(Partial(sum),)", "(Replicate(),)", (2,), ("tp",))  # ColwiseParallel's input gradient
    step = [("MlpNet.layers.0 forward", "all_reduce", row), ("MlpNet.layers.1 forward", "all_reduce", row),
            ("MlpNet.layers.1 backward", "all_reduce", col), ("MlpNet.layers.0 backward", "all_reduce", col)]
    assert [jobs[backend] for jobs in why_runs] == [step * 2, step * 2]


@pytest.mark.parametrize("compiler", ["dynamo", "dynamo fullgraph", "graph run as is"])
def test_compiled_autograd_trains_as_untraced_with_forward_spans_only(telemetry, tracer_factory, compiler, caplog):
    """Compiled autograd (torchtitan's ``experimental.enable_compiled_autograd``) runs the backward as one
    compiled graph, which dynamo traces with the tensor hooks it captured (or which runs them eagerly, given a
    compiler that returns the graph as is): ours return at once there, as the module hooks of its graph module
    do. With fullgraph our hooks used to raise dynamo's ``Unsupported`` into backward()."""
    def run(traced):
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        compile_graph = (torch.compile(backend="eager", fullgraph=compiler == "dynamo fullgraph")
                         if compiler.startswith("dynamo") else (lambda graph: graph))
        tracer = tracer_factory() if traced else None
        if tracer is not None:
            tracer.start()
        try:
            for _ in range(2):
                loss = model(torch.ones(1, 4, requires_grad=True)).sum()
                with torch._dynamo.compiled_autograd._enable(compile_graph):
                    loss.backward()
                optimizer.step()
        finally:
            if tracer is not None:
                tracer.stop()
        return [parameter.detach().clone() for parameter in model.parameters()]

    expected = run(traced=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    caplog.clear()
    got = run(traced=True)
    assert not [record.getMessage() for record in caplog.records if record.name.startswith("commdebug_otel")]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    forward = [(0, "train_step"), (1, "Net forward"), (2, "Net.layers.0 forward"), (3, "Net.layers.0.a forward"),
               (3, "Net.layers.0.act forward"), (3, "Net.layers.0.b forward"), (3, "Net.layers.0.act forward"),
               *EAGER_LAYER_1]
    assert telemetry.tree() == forward * 2
    assert "graph_break" not in torch._dynamo.utils.counters
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 2
