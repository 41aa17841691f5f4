"""Stall snapshots, per-step signals and the desync fingerprint, on real gloo ranks and a real OTLP receiver."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from commdebug_otel import semconv
from commdebug_otel.config import AUTO_BETWEEN_STEPS_S, AUTO_FIRST_S, AUTO_FLOOR_S, Settings
from commdebug_otel.core.progress import CpuWait, Progress
from commdebug_otel.stall.watchdog import StallWatch
from commdebug_otel.testing.otlp_receiver import OtlpReceiver
from tests.distributed import run_ranks
from tests.models import AllReduceLinear, Net

STEPS = 4
STUCK_STEP = 2
STUCK_S = 7.0
STALL_AFTER_S = 1.5


class Layer(nn.Module):
    """An all-reducing layer whose forward can be told to sleep (the stuck rank's module)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = AllReduceLinear(8)
        self.sleep_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.proj(x)


def _train_with_one_rank_stuck(rank: int, world_size: int) -> dict:
    from commdebug_otel import CommTracer

    torch.manual_seed(0)
    model = Net(Layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    resumed = 0.0
    with CommTracer():
        for step in range(STEPS):
            stuck = rank == 1 and step == STUCK_STEP
            model.layers[1].sleep_s = STUCK_S if stuck else 0.0
            model(torch.ones(2, 8)).sum().backward()
            if stuck:
                resumed = time.time()
            optimizer.step()
            optimizer.zero_grad()
    return {"resumed": resumed}


def _stalled_spans(receiver: OtlpReceiver, before: float) -> list[dict]:
    spans = []
    for request in receiver.requests("traces"):
        if request.received_at < before:
            from commdebug_otel.offline.otlp_json import span_dicts

            spans += span_dicts(request.request, "http")
    return spans


def _rank(span: dict) -> int:
    return span["resource"][semconv.RANK]


@pytest.fixture(scope="module")
def stuck_run():
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": str(STALL_AFTER_S),
               "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
        results = run_ranks(_train_with_one_rank_stuck, 2, env=env)
        yield receiver, results[1]["resumed"]


SETUP_S = 3.0  # set-up longer than the threshold: imports, compilation, reading data


def _set_up_slowly(rank: int, world_size: int) -> None:
    """Both ranks set up past the threshold without communicating; then rank 1 sets up longer while rank 0 waits
    for it in a barrier (the start-up hang that must still be reported); then two steps."""
    import torch.distributed as dist

    from commdebug_otel import CommTracer

    model = Net(Layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with CommTracer():
        time.sleep(SETUP_S)
        if rank == 1:
            time.sleep(SETUP_S)
        dist.barrier()
        for _ in range(2):
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()


def test_set_up_before_the_first_step_is_no_stall_but_waiting_for_a_peer_is():
    with OtlpReceiver() as receiver:
        run_ranks(_set_up_slowly, 2, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
                                          "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                          "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": "1"})
        stalled = [span for span in receiver.spans() if span["name"] == semconv.SPAN_STALLED]
    stacks = {_rank(span): span["attributes"][semconv.STALL_STACK] for span in stalled
              if span["attributes"][semconv.STALL_SNAPSHOT] == 1}
    # Sleeping in set-up is never a stall, on either rank; rank 0 waiting in the barrier for rank 1 is one.
    assert not any(any("in _set_up_slowly" in frame for frame in stack[-1:]) for stack in stacks.values())
    assert any("distributed_c10d.py" in frame and "in barrier" in frame for frame in stacks[0])


def test_both_ranks_export_a_snapshot_while_one_is_stuck(stuck_run):
    receiver, resumed = stuck_run
    early = _stalled_spans(receiver, before=resumed)
    stalled = {_rank(span): span for span in early if span["name"] == semconv.SPAN_STALLED
               and span["attributes"][semconv.STALL_SNAPSHOT] == 1}
    assert sorted(stalled) == [0, 1]
    stuck, waiting = stalled[1]["attributes"], stalled[0]["attributes"]
    # The stuck rank: in the sleeping module's forward, behind on the default group.
    assert stuck[semconv.STEP] == waiting[semconv.STEP] == STUCK_STEP
    assert (stuck[semconv.STALL_MODULE], stuck[semconv.STALL_PASS]) == ("Net.layers.1", "forward")
    assert any("in forward" in frame and "test_stall.py" in frame for frame in stuck[semconv.STALL_STACK])
    assert STALL_AFTER_S <= stuck[semconv.STALL_AGE] < STUCK_S
    per_step = 2  # forward all-reduces per step, on the default group (one per layer)
    issued = {rank: dict(zip(stalled[rank]["attributes"][semconv.STALL_GROUPS],
                             stalled[rank]["attributes"][semconv.STALL_ISSUED_SEQ])) for rank in (0, 1)}
    group = next(iter(issued[0]))
    assert issued[1][group] == STUCK_STEP * per_step  # layers.0's all-reduce of the stuck step, seq 4
    assert issued[0][group] == STUCK_STEP * per_step + 1  # rank 0 is in layers.1's, seq 5
    # The waiting rank: its last collective is in flight, issued by layers.1.proj.
    in_flight = [event["attributes"] for event in stalled[0]["events"]
                 if event["attributes"][semconv.COLLECTIVE_STATE] == semconv.STATE_IN_FLIGHT]
    assert [(a[semconv.COLLECTIVE_SEQ], a[semconv.COLLECTIVE_OP], a[semconv.MODULE_FQN]) for a in in_flight] == [
        (STUCK_STEP * per_step + 1, "all_reduce", "Net.layers.1.proj")]
    assert waiting[semconv.STALL_MODULE] == "Net.layers.1.proj"
    assert in_flight[0][semconv.COLLECTIVE_SHAPE] == [2, 8] and in_flight[0][semconv.COLLECTIVE_BYTES] == 64
    # Every collective of the earlier steps is known complete (ring of both ranks).
    done = [event["attributes"][semconv.COLLECTIVE_SEQ] for event in stalled[0]["events"]
            if event["attributes"][semconv.COLLECTIVE_STATE] == semconv.STATE_COMPLETED]
    assert done == list(range(STUCK_STEP * per_step + 1))


def test_the_snapshot_holds_the_steps_spans_so_far_in_the_steps_trace(stuck_run):
    receiver, resumed = stuck_run
    first = [span for span in _stalled_spans(receiver, before=resumed)
             if span["attributes"].get(semconv.STALL_SNAPSHOT) == 1 and _rank(span) == 1]
    # The stuck step's snapshot (on a loaded machine another step may pass the 1.5 s threshold too: its own trace).
    [stuck_trace] = {span["trace_id"] for span in first
                     if span["name"] == "train_step" and span["attributes"][semconv.STEP] == STUCK_STEP}
    early = [span for span in first if span["trace_id"] == stuck_trace]
    by_name = {span["name"]: span for span in early}
    assert by_name["train_step"]["attributes"][semconv.SPAN_INCOMPLETE] is True
    assert by_name["train_step"]["attributes"][semconv.STEP_STALLED] == 1
    assert by_name["Net.layers.1 forward"]["attributes"][semconv.SPAN_INCOMPLETE] is True
    assert semconv.SPAN_INCOMPLETE not in by_name["Net.layers.0 forward"]["attributes"]  # it had ended
    final = [span for span in receiver.spans() if span["name"] == "train_step" and _rank(span) == 1
             and span["attributes"][semconv.STEP] == STUCK_STEP and semconv.STALL_SNAPSHOT not in span["attributes"]]
    assert len(final) == 1 and final[0]["attributes"][semconv.STEP_STALLED] >= 1
    assert stuck_trace == final[0]["trace_id"]  # the snapshot is in the stuck step's own trace
    assert final[0]["end_ns"] / 1e9 >= resumed


def test_no_span_of_the_stuck_run_is_out_of_time(stuck_run):
    """Snapshots, the verdict and the steps' own exports, as the receiver got them (tests/test_span_times.py)."""
    from tests.test_span_times import time_faults

    receiver, _ = stuck_run
    spans = [(span["name"], span["start_ns"], span["end_ns"], [event["time_ns"] for event in span["events"]],
              span["attributes"]) for span in receiver.spans()]
    assert any(attrs.get(semconv.STALL_SNAPSHOT) for *_, attrs in spans)
    assert time_faults(spans) == []


def test_metrics_arrive_during_the_stall(stuck_run):
    receiver, resumed = stuck_run
    from commdebug_otel.offline.otlp_json import metric_dicts

    points = [point for request in receiver.requests("metrics") if request.received_at < resumed
              for point in metric_dicts(request.request, "http")]
    ages = {point["attributes"][semconv.RANK]: point["value"] for point in points
            if point["name"] == semconv.METRIC_STEP_AGE}
    assert ages and min(ages.values()) >= STALL_AFTER_S
    issued = {point["attributes"][semconv.RANK]: point["value"] for point in points
              if point["name"] == semconv.METRIC_SEQ_ISSUED}
    assert issued == {0: STUCK_STEP * 2 + 1, 1: STUCK_STEP * 2}  # rank 1 flat and behind


def test_every_traced_step_has_a_wait_and_a_fingerprint_equal_across_ranks(stuck_run):
    receiver, _ = stuck_run
    steps = [span for span in receiver.spans() if span["name"] == "train_step"
             and semconv.STALL_SNAPSHOT not in span["attributes"]]
    assert len(steps) == 2 * STEPS
    by_step: dict[int, list[dict]] = {}
    for span in steps:
        by_step.setdefault(span["attributes"][semconv.STEP], []).append(span["attributes"])
    for attributes in by_step.values():
        fingerprints = {tuple(a[semconv.STEP_COLLECTIVE_FINGERPRINTS]) for a in attributes}
        assert len(fingerprints) == 1
        assert [a[semconv.STEP_COLLECTIVE_COUNTS] for a in attributes] == [[2], [2]]
    waits = sorted(a[semconv.STEP_COLLECTIVE_WAIT] for a in by_step[STUCK_STEP])
    # Rank 0 waited for rank 1 (a busy machine delays the collective's end for both, not the difference).
    assert waits[1] - waits[0] >= STUCK_S - 1.0
    assert [a[semconv.STEP_COLLECTIVE_FIRST_SEQ] for a in by_step[3]] == [[6], [6]]
    # Its wait for a CPU: seconds on every traced step (0.0 where the kernel keeps no schedstat), a few ms at most
    # for the stuck rank, which slept.
    assert all(0.0 <= a[semconv.STEP_CPU_WAIT] < STUCK_S / 2 for a in by_step[STUCK_STEP])


class FunctionalLayer(nn.Module):
    """A linear layer whose output is all-reduced by a functional collective (as DTensor's are), then waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        out = self.lin(x)
        reduced = funcol.all_reduce(out.detach(), "sum", torch.distributed.group.WORLD)
        return out + funcol.wait_tensor(reduced) * 0


def _train_untraced_with_a_stall(rank: int, world_size: int, where: str) -> dict:
    from commdebug_otel import CommTracer

    torch.manual_seed(0)
    model = nn.Sequential(FunctionalLayer(), FunctionalLayer())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    resumed = 0.0
    with CommTracer():
        for step in range(STEPS):
            stuck = rank == 1 and step == STUCK_STEP
            if stuck and where == "module":
                model[1].register_forward_pre_hook(lambda module, args: time.sleep(SHORT_STUCK_S))
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if stuck and where == "between steps":
                time.sleep(SHORT_STUCK_S)  # data loading
            if stuck:
                resumed = time.time()
                model[1]._forward_pre_hooks.clear()
    return {"resumed": resumed}


SHORT_STUCK_S = 4.0


@pytest.mark.parametrize("where", ["module", "between steps"])
def test_untraced_steps_and_functional_collectives_get_snapshots_too(where):
    """Production settings (one step in 100 traced): the stuck rank is still named, from its Python stack."""
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": "1", "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": "100"}
        resumed = run_ranks(_train_untraced_with_a_stall, 2, where, env=env)[1]["resumed"]
        early = _stalled_spans(receiver, before=resumed)
        finals = [span for span in receiver.spans() if span["name"] == "train_step"
                  and semconv.STALL_SNAPSHOT not in span["attributes"]]
    # The stuck step's episode only: on a busy machine a rank that starts late can hold the other past the
    # 1 s threshold in step 0 as well, a stall of its own.
    waiting_step = STUCK_STEP if where == "module" else STUCK_STEP + 1
    early = [span for span in early if span["attributes"].get(semconv.STEP, 0) >= STUCK_STEP]
    finals = [span for span in finals if span["attributes"][semconv.STEP] >= STUCK_STEP]
    stalled = {_rank(span): span["attributes"] for span in early if span["name"] == semconv.SPAN_STALLED
               and span["attributes"][semconv.STALL_SNAPSHOT] == 1}
    assert sorted(stalled) == [0, 1]
    per_step = 2
    group = stalled[0][semconv.STALL_GROUPS][0]
    if where == "module":
        assert (stalled[1][semconv.STALL_MODULE], stalled[1][semconv.STALL_PASS]) == ("Sequential.1", "forward")
        assert stalled[1][semconv.STEP] == STUCK_STEP and semconv.STALL_BETWEEN_STEPS not in stalled[1]
        behind = STUCK_STEP * per_step
    else:
        assert (stalled[1][semconv.STALL_MODULE], stalled[1][semconv.STALL_PASS]) == ("", "")
        assert stalled[1][semconv.STEP] == STUCK_STEP + 1 and stalled[1][semconv.STALL_BETWEEN_STEPS] is True
        behind = (STUCK_STEP + 1) * per_step - 1
    # behind: the stuck rank's last collective, complete; the waiting rank is one further, waiting in wait_tensor.
    assert stalled[1][semconv.STALL_ISSUED_SEQ] == stalled[1][semconv.STALL_COMPLETED_SEQ] == [behind]
    assert stalled[0][semconv.STALL_ISSUED_SEQ] == [behind + 1] and stalled[0][semconv.STALL_COMPLETED_SEQ] == [behind]
    assert (stalled[0][semconv.STALL_MODULE], stalled[0][semconv.STALL_PASS]) == (
        "Sequential.1" if where == "module" else "Sequential.0", "forward")
    assert group == stalled[1][semconv.STALL_GROUPS][0]
    # Untraced: the snapshot is train_step and stalled; the step's final export is its train_step alone.
    snapshot_names = sorted(span["name"] for span in early if _rank(span) == 1
                            and span["attributes"].get(semconv.STALL_SNAPSHOT) == 1)
    assert snapshot_names == (["stalled", "train_step"] if where == "module" else ["stalled"])
    stalled_steps = sorted((_rank(span), span["attributes"][semconv.STEP]) for span in finals
                           if semconv.STEP_STALLED in span["attributes"])
    assert stalled_steps == sorted([(0, waiting_step)] + ([(1, STUCK_STEP)] if where == "module" else []))


# ----------------------------------------------------------------- the watchdog's rules, without ranks
def test_auto_threshold_follows_recent_steps_with_a_floor():
    progress = Progress()
    progress.step_began(time.time_ns(), 0)
    assert progress.threshold_s("auto") == AUTO_FIRST_S
    for _ in range(5):
        progress.durations.append(0.2)
    assert progress.threshold_s("auto") == AUTO_FLOOR_S
    for _ in range(40):
        progress.durations.append(10.0)
    assert progress.threshold_s("auto") == 100.0
    assert progress.threshold_s(2.5) == 2.5


def test_auto_holds_the_time_between_steps_to_its_own_floor_unless_a_collective_is_in_flight():
    progress = Progress()
    assert progress.threshold_s("auto") == AUTO_BETWEEN_STEPS_S  # set-up, nothing in flight
    progress.step_began(time.time_ns(), 0)
    for _ in range(5):
        progress.durations.append(0.2)
    progress.next_seq["0"] = 3  # seqs 0, 1, 2 issued in the step
    assert progress.threshold_s("auto") == AUTO_FLOOR_S
    progress.step_ended(time.time_ns(), True)  # the step's collectives are complete
    assert not progress.in_flight() and progress.threshold_s("auto") == AUTO_BETWEEN_STEPS_S
    assert progress.threshold_s(2.5) == 2.5  # a number applies between steps too
    progress.next_seq["0"] = 4  # a collective between steps, not known complete: the others may be waiting
    assert progress.in_flight() and progress.threshold_s("auto") == AUTO_FLOOR_S
    progress.complete("0", 3)
    assert progress.threshold_s("auto") == AUTO_BETWEEN_STEPS_S


class _NoCpuWait(CpuWait):
    """A thread that never waits for a CPU, or one that waits ``waits`` ns more at each read."""

    def __init__(self, waits: int = 0) -> None:
        super().__init__()
        self.waits, self.total = waits, 0

    def ns(self) -> int:
        self.total += self.waits
        return self.total

    def since(self, before: int) -> int:
        return self.ns() - before


def test_busy_time_leaves_out_the_steps_wait_for_a_cpu():
    """Another process on the rank's core: the training thread's run-queue wait is no work of its own."""
    progress = Progress(cpu_wait=_NoCpuWait(waits=30_000_000))
    progress.step_began(0, 3)
    progress.step_ended(100_000_000, True)
    assert (progress.busy[-1], progress.cpu_wait_ns) == ((3, 70_000_000), 30_000_000)
    # Not wanted (an untraced step, the live verdict off): not read, nothing taken off.
    reads = progress._cpu_wait.total
    progress.step_began(100_000_000, 4, cpu_wait=False)
    progress.step_ended(200_000_000, True)
    assert (progress.busy[-1], progress.cpu_wait_ns, progress._cpu_wait.total) == ((4, 100_000_000), 0, reads)
    reading = CpuWait()  # this machine's: a number, or 0 where the kernel has no schedstat
    assert reading.since(reading.ns()) >= 0


def test_busy_time_leaves_out_a_steps_tail_after_a_collective_no_python_wait_followed():
    """DDP's reducer waits for its buckets in C++: the tail after the step's last collective is its wait. A wait in
    Python after the last collective (FSDP2, DTensor, ``dist.*``) is the wait, and no tail is left out."""
    ms = 1_000_000
    for waited_ms, tail_left_out in ((None, True), (5, False)):
        progress = Progress(cpu_wait=_NoCpuWait())  # the machine's load takes nothing off here
        progress.step_began(0, 7)
        before = time.perf_counter_ns()
        progress.remember(object(), None, issued_at=before - 50 * ms)  # its last bucket, issued 50 ms ago
        if waited_ms is not None:
            progress.waited(object(), waited_ms * ms)
        progress.step_ended(100 * ms, True)
        after = time.perf_counter_ns()
        (index, busy_ns), = progress.busy
        if tail_left_out:  # 100 ms less the 50 ms (and the test's own time) since the last bucket
            assert index == 7 and 50 * ms - (after - before) <= busy_ns <= 50 * ms, busy_ns
        else:
            assert (index, busy_ns) == (7, 95 * ms)


class _OneProcessRecorder:
    """What ``StallWatch`` reads of a recorder in a one-process job; each snapshot goes to ``snapshot(...)``
    (the ``stall_snapshot`` arguments)."""

    thread_id = -1

    def __init__(self, snapshot, progress: Progress | None = None, steps_taken: int = 0, open_record=None):
        self.progress = progress or Progress()
        self.steps_taken = steps_taken
        self._snapshot = snapshot
        self._open = open_record

    def stall_place(self, where):
        from commdebug_otel.core.stall_snapshot import stall_place

        return stall_place(self.progress, where, self._open, self.steps_taken)

    def stall_snapshot(self, now, age_s, threshold_s, snapshot, place):
        self._snapshot(now, age_s, threshold_s, snapshot, place)
        return True

    def rank(self):
        from commdebug_otel.core.job_identity import RankInfo

        return RankInfo(rank=0, world_size=1, local_rank=0, node_rank=0, run_id="none", backend="gloo",
                        distributed=False)


def test_snapshots_back_off_while_one_stall_lasts():
    calls = []
    recorder = _OneProcessRecorder(lambda now, age_s, *rest: calls.append((round(age_s), rest[1])), steps_taken=1)
    watch = StallWatch(recorder, 2.0, lambda: None, lambda module: None)
    start = recorder.progress.since_ns
    for second in range(0, 20):
        watch.check(start + second * 10**9)
    assert calls == [(2, 1), (4, 2), (8, 3), (16, 4)]
    recorder.progress.step_began(start + 20 * 10**9, 1)
    watch.check(start + 23 * 10**9)
    assert calls[-1] == (3, 1)  # a new stall starts counting again


def test_late_snapshots_keep_to_the_threshold_grid():
    """A late look (a loaded machine) does not push the later snapshots back: at T, 2T, 4T, 8T... of the stall,
    as every rank of the stall takes them (twice the age would give 2.4, 4.8, 9.6, 19.2 s here)."""
    ages = []
    recorder = _OneProcessRecorder(lambda now, age_s, *rest: ages.append((age_s, rest[1])), steps_taken=1)
    watch = StallWatch(recorder, 2.0, lambda: None, lambda module: None)
    start = recorder.progress.since_ns
    for age_s in (2.4, 4.0, 4.8, 7.9, 8.0, 9.6, 16.0, 19.2, 40.0, 63.9, 64.0):
        watch.check(start + round(age_s * 1e9))
    assert ages == [(2.4, 1), (4.0, 2), (8.0, 3), (16.0, 4), (40.0, 5), (64.0, 6)]  # 32 s was missed: 64 s next


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("off", None), ("2.5", 2.5), ("0", None)])
def test_stall_after_accepts_auto_off_and_seconds(text, expected):
    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_STALL_AFTER": text}).stall_after_s == expected


def test_bad_stall_after_costs_one_message_and_keeps_the_default(caplog):
    settings = Settings.from_env({"OTEL_PYTHON_COMMDEBUG_STALL_AFTER": "soon"})
    assert settings.stall_after_s == "auto"
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "OTEL_PYTHON_COMMDEBUG_STALL_AFTER" in messages[0] and "auto, off" in messages[0]


def test_diagnose_names_the_stuck_rank_its_module_and_the_collective_the_other_waits_in(tmp_path):
    """As a user: the job's files, then `commdebug-otel diagnose --format json`."""
    import json
    import subprocess
    import sys

    env = {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": str(STALL_AFTER_S)}
    began = time.monotonic()
    run_ranks(_train_with_one_rank_stuck, 2, env=env)
    job_s = time.monotonic() - began
    [run] = tmp_path.glob("run-*")
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "diagnose", str(run), "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    # A loaded machine can hold a rank past the threshold in another step too: that is a stall of its own.
    [stall] = [stall for stall in found["stalls"] if stall["step"] == STUCK_STEP]
    assert (stall["rank"], stall["module"], stall["pass"]) == (1, "Net.layers.1", "forward")
    # The rank went on and its step was exported whole: the stall is over, and lasted about STUCK_S.
    assert stall["ended"] is True and STUCK_S <= stall["duration_s"] < job_s, stall  # no wall-clock bound
    assert abs(stall["duration_s"] - stall["age_s"] - stall["ended_after_s"]) < 0.01
    [waiting] = stall["waiting_ranks"]
    assert waiting["rank"] == 0
    assert [(c["op"], c["seq"], c["module"]) for c in waiting["in_flight"]] == [
        ("all_reduce", 2 * STUCK_STEP + 1, "Net.layers.1.proj")]
    assert found["desyncs"] == []
    # The live verdict in the same files (the leader's stall_verdict span) and diagnose apply one rule
    # (offline/hangs.py) to the same snapshots: the same rank behind, the same waiters, the same sentence.
    from commdebug_otel.offline.summary import load_spans

    live = [span["attributes"] for span in load_spans([str(run)]) if span["name"] == semconv.SPAN_STALL_VERDICT
            and span["attributes"][semconv.STEP] == STUCK_STEP]
    assert len(live) == 1, live
    assert (live[0][semconv.VERDICT_KIND], live[0][semconv.VERDICT_BEHIND_RANKS],
            live[0][semconv.VERDICT_WAITING_RANKS], live[0][semconv.VERDICT_SUMMARY]) == (
        stall["verdict"]["kind"], [stall["rank"]], [waiting["rank"]], stall["verdict"]["summary"])
    assert stall["verdict"]["kind"] == "hang"
    # The stuck step's final export is one train_step per rank, counted once by summarize too.
    text = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "summarize", str(run), "--step",
                           str(STUCK_STEP), "--format", "report-json"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert json.loads(text.stdout)["module_counts"]["Net.layers.1.proj"]["forward"] == {"c10d.allreduce_": 1}
    assert "spans of stall snapshots left out" in text.stderr


def test_the_watchdog_retries_a_failed_check_and_gives_up_after_three():
    import threading

    failures = []

    class Broken:
        thread_id = threading.get_ident()
        progress = Progress()

        def stall_snapshot(self, *args):
            raise RuntimeError("racing the step's end")

        def hook_failed(self, where, error):
            failures.append(where)

    Broken.progress.since_ns -= 10 * 10**9  # stalled for 10 s already
    watch = StallWatch(Broken(), 0.2, lambda: None, lambda module: None)
    watch._due_s = 0.0
    watch.start()
    watch._thread.join(timeout=10)
    assert not watch._thread.is_alive() and failures == ["stall watchdog"] * 3


def test_a_snapshot_copies_the_stuck_steps_records_even_if_the_step_ends_meanwhile(monkeypatch, telemetry,
                                                                                    tracer_factory):
    """The watchdog copies the open step's records on its own thread; if the training thread closes that step
    and starts the next during the copy, the next step's calls must not reuse the records being copied (and
    the training thread does not wait for the copy)."""
    import threading

    from commdebug_otel.core import step_export as lifecycle_module  # where a snapshot copies the records

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.second(self.first(x))

    stuck, other = Net(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.SGD([*stuck.parameters(), *other.parameters()], lr=0.1)
    copying, real_copy = threading.Event(), lifecycle_module.snapshot_tree

    def slow_copy(*args):
        copying.set()
        time.sleep(0.5)  # the training thread goes on meanwhile
        return real_copy(*args)

    monkeypatch.setattr(lifecycle_module, "snapshot_tree", slow_copy)
    with tracer_factory() as tracer:
        stuck(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # step 0: its records are spare for the next steps
        loss = stuck(torch.ones(2, 4)).sum()  # step 1, open
        watchdog = threading.Thread(target=tracer.recorder.stall_snapshot,
                                    args=(time.time_ns(), 60.0, 30.0, 1, tracer.recorder.stall_place(("", "", []))))
        watchdog.start()
        assert copying.wait(5)
        loss.backward()
        optimizer.step()  # step 1 closes while the copy runs
        other(torch.ones(2, 4)).sum().backward()  # step 2: other modules
        optimizer.step()
        watchdog.join(5)
        assert not watchdog.is_alive()
    # Step 1 as it was when the copy began (forward only), nothing of step 2's.
    snapshot = sorted(span.name for span in telemetry.spans() if span.attributes.get(semconv.STALL_SNAPSHOT) == 1)
    assert snapshot == ["Net forward", "Net.first forward", "Net.second forward", "stalled", "train_step"]


def _pause_between_steps(rank: int, world_size: int) -> dict:
    """Four fast steps, then rank 1 pauses between steps (a checkpoint save) while rank 0 waits for it in an
    all_reduce. Each rank's watchdog is asked, during the pause, at a clock a minute past the last step's end
    (above auto's 30 s floor): the pause alone is no stall; the wait in a collective is."""
    import threading

    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fired = []
    with CommTracer(Settings(stall_after_s="auto"), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider) as tracer:
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        watch, progress = tracer._stall_watch, tracer.recorder.progress

        def ask():
            time.sleep(1.0)  # rank 0 is in its all_reduce by now, rank 1 in its pause
            fired.append(watch.check(progress.since_ns + 60 * 10**9))

        asking = threading.Thread(target=ask)
        asking.start()
        if rank == 1:
            time.sleep(3.0)  # the planned pause, nothing in flight
        dist.all_reduce(torch.ones(1))  # between steps; rank 0 waits here for rank 1
        asking.join()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    stalled = [span for span in telemetry.spans() if span.name == "stalled"]
    return {"fired": fired, "stalled": [(dict(span.attributes).get(semconv.STALL_BETWEEN_STEPS),
                                         [event.attributes.get(semconv.COLLECTIVE_STATE) for event in span.events])
                                        for span in stalled]}


def test_auto_reports_a_wait_in_a_collective_between_steps_but_not_a_planned_pause():
    waiting, pausing = run_ranks(_pause_between_steps, 2)
    assert pausing == {"fired": [False], "stalled": []}
    assert waiting["fired"] == [True]
    [(between_steps, states)] = waiting["stalled"]
    assert between_steps is True and states[-1] == semconv.STATE_IN_FLIGHT


@pytest.mark.parametrize("in_step, steps_taken, where, expected", [
    (False, 0, ("", "", []), "before step 0, outside any module"),  # before the first optimizer step
    (False, 3, ("", "", []), "between step 2 and step 3, outside any module"),
    (True, 3, ("Net.layers.1", "forward", []), "in step 3 at Net.layers.1 forward"),
])
def test_the_stall_line_and_diagnose_say_the_same_place(monkeypatch, caplog, in_step, steps_taken, where, expected):
    """The stderr line of a stall's first snapshot names the place as diagnose does for the same ``stalled`` span
    (it said "after step 0" for a stall before the first optimizer step, where diagnose says "before step 0")."""
    from commdebug_otel.core.stall_snapshot import stalled_record
    from commdebug_otel.offline.diagnose import _stall_where
    from commdebug_otel.stall import watchdog

    progress = Progress()
    if in_step:
        progress.step_began(progress.since_ns, steps_taken)
    elif steps_taken:  # step 2 ended: step 3 has not begun
        progress.step_began(progress.since_ns, steps_taken - 1)
        progress.step_ended(progress.since_ns, training=True)
    spans = []

    def snapshot(now, age_s, threshold_s, number, place):
        spans.append(stalled_record(progress, place, now, age_s, threshold_s, number, 64))

    monkeypatch.setattr(watchdog, "training_thread_location", lambda thread_id, fqn_of: where)
    monkeypatch.setattr(watchdog, "communicating", lambda thread_id: True)  # before step 0: waiting for a peer
    watch = StallWatch(_OneProcessRecorder(snapshot, progress, steps_taken), 2.0, lambda: None, lambda module: None)
    with caplog.at_level("WARNING", logger=watchdog.__name__):
        assert watch.check(progress.since_ns + 3 * 10**9)
    [message] = [record.getMessage() for record in caplog.records]
    assert message.startswith(f"commdebug-otel: rank 0 made no progress for 3.0 s ({expected}); a stall snapshot ")
    attrs = spans[0].attrs
    stall = {"between_steps": attrs.get(semconv.STALL_BETWEEN_STEPS, False), "step": attrs[semconv.STEP],
             "module": attrs[semconv.STALL_MODULE], "pass": attrs[semconv.STALL_PASS]}
    assert _stall_where(stall) == expected.removesuffix(", outside any module")


def test_a_module_named_by_the_open_record_is_the_one_the_span_the_line_and_the_verdict_record_say(
        monkeypatch, caplog):
    """In a backward pass no module is on the Python stack: the innermost open record names it. The ``stalled``
    span said it while the stderr line said "outside any module" and the verdict's record named none (the verdict
    then told the train_step): the place is worked out once, for all three."""
    from commdebug_otel.core.records import Record, SpanKind
    from commdebug_otel.core.stall_snapshot import stalled_record
    from commdebug_otel.stall import watchdog

    progress = Progress()
    progress.step_began(progress.since_ns, 3)
    open_record = Record(SpanKind.MODULE, "Net.layers.0 backward", progress.since_ns)
    open_record.fqn, open_record.pass_ = "Net.layers.0", "backward"
    spans, published = [], []
    recorder = _OneProcessRecorder(
        lambda now, age_s, threshold_s, number, place: spans.append(
            stalled_record(progress, place, now, age_s, threshold_s, number, 64)), progress, 3, open_record)
    monkeypatch.setattr(watchdog, "training_thread_location", lambda thread_id, fqn_of: ("", "backward", ["a.py:1"]))
    watch = StallWatch(recorder, 2.0, lambda: None, lambda module: None)
    monkeypatch.setattr(watch.exchange, "ready", lambda: True)
    monkeypatch.setattr(watch.exchange, "publish", lambda record, since_ns: published.append(record))
    with caplog.at_level("WARNING", logger=watchdog.__name__):
        assert watch.check(progress.since_ns + 3 * 10**9)
    [message] = [record.getMessage() for record in caplog.records]
    assert "(in step 3 at Net.layers.0 backward)" in message
    assert (spans[0].attrs[semconv.STALL_MODULE], spans[0].attrs[semconv.STALL_PASS]) == ("Net.layers.0", "backward")
    [record] = published
    assert (record.step, record.between_steps, record.module, record.pass_, record.stack) == (
        3, False, "Net.layers.0", "backward", ("a.py:1",))


def test_progress_gauges_read_the_latest_tracer_and_keep_no_old_one():
    """Tracers share a meter (one provider); the SDK keeps the callbacks of an instrument's first creation only,
    so the gauges read the first tracer's progress forever (and kept it alive). They read the latest one."""
    import gc
    import weakref

    from commdebug_otel.otel.metrics import CollectiveMetrics
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    meter = telemetry.meter_provider.get_meter("commdebug_otel")
    first = CollectiveMetrics(meter, progress=lambda: (3, 1.5, [("0", 7, 6, "default_pg")]))
    assert [(labels[semconv.RANK], value) for labels, value in telemetry.metric_points(semconv.METRIC_STEP_AGE)] \
        == [(3, 1.5)]
    first.close(1.0)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    assert telemetry.metric_points(semconv.METRIC_STEP_AGE) == []  # nothing of a tracer that is gone
    second = CollectiveMetrics(meter, progress=lambda: (5, 0.25, [("0", 9, 9, "default_pg")]))
    assert [(labels[semconv.RANK], value) for labels, value in telemetry.metric_points(semconv.METRIC_STEP_AGE)] \
        == [(5, 0.25)]
    assert [value for _, value in telemetry.metric_points(semconv.METRIC_SEQ_ISSUED)] == [9]
    second.close(1.0)
