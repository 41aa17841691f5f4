"""The "why" of every DTensor-caused collective, at the default detail: what caused it (an op, or an explicit
``redistribute``/``full_tensor``, or ``from_local``'s backward), its source and target placements, and the mesh."""

import pytest
import torch

from commdebug_otel import semconv

from distributed import run_ranks

_WHY = (semconv.DTENSOR_CAUSE, semconv.DTENSOR_SOURCE_PLACEMENTS, semconv.DTENSOR_TARGET_PLACEMENTS,
        semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES)


class _Block(torch.nn.Module):
    """An MLP block: a norm, then a column- and a row-parallel linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sp, self.tp = _Block(), _Block()

    def forward(self, shard: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``shard``: this rank's sequence shard (batch, seq / ranks, 8); ``full``: (batch, seq, 8)."""
        return self.sp(shard).full_tensor() + self.tp(full)


def _why_of_every_collective(rank, world_size, detail):
    """One step of a sequence-parallel block and a tensor-parallel block; every collective event's "why"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = _Model()
    parallelize_module(model.sp, mesh, {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    # The block's input arrives as a local sequence shard; PrepareModuleInput makes it a DTensor.
    parallelize_module(model.sp, mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Shard(1),)))
    parallelize_module(model.tp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(detail=detail), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        model(torch.randn(2, 4, 8), torch.randn(2, 4 * world_size, 8)).sum().backward()
        optimizer.step()
    return [(span.name, event.name, tuple(event.attributes.get(key) for key in _WHY),
             event.attributes.get(semconv.DTENSOR_OP))
            for span in telemetry.spans() for event in span.events if semconv.COLLECTIVE_OP in event.attributes]


def _every_job(rank, world_size):
    """The workloads of this file one after another in one 2-rank job (one spawn for the three checks): each
    builds its own mesh, model and tracer on the default group."""
    return {"collectives": _why_of_every_collective(rank, world_size, "collectives"),
            "dtensor": _why_of_every_collective(rank, world_size, "dtensor"),
            "set_up": _why_of_set_up(rank, world_size)}


@pytest.fixture(scope="module")
def runs():
    """Per rank: ``{"collectives" or "dtensor": _why_of_every_collective at that detail, "set_up": _why_of_set_up}``."""
    return run_ranks(_every_job, 2)


@pytest.mark.parametrize("detail", ["collectives", "dtensor"])
def test_every_dtensor_collective_names_its_cause_placements_and_mesh(runs, detail):
    shard, replicate, partial = "(Shard(dim=1),)", "(Replicate(),)", "(Partial(sum),)"
    mesh = ((2,), ("tp",))
    add = "aten.add_.Tensor"
    expected = [  # in the order the spans are exported
        ("_Model forward", "all_gather", ("full_tensor", shard, replicate, *mesh), None),
        # SGD's add_ on the sequence-parallel norm's Partial weight and bias gradients: an op's redistribution.
        ("train_step", "all_reduce", (add, partial, replicate, *mesh), add),
        ("train_step", "all_reduce", (add, partial, replicate, *mesh), add),
        # The parallel styles' own redistribute() in their input/output hooks, and its backward.
        ("_Model.sp.w1 forward", "all_gather", ("redistribute", shard, replicate, *mesh), None),
        ("_Model.sp.w2 forward", "reduce_scatter", ("redistribute", partial, shard, *mesh), None),
        ("_Model.tp.w2 forward", "all_reduce", ("redistribute", partial, replicate, *mesh), None),
        # ColwiseParallel's input gradient: from_local's backward turns the Partial gradient Replicate.
        ("_Model.tp.w1 backward", "all_reduce", ("from_local", partial, replicate, *mesh), None),
        ("_Model.sp.w2 backward", "all_gather", ("redistribute", shard, replicate, *mesh), None),
        ("_Model.sp.w1 backward", "reduce_scatter", ("redistribute", partial, shard, *mesh), None),
    ]
    assert [jobs[detail] for jobs in runs] == [expected, expected]


def _why_of_set_up(rank, world_size):
    """Collectives of parallelize_module's parameter sharding and of distribute_tensor, traced at set-up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor  # held since before the tracer started
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        parallelize_module(torch.nn.Linear(8, 8), mesh, ColwiseParallel())  # weight and bias: Shard(0)
        distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
        distribute_tensor(torch.ones(4, 4), mesh)  # placements default: Replicate
    return [(span.name, event.name, tuple(event.attributes.get(key) for key in _WHY))
            for span in telemetry.spans() for event in span.events if semconv.COLLECTIVE_OP in event.attributes]


def test_set_up_scatters_and_broadcasts_name_distribute_tensor_and_from_local(runs):
    shard, replicate, mesh = "(Shard(dim=0),)", "(Replicate(),)", ((2,), ("tp",))
    expected = [
        ("outside_step", "scatter", ("distribute_tensor", "()", shard, *mesh)),  # ColwiseParallel: weight
        ("outside_step", "scatter", ("distribute_tensor", "()", shard, *mesh)),  # and bias
        ("outside_step", "broadcast", ("distribute_tensor", "()", replicate, *mesh)),
        ("outside_step", "broadcast", ("distribute_tensor", "()", replicate, *mesh)),
    ]
    assert [jobs["set_up"] for jobs in runs] == [expected, expected]
