"""The "why" of every DTensor-caused collective, at the default detail: what caused it (an op, or an explicit
``redistribute``/``full_tensor``, or ``from_local``'s backward), its source and target placements, and the mesh."""

import torch

from commdebug_otel import semconv

from distributed import run_ranks

_WHY = (semconv.DTENSOR_CAUSE, semconv.DTENSOR_SOURCE_PLACEMENTS, semconv.DTENSOR_TARGET_PLACEMENTS,
        semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES)


class _Block(torch.nn.Module):
    """A sequence-parallel MLP block: norm on sequence shards, then a column- and a row-parallel linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


def _sequence_parallel(rank, world_size):
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
    block = _Block()
    parallelize_module(block, mesh, {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    # The block's input arrives as a local sequence shard; PrepareModuleInput makes it a DTensor.
    parallelize_module(block, mesh, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),)))
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1, foreach=False)
    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        out = block(torch.randn(2, 4, 8))
        out.full_tensor().sum().backward()
        optimizer.step()
    return [(span.name, event.name, tuple(event.attributes.get(key) for key in _WHY))
            for span in telemetry.spans() for event in span.events]


def test_every_collective_of_a_sequence_parallel_block_names_placements_and_mesh():
    shard, replicate, partial = "(Shard(dim=1),)", "(Replicate(),)", "(Partial(sum),)"
    mesh = ((2,), ("tp",))
    expected = [
        # full_tensor() on the block's output, outside any module.
        ("train_step", "all_gather", ("full_tensor", shard, replicate, *mesh)),
        # SGD's add_ on the norm's Partial weight and bias gradients: an op's redistribution.
        ("train_step", "all_reduce", ("aten.add_.Tensor", partial, replicate, *mesh)),
        ("train_step", "all_reduce", ("aten.add_.Tensor", partial, replicate, *mesh)),
        # The parallel styles' own redistribute() in their input/output hooks, and their backward.
        ("_Block.w1 forward", "all_gather", ("redistribute", shard, replicate, *mesh)),
        ("_Block.w2 forward", "reduce_scatter", ("redistribute", partial, shard, *mesh)),
        ("_Block.w2 backward", "all_gather", ("redistribute", shard, replicate, *mesh)),
        ("_Block.w1 backward", "reduce_scatter", ("redistribute", partial, shard, *mesh)),
    ]
    assert run_ranks(_sequence_parallel, 2) == [expected, expected]
