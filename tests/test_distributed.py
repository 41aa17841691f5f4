"""Real multi-rank gloo runs: per-module counts equal torch's CommDebugMode, events match across ranks."""

import pytest
import torch
import torch.distributed as dist

from commdebug_otel import semconv

from distributed import run_ranks


def _normalize(counts):
    return {fqn: {key: {str(op): n for op, n in ops.items() if n} for key, ops in by_pass.items()}
            for fqn, by_pass in counts.items()}


def _span_view(telemetry):
    spans = telemetry.spans()
    by_id = {span.context.span_id: span for span in spans}
    return [{
        "name": span.name,
        "parent": by_id[span.parent.span_id].name if span.parent is not None else None,
        "trace_id": span.context.trace_id,
        "attributes": dict(span.attributes),
        "events": [(event.name, dict(event.attributes)) for event in span.events],
    } for span in spans]


def _parallel_demo(world_size, dp):
    """The demo transformer, tensor parallel on every rank (FSDP2 + TP on a (2, 2) mesh if ``dp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import _demo_model as demo

    args = demo.ModelArgs()
    if dp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = demo.parallelize(demo.Transformer(args), mesh["tp"], mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        model = demo.parallelize(demo.Transformer(args), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return args, model, optimizer


def _train_and_compare(rank, world_size, dp):
    """Train the demo model 2 steps under ours, then 1 step under torch's CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from commdebug_otel import CommDebugMode
    from commdebug_otel import _demo_model as demo
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    telemetry = InMemoryTelemetry()
    ours = CommDebugMode(tracer_provider=telemetry.tracer_provider,
                         meter_provider=telemetry.meter_provider)
    with ours:
        args, model, optimizer = _parallel_demo(world_size, dp)
        setup_counts = _normalize(ours.comm_module_counts)
        tokens, targets = demo.make_batch(args, 2, 0)
        demo.train_step(model, optimizer, tokens, targets)
        step_counts = _normalize(ours.comm_module_counts)
    theirs = TorchCommDebugMode()
    with theirs:
        demo.train_step(model, optimizer, tokens, targets)
    return {
        "setup": setup_counts,
        "ours": step_counts,
        "torch": _normalize(theirs.comm_module_counts),
        "spans": _span_view(telemetry),
        "metrics": telemetry.metric_points(semconv.METRIC_OPERATIONS),
    }


def _minus(after, before):
    """Counts of ``after`` minus ``before`` (the set-up collectives), dropping zeros."""
    out = {}
    for fqn, by_pass in after.items():
        for key, ops in by_pass.items():
            for op, n in ops.items():
                left = n - before.get(fqn, {}).get(key, {}).get(op, 0)
                if left:
                    out.setdefault(fqn, {}).setdefault(key, {})[op] = left
    return out


def _torch_nonzero(counts):
    return {fqn: {k: v for k, v in by_pass.items() if v} for fqn, by_pass in counts.items()
            if any(by_pass.values())}


