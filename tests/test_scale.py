"""Scale: trace blocks (ids, sizes at 1,024 simulated ranks) and metric label sets without the rank."""

import multiprocessing
import traceback

import pytest

from commdebug_otel import Settings, semconv
from commdebug_otel.capture.ops import GroupFacts
from commdebug_otel.config import DEFAULT_RANKS_PER_TRACE, METRIC_RANK_LABEL_AUTO_MAX_WORLD, MetricRankLabel
from commdebug_otel.core.fact import CollectiveFact
from commdebug_otel.core.job_identity import RankInfo, job_trace_id, step_trace_id, trace_block
from commdebug_otel.otel.metrics import CollectiveMetrics
from commdebug_otel.testing import InMemoryTelemetry

TEMPO_MAX_BYTES_PER_TRACE = 5_000_000


def _info(rank, world_size):
    return RankInfo(rank=rank, world_size=world_size, local_rank=rank % 8, node_rank=rank // 8,
                    run_id="run", backend="fake", distributed=True)


def test_trace_blocks_are_runs_of_consecutive_ranks():
    assert [trace_block(rank, 8, 16) for rank in range(8)] == [None] * 8
    assert [trace_block(rank, 16, 16) for rank in (0, 15)] == [None, None]
    assert [trace_block(rank, 6, 2) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [trace_block(rank, 1024, 16) for rank in (0, 15, 16, 1023)] == [0, 0, 1, 63]
    with pytest.raises(ValueError, match="ranks_per_trace"):
        trace_block(0, 8, 0)


def test_a_job_that_fits_one_trace_keeps_its_ids():
    for rank in range(16):
        assert job_trace_id(_info(rank, 16), "nonce", 7, 16) == (step_trace_id("run", "nonce", 7), None)
    assert step_trace_id("run", "nonce", 7) == step_trace_id("run", "nonce", 7, None)


def test_trace_ids_group_by_block_and_step():
    ids = {rank: job_trace_id(_info(rank, 64), "nonce", 3, 16) for rank in range(64)}
    assert {block for _, block in ids.values()} == {0, 1, 2, 3}
    by_block = {}
    for trace_id, block in ids.values():
        by_block.setdefault(block, set()).add(trace_id)
    assert all(len(trace_ids) == 1 for trace_ids in by_block.values())  # one trace per block
    assert len({trace_id for trace_ids in by_block.values() for trace_id in trace_ids}) == 4  # four traces
    assert by_block[1] == {step_trace_id("run", "nonce", 3, 1)}
    assert step_trace_id("run", "nonce", 3, 0) != step_trace_id("run", "nonce", 3)  # block 0 is a block too
    assert step_trace_id("run", "nonce", 4, 1) not in by_block[1]  # the next step: another trace
    assert job_trace_id(_info(0, 64), "other job", 3, 16)[0] not in by_block[0]


def test_scale_settings_from_the_environment():
    assert Settings().ranks_per_trace == DEFAULT_RANKS_PER_TRACE
    settings = Settings.from_env({"OTEL_PYTHON_COMMDEBUG_RANKS_PER_TRACE": "8",
                                  "OTEL_PYTHON_COMMDEBUG_METRIC_RANK_LABEL": "OFF"})
    assert settings.ranks_per_trace == 8 and settings.metric_rank_label is MetricRankLabel.OFF
    assert Settings(metric_rank_label="on").metric_rank_label is MetricRankLabel.ON
    with pytest.raises(ValueError, match="ranks_per_trace"):
        Settings(ranks_per_trace=0)
    with pytest.raises(ValueError, match="metric_rank_label"):
        Settings(metric_rank_label="sometimes")


@pytest.mark.parametrize(("setting", "world_size", "on"), [
    ("auto", 1, True), ("auto", METRIC_RANK_LABEL_AUTO_MAX_WORLD, True),
    ("auto", METRIC_RANK_LABEL_AUTO_MAX_WORLD + 1, False), ("auto", 16384, False),
    ("on", 16384, True), ("off", 2, False)])
def test_metric_rank_label_by_world_size(setting, world_size, on):
    assert Settings(metric_rank_label=setting).metric_rank_label_on(world_size) is on


def _fact(op, pass_, group, nbytes):
    return CollectiveFact(op, op, group, 0, "float32", (16,), 16, 16, nbytes, False, "", -1, 0, 1000, "", pass_, None)


def _label_sets(rank_label, rank):
    """Label sets of one rank's points: a tp all_reduce (a mesh dimension), a plain group's broadcast, a drop."""
    telemetry = InMemoryTelemetry()
    metrics = CollectiveMetrics(telemetry.meter_provider.get_meter("test"), rank_label=rank_label)
    tp = GroupFacts(name=str(10 + rank // 4), size=4, dim_name="tp")  # another name in each tp group
    metrics.collective(_fact("all_reduce", "forward", tp, 64), rank, 0.001)
    metrics.collective(_fact("broadcast", "none", GroupFacts(name="0", size=1024, dim_name=""), 8), rank, 0.001)
    metrics.dropped(semconv.DROPPED_KIND_SPAN, 2, rank)
    assert metrics.drain(5.0)
    return {name: sorted(sorted(labels.items()) for labels, _ in telemetry.metric_points(name))
            for name in (semconv.METRIC_OPERATIONS, semconv.METRIC_DURATION, semconv.METRIC_DROPPED)}


def test_metric_labels_with_the_rank():
    sets = _label_sets(True, 5)
    assert sets[semconv.METRIC_OPERATIONS] == sets[semconv.METRIC_DURATION] == [
        sorted({semconv.COLLECTIVE_OP: "all_reduce", semconv.MODULE_PASS: "forward",
                semconv.PROCESS_GROUP_NAME: "11", semconv.PROCESS_GROUP_SIZE: 4, semconv.RANK: 5,
                semconv.DEVICE_MESH_DIM_NAME: "tp"}.items()),
        sorted({semconv.COLLECTIVE_OP: "broadcast", semconv.MODULE_PASS: "none",
                semconv.PROCESS_GROUP_NAME: "0", semconv.PROCESS_GROUP_SIZE: 1024, semconv.RANK: 5}.items()),
    ]
    assert sets[semconv.METRIC_DROPPED] == [sorted({semconv.DROPPED_KIND: "span", semconv.RANK: 5}.items())]


def test_metric_labels_without_the_rank_are_the_same_on_every_rank():
    sets = _label_sets(False, 5)
    assert sets[semconv.METRIC_OPERATIONS] == sets[semconv.METRIC_DURATION] == [
        sorted({semconv.COLLECTIVE_OP: "all_reduce", semconv.MODULE_PASS: "forward",
                semconv.PROCESS_GROUP_SIZE: 4, semconv.DEVICE_MESH_DIM_NAME: "tp"}.items()),
        sorted({semconv.COLLECTIVE_OP: "broadcast", semconv.MODULE_PASS: "none",
                semconv.PROCESS_GROUP_NAME: "0", semconv.PROCESS_GROUP_SIZE: 1024}.items()),
    ]
    assert sets[semconv.METRIC_DROPPED] == [[(semconv.DROPPED_KIND, "span")]]
    assert _label_sets(False, 1000) == sets  # rank 1000, in another tp group: the same series


def _simulated_rank(world_size, tp, result):
    """Rank 0 of a ``world_size``-rank FSDP2 + TP job on torch's fake process group: puts
    :func:`_traces_and_labels`'s answer on ``result``, or the traceback."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        result.put(_traces_and_labels(world_size, tp))
    except BaseException:
        result.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _traces_and_labels(world_size, tp):
    """Set-up and two steps traced with the default settings: per trace, this rank's bytes and the
    block its roots name; the metric label sets."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import CommTracer, _demo_model
    from commdebug_otel.testing.wire import trace_wire

    telemetry = InMemoryTelemetry()
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        args = _demo_model.ModelArgs(n_layers=4)
        model = _demo_model.parallelize(_demo_model.Transformer(args, seed=0), mesh["tp"], mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        for step in range(2):
            _demo_model.train_step(model, optimizer, *_demo_model.make_batch(args, 2, step))
    blocks = {span.context.trace_id: span.attributes.get(semconv.TRACE_BLOCK)
              for span in telemetry.spans() if span.parent is None}
    return {"traces": {trace_id: (wire.raw, blocks[trace_id])
                       for trace_id, wire in trace_wire(telemetry.spans()).items()},
            "labels": sorted({tuple(sorted(labels)) for labels, _ in
                              telemetry.metric_points(semconv.METRIC_OPERATIONS)})}


def test_every_trace_of_a_1024_rank_job_stays_under_tempos_limit():
    """One simulated rank of 1,024 (FSDP2 + TP 4, fake process group): set-up and step traces, times the
    ranks of its trace block, stay under 5 MB; metric points carry neither rank nor group names."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    process = context.Process(target=_simulated_rank, args=(1024, 4, result))
    process.start()
    found = result.get(timeout=240)
    process.join(60)
    assert isinstance(found, dict), found  # else the rank's traceback
    assert found["traces"] and all(block == 0 for _, block in found["traces"].values())
    largest = max(raw for raw, _ in found["traces"].values()) * DEFAULT_RANKS_PER_TRACE
    assert largest <= TEMPO_MAX_BYTES_PER_TRACE / 4, largest  # well under: a model 4x larger still fits
    assert all(semconv.RANK not in labels and semconv.PROCESS_GROUP_NAME not in labels
               for labels in found["labels"]), found["labels"]
