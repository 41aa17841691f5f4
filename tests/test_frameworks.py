"""The patterns the frameworks use: FSDP2 on a 1-D mesh (a mesh dimension that is the default group), loss
parallel (collectives DTensor's custom op handlers issue), and work after ``optimizer.step()`` (torchtitan's
loss logging, DeepSpeed ZeRO's parameter all-gather), on real 2-rank gloo jobs."""

import collections

import pytest
import torch
from torch import nn

from commdebug_otel import semconv

from distributed import run_ranks


def _tracer(telemetry, **settings):
    from commdebug_otel import CommTracer, Settings

    return CommTracer(Settings(**settings), tracer_provider=telemetry.tracer_provider,
                      meter_provider=telemetry.meter_provider)


def _collective_events(telemetry):
    return [(span, event) for span in telemetry.spans() for event in span.events
            if semconv.COLLECTIVE_OP in event.attributes]


def _operations(telemetry):
    """``{(op, dim name or None): count}`` from the operations counter."""
    counts = collections.Counter()
    for labels, value in telemetry.metric_points(semconv.METRIC_OPERATIONS):
        counts[labels[semconv.COLLECTIVE_OP], labels.get(semconv.DEVICE_MESH_DIM_NAME)] += value
    return dict(counts)


# ------------------------------------------------------------------ 1. mesh dimensions
def _fsdp2_on_a_1d_mesh(rank, world_size):
    """Two steps of FSDP2 over ``init_device_mesh("cpu", (2,), ("dp_shard",))``, made before the tracer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commdebug_otel.testing import InMemoryTelemetry

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.0), nn.ReLU(), nn.Linear(16, 8))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    telemetry = InMemoryTelemetry()
    with _tracer(telemetry):
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    events = collections.Counter((event.name, event.attributes.get(semconv.DEVICE_MESH_DIM_NAME))
                                 for _, event in _collective_events(telemetry))
    return dict(events), _operations(telemetry)


def test_fsdp2_collectives_on_a_1d_mesh_name_its_dimension():
    # Per step: each of the two units all-gathers in forward and again in backward (resharded after
    # forward), and reduce-scatters its gradients once.
    expected = {("all_gather", "dp_shard"): 8, ("reduce_scatter", "dp_shard"): 4}
    assert run_ranks(_fsdp2_on_a_1d_mesh, 2) == [(expected, expected)] * 2


def _two_meshes_one_group(rank, world_size):
    """A (1, 2) mesh made while the tracer runs: "dp" is a one-rank group, "tp" the default group, and the
    flattened "dp_tp" the default group again; a barrier before the mesh exists has no dimension."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    with _tracer(telemetry):
        dist.barrier()
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
        mesh["dp", "tp"]._flatten("dp_tp")
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=mesh.get_group("tp"))
        dist.all_reduce(tensor, group=mesh.get_group("dp"))
        funcol.all_reduce(tensor, "sum", (mesh, 1)).wait()  # dimension 1: "tp"
        dist.barrier()
    events = [(event.name, event.attributes.get(semconv.DEVICE_MESH_DIM_NAME))
              for _, event in _collective_events(telemetry)]
    return events, _operations(telemetry)


def test_a_group_serving_several_mesh_dimensions_names_them_all():
    both = "tp,dp_tp"
    events = [("barrier", None), ("all_reduce", both), ("all_reduce", "dp"), ("all_reduce", both),
              ("barrier", both)]
    operations = {("barrier", None): 1, ("all_reduce", both): 2, ("all_reduce", "dp"): 1, ("barrier", both): 1}
    assert run_ranks(_two_meshes_one_group, 2) == [(events, operations)] * 2


# ------------------------------------------------------------------ 2. loss parallel
_WHY = (semconv.DTENSOR_CAUSE, semconv.DTENSOR_OP, semconv.DTENSOR_INPUT_PLACEMENTS,
        semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES, semconv.DTENSOR_SOURCE_PLACEMENTS)