def counted_by_both(step):
    """Run ``step()`` under our CommDebugMode, then again under torch's.

    Returns ``(our counts, torch's counts without empty entries, our InMemoryTelemetry)``.
    """
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from commdebug_otel import CommDebugMode
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    ours = CommDebugMode(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    with ours:
        step()
    theirs = TorchCommDebugMode()
    with theirs:
        step()
    return _normalize(ours.comm_module_counts), _torch_nonzero(_normalize(theirs.comm_module_counts)), telemetry


def test_tensor_parallel_two_ranks(two_ranks):
    results = [jobs["train_and_compare"] for jobs in two_ranks]
    for result in results:
        assert _minus(result["ours"], result["setup"]) == _torch_nonzero(result["torch"])
    spans = results[0]["spans"]
    # Set-up collectives (distribute_tensor scatters) sit on the outside_step root span.
    outside = [s for s in spans if s["name"] == "outside_step"]
    assert len(outside) == 1 and outside[0]["parent"] is None
    assert {name for name, _ in outside[0]["events"]} == {"scatter"}
    # RowwiseParallel's output all_reduce, issued in wo's own forward hook, is on wo's span.
    wo = next(s for s in spans if s["name"] == "Transformer.layers.0.attention.wo forward")
    assert [name for name, _ in wo["events"]] == ["all_reduce"]
    attributes = wo["events"][0][1]
    assert attributes[semconv.COLLECTIVE_BYTES] == 2 * 32 * 64 * 4  # batch, seq, dim, float32
    assert attributes[semconv.COLLECTIVE_SHAPE] == (2, 32, 64)
    assert attributes[semconv.PROCESS_GROUP_SIZE] == 2
    assert wo["parent"] == "Transformer.layers.0.attention forward"
    # ColwiseParallel's input-gradient all_reduce stays with the layer's backward span.
    wq = next(s for s in spans if s["name"] == "Transformer.layers.0.attention.wq backward")
    assert [name for name, _ in wq["events"]] == ["all_reduce"]
    assert wq["parent"] == "Transformer.layers.0.attention backward"
    # The same collective has the same (group, seq) on both ranks, and step N one trace id.
    def keyed(result):
        return sorted((e[semconv.PROCESS_GROUP_NAME], e[semconv.COLLECTIVE_SEQ], name)
                      for s in result["spans"] for name, e in s["events"])
    assert keyed(results[0]) == keyed(results[1])
    step_ids = [[s["trace_id"] for s in r["spans"] if s["name"] == "train_step"] for r in results]
    assert step_ids[0] == step_ids[1] and len(step_ids[0]) == 1
    # Metrics agree with events.
    events = sum(len(s["events"]) for s in spans)
    assert sum(value for _, value in results[0]["metrics"]) == events


def test_fsdp2_and_tensor_parallel_four_ranks(four_ranks):
    results = [jobs["train_and_compare"] for jobs in four_ranks]
    for result in results:
        ours, theirs = _minus(result["ours"], result["setup"]), _torch_nonzero(result["torch"])
        # FSDP2's post-backward reduce-scatter: torch books it to a leaf of the unit (the
        # block's first module; tok_embeddings for the root), we book it to the FSDP unit.
        # The root's backward prefetch all-gather: both book it to the root, now that the demo's
        # root returns a tensor of its own (a view made us book it to the root's last module,
        # docs/comparison.md).
        root = "FSDPTransformer"  # the drop-in's keys are torch's: type(root).__name__
        for leaf in (f"{root}.layers.0.attention_norm", f"{root}.layers.1.attention_norm",
                     f"{root}.tok_embeddings"):
            assert theirs[leaf]["backward"].pop("c10d._reduce_scatter_base_") == 1
            if not theirs[leaf]["backward"]:
                del theirs[leaf]["backward"]
            if not theirs[leaf]:
                del theirs[leaf]
        assert ours == theirs
    spans = results[0]["spans"]
    block_backward = next(s for s in spans if s["name"] == "Transformer.layers.0 backward")
    assert "reduce_scatter" in [name for name, _ in block_backward["events"]]
    all_gathers = [e for s in spans if s["name"] == "Transformer.layers.0 forward"
                   for name, e in s["events"] if name == "all_gather"]
    assert all_gathers and all_gathers[0][semconv.DEVICE_MESH_DIM_NAME] == "dp"


def _send_recv(rank, world_size):
    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()

    class Stage(torch.nn.Module):
        def forward(self, x):
            if rank == 0:
                dist.send(x, dst=1)
            else:
                dist.recv(x, src=0)
            return x

    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        Stage()(torch.zeros(3, 2))
    return [(e.name, dict(e.attributes)) for e in telemetry.one("Stage forward").events]


def test_send_and_recv_are_events_with_peer(two_ranks):
    sent, received = [jobs["send_recv"] for jobs in two_ranks]
    assert [(name, a[semconv.COLLECTIVE_PEER], a[semconv.COLLECTIVE_BYTES]) for name, a in sent] == [
        ("send", 1, 24)]
    assert [(name, a[semconv.COLLECTIVE_PEER], a[semconv.COLLECTIVE_BYTES]) for name, a in received] == [
        ("recv", 0, 24)]


def _ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                                        torch.nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
    return [(s.name, [(e.name, dict(e.attributes)) for e in s.events]) for s in telemetry.spans() if s.events]


def test_ddp_reducer_all_reduce_is_seen_in_backward(two_ranks):
    # DDP's C++ reducer calls ProcessGroup::allreduce, which goes through the dispatcher's c10d ops.
    spans = two_ranks[0]["ddp"]
    reduces = [(name, e) for name, events in spans for op, e in events if op == "all_reduce"]
    assert len(reduces) == 2  # one gradient bucket per step
    for name, attributes in reduces:
        assert name.endswith("backward")
        assert attributes[semconv.COLLECTIVE_BYTES] == (4 * 4 + 4 + 4 * 2 + 2) * 4  # every gradient, float32
        assert attributes[semconv.MODULE_PASS] == "backward"


def _pipeline(rank, world_size):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    torch.manual_seed(0)
    telemetry = InMemoryTelemetry()
    stage_module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        x = torch.randn(4, 4)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros(4, 4), losses=[])
        optimizer.step()
    return [(e.name, dict(e.attributes)) for s in telemetry.spans() for e in s.events
            if semconv.COLLECTIVE_OP in e.attributes]


