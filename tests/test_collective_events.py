"""Collective events and metrics on a real one-rank gloo group in the test process."""

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commdebug_otel import Detail, semconv

from models import AllReduceLinear


def one_traced_step(tracer_factory):
    """One optimizer step of AllReduceLinear (one forward all_reduce) under a tracer."""
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()


def test_collective_event_attributes_and_owner(telemetry, tracer_factory, single_rank_group):
    one_traced_step(tracer_factory)
    span = telemetry.one("AllReduceLinear forward")
    assert [event.name for event in span.events] == ["all_reduce"]
    attributes = dict(span.events[0].attributes)
    assert attributes.pop(semconv.COLLECTIVE_DURATION) > 0
    assert attributes == {
        semconv.COLLECTIVE_OP: "all_reduce",
        semconv.OP_NAME: "c10d.allreduce_.default",
        semconv.COLLECTIVE_BYTES: 3 * 4 * 4,
        semconv.COLLECTIVE_INPUT_ELEMENTS: 12,
        semconv.COLLECTIVE_OUTPUT_ELEMENTS: 12,
        semconv.COLLECTIVE_DTYPE: "float32",
        semconv.COLLECTIVE_SHAPE: (3, 4),
        semconv.COLLECTIVE_REDUCE_OP: "sum",
        semconv.PROCESS_GROUP_NAME: single_rank_group.group_name,
        semconv.PROCESS_GROUP_SIZE: 1,
        semconv.COLLECTIVE_SEQ: 0,
        semconv.MODULE_PASS: "forward",
    }


def test_outside_step_span_collects_setup_collectives(telemetry, tracer_factory, single_rank_group):
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        dist.broadcast(torch.zeros(5, dtype=torch.int64), src=0)
        dist.barrier()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        dist.all_reduce(torch.ones(2))  # logging after the step
    outside = telemetry.by_name("outside_step")
    assert [[event.name for event in span.events] for span in outside] == [["broadcast", "barrier"]]
    assert all(span.parent is None for span in outside)
    # The logging after optimizer.step() is the step's tail: under its train_step, in its trace.
    tail, step = telemetry.one(semconv.SPAN_TRAIN_STEP_TAIL), telemetry.one("train_step")
    assert [event.name for event in tail.events] == ["all_reduce"]
    assert (tail.parent.span_id, tail.context.trace_id, tail.attributes[semconv.STEP]) == (
        step.context.span_id, step.context.trace_id, 0)
    broadcast = outside[0].events[0].attributes
    assert broadcast[semconv.COLLECTIVE_BYTES] == 40 and broadcast[semconv.COLLECTIVE_DTYPE] == "int64"
    assert outside[0].events[1].attributes[semconv.COLLECTIVE_BYTES] == 0
    assert [e.attributes[semconv.COLLECTIVE_SEQ] for s in telemetry.spans() for e in s.events] == [0, 1, 2, 3]


def test_collectives_between_steps_follow_the_step_before(telemetry, tracer_factory, single_rank_group):
    """A logging all_reduce after every optimizer step is traced only after a traced step."""
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory(trace_every=2):
        dist.barrier()  # set-up, before any step: traced
        for step in range(4):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            dist.all_reduce(torch.full((2,), float(step)))  # logging after the step
    outside, tails = telemetry.by_name("outside_step"), telemetry.by_name(semconv.SPAN_TRAIN_STEP_TAIL)
    assert [[event.name for event in span.events] for span in outside + tails] == [
        ["barrier"], ["all_reduce"], ["all_reduce"]]
    # The events keep the group's sequence numbers: the untraced steps' collectives are counted.
    assert [span.events[0].attributes[semconv.COLLECTIVE_SEQ] for span in outside + tails] == [0, 2, 6]
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 2]
    assert [s.attributes[semconv.STEP] for s in tails] == [0, 2]
    points = {(labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS]): value
              for labels, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)}
    assert points == {("barrier", "none"): 1, ("all_reduce", "forward"): 4, ("all_reduce", "none"): 4}


