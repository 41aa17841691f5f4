"""The live straggler verdict: real gloo ranks beside a process that burns a core, the job's own c10d store,
the verdict read back from the OTLP-JSON files as a user reads them."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.config import Settings
from commdebug_otel.offline import stragglers
from commdebug_otel.offline.otlp_json import metrics_from_otlp_json, spans_from_otlp_json
from commdebug_otel.stall.straggler import (
    MIN_STEPS_JUDGED,
    ONSET_GAP_STEPS,
    RECOVER_STEPS,
    WARMUP_STEPS,
    BusyRecord,
    StragglerJudge,
    late_from_busy,
)
from tests.distributed import run_ranks
from tests.models import Net
from tests.test_stall import Layer  # the same sleeping layer as the stall tests

ONSET = 30  # the slow rank sleeps SLOW_S in Net.layers.1 forward from this step...
UNTIL = 55  # ...up to this one
STEPS = 90
HEALTHY_STEPS = 70
SLOW_S = 0.05
WORK_S = 0.03  # every rank's own work in each step, in Net.layers.0 forward (its compute)
STEP_S = 0.01  # between steps (a data loader's)
DETECT_STEPS = 6  # the verdict names the slow rank within this many steps of the onset


def _train(rank: int, world_size: int, slow_rank: int, steps: int) -> dict:
    from commdebug_otel import CommTracer

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("commdebug_otel.stall.straggler").addHandler(handler)
    torch.manual_seed(0)
    model = Net(Layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with CommTracer() as tracer:
        for step in range(steps):
            model.layers[0].sleep_s = WORK_S
            model.layers[1].sleep_s = SLOW_S if rank == slow_rank and ONSET <= step < UNTIL else 0.0
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(STEP_S)
        time.sleep(0.5)  # the judge's last polls
        said = [(verdict.kind, verdict.step, at) for verdict, at in tracer._stall_watch.stragglers.said]
    return {"lines": [line for line in lines if "straggler verdict" in line], "said": said}


@contextlib.contextmanager
def _burning_a_core():
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def _run(tmp_path, world_size: int, slow_rank: int, steps: int) -> tuple[list[dict], list[dict], list[dict]]:
    env = {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": "100",
           "OTEL_PYTHON_COMMDEBUG_STRAGGLER": "on"}
    with _burning_a_core():
        results = run_ranks(_train, world_size, slow_rank, steps, env=env)
    [run] = glob.glob(os.path.join(tmp_path, "run-*"))
    spans, points = [], []
    for path in sorted(glob.glob(os.path.join(run, "traces-rank*.jsonl"))):
        with open(path) as handle:
            spans += [span | {"file": os.path.basename(path)} for line in handle for span in spans_from_otlp_json(line)]
    with open(os.path.join(run, "metrics-rank0.jsonl")) as handle:
        points = [point for line in handle for point in metrics_from_otlp_json(line)
                  if point["name"] == semconv.METRIC_STRAGGLER_LOST]
    for path in glob.glob(os.path.join(run, "metrics-rank*.jsonl")):
        if not path.endswith("rank0.jsonl"):
            with open(path) as handle:
                assert semconv.METRIC_STRAGGLER_LOST not in handle.read()  # from the judging rank only
    verdicts = [span for span in spans if span["name"] == semconv.SPAN_STRAGGLER_VERDICT]
    return results, verdicts, points


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_slow_from_a_step_is_named_within_six_steps_and_said_recovered_after(tmp_path, world_size):
    slow_rank = world_size - 1
    results, verdicts, points = _run(tmp_path, world_size, slow_rank, STEPS)
    assert {span["file"] for span in verdicts} == {"traces-rank0.jsonl"}  # exported by one rank
    named, recovered = [span["attributes"] for span in verdicts]
    assert named[semconv.VERDICT_KIND] == "straggler" and recovered[semconv.VERDICT_KIND] == "recovered"
    for attrs in (named, recovered):
        assert attrs[semconv.VERDICT_BEHIND_RANKS] == [slow_rank]
        assert attrs[semconv.VERDICT_MODULE] == "" and attrs[semconv.VERDICT_PASS] == ""
        # The onset: a late step of the slow rank up to ONSET_GAP_STEPS before it may be noise counted in.
        assert ONSET - ONSET_GAP_STEPS < attrs[semconv.VERDICT_SINCE_STEP] <= ONSET
        assert 0.045 <= attrs[semconv.VERDICT_LOST] < 2 * SLOW_S, attrs
        assert 3 <= attrs[semconv.VERDICT_STEPS_LATE] <= attrs[semconv.VERDICT_STEPS_SEEN]
    since = named[semconv.VERDICT_SINCE_STEP]
    assert named[semconv.VERDICT_SINCE_STEP] == recovered[semconv.VERDICT_SINCE_STEP]
    step = named[semconv.STEP]
    assert ONSET <= step <= ONSET + DETECT_STEPS, named  # the newest step judged: the deciding step
    assert UNTIL < recovered[semconv.STEP] <= UNTIL + RECOVER_STEPS + DETECT_STEPS, recovered
    assert named[semconv.VERDICT_SUMMARY].startswith(
        f"rank {slow_rank} is slow since step {since}: the other ranks wait ")
    assert named[semconv.VERDICT_SUMMARY].endswith(f"; step {step}")
    assert recovered[semconv.VERDICT_SUMMARY].startswith(
        f"rank {slow_rank} is no longer slow: the test finds it no more over the last {RECOVER_STEPS} steps "
        f"(it was since step {since}, ")
    # One stderr line per change, on the judging rank only.
    assert results[0]["lines"] == [f"commdebug-otel: straggler verdict: {span['attributes'][semconv.VERDICT_SUMMARY]}"
                                   for span in verdicts]
    assert all(result["lines"] == [] for result in results[1:])
    [(_, _, named_at), (_, _, _)] = results[0]["said"]
    assert named_at - ONSET <= DETECT_STEPS + 2  # rank 0's own step then (the others may run a step ahead)
    # The metric: the seconds per step the others wait on the slow rank while named, 0 once recovered.
    by_rank = {point["attributes"][semconv.RANK] for point in points}
    assert by_rank == {slow_rank}
    assert any(point["value"] >= 0.045 for point in points) and points[-1]["value"] == 0.0


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_healthy_job_beside_a_busy_core_gets_no_verdict(tmp_path, world_size):
    results, verdicts, points = _run(tmp_path, world_size, -1, HEALTHY_STEPS)
    assert verdicts == [] and points == []
    assert [result["lines"] for result in results] == [[]] * world_size


# ------------------------------------------------------------------ the judge alone (no ranks)


def _busy(steps: range, slow: dict[int, int], world_size: int = 2, base_ns: int = 10_000_000) -> dict:
    """``{step: {rank: busy ns}}``: every rank ``base_ns`` plus a few µs of jitter, ``slow[rank]`` ns more."""
    return {step: {rank: base_ns + (step * 7 + rank * 13) % 50 * 1000 + slow.get(rank, 0)
                   for rank in range(world_size)} for step in steps}


def test_late_from_busy_makes_one_record_per_complete_step_at_the_train_step_place():
    busy = {10: {0: 5_000_000, 1: 9_000_000, 2: 6_000_000}, 11: {0: 5_000_000, 1: 5_000_100, 2: 5_000_000},
            12: {0: 5_000_000, 2: 9_000_000}}  # step 12: rank 1 did not report
    records, seen = late_from_busy(busy, 3)
    assert records == [stragglers.Late(1, 10, stragglers.TRAIN_STEP, "", 3_000_000, 3_000_000 + 3_000_000,
                                       3_000_000)]
    assert seen == {0: {10, 11}, 1: {10, 11}, 2: {10, 11}}


def test_the_judge_names_a_slow_rank_then_says_it_recovered_and_blames_nobody_on_a_steady_job():
    judge = StragglerJudge(2)
    said = []
    for step in range(WARMUP_STEPS, 90):
        slow = {1: 30_000_000} if 40 <= step < 60 else {}
        for rank, busy_ns in _busy(range(step, step + 1), slow)[step].items():
            judge.add(BusyRecord(rank, ((step, busy_ns),)))
        said += [(verdict.kind, verdict.step, verdict.behind, verdict.since_step, verdict.steps_late)
                 for verdict in judge.judge()]
    # 2 ranks, no late step before: q = 1 / (steps judged + 1); 4 late steps are the first p x 1 <= 0.05.
    # Recovered once the last 12 steps hold 3 late ones (57-59): P(Binomial(12, 1/13) >= 3) = 0.06 > 0.05.
    assert said == [("straggler", 43, (1,), 40, 4), ("recovered", 68, (1,), 40, 20)]
    assert judge.lost_by_rank() == {1: 0.0}
    steady = StragglerJudge(2)
    for step in range(WARMUP_STEPS, 90):
        for rank, busy_ns in _busy(range(step, step + 1), {})[step].items():
            steady.add(BusyRecord(rank, ((step, busy_ns),)))
        assert steady.judge() == []


def test_nobody_is_named_before_the_window_holds_enough_steps():
    judge = StragglerJudge(2)
    for step in range(WARMUP_STEPS, WARMUP_STEPS + MIN_STEPS_JUDGED - 1):
        for rank, busy_ns in _busy(range(step, step + 1), {1: 30_000_000})[step].items():
            judge.add(BusyRecord(rank, ((step, busy_ns),)))
        assert judge.judge() == []


def test_a_record_round_trips_in_microseconds_and_another_format_is_skipped():
    record = BusyRecord(3, ((41, 12_345_678), (42, 9_000)))
    text = record.to_json()
    assert json.loads(text) == {"format": 1, "rank": 3, "steps": [[41, 12345], [42, 9]]}
    assert BusyRecord.from_json(text) == BusyRecord(3, ((41, 12_345_000), (42, 9_000)))
    assert BusyRecord.from_json('{"format": 2, "rank": 0}') is None


def test_the_setting_is_off_by_default_and_a_bad_value_costs_one_message(caplog):
    assert Settings().straggler is False
    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_STRAGGLER": "on"}).straggler is True
    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_STRAGGLER": "sometimes"}).straggler is False
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "OTEL_PYTHON_COMMDEBUG_STRAGGLER" in messages[0] and "true, 1, yes" in messages[0]


def test_a_rank_a_little_slower_every_step_is_below_the_floor_and_not_named():
    # Rank 1 shares its core with another process: 1.5 ms (7 %) slower every step, consistently.
    judge = StragglerJudge(2)
    for step in range(WARMUP_STEPS, 90):
        for rank, busy_ns in _busy(range(step, step + 1), {1: 1_500_000}, base_ns=20_000_000)[step].items():
            judge.add(BusyRecord(rank, ((step, busy_ns),)))
        assert judge.judge() == []


def test_one_rank_recovering_leaves_another_named_until_its_own_recovery():
    judge = StragglerJudge(4)
    said = []
    for step in range(WARMUP_STEPS, 110):
        slow = {1: 30_000_000} if 40 <= step < 60 else {}
        if 45 <= step < 80:
            slow[2] = 40_000_000
        for rank, busy_ns in _busy(range(step, step + 1), slow, world_size=4)[step].items():
            judge.add(BusyRecord(rank, ((step, busy_ns),)))
        said += [(verdict.kind, verdict.behind) for verdict in judge.judge()]
    assert said == [("straggler", (1,)), ("straggler", (2,)), ("recovered", (1,)), ("recovered", (2,))]