def test_pipeline_parallel_send_and_recv(two_ranks):
    first, last = [jobs["pipeline"] for jobs in two_ranks]

    def view(events):
        return [(name, e[semconv.COLLECTIVE_PEER], e[semconv.COLLECTIVE_BYTES], e[semconv.COLLECTIVE_DTYPE])
                for name, e in events]

    # Stage set-up exchanges shape metadata (send_object_list: a size, then pickled bytes) ...
    assert [(name, dtype) for name, _, _, dtype in view(first)[:6]] == [
        ("send", "int32"), ("recv", "int32"), ("send", "int64"), ("send", "uint8"),
        ("recv", "int64"), ("recv", "uint8")]
    # ... then two microbatches of [2, 4] float32 activations go forward and their gradients come back.
    assert view(first)[6:] == [("send", 1, 32, "float32")] * 2 + [("recv", 1, 32, "float32")] * 2
    assert view(last)[6:] == [("recv", 0, 32, "float32")] * 2 + [("send", 0, 32, "float32")] * 2


def _metric_totals(telemetry):
    """``{(op, pass, group, rank): (operations, bytes)}`` from the cumulative counters."""
    totals = {}
    for metric, index in ((semconv.METRIC_OPERATIONS, 0), (semconv.METRIC_IO, 1)):
        for labels, value in telemetry.metric_points(metric):
            key = (labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS],
                   labels[semconv.PROCESS_GROUP_NAME], labels[semconv.RANK])
            totals.setdefault(key, [0, 0])[index] += value
    return {key: tuple(value) for key, value in totals.items()}


def _minus_totals(after, before):
    return {key: (n - before.get(key, (0, 0))[0], b - before.get(key, (0, 0))[1])
            for key, (n, b) in after.items() if (n, b) != before.get(key, (0, 0))}


