"""Message sizes per op on real gloo ranks: bytes this rank sends (or, sending nothing, receives), and the
profiler's input/output element counts, with a dtype and shape on every rank (docs/semantic-conventions.md)."""

import pytest
import torch
import torch.distributed as dist

from commdebug_otel import semconv

from distributed import run_ranks

_FIELDS = (semconv.COLLECTIVE_BYTES, semconv.COLLECTIVE_INPUT_ELEMENTS, semconv.COLLECTIVE_OUTPUT_ELEMENTS,
           semconv.COLLECTIVE_DTYPE, semconv.COLLECTIVE_SHAPE)


def _every_op(rank, world_size):
    """Each collective once, outside any step, on tensors of 2x3 float32 per rank (6 elements, 24 bytes)."""
    import torch.distributed._functional_collectives as funcol

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()

    def chunk():
        return torch.ones(2, 3)

    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider) as tracer:
        dist.all_reduce(chunk())
        dist.broadcast(chunk(), src=0)
        dist.reduce(chunk(), dst=0)
        dist.all_gather([chunk() for _ in range(world_size)], chunk())
        dist.all_gather_into_tensor(torch.empty(2 * world_size, 3), chunk())
        dist.reduce_scatter(chunk(), [chunk() for _ in range(world_size)])
        dist.reduce_scatter_tensor(chunk(), torch.ones(2 * world_size, 3))
        dist.scatter(chunk(), [chunk() for _ in range(world_size)] if rank == 0 else None, src=0)
        dist.gather(chunk(), [chunk() for _ in range(world_size)] if rank == 0 else None, dst=0)
        dist.all_to_all([chunk() for _ in range(world_size)], [chunk() for _ in range(world_size)])
        dist.all_to_all_single(torch.empty(2 * world_size, 3), torch.ones(2 * world_size, 3))
        if rank == 0:
            dist.send(chunk(), dst=1)
            dist.isend(chunk(), dst=1).wait()
        else:
            dist.recv(chunk(), src=0)
            dist.irecv(chunk(), src=0).wait()
        dist.barrier()
        funcol.all_gather_tensor(chunk(), 0, dist.group.WORLD).wait()
        funcol.reduce_scatter_tensor(torch.ones(2 * world_size, 3), "sum", 0, dist.group.WORLD).wait()
        dist.all_reduce(torch.tensor(1.0))  # a 0-d tensor: its shape is empty, so left out
        tracer.flush_metrics()
    events = [(e.name, e.attributes.get(semconv.OP_NAME), tuple(e.attributes.get(f) for f in _FIELDS),
               tuple(e.attributes)) for s in telemetry.by_name(semconv.SPAN_OUTSIDE_STEP) for e in s.events]
    io = {}
    for attributes, value in telemetry.metric_points(semconv.METRIC_IO):
        op = attributes[semconv.COLLECTIVE_OP]
        io[op] = io.get(op, 0) + value
    return events, io