def test_functional_collectives_and_metrics(telemetry, tracer_factory, single_rank_group):
    class Funcol(torch.nn.Module):
        def forward(self, x):
            x = funcol.all_reduce(x, "sum", single_rank_group)
            return funcol.all_gather_tensor(x, 0, single_rank_group).wait()

    with tracer_factory():
        Funcol()(torch.ones(2, 3))
    span = telemetry.one("Funcol forward")
    assert [(e.name, e.attributes[semconv.OP_NAME]) for e in span.events] == [
        ("all_reduce", "_c10d_functional.all_reduce.default"),
        ("all_gather", "_c10d_functional.all_gather_into_tensor.default")]
    points = {(labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS]): value
              for labels, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)}
    assert points == {("all_reduce", "forward"): 1, ("all_gather", "forward"): 1}
    io = {labels[semconv.COLLECTIVE_OP]: value for labels, value in telemetry.metric_points(semconv.METRIC_IO)}
    assert io == {"all_reduce": 24, "all_gather": 24}
    labels = telemetry.metric_points(semconv.METRIC_DURATION)[0][0]
    assert labels == {semconv.COLLECTIVE_OP: labels[semconv.COLLECTIVE_OP], semconv.MODULE_PASS: "forward",
                      semconv.PROCESS_GROUP_NAME: single_rank_group.group_name,
                      semconv.PROCESS_GROUP_SIZE: 1, semconv.RANK: 0}


def test_metrics_cover_untraced_steps(telemetry, tracer_factory, single_rank_group):
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory(trace_every=3):
        for _ in range(4):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 3]
    assert sum(len(s.events) for s in telemetry.spans()) == 2
    [(_, count)] = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert count == 4
    [(_, timed)] = telemetry.metric_points(semconv.METRIC_DURATION)
    assert timed.count == 2  # issue times on the timed steps only: 0 and 3 (traced)


def test_collectives_are_timed_on_the_steps_trace_every_and_completion_every_pick(
        telemetry, tracer_factory, single_rank_group):
    """Issue times (functional collectives too) and c10d completions; counts and bytes on every step.
    Collectives between steps are always timed (a logging collective every k steps would alias)."""
    model = AllReduceLinear()  # one c10d all_reduce per forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory(trace_every=3, completion_every=2):
        dist.all_reduce(torch.ones(2))  # set-up: timed
        for _ in range(5):  # steps 0, 2, 3 and 4 are timed; step 1 is not
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            dist.all_reduce(torch.ones(2))  # logging between steps: timed
            funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(2), 0, single_rank_group))
    dist.barrier()  # completion callbacks run on gloo's thread; barrier orders them before the read
    def by_op_and_pass(name: str, value: Any) -> dict:
        return {(labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS]): value(point)
                for labels, point in telemetry.metric_points(name)}

    assert by_op_and_pass(semconv.METRIC_OPERATIONS, int) == {
        ("all_reduce", "forward"): 5, ("all_reduce", "none"): 6, ("all_gather", "none"): 5}
    assert by_op_and_pass(semconv.METRIC_DURATION, lambda point: point.count) == {
        ("all_reduce", "forward"): 4, ("all_reduce", "none"): 6, ("all_gather", "none"): 5}
    assert by_op_and_pass(semconv.METRIC_COMPLETION, lambda point: point.count) == {
        ("all_reduce", "forward"): 4, ("all_reduce", "none"): 6}


def test_metrics_of_a_step_that_never_ends_are_recorded(telemetry, tracer_factory, single_rank_group):
    """A rank stuck in a hung collective never reaches its flush: the idle worker records what is pending."""
    import time

    from commdebug_otel.otel.metrics import IDLE_TAKE_S

    with tracer_factory(trace_every=10**6):
        model = AllReduceLinear()
        model(torch.randn(3, 4)).sum().backward()  # step 0 (traced) stays open: no optimizer step
        dist.all_reduce(torch.ones(2))
        deadline = time.monotonic() + 5 * IDLE_TAKE_S
        while not telemetry.metric_points(semconv.METRIC_OPERATIONS) and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = [count for _, count in telemetry.metric_points(semconv.METRIC_OPERATIONS)]
        completions = telemetry.metric_points(semconv.METRIC_COMPLETION)
    assert sum(counts) == 2
    assert sum(point.count for _, point in completions) == 2  # both c10d all_reduces completed


def test_event_cap_counts_overflow_on_span_and_metric(telemetry, tracer_factory, single_rank_group, caplog):
    class Chatty(torch.nn.Module):
        def forward(self, x):
            for _ in range(7):
                dist.all_reduce(x)
            return x

    with tracer_factory(max_events_per_span=5):
        Chatty()(torch.ones(1))
        Chatty()(torch.ones(1))
    [said] = [r.getMessage() for r in caplog.records if "OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN" in r.getMessage()]
    assert said.startswith("commdebug-otel: span 'Chatty forward' reached OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN=5")
    span = telemetry.by_name("Chatty forward")[0]
    assert len(span.events) == 5
    assert span.attributes[semconv.SPAN_DROPPED_EVENTS] == 2
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == [({semconv.DROPPED_KIND: "event", semconv.RANK: 0}, 4)]
    [(_, count)] = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert count == 14  # metrics never drop


