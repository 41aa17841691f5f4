"""Offline analysis of pipeline parallel jobs (send/recv pairs), ``--step``, a closed stdout."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.offline import summary

from distributed import run_ranks
from otlp_files import checkout_env as _env
from otlp_files import span as _span
from otlp_files import write_otlp as _write_otlp

_CLI = [sys.executable, "-m", "commdebug_otel.cli"]


def _p2p(op, peer, seq, issue_s=0.0, group="0", size=2):
    return {semconv.COLLECTIVE_OP: op, semconv.COLLECTIVE_PEER: peer, semconv.COLLECTIVE_SEQ: seq,
            semconv.COLLECTIVE_DURATION: issue_s, semconv.PROCESS_GROUP_NAME: group,
            semconv.PROCESS_GROUP_SIZE: size, semconv.COLLECTIVE_BYTES: 8}


def _all_reduce(seq, group="0", size=2):
    return {semconv.COLLECTIVE_OP: "all_reduce", semconv.COLLECTIVE_SEQ: seq, semconv.PROCESS_GROUP_NAME: group,
            semconv.PROCESS_GROUP_SIZE: size, semconv.COLLECTIVE_BYTES: 4}


MS = 1_000_000


def _hand_built_pipeline():
    """Ranks 0 -> 1 on the world group "0" (size 2 here), ranks 1 -> 3 on group "5" = global ranks [1, 3].

    Rank 0 sends twice, then all_reduces at seq 2; rank 1 receives twice (the first before its
    step began, on ``outside_step``), sends once on group "5", and all_reduces at seq 2 on group "0".
    """
    rank0 = [_span(0, "train_step", "s0", events=[
        (10 * MS, _p2p("send", 1, 0, issue_s=0.001)),   # issue starts at 9 ms
        (20 * MS, _p2p("send", 1, 1, issue_s=0.002)),   # 18 ms
        (30 * MS, _all_reduce(2)),
    ], **{semconv.STEP: 0})]
    rank1 = [
        _span(1, "outside_step", "o1", events=[(2 * MS, _p2p("recv", 0, 0, issue_s=0.0005))]),  # 1.5 ms
        _span(1, "train_step", "s1", events=[
            (19 * MS, _p2p("recv", 0, 1, issue_s=0.0)),   # 19 ms: posted after the send began
            (21 * MS, _p2p("send", 1, 0, issue_s=0.0, group="5")),  # 21 ms, to global rank 3
            (31 * MS, _all_reduce(2)),
            (40 * MS, _p2p("recv", 0, 3)),  # no send to match
        ], **{semconv.STEP: 0}),
    ]
    rank3 = [_span(3, "train_step", "s3", events=[
        (24 * MS, _p2p("recv", 0, 0, issue_s=0.004, group="5")),  # 20 ms
    ], **{semconv.STEP: 0})]
    return rank0 + rank1 + rank3


_HAND_BUILT_WAITS = {
    "pairs": 3,
    "wait_ms": 7.5 + 1.0,
    "unmatched": {"send": 0, "recv": 1},
    "per_stage": [
        # 9 - 1.5 = 7.5 ms, then the second recv was posted 1 ms after its send began: 0.
        {"rank": 1, "group": "0", "group_rank": 1, "recvs": 2, "wait_ms": 7.5, "max_wait_ms": 7.5,
         "mean_wait_ms": 3.75},
        # rank 3 (group rank 1 of group "5") posted its recv at 20 ms, rank 1 began sending at 21 ms.
        {"rank": 3, "group": "5", "group_rank": 1, "recvs": 1, "wait_ms": 1.0, "max_wait_ms": 1.0,
         "mean_wait_ms": 1.0},
    ],
}


def test_send_and_recv_pair_by_peer_and_order_not_as_collectives():
    spans = _hand_built_pipeline()
    waits = summary.pipeline_waits(spans)
    assert waits == _HAND_BUILT_WAITS
    # The recv on outside_step belongs to its send's step.
    assert summary.pipeline_waits(spans, step=0) == waits
    assert summary.pipeline_waits(spans, step=1) == {"pairs": 0, "wait_ms": 0.0,
                                                     "unmatched": {"send": 0, "recv": 0}, "per_stage": []}
    lag = summary.lateness(spans)
    # Only the all_reduce (seq 2 on ranks 0 and 1, less the two sends or two recvs before it on group "0");
    # send and recv are not matched as collectives. Rank 1 was 1 ms late.
    assert lag["matched"] == 1 and lag["incomplete"] == 0
    assert lag["per_rank"][1] == {"matched": 1, "mean_late_ms": 1.0, "max_late_ms": 1.0, "last": 1}
    assert lag["per_rank"][3]["matched"] == 0
    text = summary.format_report(spans, rank=0).splitlines()
    start = text.index("Pipeline waits: 3 send/recv pairs matched by (process group, sender, receiver) in order; "
                       "0 sends and 1 recvs without a partner. Total wait 8.500 ms.")
    assert text[start + 1:start + 4] == [
        "rank  group  group rank  recvs  wait ms  mean wait ms  max wait ms",
        "1     0      1           2      7.500    3.750         7.500",
        "3     5      1           1      1.000    1.000         1.000",
    ]
    # Stages send and receive different amounts: only the all_reduce counts make a rank odd.
    assert {rank: total["odd"] for rank, total in summary.rank_totals(spans).items()} == {
        0: False, 1: False, 3: True}


def test_a_group_whose_ranks_the_files_cannot_tell_is_not_paired():
    # Group "7" has 4 ranks in a world of 8, and only two of them left files: the peer cannot be placed.
    spans = [
        _span(0, "train_step", "a", events=[(1 * MS, _p2p("send", 1, 0, group="7", size=4))], **{semconv.STEP: 0}),
        _span(2, "train_step", "b", events=[(2 * MS, _p2p("recv", 0, 0, group="7", size=4))], **{semconv.STEP: 0}),
    ]
    for span in spans:
        span["resource"][semconv.WORLD_SIZE] = 8
    assert summary.pipeline_waits(spans) == {"pairs": 0, "wait_ms": 0.0, "unmatched": {"send": 1, "recv": 1},
                                             "per_stage": []}
    # The same ranks on the world group (peer = global rank) pair.
    world = [dict(span, events=[dict(event, attributes=event["attributes"] | {
        semconv.PROCESS_GROUP_NAME: "0", semconv.PROCESS_GROUP_SIZE: 8, semconv.COLLECTIVE_PEER: peer})
        for event in span["events"]]) for span, peer in zip(spans, (2, 0), strict=True)]
    waits = summary.pipeline_waits(world)
    assert (waits["pairs"], waits["unmatched"], waits["per_stage"][0]["rank"]) == (1, {"send": 0, "recv": 0}, 2)


def test_collectives_after_unequal_p2p_counts_still_match():
    # A middle stage receives and sends; the last only receives: their seq differ at the all_reduce.
    spans = [
        _span(0, "train_step", "a", events=[(1 * MS, _p2p("send", 1, 0, size=3)), (5 * MS, _all_reduce(1, size=3))],
              **{semconv.STEP: 0}),
        _span(1, "train_step", "b", events=[(1 * MS, _p2p("recv", 0, 0, size=3)), (2 * MS, _p2p("send", 2, 1, size=3)),
                                           (6 * MS, _all_reduce(2, size=3))], **{semconv.STEP: 0}),
        _span(2, "train_step", "c", events=[(3 * MS, _p2p("recv", 1, 0, size=3)), (8 * MS, _all_reduce(1, size=3))],
              **{semconv.STEP: 0}),
    ]
    lag = summary.lateness(spans)
    assert (lag["matched"], lag["incomplete"], lag["most_often_last"]) == (1, 0, 2)
    assert lag["per_rank"][2]["max_late_ms"] == 3.0
    assert summary.pipeline_waits(spans)["pairs"] == 2


def _steps_job():
    def root(step, span_id, start, n_events):
        events = [(start + i, _all_reduce(step * 10 + i)) for i in range(n_events)]
        return [_span(0, "train_step", span_id, start=start, end=start + 100, trace=span_id, **{semconv.STEP: step}),
                _span(0, "Model forward", span_id + "m", span_id, start, start + 50, events=events, trace=span_id,
                      **{semconv.MODULE_FQN: "Model", semconv.MODULE_PASS: "forward"})]

    return [
        _span(0, "outside_step", "set", start=0, end=5, events=[(1, _all_reduce(0))], trace="set"),
        *root(0, "r0", 10, 1),
        *root(1, "r1", 200, 2),
        # An inference root (a top-level forward without grad) between steps.
        _span(0, "Model forward", "inf", start=400, end=450, events=[(410, _all_reduce(99))], trace="inf",
              **{semconv.MODULE_FQN: "Model", semconv.MODULE_PASS: "forward"}),
    ]


def test_step_selects_one_train_step_and_its_descendants():
    spans = _steps_job()
    assert [span["span_id"] for span in summary.step_spans(spans, 1)] == ["r1", "r1m"]
    assert summary.step_spans(spans, 7) == []
    report = summary.report_dict(spans, step=1)
    assert report["spans"] == 2 and report["step"] == 1
    assert report["module_counts"]["Model"]["forward"] == {"all_reduce": 2}
    assert report["rank_totals"] == {0: {"events": 2, "bytes": 8, "by_op": {"all_reduce": 2}, "odd": False}}
    whole = summary.report_dict(spans)
    assert whole["rank_totals"][0]["events"] == 5  # set-up, steps 0 and 1, inference
    assert summary.steps_present(spans) == [0, 1]
    # A step exported in parts (MAX_SPANS_PER_STEP): every part is the step.
    part = _span(0, "train_step", "r1b", start=150, end=160, events=[(155, _all_reduce(13))], trace="r1b",
                 **{semconv.STEP: 1, semconv.STEP_PART: 1})
    assert [span["span_id"] for span in summary.step_spans([*spans, part], 1)] == ["r1", "r1m", "r1b"]
    assert summary.format_report(spans, step=1).startswith("2 spans in step 1 from 1 rank(s) in 1 file(s)\n")


def test_step_on_the_command_line(tmp_path):
    path = tmp_path / "traces-rank0.jsonl"
    _write_otlp(_steps_job(), path)
    out = subprocess.run([*_CLI, "summarize", str(path), "--step", "1", "--format", "report-json"],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rank_totals"] == {"0": {"events": 2, "bytes": 8, "by_op": {"all_reduce": 2},
                                                           "odd": False}}
    out = subprocess.run([*_CLI, "summarize", str(path), "--step", "5"], capture_output=True, text=True, env=_env())
    assert out.returncode == 1
    assert out.stderr == "commdebug-otel summarize: no train_step 5 in the files; steps present: 0, 1\n"


def test_pipeline_waits_from_otlp_json_files(tmp_path):
    _write_otlp(_hand_built_pipeline(), tmp_path / "traces.jsonl")
    out = subprocess.run([*_CLI, "summarize", str(tmp_path), "--format", "report-json"], capture_output=True,
                         text=True, env=_env())
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pipeline_waits"] == _HAND_BUILT_WAITS
    assert report["lateness"]["matched"] == 1 and report["lateness"]["per_rank"]["1"]["max_late_ms"] == 1.0
    assert report["stragglers"] == []


@pytest.mark.parametrize(("command", "status"), [
    (["summarize"], 141), (["summarize", "--format", "report-json"], 141), (["summarize", "--format", "json"], 141),
    (["perfetto", "-o", "TRACE"], 141),
    (["summarize", "--help"], 0),  # argparse ignores a failed help write itself and exits 0
])
def test_a_closed_stdout_ends_quietly(tmp_path, command, status):
    path = tmp_path / "traces-rank0.jsonl"
    _write_otlp(_steps_job(), path)
    command = [str(tmp_path / "t.json") if arg == "TRACE" else arg for arg in command]
    read, write = os.pipe()
    os.close(read)  # the reader (``| head -1`` after its line) is gone before we print
    try:
        process = subprocess.run([*_CLI, command[0], str(path), *command[1:]], stdout=write,
                                 stderr=subprocess.PIPE, text=True, env=_env(), timeout=120)
    finally:
        os.close(write)
    assert process.stderr == ""
    assert process.returncode == status  # 141 = 128 + SIGPIPE, what a shell shows for `yes | head`


def test_a_pipe_closed_after_one_line(tmp_path):
    # More output than a pipe holds (64 KiB on Linux), so the writer is still writing when the
    # reader takes one line and closes it, as `| head -1` does: 3,000 modules in the module counts.
    spans = _steps_job()
    big = [_span(0, f"Model.layer{i} forward", f"m{i}", "r1", 200, 250, events=[(210, _all_reduce(100 + i))],
                 trace="r1", **{semconv.MODULE_FQN: f"Model.layer{i}", semconv.MODULE_PASS: "forward"})
           for i in range(3000)]
    path = tmp_path / "traces-rank0.jsonl"
    _write_otlp(spans + big, path)
    process = subprocess.Popen([*_CLI, "summarize", str(path), "--format", "report-json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert process.stdout.readline() == b"{\n"
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141
    assert stderr == b""


# ------------------------------------------------------------- a real pipeline

_DELAY_S = 0.2
_STEPS = 3
_MICROBATCHES = 2


def _pipeline_job(rank, world_size, out_dir):
    """Two GPipe stages over gloo; stage 0's forward sleeps ``_DELAY_S`` per microbatch; a loss all_reduce."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from commdebug_otel import CommTracer, Settings

    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        del os.environ[name]  # the file exporter is the default only without OTEL_* settings
    torch.manual_seed(0)
    torch.set_num_threads(1)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            if rank == 0 and x.device.type != "meta":
                time.sleep(_DELAY_S)  # the sender is slow: the next stage waits for it
            return self.linear(x)

    module = Stage()
    stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=_MICROBATCHES, loss_fn=lambda out, target: out.sum())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def step():
        if rank == 0:
            schedule.step(torch.randn(4, 4))
        else:
            schedule.step(target=torch.zeros(4, 4), losses=[])
        optimizer.step()
        dist.all_reduce(torch.ones(1))  # a collective on the pipeline's own group

    step()  # stage set-up (shape exchange) before tracing
    tracer = CommTracer(Settings(output_dir=out_dir))
    with tracer:
        for _ in range(_STEPS):
            step()
    tracer.telemetry.shutdown()