def _traced_and_untraced(rank, world_size, dp):
    """The same steps with every step traced, then with tracing 1 in 1000: metrics and mode stack.

    Detail ``dtensor``, so traced steps need the dispatch mode (for op events).
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel import _demo_model as demo
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    args, model, optimizer = _parallel_demo(world_size, dp)
    modes_seen = []
    model.register_forward_pre_hook(lambda *_: modes_seen.append(len(_get_current_dispatch_mode_stack())))
    tokens, targets = demo.make_batch(args, 2, 0)
    result = {}
    for trace_every in (1, 1000):
        telemetry = InMemoryTelemetry()
        with CommTracer(Settings(trace_every=trace_every, detail="dtensor"),
                        tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider) as tracer:
            demo.train_step(model, optimizer, tokens, targets)  # step 0 is traced in both
            assert tracer.flush_metrics()
            before = _metric_totals(telemetry)
            modes_seen.clear()
            for _ in range(3):
                demo.train_step(model, optimizer, tokens, targets)
            assert tracer.flush_metrics()
            result[trace_every] = {
                "metrics": _minus_totals(_metric_totals(telemetry), before),
                "train_steps": sum(1 for s in telemetry.spans() if s.name == "train_step"),
                "modes": list(modes_seen),
            }
    return result


def _check_traced_and_untraced(results):
    for result in results:
        traced, untraced = result[1], result[1000]
        assert traced["train_steps"] == 4 and untraced["train_steps"] == 1
        # Untraced steps run without any dispatch mode: ops never leave C++ for us.
        assert traced["modes"] == [1, 1, 1] and untraced["modes"] == [0, 0, 0]
        assert untraced["metrics"] == traced["metrics"]
        assert traced["metrics"]  # the workload issues collectives
    return results[0][1]["metrics"]


def test_untraced_steps_count_the_same_collectives_without_a_dispatch_mode(two_ranks):
    metrics = _check_traced_and_untraced([jobs["traced_and_untraced"] for jobs in two_ranks])
    # Rank 0, 3 steps of the 2-layer demo, batch 2 x 32 tokens x dim 64 float32 (16 KiB).
    assert metrics == {
        ("all_gather", "forward", "0", 0): (3, 3 * 16384),  # the output layer's logits
        ("all_reduce", "forward", "0", 0): (15, 15 * 16384),
        ("all_reduce", "backward", "0", 0): (33, 540672),
    }


def test_untraced_fsdp2_and_tensor_parallel_steps_count_the_same_collectives(four_ranks):
    metrics = _check_traced_and_untraced([jobs["traced_and_untraced"] for jobs in four_ranks])
    # Rank 0: group "1" is the dp mesh dimension (FSDP2), "3" the tp one.
    assert metrics == {
        ("all_gather", "forward", "1", 0): (9, 296832),
        ("all_gather", "backward", "1", 0): (6, 247296),
        ("reduce_scatter", "backward", "1", 0): (9, 593664),
        ("all_gather", "forward", "3", 0): (3, 3 * 16384),
        ("all_reduce", "forward", "3", 0): (15, 15 * 16384),
        ("all_reduce", "backward", "3", 0): (33, 540672),
    }


def _redistributing_matmul(rank, world_size):
    """A DTensor op whose inputs must be redistributed: its collective names the op and placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    a = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])
    b = distribute_tensor(torch.ones(6, 2), mesh, [Shard(1)])

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = []

    class MatMul(torch.nn.Module):
        def forward(self, a, b):
            modes.append(len(_get_current_dispatch_mode_stack()))
            return a @ b

    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        MatMul()(a, b)
        MatMul()(a, b)
    assert modes == [0, 0]  # named by DTensor's redistribution step, not by a dispatch mode
    return [[(e.name, dict(e.attributes)) for e in span.events] for span in telemetry.by_name("MatMul forward")]


def test_a_redistribution_inside_a_dtensor_op_names_the_op(two_ranks):
    for spans in [jobs["redistributing_matmul"] for jobs in two_ranks]:
        assert len(spans) == 2
        for events in spans:
            assert events, "the matmul redistributes its inputs"
            for _name, attributes in events:
                assert attributes[semconv.DTENSOR_OP] == "aten.mm.default"
                assert attributes[semconv.DTENSOR_INPUT_PLACEMENTS] == ("(Shard(dim=1),)", "(Shard(dim=1),)")
                assert attributes[semconv.DEVICE_MESH_SHAPE] == (2,)


# ------------------------------------------------------------------ one job per world size
def _jobs(rank, world_size, dp):
    """Every workload above for one world size, one after another in one spawned job (one torch import and
    process group per rank instead of one per test): each builds its own model, tracer and telemetry, so
    they share only the process group. ``_traced_and_untraced`` goes first: its expected metrics name the
    mesh's groups by number, which later meshes would shift."""
    jobs = {"traced_and_untraced": (_traced_and_untraced, dp), "train_and_compare": (_train_and_compare, dp)}
    if not dp:
        jobs.update(send_recv=(_send_recv,), ddp=(_ddp,), pipeline=(_pipeline,),
                    redistributing_matmul=(_redistributing_matmul,))
    results = {}
    for name, (fn, *args) in jobs.items():
        results[name] = fn(rank, world_size, *args)
        dist.barrier()  # no rank starts a workload while another still talks in the last one
    return results


@pytest.fixture(scope="module")
def two_ranks():
    """Per rank of a 2-rank gloo job: ``{workload name: its result}``."""
    return run_ranks(_jobs, 2, False)


@pytest.fixture(scope="module")
def four_ranks():
    """Per rank of a 4-rank gloo job (FSDP2 + tensor parallel on a (2, 2) mesh): ``{workload name: result}``."""
    return run_ranks(_jobs, 4, True)