def _loss_parallel_step(rank, world_size):
    """One step of a tensor-parallel head whose Shard(-1) logits go to ``F.cross_entropy`` in ``loss_parallel()``."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12))
    parallelize_module(model, mesh, {"2": ColwiseParallel(use_local_output=False)})  # logits: Shard(-1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, target = torch.randn(4, 8), torch.tensor([0, 5, 7, 11])
    telemetry = InMemoryTelemetry()
    with _tracer(telemetry):
        with loss_parallel():
            loss = F.cross_entropy(model(inputs), target)
            loss.backward()
        optimizer.step()
    return [(span.name, event.name, tuple(event.attributes.get(key) for key in _WHY))
            for span, event in _collective_events(telemetry)]


def test_loss_parallel_all_reduces_name_the_loss_op(shared_job):
    shard, replicate, mesh = "(Shard(dim=1),)", "(Replicate(),)", ((2,), ("tp",))
    log_softmax, nll = "aten._log_softmax.default", "aten.nll_loss_forward.default"
    expected = [
        # _log_softmax's max and sum of exponentials over the class shards, then nll_loss's masked gather.
        ("train_step", "all_reduce", (log_softmax, log_softmax, (shard,), *mesh, None)),
        ("train_step", "all_reduce", (log_softmax, log_softmax, (shard,), *mesh, None)),
        ("train_step", "all_reduce", (nll, nll, (shard, replicate), *mesh, None)),
        # ColwiseParallel's input gradient: from_local's backward (a redistribution, as before).
        ("Sequential.2 backward", "all_reduce",
         ("from_local", None, None, *mesh, "(Partial(sum),)")),
    ]
    assert [jobs["loss_parallel_step"] for jobs in shared_job] == [expected, expected]


# ------------------------------------------------------------------ 3. the tail of a step
def _logging_after_the_step(rank, world_size):
    """torchtitan's pattern: set-up broadcasts, then per step forward, backward, optimizer.step() and a loss
    all_reduce for logging."""
    import torch.distributed as dist

    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    telemetry = InMemoryTelemetry()
    with _tracer(telemetry):
        for parameter in model.parameters():  # set-up: the same weights on every rank
            dist.broadcast(parameter.data, src=0)
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            optimizer.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
    spans = telemetry.spans()
    by_id = {span.context.span_id: span for span in spans}
    rows = []
    for span in spans:
        if span.name in (semconv.SPAN_TRAIN_STEP, semconv.SPAN_TRAIN_STEP_TAIL, semconv.SPAN_OUTSIDE_STEP):
            parent = by_id.get(span.parent.span_id) if span.parent is not None else None
            rows.append((span.name, span.attributes.get(semconv.STEP), f"{span.context.trace_id:032x}",
                         parent.name if parent is not None else None,
                         parent.attributes.get(semconv.STEP) if parent is not None else None,
                         [event.name for event in span.events]))
    events = len(_collective_events(telemetry))
    counted = sum(value for value in _operations(telemetry).values())
    return rows, events, counted


def test_work_after_optimizer_step_is_the_tail_of_that_step(shared_job):
    ranks = [jobs["logging_after_the_step"] for jobs in shared_job]
    for rows, events, counted in ranks:
        assert (events, counted) == (5, 5)  # metric totals equal event totals
        shapes = sorted((name, step, parent, parent_step, names) for name, step, _, parent, parent_step, names in rows)
        assert shapes == [
            ("outside_step", None, None, None, ["broadcast", "broadcast"]),
            ("train_step", 0, None, None, []),
            ("train_step", 1, None, None, []),
            ("train_step", 2, None, None, []),
            ("train_step_tail", 0, "train_step", 0, ["all_reduce"]),
            ("train_step_tail", 1, "train_step", 1, ["all_reduce"]),
            ("train_step_tail", 2, "train_step", 2, ["all_reduce"]),
        ]
        traces = {(name, step): trace for name, step, trace, *_ in rows}
        for step in range(3):
            assert traces["train_step_tail", step] == traces["train_step", step]
        assert len({traces["outside_step", None], *(traces["train_step", step] for step in range(3))}) == 4
    # The same trace ids on every rank (trace scope job).
    views = [sorted(row[:3] for row in rows) for rows, *_ in ranks]
    assert views[0] == views[1]


def _other_dtensor_handlers(rank, world_size):
    """argmax over a sharded dimension (its handler all-gathers values and indices) and torch.equal (the dispatcher's
    Python tail all-reduces the local answers), traced outside any step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from commdebug_otel.testing import InMemoryTelemetry

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tensor = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    telemetry = InMemoryTelemetry()
    with _tracer(telemetry):
        index = tensor.argmax().full_tensor()
        same = torch.equal(tensor, tensor)
    return int(index), same, [(event.name, tuple(event.attributes.get(key) for key in _WHY[:3]))
                              for _, event in _collective_events(telemetry)]


def test_other_dtensor_handlers_name_their_op(shared_job):
    shard = ("(Shard(dim=0),)",)
    argmax, equal = "aten.argmax.default", "aten.equal.default"
    expected = [("all_gather", (argmax, argmax, shard)), ("all_gather", (argmax, argmax, shard)),
                ("all_reduce", (equal, equal, shard * 2))]
    assert [jobs["other_dtensor_handlers"] for jobs in shared_job] == [(7, True, expected)] * 2


# ------------------------------------------------------------------ one job for the checks that allow it
def _shared(rank, world_size):
    """The workloads whose checks do not depend on which meshes the default group serves, one after another in
    one job (one spawn for three tests), each with its own tracer. The mesh-dimension checks (section 1) keep
    a job each: a mesh made by another workload would name the default group too."""
    return {"logging_after_the_step": _logging_after_the_step(rank, world_size),
            "loss_parallel_step": _loss_parallel_step(rank, world_size),
            "other_dtensor_handlers": _other_dtensor_handlers(rank, world_size)}


@pytest.fixture(scope="module")
def shared_job():
    """Per rank of one 2-rank gloo job: ``{workload name: its result}``."""
    return run_ranks(_shared, 2)