def test_dtensor_op_events_by_detail(telemetry, tracer_factory, single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))

    class MatMul(torch.nn.Module):
        def forward(self, a, b):
            return (a @ b.t()).full_tensor()

    a = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with tracer_factory(detail=Detail.DTENSOR):
        MatMul()(a, a)
    names = [event.name for event in telemetry.one("MatMul forward").events]
    assert "aten.mm.default" in names and "aten.t.default" not in names  # trivial ops only at "all"
    mm = next(e for e in telemetry.one("MatMul forward").events if e.name == "aten.mm.default")
    assert dict(mm.attributes) == {
        semconv.OP_NAME: "aten.mm.default",
        semconv.DTENSOR_INPUT_SHAPES: ("[4, 4]", "[4, 4]"),
        semconv.DTENSOR_INPUT_PLACEMENTS: ("(Shard(dim=0),)", "(Shard(dim=1),)"),
        semconv.DEVICE_MESH: str(mesh),
        semconv.DEVICE_MESH_SHAPE: (1,),
        semconv.DEVICE_MESH_DIM_NAMES: ("tp",),
    }
    telemetry.clear()
    with tracer_factory(detail=Detail.ALL):
        MatMul()(a, a)
    assert "aten.t.default" in [event.name for event in telemetry.one("MatMul forward").events]


def test_no_attribute_is_an_empty_array(telemetry, tracer_factory, single_rank_group):
    """``_foreach_*`` optimizer ops on DTensor parameters at detail ``dtensor``, on a mesh without dim names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]))
    optimizer = torch.optim.AdamW([weight], lr=0.1, foreach=True)

    class Square(torch.nn.Module):
        def forward(self, x):
            return (x @ weight).full_tensor()

    with tracer_factory(detail=Detail.DTENSOR):
        Square()(distribute_tensor(torch.ones(2, 4), mesh, [Replicate()])).sum().backward()
        optimizer.step()
    events = [(e.name, dict(e.attributes)) for s in telemetry.spans() for e in s.events]
    foreach = [attributes for name, attributes in events if name.startswith("aten._foreach_")]
    assert foreach and all(attributes == {semconv.OP_NAME: attributes[semconv.OP_NAME]} for attributes in foreach)
    mm = next(attributes for name, attributes in events if name == "aten.mm.default")
    assert semconv.DEVICE_MESH_DIM_NAMES not in mm and mm[semconv.DEVICE_MESH_SHAPE] == (1,)
    empty = [(name, key) for name, attributes in events for key, value in attributes.items() if value == ()]
    empty += [(s.name, key) for s in telemetry.spans() for key, value in s.attributes.items() if value == ()]
    assert empty == []


def test_no_tensor_values_leave_the_process(telemetry, tracer_factory, single_rank_group):
    sentinel = 1234.5678
    with tracer_factory(detail=Detail.ALL):
        model = AllReduceLinear()
        with torch.no_grad():
            model.lin.weight.fill_(sentinel)
        model(torch.full((2, 4), sentinel))
    text = repr([(s.name, dict(s.attributes), [(e.name, dict(e.attributes)) for e in s.events])
                 for s in telemetry.spans()])
    assert "1234.5" not in text and "aten.addmm.default" in text


def test_metric_exemplars_point_at_the_span_that_owns_the_collective(telemetry, tracer_factory,
                                                                     single_rank_group):
    one_traced_step(tracer_factory)
    span = telemetry.one("AllReduceLinear forward")
    data = telemetry.metric_reader.get_metrics_data()
    exemplars = [exemplar for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                 if m.name == semconv.METRIC_OPERATIONS for point in m.data.data_points
                 for exemplar in point.exemplars]
    assert [(e.trace_id, e.span_id) for e in exemplars] == [(span.context.trace_id, span.context.span_id)]
    assert span.context.trace_id == telemetry.one("train_step").context.trace_id


def test_c10d_completion_is_timed_from_the_work_future(telemetry, tracer_factory, single_rank_group):
    model = AllReduceLinear()
    with tracer_factory():
        for _ in range(3):
            model(torch.randn(3, 4))
        funcol.all_reduce(torch.ones(2), "sum", single_rank_group).wait()
    dist.barrier()  # completion callbacks run on gloo's thread; barrier orders them before the read
    points = telemetry.metric_points(semconv.METRIC_COMPLETION)
    assert [(labels[semconv.COLLECTIVE_OP], point.count) for labels, point in points] == [("all_reduce", 3)]
    [(labels, _)] = [p for p in telemetry.metric_points(semconv.METRIC_DURATION)
                     if p[0][semconv.MODULE_PASS] == "forward"]
    assert points[0][0] == labels and points[0][1].sum > 0


def test_untraced_step_runs_no_module_hook_inside_the_outermost_call(telemetry, tracer_factory, single_rank_group):
    """Inside an untraced step's outermost call the global hooks are off; pass labels and later spans stay exact."""
    from torch.nn.modules import module as nn_module

    global_pre_hooks = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            global_pre_hooks.append(len(nn_module._global_forward_pre_hooks))
            dist.all_reduce(x.detach())
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.probe = Probe()

        def forward(self, x):
            return self.probe(self.lin(x))

    model = Outer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(nn_module._global_forward_pre_hooks)
    with tracer_factory(trace_every=2):
        for _ in range(3):  # steps 0 and 2 traced, step 1 not
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
        after = len(nn_module._global_forward_pre_hooks)
    assert global_pre_hooks == [before + 1, before, before + 1]
    assert after == before + 1
    points = telemetry.metric_points(semconv.METRIC_OPERATIONS)
    assert [labels[semconv.MODULE_PASS] for labels, _ in points] == ["forward"]
    assert sum(count for _, count in telemetry.metric_points(semconv.METRIC_OPERATIONS)) == 3
    for name in ("Outer.probe forward", "Outer.lin forward", "Outer.lin backward"):
        spans = telemetry.by_name(name)
        assert [telemetry.parent_name(span) for span in spans] == [name.replace(".probe", "").replace(".lin", "")] * 2