def test_message_sizes_per_op_on_every_rank(two_ranks):
    results = [jobs["every_op"] for jobs in two_ranks]
    f32, shape = "float32", (2, 3)
    common = [  # (event, overload, (bytes, input elements, output elements, dtype, shape)) on both ranks
        ("all_reduce", "c10d.allreduce_.default", (24, 6, 6, f32, shape)),
        ("broadcast", "c10d.broadcast_.default", (24, 6, 6, f32, shape)),
        ("reduce", "c10d.reduce_.default", (24, 6, 6, f32, shape)),
        ("all_gather", "c10d.allgather_.default", (24, 6, 12, f32, shape)),
        ("all_gather", "c10d._allgather_base_.default", (24, 6, 12, f32, shape)),
        ("reduce_scatter", "c10d.reduce_scatter_.default", (48, 12, 6, f32, shape)),
        ("reduce_scatter", "c10d._reduce_scatter_base_.default", (48, 12, 6, f32, (4, 3))),
    ]
    # The source sends every chunk; a non-source rank only receives its chunk: that is its message.
    scatter = [("scatter", "c10d.scatter_.default", (48, 12, 6, f32, shape)),
               ("scatter", "c10d.scatter_.default", (24, 12, 6, f32, shape))]
    middle = [
        ("gather", "c10d.gather_.default", (24, 6, 12, f32, shape)),  # the root receives too, but sends its own
        ("all_to_all", "c10d.alltoall_.default", (48, 12, 12, f32, shape)),
        ("all_to_all", "c10d.alltoall_base_.default", (48, 12, 12, f32, (4, 3))),
    ]
    point_to_point = [[("send", "c10d.send.default", (24, 6, 6, f32, shape))] * 2,
                      [("recv", "c10d.recv_.default", (24, 6, 6, f32, shape))] * 2]
    tail = [
        ("barrier", "c10d.barrier.default", (0, 0, 0, "uint8", (0,))),
        ("all_gather", "_c10d_functional.all_gather_into_tensor.default", (24, 6, 12, f32, shape)),
        ("reduce_scatter", "_c10d_functional.reduce_scatter_tensor.default", (48, 12, 6, f32, (4, 3))),
        ("all_reduce", "c10d.allreduce_.default", (4, 1, 1, f32, None)),
    ]
    expected = [[*common, scatter[rank], *middle, *point_to_point[rank], *tail] for rank in range(2)]
    for rank, (events, io) in enumerate(results):
        assert [(name, op, facts) for name, op, facts, _ in events] == expected[rank]
        # A 0-d tensor's shape is left out rather than exported as an empty array.
        assert semconv.COLLECTIVE_SHAPE not in events[-1][3]
        assert all(semconv.COLLECTIVE_SHAPE in keys for *_, keys in events[:-1])
        # Metrics carry the same bytes as the events.
        by_op = {}
        for name, _, facts, _ in events:
            by_op[name] = by_op.get(name, 0) + facts[0]
        assert io == {op: n for op, n in by_op.items() if n or op != "barrier"} | {"barrier": 0}


def _recv_from_any_source(rank, world_size):
    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        if rank == 1:
            dist.send(torch.ones(3), dst=0)
        else:
            dist.recv(torch.empty(3))  # no src: c10d.recv_any_source_
        dist.barrier()
    return [(e.name, e.attributes.get(semconv.COLLECTIVE_PEER)) for s in telemetry.spans() for e in s.events
            if e.name in ("send", "recv")]


def test_a_recv_from_any_source_names_its_peer_once_received(two_ranks):
    assert [jobs["recv_from_any_source"] for jobs in two_ranks] == [[("recv", 1)], [("send", 0)]]


def _both(rank, world_size):
    """Both workloads one after another in one job (one spawn for two tests), each with its own tracer."""
    return {"every_op": _every_op(rank, world_size), "recv_from_any_source": _recv_from_any_source(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks():
    """Per rank of one 2-rank gloo job: ``{"every_op": ..., "recv_from_any_source": ...}``."""
    return run_ranks(_both, 2)


def test_a_sparse_all_reduce_on_an_untraced_step_counts_its_bytes(telemetry, tracer_factory, single_rank_group):
    """gloo all-reduces sparse COO tensors (DDP with sparse embedding gradients); ``nbytes`` is not defined
    for them, so their bytes are elements times element size, on the quiet path of untraced steps too."""
    tracer = tracer_factory(trace_every=100)
    tracer.start()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # step 0 is traced, step 1 is not
        model(torch.ones(1, 2)).sum().backward()
        dist.all_reduce(torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)))
        dist.all_reduce(torch.ones(4))
        optimizer.step()
    tracer.flush_metrics()
    io = sum(value for attributes, value in telemetry.metric_points(semconv.METRIC_IO)
             if attributes[semconv.COLLECTIVE_OP] == semconv.ALL_REDUCE)
    operations = sum(value for attributes, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)
                     if attributes[semconv.COLLECTIVE_OP] == semconv.ALL_REDUCE)
    assert (io, operations) == (4 * 16, 4)
    assert not telemetry.metric_points(semconv.METRIC_DROPPED)