@pytest.fixture(scope="module")
def pipeline_spans(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("pipeline"))
    run_ranks(_pipeline_job, 2, out_dir)
    return summary.load_spans([out_dir])


def test_a_real_pipeline_reports_its_bubble_not_stragglers(pipeline_spans):
    waits = summary.pipeline_waits(pipeline_spans)
    per_microbatch = _STEPS * _MICROBATCHES
    # Each step: two activations forward (0 -> 1), two gradients back (1 -> 0).
    assert waits["pairs"] == 2 * per_microbatch and waits["unmatched"] == {"send": 0, "recv": 0}
    rows = {row["rank"]: row for row in waits["per_stage"]}
    assert rows[1]["group_rank"] == 1 and rows[1]["recvs"] == per_microbatch
    expected_ms = _DELAY_S * 1e3 * per_microbatch  # stage 1 waits for each slow forward of stage 0
    # Lower bounds only: a sleep never ends early, but a busy machine (2 shared cores) lengthens every wait.
    assert rows[1]["wait_ms"] >= 0.8 * expected_ms, rows
    assert rows[0]["wait_ms"] < rows[1]["wait_ms"] / 2, rows  # stage 0 never waits for a sleeping peer
    lag = summary.lateness(pipeline_spans, include_warmup=True)
    # Only the loss all_reduces, one per step (the first too), matched although the group also carries send/recv.
    assert (lag["matched"], lag["incomplete"]) == (_STEPS, 0)
    assert all(stats["matched"] == _STEPS for stats in lag["per_rank"].values())
    one = summary.pipeline_waits(pipeline_spans, step=1)
    assert one["pairs"] == 2 * _MICROBATCHES
    one_row = next(row for row in one["per_stage"] if row["rank"] == 1)
    expected_ms = _DELAY_S * 1e3 * _MICROBATCHES
    assert one_row["wait_ms"] >= 0.8 * expected_ms, one_row
    assert rows[0]["group_rank"] == 0 and rows[0]["recvs"] == per_microbatch
    text = summary.format_report(pipeline_spans)
    # Step 0, the warm-up, is left out of the lateness by default: two of the three loss all_reduces.
    assert "Pipeline waits: 12 send/recv pairs" in text and "Lateness: 2 collectives matched" in text
    assert "differs from the other ranks" not in text  # stage 0 sends what stage 1 receives, and back
    text = summary.format_report(pipeline_spans, step=1)
    # Step 1's loss all_reduce after optimizer.step() is its train_step_tail's: in the step.
    assert "Pipeline waits: 4 send/recv pairs" in text and "Lateness: 1 collectives matched" in text