def test_metric_points_beyond_the_pending_bound_are_dropped_and_counted(
        telemetry, tracer_factory, single_rank_group, monkeypatch):
    from commdebug_otel.otel import metrics

    monkeypatch.setattr(metrics, "MAX_PENDING_POINTS", 2)  # the worker takes points at the step end only

    class FiveAllReduces(torch.nn.Module):
        def forward(self, x):
            for _ in range(5):
                dist.all_reduce(x)
            return x

    with tracer_factory(trace_every=10**6):
        FiveAllReduces()(torch.ones(2))
    assert telemetry.metric_points(semconv.METRIC_OPERATIONS)[0][1] == 2
    [(_, completions)] = telemetry.metric_points(semconv.METRIC_COMPLETION)
    assert completions.count == 2
    # Step 0 is traced, so each all_reduce is also timed to completion: 3 points and 3 completions dropped.
    assert telemetry.metric_points(semconv.METRIC_DROPPED) == [
        ({semconv.DROPPED_KIND: semconv.DROPPED_KIND_METRIC, semconv.RANK: 0}, 6)]


def test_meshes_are_searched_again_only_after_process_groups_changed(telemetry, tracer_factory, single_rank_group,
                                                                     monkeypatch):
    """Each tracer's start searched every object of the process for device meshes (0.15-0.2 s at 290,000
    objects: a step of benchmarks/bench.py's TP job, paid on every step by a CommDebugMode drop-in entered per
    step). A search now follows only a change of process groups; the meshes found keep naming their groups."""
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel.capture.ops import MESHES

    searches = []
    search = MESHES._scan
    monkeypatch.setattr(MESHES, "_scan", lambda: searches.append(1) or search())
    dist.new_group([0])  # a change since any earlier search
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))  # made while no tracer runs

    def traced_all_reduce():
        with tracer_factory():
            funcol.all_reduce(torch.ones(2), "sum", mesh).wait()
        return telemetry.spans()[-1].events[-1].attributes[semconv.DEVICE_MESH_DIM_NAME]

    dims = [traced_all_reduce() for _ in range(3)]
    assert len(searches) == 1
    assert dims[0] == dims[1] == dims[2] and "tp" in dims[0].split(",")
    dist.new_group([0])
    assert "tp" in traced_all_reduce().split(",")
    assert len(searches) == 2
