"""One collective fact, rendered alike everywhere: span event, stall-ring event, progress gauges, offline parse.

On a real one-rank gloo group with a 1-D device mesh ("tp") in the test process.
"""

import time

import torch
import torch.distributed as dist
from torch import nn

from commdebug_otel import semconv
from commdebug_otel.core.fact import CollectiveFact, GroupFacts, event_attributes, parse, ranges_text

# What a stall-ring event says of a collective, beside its state and age: the same as its span event.
SHARED = (semconv.COLLECTIVE_OP, semconv.PROCESS_GROUP_NAME, semconv.PROCESS_GROUP_SIZE, semconv.COLLECTIVE_SEQ,
          semconv.COLLECTIVE_DTYPE, semconv.COLLECTIVE_SHAPE, semconv.COLLECTIVE_BYTES, semconv.DEVICE_MESH_DIM_NAME,
          semconv.MODULE_PASS)


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


class MeshAllReduce(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def test_ring_events_gauges_and_span_events_tell_the_same_collective(telemetry, tracer_factory, single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    tracer = tracer_factory()
    with tracer:
        # Made while the tracer runs: a mesh made between two tracers over groups that existed is not found
        # (docs/semantic-conventions.md), and an earlier test's tracer may have run.
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        MeshAllReduce(mesh.get_group("tp"))(torch.ones(3, 2, dtype=torch.float16))
        progress = tracer.recorder.progress
        [(name, ring, _)] = progress.ring_events(time.time_ns())
        seqs = progress.seqs()
    [span_event] = telemetry.one("MeshAllReduce forward").events
    event = dict(span_event.attributes)
    assert name == span_event.name == "all_reduce"
    # (a one-rank mesh uses the default group: meshes of earlier tests that are still alive name it too)
    dims = event[semconv.DEVICE_MESH_DIM_NAME]
    assert "tp" in dims.split(",")  # the ring dropped it before
    # (the SDK keeps arrays as tuples; the ring's attributes are handed to it at the snapshot)
    assert {key: _tuple(ring.get(key)) for key in SHARED} == {key: event.get(key) for key in SHARED}
    assert ring[semconv.MODULE_FQN] == "MeshAllReduce"
    # The progress gauges' mesh dimension comes from the group resolver, as the events'.
    assert [(group, dim) for group, _, _, dim in seqs] == [(event[semconv.PROCESS_GROUP_NAME], dims)]


def test_the_offline_reader_parses_back_what_the_event_says():
    fact = CollectiveFact(op="all_gather", overload="_c10d_functional.all_gather_into_tensor.default",
                          group=GroupFacts("3", 4, "dp_shard"), seq=41, dtype="bfloat16", shape=(8, 64),
                          input_elements=512, output_elements=2048, nbytes=1024, fake=False, reduce_op="", peer=-1,
                          time_ns=0, duration_ns=210_000, fqn="Model.layers.0", pass_="backward",
                          why={semconv.DTENSOR_CAUSE: "redistribute",
                               semconv.DTENSOR_SOURCE_PLACEMENTS: "(Shard(dim=0),)",
                               semconv.DTENSOR_TARGET_PLACEMENTS: "(Replicate(),)"})
    attributes = event_attributes(fact)
    # The event carries no owner (its span does): everything else comes back.
    assert parse(attributes) == fact._replace(fqn="")
    assert parse({**attributes, semconv.MODULE_FQN: "Model.layers.0"}) == fact
    assert parse({}, "") is None


def test_ranks_and_steps_read_as_ranges():
    """One rule for the verdict's ranks and the offline commands' ranks and steps."""
    assert ranges_text([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and ranges_text([3, 4], ", ") == "3-4"
    assert ranges_text([]) == "" and ranges_text([9]) == "9"
