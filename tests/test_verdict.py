"""The live cross-rank stall verdict: real gloo ranks, the job's own c10d store, a real OTLP receiver."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import itertools
import json
import os
import signal
import sys
import tempfile
import time

import pytest
import torch
from torch import nn

from commdebug_otel import semconv
from commdebug_otel.core.fact import CollectiveFact, GroupFacts
from commdebug_otel.offline.hangs import RECORD_FORMAT, InFlight, StallRecord, form_verdict, ranks_text
from commdebug_otel.stall.verdict import progress_record
from commdebug_otel.testing.otlp_receiver import OtlpReceiver
from tests import models
from tests.distributed import free_port

STALL_AFTER_S = 2.0
STUCK_STEP = 2
STUCK_S = 16.0  # a stuck rank's sleep: the verdict comes well before it ends
PG_TIMEOUT_S = 20  # gloo gives up on a collective that never completes (desync, a dead peer) after this
JOB_DEADLINE_S = 150  # the whole job, start-up on a loaded machine included
PER_STEP = 2  # forward all-reduces per step (one per layer), on the default group


class Layer(nn.Module):
    """All-reduces its output; its forward can be told to sleep before the all-reduce (a stuck module)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.sleep_s = 0.0
        self.odd = False  # issue a broadcast where the other ranks all-reduce (a desync)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        out = self.lin(x)
        if self.odd:
            torch.distributed.broadcast(out.detach(), src=0)
        else:
            torch.distributed.all_reduce(out.detach())
        return out


Net = functools.partial(models.Net, Layer)  # Net.layers.0 and .1


def _die_keeping_sockets(pid_file: str) -> None:
    """Exit at once, as a crashed rank does, but leave its sockets open (a child holds them): gloo's peers then
    wait as NCCL's do for a dead rank, instead of seeing the connection close."""
    child = os.fork()
    if child == 0:
        time.sleep(PG_TIMEOUT_S + 30)
        os._exit(0)
    with open(pid_file, "w") as handle:
        handle.write(str(child))
    os._exit(3)


def _hold_the_gil(seconds: int) -> None:
    """Sleep in C without releasing the GIL (``PyDLL`` calls keep it): the watchdog thread cannot run."""
    ctypes.PyDLL(None).sleep(seconds)


def _job(rank: int, world_size: int, port: int, env: dict, scenario: str, odd_rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    from commdebug_otel import CommTracer

    outcome = "finished"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        pair = dist.new_group([2, 3]) if scenario == "subgroup" else None  # (every rank makes it)
        with CommTracer() as tracer:
            if scenario in ("killed", "gil"):
                # The watchdog writes this rank's alive key at its first look after the process group exists;
                # a rank gone before that is "unknown" (documented): let it look first on a loaded machine.
                exchange, deadline = tracer._stall_watch.exchange, time.monotonic() + 30
                while exchange._store is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            for step in range(4):
                mine = rank == odd_rank and step == STUCK_STEP
                if mine and scenario == "between":
                    time.sleep(STUCK_S)  # before the step's first forward: between steps
                if mine and scenario == "killed":
                    _die_keeping_sockets(os.path.join(out_dir, "child.pid"))
                if mine and scenario == "gil":
                    _hold_the_gil(int(STUCK_S))
                model.layers[1].sleep_s = STUCK_S if mine and scenario == "module" else 0.0
                if scenario == "two":  # stuck in one module, then in the next: the verdict changes
                    model.layers[0].sleep_s = model.layers[1].sleep_s = STUCK_S * 0.6 if mine else 0.0
                model.layers[1].odd = mine and scenario == "desync"
                model(torch.ones(2, 8)).sum().backward()
                if scenario == "subgroup":
                    # After the step's backward, in the step: ranks 2-3 all-reduce on their pair, then every rank
                    # meets at a world barrier.
                    if mine:
                        time.sleep(STUCK_S)  # before the pair's all-reduce
                    if rank in (2, 3):
                        dist.all_reduce(torch.ones(2), group=pair)
                    dist.barrier()
                if mine and scenario == "behind":
                    time.sleep(STUCK_S)  # after the step's collectives: the others wait in the next step's first
                optimizer.step()
                optimizer.zero_grad()
    except Exception as error:  # gloo's timeout ends a job that can never finish (desync, a dead peer)
        outcome = f"raised {type(error).__name__}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"outcome": outcome}, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a peer still hung in gloo's teardown must not hold this one


def run_job(scenario: str, world_size: int, odd_rank: int, receiver: OtlpReceiver, trace_every: int = 1) -> dict:
    """Run the 4-step job on ``world_size`` gloo ranks with ``odd_rank`` misbehaving at step 2; return what
    each rank said (``{rank: outcome}``, ranks that died absent) and when the job started."""
    import torch.multiprocessing as mp

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": str(STALL_AFTER_S), "OTEL_METRIC_EXPORT_INTERVAL": "60000",
           "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": str(trace_every)}
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_job, args=(world_size, free_port(), env, scenario, odd_rank, out_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + JOB_DEADLINE_S
        try:
            while not context.join(timeout=1) and time.monotonic() < deadline:
                pass
        except Exception:  # a rank that died (os._exit(3)): the others go on
            while time.monotonic() < deadline and any(p.is_alive() for p in context.processes):
                time.sleep(0.5)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            child = os.path.join(out_dir, "child.pid")
            if os.path.exists(child):
                try:
                    os.kill(int(open(child).read()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        outcomes = {}
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                outcomes[rank] = json.load(open(path))["outcome"]
        return outcomes


def _verdicts(receiver: OtlpReceiver) -> list[dict]:
    """The stuck step's verdicts (a loaded machine can make step 0's start-up a stall of its own, with its own)."""
    return [span for span in receiver.spans() if span["name"] == semconv.SPAN_STALL_VERDICT
            and span["attributes"][semconv.STEP] == STUCK_STEP]


def _stalled_step_trace(receiver: OtlpReceiver) -> set[str]:
    return {span["trace_id"] for span in receiver.spans() if span["name"] == "train_step"
            and span["attributes"].get(semconv.STEP) == STUCK_STEP}


def _offline_agrees(receiver: OtlpReceiver, attrs: dict) -> None:
    """``diagnose`` over the same job's ``stalled`` spans names what the live verdict ``attrs`` names: one rule
    (offline/hangs.py) over the same snapshots; its entries of the stuck step (the behind ranks' own step)."""
    from commdebug_otel.offline import diagnose

    spans = [span | {"rank": span["resource"][semconv.RANK]} for span in receiver.spans()]
    found = [stall for stall in diagnose.stalls(spans) if stall["step"] == STUCK_STEP]
    assert found, [stall["step"] for stall in diagnose.stalls(spans)]
    assert ([stall["rank"] for stall in found], [w["rank"] for w in found[0]["waiting_ranks"]], found[0]["verdict"]) \
        == (attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_WAITING_RANKS],
            {"kind": attrs[semconv.VERDICT_KIND], "summary": attrs[semconv.VERDICT_SUMMARY]})


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


def _one_verdict(receiver: OtlpReceiver, capfd) -> dict:
    """The one verdict of the stuck step (with STALL_AFTER at 2 s, a loaded machine's slow start-up may stall
    step 0 for real: its verdicts are right but not this test's)."""
    err = capfd.readouterr().err
    sys.stderr.write(err)  # shown when the test fails
    verdicts = [v for v in _verdicts(receiver) if v["attributes"].get(semconv.STEP) == STUCK_STEP]
    assert len(verdicts) == 1, [v["attributes"] for v in _verdicts(receiver)]
    verdict = verdicts[0]
    attrs = verdict["attributes"]
    assert verdict["resource"][semconv.RANK] == min(attrs[semconv.VERDICT_WAITING_RANKS])  # the lowest that published
    assert verdict["trace_id"] in _stalled_step_trace(receiver)  # in the stalled step's trace
    assert err.count(f"commdebug-otel: stall verdict: {attrs[semconv.VERDICT_SUMMARY]}\n") == 1
    return attrs


@pytest.mark.parametrize("world_size", [4, 8])
def test_a_rank_stuck_in_a_module_is_named_with_the_collective_the_others_wait_in(receiver, capfd, world_size):
    outcomes = run_job("module", world_size, 2, receiver)
    assert outcomes == dict.fromkeys(range(world_size), "finished")
    attrs = _one_verdict(receiver, capfd)
    _latency_s(receiver)
    seq = STUCK_STEP * PER_STEP + 1  # layers.1's all-reduce of the stuck step
    waiting = [rank for rank in range(world_size) if rank != 2]
    assert {key: attrs[key] for key in (semconv.VERDICT_KIND, semconv.VERDICT_BEHIND_RANKS,
                                        semconv.VERDICT_WAITING_RANKS, semconv.VERDICT_GROUP, semconv.VERDICT_SEQ,
                                        semconv.VERDICT_OP, semconv.VERDICT_MODULE, semconv.VERDICT_WAITING_MODULE,
                                        semconv.STEP, semconv.VERDICT_WORLD_SIZE,
                                        semconv.VERDICT_REPORTED_RANKS)} == {
        semconv.VERDICT_KIND: "hang", semconv.VERDICT_BEHIND_RANKS: [2], semconv.VERDICT_WAITING_RANKS: waiting,
        semconv.VERDICT_GROUP: "0", semconv.VERDICT_SEQ: seq, semconv.VERDICT_OP: "all_reduce",
        semconv.VERDICT_MODULE: "Net.layers.1", semconv.VERDICT_WAITING_MODULE: "Net.layers.1",
        semconv.STEP: STUCK_STEP, semconv.VERDICT_WORLD_SIZE: world_size, semconv.VERDICT_REPORTED_RANKS: world_size}
    assert attrs[semconv.VERDICT_STACK][-1].endswith("in forward")  # the stuck line: Layer.forward's sleep
    assert "test_verdict.py" in attrs[semconv.VERDICT_STACK][-1]
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"rank 2 never entered all_reduce #{seq} on group 0, issued by Net.layers.1; it is in Net.layers.1 "
        f"forward; {ranks_text(waiting)} wait in it (step {STUCK_STEP}, {world_size} of {world_size} ranks reported)")
    _offline_agrees(receiver, attrs)


def test_a_rank_stuck_in_a_module_of_an_untraced_step_is_named_from_its_stack(receiver, capfd):
    """One step in 100 traced: the stuck step runs its module calls with no hook of ours (after the first); the
    verdict names the module from the training thread's Python stack all the same."""
    outcomes = run_job("module", 4, 2, receiver, trace_every=100)
    assert outcomes == dict.fromkeys(range(4), "finished")
    attrs = _one_verdict(receiver, capfd)
    seq = STUCK_STEP * PER_STEP + 1
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_SEQ],
            attrs[semconv.VERDICT_MODULE], attrs[semconv.VERDICT_WAITING_MODULE], attrs[semconv.STEP]) == (
        "hang", [2], seq, "Net.layers.1", "Net.layers.1", STUCK_STEP)
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"rank 2 never entered all_reduce #{seq} on group 0, issued by Net.layers.1; it is in Net.layers.1 "
        f"forward; {ranks_text([0, 1, 3])} wait in it (step {STUCK_STEP}, 4 of 4 ranks reported)")
    # Untraced: the stuck step exports no module span, only its stall snapshot.
    assert not [span for span in receiver.spans() if span["name"].startswith("Net.layers")
                and span["attributes"].get(semconv.STALL_SNAPSHOT) is None
                and span["trace_id"] in _stalled_step_trace(receiver)]


def _latency_s(receiver: OtlpReceiver) -> float:
    """Seconds from STALL_AFTER (after the earliest stall's start) to the verdict's arrival (reported, not
    asserted: a busy machine may take longer)."""
    from commdebug_otel.offline.otlp_json import span_dicts

    for request in receiver.requests("traces"):
        for span in span_dicts(request.request, "http"):
            if span["name"] == semconv.SPAN_STALL_VERDICT:
                latency = request.received_at - span["start_ns"] / 1e9 - STALL_AFTER_S
                print(f"verdict {latency:.1f} s after STALL_AFTER")
                return latency
    return float("nan")


def test_a_rank_stuck_between_steps_is_named_between_steps(receiver, capfd):
    outcomes = run_job("between", 4, 1, receiver)
    assert outcomes == dict.fromkeys(range(4), "finished")
    attrs = _one_verdict(receiver, capfd)
    _latency_s(receiver)
    seq = STUCK_STEP * PER_STEP  # layers.0's all-reduce: the first of the step rank 1 never began
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_WAITING_RANKS],
            attrs[semconv.VERDICT_SEQ], attrs[semconv.VERDICT_OP], attrs[semconv.VERDICT_MODULE],
            attrs[semconv.VERDICT_WAITING_MODULE], attrs[semconv.STEP]) == (
        "hang", [1], [0, 2, 3], seq, "all_reduce", "(between steps)", "Net.layers.0", STUCK_STEP)
    assert attrs[semconv.VERDICT_SUMMARY].startswith(
        f"rank 1 never entered all_reduce #{seq} on group 0, issued by Net.layers.0; it is in (between steps); ")
    _offline_agrees(receiver, attrs)


@pytest.mark.parametrize("scenario, state", [("killed", "dead"), ("gil", "silent")])
def test_a_rank_that_publishes_nothing_is_missing_dead_or_silent(receiver, capfd, scenario, state):
    """Rank 3 exits (its sockets held open, so its peers hang as NCCL's would), or holds the GIL in C (its
    watchdog cannot run): the others wait in layers.0's all-reduce; rank 3 wrote its alive key at start."""
    outcomes = run_job(scenario, 4, 3, receiver)
    assert 3 not in outcomes if scenario == "killed" else outcomes[3] == "finished"
    attrs = _one_verdict(receiver, capfd)
    _latency_s(receiver)
    seq = STUCK_STEP * PER_STEP
    key = semconv.VERDICT_DEAD_RANKS if state == "dead" else semconv.VERDICT_SILENT_RANKS
    other = semconv.VERDICT_SILENT_RANKS if state == "dead" else semconv.VERDICT_DEAD_RANKS
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[key], other in attrs,
            attrs[semconv.VERDICT_WAITING_RANKS], attrs[semconv.VERDICT_SEQ], attrs[semconv.VERDICT_OP],
            attrs[semconv.VERDICT_WAITING_MODULE], attrs[semconv.VERDICT_REPORTED_RANKS]) == (
        "missing", [3], [3], False, [0, 1, 2], seq, "all_reduce", "Net.layers.0", 3)
    said = "process gone" if state == "dead" else \
        "process alive but silent (holding the GIL, stopped, or not yet at its own stall threshold)"
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"rank 3 published nothing (rank 3: {said}); ranks 0-2 wait in all_reduce #{seq} on group 0, issued by "
        f"Net.layers.0 (step {STUCK_STEP}, 3 of 4 ranks reported)")


def test_two_ranks_issuing_different_collectives_at_one_seq_are_a_desync(receiver, capfd):
    outcomes = run_job("desync", 4, 1, receiver)
    assert len(outcomes) == 4 and all(outcome.startswith("raised") for outcome in outcomes.values())  # gloo gives up
    attrs = _one_verdict(receiver, capfd)
    _latency_s(receiver)
    seq = STUCK_STEP * PER_STEP + 1
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_WAITING_RANKS],
            attrs[semconv.VERDICT_SEQ], attrs[semconv.VERDICT_OP], attrs[semconv.VERDICT_MODULE],
            attrs[semconv.VERDICT_WAITING_MODULE]) == (
        "desync", [1], [0, 2, 3], seq, "all_reduce", "Net.layers.1", "Net.layers.1")
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"desync at #{seq} on group 0 in step {STUCK_STEP}: ranks 0,2-3 issued all_reduce from Net.layers.1; "
        "rank 1 issued broadcast from Net.layers.1 (4 of 4 ranks reported)")
    _offline_agrees(receiver, attrs)


def test_a_rank_one_step_behind_is_named_behind_not_missing(receiver, capfd):
    """Rank 1 sleeps after its stuck step's collectives (before optimizer.step): the others wait in the next
    step's first all-reduce. Ranks at different step numbers find each other's records (keyed per job)."""
    outcomes = run_job("behind", 4, 1, receiver)
    assert outcomes == dict.fromkeys(range(4), "finished")
    attrs = _one_verdict(receiver, capfd)
    seq = (STUCK_STEP + 1) * PER_STEP  # layers.0's all-reduce of the next step
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_WAITING_RANKS],
            attrs[semconv.VERDICT_GROUP], attrs[semconv.VERDICT_SEQ], attrs[semconv.VERDICT_OP],
            attrs[semconv.VERDICT_MODULE], attrs[semconv.VERDICT_WAITING_MODULE], attrs[semconv.STEP],
            attrs[semconv.VERDICT_REPORTED_RANKS]) == (
        "hang", [1], [0, 2, 3], "0", seq, "all_reduce", "train_step", "Net.layers.0", STUCK_STEP, 4)
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"rank 1 never entered all_reduce #{seq} on group 0, issued by Net.layers.0; it is in train_step; "
        f"ranks 0,2-3 wait in it (rank 1 in step {STUCK_STEP}, ranks 0,2-3 in step {STUCK_STEP + 1}, "
        "4 of 4 ranks reported)")
    _offline_agrees(receiver, attrs)


def test_a_rank_stuck_in_a_subgroup_gets_one_verdict_naming_who_waits_on_each_group(receiver, capfd):
    """Rank 3 sleeps before its pair's all-reduce: rank 2 waits for it on the pair's group, ranks 0-1 at the world
    barrier. One verdict, from rank 0, names rank 3 behind and both groups' waiters."""
    outcomes = run_job("subgroup", 4, 3, receiver)
    assert outcomes == dict.fromkeys(range(4), "finished")
    attrs = _one_verdict(receiver, capfd)
    pair_seq, world_seq = STUCK_STEP, (STUCK_STEP + 1) * (PER_STEP + 1) - 1  # a step: 2 all-reduces, a barrier
    assert (attrs[semconv.VERDICT_KIND], attrs[semconv.VERDICT_BEHIND_RANKS], attrs[semconv.VERDICT_WAITING_RANKS],
            attrs[semconv.VERDICT_GROUP], attrs[semconv.VERDICT_SEQ], attrs[semconv.VERDICT_OP],
            attrs[semconv.VERDICT_MODULE], attrs[semconv.STEP], attrs[semconv.VERDICT_REPORTED_RANKS]) == (
        "hang", [3], [0, 1, 2], "1", pair_seq, "all_reduce", "train_step", STUCK_STEP, 4)
    assert attrs[semconv.VERDICT_SUMMARY] == (
        f"rank 3 never entered all_reduce #{pair_seq} on group 1, issued by train_step; it is in train_step; "
        f"rank 2 waits in it; ranks 0-1 wait in barrier #{world_seq} on group 0, issued by train_step "
        f"(step {STUCK_STEP}, 4 of 4 ranks reported)")
    _offline_agrees(receiver, attrs)


# ------------------------------------------------------------------ records and verdicts, by hand
def _record(rank: int, step: int = 5, between: bool = False, module: str = "M", groups: dict | None = None,
            ring: list | None = None, causes: dict | None = None, world: dict | None = None) -> dict:
    """A rank's record through progress_record: ``groups`` {name: (issued, completed, mesh dim, size)},
    ``ring`` [(op, group, seq, module)]."""
    groups = groups or {"0": (9, 9, "", 4)}
    facts = {name: GroupFacts(name, size, dim) for name, (_, _, dim, size) in groups.items()}
    causes = causes or {}
    entries = [CollectiveFact(op, op, facts[group], seq, "float32", (4,), 4, 4, 16, False, "", -1, 0, 0, fqn,
                              "forward", _why(causes.get((group, seq))))
               for op, group, seq, fqn in ring or []]
    seqs = [(name, issued, completed, dim) for name, (issued, completed, dim, _) in groups.items()]
    return progress_record(rank, step, 10**18, 31.0, 1, not between, (module, "forward", ["a.py:1 in f"]), seqs,
                           entries)


def _why(cause: str | None) -> dict | None:
    """The why attributes that ``cause_text`` writes as ``cause``: ``"op source -> target"``."""
    if cause is None:
        return None
    op, _, placements = cause.partition(" ")
    source, _, target = placements.partition(" -> ")
    return {semconv.DTENSOR_CAUSE: op, semconv.DTENSOR_SOURCE_PLACEMENTS: source,
            semconv.DTENSOR_TARGET_PLACEMENTS: target}


def test_two_behind_ranks_each_in_its_own_tensor_parallel_group_of_a_2d_mesh():
    """Mesh (dp=2, tp=2): TP groups a = {0, 1}, b = {2, 3}; DP groups c = {0, 2}, d = {1, 3}. Ranks 0 and 2 are
    behind, each on its own TP group, which the other is not in: both named, each group's waiter and collective."""
    records = {rank: _record(rank, groups=groups, ring=ring) for rank, groups, ring in [
        (0, {"a": (5, 5, "tp", 2), "c": (7, 7, "dp", 2)}, []),
        (1, {"a": (6, 5, "tp", 2), "d": (7, 7, "dp", 2)}, [("all_reduce", "a", 6, "M")]),
        (2, {"b": (9, 9, "tp", 2), "c": (7, 7, "dp", 2)}, []),
        (3, {"b": (10, 9, "tp", 2), "d": (7, 7, "dp", 2)}, [("all_reduce", "b", 10, "M")])]}
    verdict = form_verdict(records, 4, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.group, verdict.seq) == \
        ("hang", (0, 2), (1, 3), "a", 6)
    assert verdict.summary == (
        "ranks 0,2 never entered all_reduce #6 on group a (tp), issued by M; they are in M forward; rank 1 waits in "
        "it; rank 3 waits in all_reduce #10 on group b (tp), issued by M (step 5, 4 of 4 ranks reported)")


def test_a_record_keeps_the_first_and_last_collectives_in_flight_and_their_why():
    ring = [("all_gather", "3", seq, "layers.12.attention") for seq in range(100, 140)]
    record = _record(5, groups={"3": (139, 99, "dp_shard", 1024)}, ring=ring,
                     causes={("3", 100): "aten.mm.default (Shard(dim=0),) -> (Replicate(),)"})
    group = record.groups["3"]
    assert [entry.seq for entry in group.in_flight] == [*range(100, 108), *range(132, 140)]
    assert group.in_flight[0] == InFlight(100, "all_gather", "layers.12.attention", "forward",
                                          "aten.mm.default (Shard(dim=0),) -> (Replicate(),)")
    assert (group.issued, group.completed, group.mesh_dim, group.size) == (139, 99, "dp_shard", 1024)
    text = record.to_json()
    assert StallRecord.from_json(text) == record  # named fields round-trip
    assert json.loads(text)["groups"]["3"]["in_flight"][0] == {
        "seq": 100, "op": "all_gather", "module": "layers.12.attention", "pass": "forward",
        "cause": "aten.mm.default (Shard(dim=0),) -> (Replicate(),)"}
    assert json.loads(text)["format"] == RECORD_FORMAT == 2
    assert StallRecord.from_json(text.replace('"format":2', '"format":1')) is None  # another version's record


def test_a_rank_behind_on_one_group_but_ahead_on_another_only_waits_down_the_chain():
    """Rank 1 is behind rank 3 on group 1 but waits on group 0 for rank 2, which is behind there: rank 2 is blamed."""
    records = {
        0: _record(0, groups={"0": (4, 3, "", 3)}, ring=[("all_reduce", "0", 4, "A")]),
        1: _record(1, groups={"0": (4, 3, "", 3), "1": (6, 6, "tp", 2)}, ring=[("all_reduce", "0", 4, "A")]),
        2: _record(2, module="B", groups={"0": (3, 3, "", 3)}),
        3: _record(3, groups={"1": (7, 6, "tp", 2)}, ring=[("all_gather", "1", 7, "C")]),
    }
    verdict = form_verdict(records, 4, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.group, verdict.seq, verdict.op, verdict.module,
            verdict.waiting_module) == ("hang", (2,), (0, 1), "0", 4, "all_reduce", "B", "A")


def test_a_missing_rank_on_another_host_is_not_known_dead_or_silent_and_many_ranks_are_counted():
    records = {rank: _record(rank, groups={"0": (7, 6, "", 1024)}, ring=[("all_reduce", "0", 7, "L")])
               for rank in range(1024) if rank != 37}
    verdict = form_verdict(records, 1024, 5, {37: "unknown"})
    assert (verdict.kind, verdict.behind, len(verdict.waiting), verdict.dead, verdict.silent) == (
        "missing", (37,), 1023, (), ())
    assert verdict.summary == ("rank 37 published nothing (rank 37: dead or holding the GIL, not known from here); "
                               "the other 1,023 ranks wait in all_reduce #7 on group 0, issued by L "
                               "(step 5, 1023 of 1024 ranks reported)")


def test_a_hang_names_the_ranks_that_published_nothing_too():
    records = {0: _record(0, groups={"0": (5, 4, "", 3)}, ring=[("all_reduce", "0", 5, "L1")]),
               1: _record(1, between=True, groups={"0": (4, 4, "", 3)})}
    verdict = form_verdict(records, 3, 5, {2: "dead"})
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.dead) == ("hang", (1,), (0,), (2,))
    assert verdict.summary == ("rank 1 never entered all_reduce #5 on group 0, issued by L1; it is in (between steps); "
                               "rank 0 waits in it; rank 2 published nothing (step 5, 2 of 3 ranks reported)")


def test_a_rank_waiting_for_a_dead_rank_on_another_group_is_not_blamed():
    """FSDP2 + TP on a (dp=2, tp=2) mesh, rank 3 dead at a step's start: rank 1 waits for it in the dp all-gather
    (group 2, {1, 3}), so it never enters the tp all-reduce (group 3, {0, 1}) where rank 0 waits for it; rank 2
    waits for rank 3 on their tp group (4). Rank 1 is behind on group 3 only because it waits down the chain: the
    verdict is rank 3 missing (``benchmarks/accuracy.py``'s dead/fsdp_tp scenario named rank 1 hung)."""
    records = {
        0: _record(0, groups={"1": (27, 27, "dp", 2), "3": (51, 50, "tp", 2)}, ring=[("all_reduce", "3", 51, "E")]),
        1: _record(1, groups={"2": (27, 26, "dp", 2), "3": (50, 50, "tp", 2)}, ring=[("all_gather", "2", 27, "T")]),
        2: _record(2, groups={"1": (27, 27, "dp", 2), "4": (51, 50, "tp", 2)}, ring=[("all_reduce", "4", 51, "E")]),
    }
    verdict = form_verdict(records, 4, 5, {3: "dead"})
    assert (verdict.kind, verdict.behind, verdict.dead, verdict.reported) == ("missing", (3,), (3,), 3)
    assert verdict.summary.startswith("rank 3 published nothing (rank 3: process gone); ")
    # A rank stuck with an asynchronous collective in flight, behind the others on that group, is still behind
    # while a rank has not yet published.
    stuck = {rank: _record(rank, groups={"0": (8, 7, "", 4)}, ring=[("all_reduce", "0", 8, "L")]) for rank in (0, 2)}
    stuck[3] = _record(3, module="B", groups={"0": (7, 6, "", 4)}, ring=[("all_gather", "0", 7, "A")])
    verdict = form_verdict(stuck, 4, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.seq) == ("hang", (3,), (0, 2), 8)


def test_a_pipeline_stage_stuck_with_a_recv_in_flight_is_a_hang_not_a_desync():
    """Stage 1 posted its recv #18 and is stuck in a module; stage 0's send #18 and its recv #19 (the gradient)
    are in flight: a send and a recv at one seq are one transfer (``benchmarks/accuracy.py``'s hang_module/pp
    scenario said desync)."""
    records = {0: _record(0, groups={"0": (19, 17, "", 2)}, ring=[("send", "0", 18, "S0"), ("recv", "0", 19, "S0")]),
               1: _record(1, module="B", groups={"0": (18, 17, "", 2)}, ring=[("recv", "0", 18, "S1")])}
    verdict = form_verdict(records, 2, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.seq, verdict.op, verdict.module) == (
        "hang", (1,), (0,), 19, "recv", "B")


def test_no_verdict_from_a_behind_rank_record_older_than_the_others():
    """Rank 1's record says seq 3, but rank 0 knows seq 4 complete: rank 1 issued it since (its record is stale)."""
    records = {0: _record(0, groups={"0": (5, 4, "", 2)}, ring=[("all_reduce", "0", 5, "L1")]),
               1: _record(1, groups={"0": (3, 3, "", 2)})}
    assert form_verdict(records, 2, 5) is None


def test_no_verdict_when_every_rank_waits_in_the_same_collective_or_none_waits():
    same = {rank: _record(rank, ring=[("all_reduce", "0", 9, "L")], groups={"0": (9, 8, "", 2)}) for rank in (0, 1)}
    idle = {rank: _record(rank) for rank in (0, 1)}
    assert form_verdict(same, 2, 5) is None and form_verdict(idle, 2, 5) is None


def test_a_rank_at_another_step_number_is_matched_by_seq_and_gives_the_step_of_the_behind_rank():
    """Rank 1 finished step 3's collectives (seq 7) and is stuck before its optimizer step; ranks 0, 2 wait in
    step 4's first all-reduce (seq 8): rank 1 is behind, and the verdict's step is rank 1's."""
    records = {rank: _record(rank, step=4, groups={"0": (8, 7, "", 3)}, ring=[("all_reduce", "0", 8, "L0")])
               for rank in (0, 2)}
    records[1] = dataclasses.replace(_record(1, step=3, module="", groups={"0": (7, 7, "", 3)}), pass_="")
    verdict = form_verdict(records, 3, 4)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.group, verdict.seq, verdict.op, verdict.module,
            verdict.step, verdict.reported) == ("hang", (1,), (0, 2), "0", 8, "all_reduce", "train_step", 3, 3)
    assert verdict.summary == ("rank 1 never entered all_reduce #8 on group 0, issued by L0; it is in train_step; "
                               "ranks 0,2 wait in it (rank 1 in step 3, ranks 0,2 in step 4, 3 of 3 ranks reported)")


def test_a_rank_stuck_in_a_subgroup_is_named_with_its_waiters_on_every_group():
    """Rank 3 never entered its pair's all-reduce (group 1, seq 6): rank 2 waits there; ranks 0-1 wait at the world
    barrier (group 0, seq 12) that ranks 2-3 have not reached. The pair's group comes first: rank 2, waiting there,
    has not reached the barrier either."""
    records = {rank: _record(rank, groups={"0": (12, 11, "", 4)}, ring=[("barrier", "0", 12, "")]) for rank in (0, 1)}
    records[2] = _record(2, groups={"0": (11, 11, "", 4), "1": (6, 5, "", 2)}, ring=[("all_reduce", "1", 6, "P")])
    records[3] = _record(3, module="B", groups={"0": (11, 11, "", 4), "1": (5, 5, "", 2)})
    verdict = form_verdict(records, 4, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.group, verdict.seq, verdict.op, verdict.module,
            verdict.waiting_module, verdict.step) == ("hang", (3,), (0, 1, 2), "1", 6, "all_reduce", "B", "P", 5)
    assert verdict.summary == ("rank 3 never entered all_reduce #6 on group 1, issued by P; it is in B forward; "
                               "rank 2 waits in it; ranks 0-1 wait in barrier #12 on group 0, issued by M "
                               "(step 5, 4 of 4 ranks reported)")


def test_an_idle_rank_is_blamed_when_a_waiting_rank_is_not_in_the_group_of_the_first_collective_in_flight():
    records = {0: _record(0, groups={"0": (5, 4, "", 2)}, ring=[("all_reduce", "0", 5, "A")]),
               1: _record(1, groups={"1": (3, 2, "", 1)}, ring=[("all_gather", "1", 3, "B")]),
               2: _record(2, module="C", groups={"0": (5, 5, "", 2)})}
    verdict = form_verdict(records, 3, 5)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.group, verdict.seq, verdict.module) == (
        "hang", (2,), (0,), "0", 5, "C")


def test_a_desync_between_ranks_at_different_step_numbers_names_each_side_s_step():
    records = {0: _record(0, step=4, groups={"0": (8, 7, "", 2)}, ring=[("all_reduce", "0", 8, "A")]),
               1: _record(1, step=3, groups={"0": (8, 7, "", 2)}, ring=[("broadcast", "0", 8, "B")])}
    verdict = form_verdict(records, 2, 4)
    assert (verdict.kind, verdict.behind, verdict.waiting, verdict.step) == ("desync", (1,), (0,), 3)
    assert verdict.summary == ("desync at #8 on group 0 (rank 1 in step 3, rank 0 in step 4): rank 0 issued all_reduce "
                               "from A; rank 1 issued broadcast from B (2 of 2 ranks reported)")


# ------------------------------------------------------------------ the exchange through a store
def _info(rank: int, world_size: int, distributed: bool = True):
    from commdebug_otel.core.job_identity import RankInfo

    return RankInfo(rank=rank, world_size=world_size, local_rank=rank, node_rank=0, run_id="none", backend="gloo",
                    distributed=distributed)


class CountingStore:
    """A store proxy counting calls, and bytes written and read (keys and values)."""

    def __init__(self, store) -> None:
        self.store, self.calls, self.bytes = store, 0, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            self.calls += 1
            self.bytes += sum(len(arg) for arg in args if isinstance(arg, (str, bytes)))
            self.bytes += sum(len(item) for arg in args if isinstance(arg, list) for item in arg)
            out = method(*args)
            self.bytes += len(out) if isinstance(out, (str, bytes)) else sum(
                len(item) for item in out) if isinstance(out, list) else 0
            return out
        return call


def test_1024_simulated_ranks_through_a_real_tcp_store_give_one_verdict_and_leave_no_key():
    """Keys, bytes and time to form the verdict for 1,024 ranks' records (printed: docs/performance.md)."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import StoreExchange

    world = 1024
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    store = CountingStore(server)
    exported = []
    base_keys = server.num_keys()
    exchanges = [StoreExchange(lambda rank=rank: _info(rank, world), lambda own: "job-1",
                               lambda v, s: exported.append(v), lambda timeout_s: store, wait_s=60.0)
                 for rank in range(world)]
    assert all(exchange.ready() for exchange in exchanges)  # each rank's alive key
    groups = {"0": (811, 811, "", world), "3": (811, 810, "dp_shard", 32), "5": (40, 40, "tp", 8)}
    ring = [("all_gather", "3", 811, "Transformer.layers.12.attention")] + [
        ("reduce_scatter", "0", seq, "Transformer.layers.11") for seq in range(748, 811)]
    cause = {("3", 812): "aten.mm.default (Shard(dim=0),) -> (Replicate(),)"}
    records = []
    for rank in range(world):
        if rank == 37:
            records.append(_record(rank, module="Transformer.layers.12", groups=groups, ring=ring))
        else:
            ahead = dict(groups, **{"3": (812, 810, "dp_shard", 32)})
            records.append(_record(rank, groups=ahead, ring=[*ring, ("all_gather", "3", 812,
                                                                      "Transformer.layers.12.attention")],
                                   causes=cause))
    calls, sent = store.calls, store.bytes
    began = time.perf_counter()
    for exchange, record in zip(exchanges, records):
        exchange.publish(record, since_ns=1)
    published_s = time.perf_counter() - began
    publish_calls, publish_bytes = store.calls - calls, store.bytes - sent
    keys = server.num_keys() - base_keys
    for exchange in exchanges[1:]:
        exchange.poll()  # not the leader: one read each, then nothing
    calls, sent = store.calls, store.bytes
    began = time.perf_counter()
    exchanges[0].poll()
    formed_s = time.perf_counter() - began
    print(f"\n{world} ranks: {keys} keys ({world} alive keys among them), {publish_calls} calls and "
          f"{publish_bytes / 1e6:.2f} MB to publish ({published_s:.2f} s, one client in turn), largest record "
          f"{max(len(r.to_json()) for r in records)} B; the leader read {store.bytes - sent} B in "
          f"{store.calls - calls} calls and formed the verdict in {formed_s:.3f} s")
    assert len(exported) == 1 and exchanges[0].exported == 1
    verdict = exported[0]
    assert (verdict.kind, verdict.behind, verdict.group, verdict.mesh_dim, verdict.seq, verdict.op, verdict.module,
            verdict.waiting_module, verdict.cause, verdict.reported) == (
        "hang", (37,), "3", "dp_shard", 812, "all_gather", "Transformer.layers.12",
        "Transformer.layers.12.attention", "aten.mm.default (Shard(dim=0),) -> (Replicate(),)", world)
    assert verdict.summary == (
        "rank 37 never entered all_gather #812 on group 3 (dp_shard), issued by Transformer.layers.12.attention for "
        "aten.mm.default (Shard(dim=0),) -> (Replicate(),); it is in Transformer.layers.12 forward; the other 1,023 "
        "ranks wait in it (step 5, 1024 of 1024 ranks reported)")
    assert keys == 2 * world + 4  # alive and record keys; index, count, leader, round/1
    for exchange in exchanges:
        exchange.ended()
    assert server.num_keys() - base_keys == world  # the alive keys only
    for exchange in exchanges:
        exchange.stop()
    assert server.num_keys() == base_keys


class _StalledRecorder:
    """What StallWatch reads of a recorder, stalled for 10 s in step 3 (a fake: no process group)."""

    def __init__(self, world_size: int, distributed: bool) -> None:
        from commdebug_otel.core.progress import Progress

        self.thread_id = -1
        self.progress = Progress()
        self.progress.step_began(self.progress.since_ns - 10 * 10**9, 3)
        self.info = _info(0, world_size, distributed)
        self.snapshots = []
        self.steps_taken = 3

    def rank(self):
        return self.info

    def job_id(self, store=None):
        return "job-1"

    def stall_place(self, where):
        from commdebug_otel.core.stall_snapshot import stall_place

        return stall_place(self.progress, where, None, self.steps_taken)

    def stall_snapshot(self, now, age_s, threshold_s, snapshot, place):
        self.snapshots.append(snapshot)
        return True


class _BrokenStore:
    def __getattr__(self, name):
        def call(*args):
            raise RuntimeError("connection reset")
        return call


@pytest.mark.parametrize("failure", ["connect", "calls"])
def test_a_store_that_fails_costs_one_message_and_the_snapshots_go_on(caplog, failure):
    from commdebug_otel.stall.verdict import StoreExchange
    from commdebug_otel.stall.watchdog import StallWatch

    recorder = _StalledRecorder(2, True)
    connects = []

    def connect(timeout_s):
        connects.append(timeout_s)
        if failure == "connect":
            raise RuntimeError("store unreachable")
        return _BrokenStore()

    exchange = StoreExchange(recorder.rank, recorder.job_id, lambda v, s: None, connect)
    watch = StallWatch(recorder, 1.0, lambda: None, lambda module: None, exchange=exchange)
    start = recorder.progress.since_ns
    for second in range(10, 40):
        watch.check(start + second * 10**9)
        exchange.heartbeat()
        exchange.poll()
    assert recorder.snapshots == [1, 2, 3]  # at 10 s, 16 s and 32 s (2T, 4T... of the stall), as without the exchange
    said = [r.getMessage() for r in caplog.records if "cross-rank stall verdict is off" in r.getMessage()]
    assert len(said) == 1 and len(connects) == 1 and not exchange.on


def test_one_process_never_asks_for_a_store():
    from commdebug_otel.stall.verdict import StoreExchange
    from commdebug_otel.stall.watchdog import StallWatch

    recorder = _StalledRecorder(1, False)
    connects = []
    exchange = StoreExchange(recorder.rank, recorder.job_id, lambda v, s: None, connects.append)
    watch = StallWatch(recorder, 1.0, lambda: None, lambda module: None, exchange=exchange)
    watch.check(recorder.progress.since_ns + 10 * 10**9)
    exchange.heartbeat()
    exchange.poll()
    assert recorder.snapshots == [1] and connects == [] and exchange.on


def test_the_verdict_is_exported_again_only_when_it_changes():
    """Rank 2's record comes late: first rank 2 is missing, then (at rank 0's next snapshot) rank 2 is behind."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import StoreExchange

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    exported = []
    exchanges = [StoreExchange(lambda rank=rank: _info(rank, 3), lambda own: "job-2", lambda v, s: exported.append(v),
                               lambda timeout_s: store, wait_s=0.0) for rank in range(3)]
    waiting = {"groups": {"0": (4, 3, "", 3)}, "ring": [("all_reduce", "0", 4, "A")]}
    for snapshot in (1, 2):
        for rank in (0, 1):
            exchanges[rank].publish(dataclasses.replace(_record(rank, **waiting), snapshot=snapshot), since_ns=1)
        exchanges[0].poll()
    assert [(v.kind, v.behind) for v in exported] == [("missing", (2,))]  # said once, not again unchanged
    exchanges[2].publish(_record(2, module="B", groups={"0": (3, 3, "", 3)}), since_ns=1)
    exchanges[0].publish(dataclasses.replace(_record(0, **waiting), snapshot=3), since_ns=1)
    exchanges[0].poll()
    assert [(v.kind, v.behind, v.module) for v in exported] == [("missing", (2,), ""), ("hang", (2,), "B")]
    for exchange in exchanges:
        exchange.stop()
    assert store.num_keys() == 0


def test_ranks_publishing_at_different_steps_get_one_verdict_and_a_leader_that_leaves_is_replaced():
    """Rank 1 publishes at step 3, ranks 0, 2 and 3 at step 4: one verdict naming rank 1 behind (keyed per step,
    rank 0 said rank 1 published nothing). Rank 0's stall then ends: rank 1, the lowest with a live record, leads
    (rank 0, alive, is then among the ranks that published nothing)."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import StoreExchange

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    exported = []
    exchanges = [StoreExchange(lambda rank=rank: _info(rank, 4), lambda own: "job-4",
                               lambda v, s, rank=rank: exported.append((rank, v.kind, v.behind, v.waiting, v.step)),
                               lambda timeout_s: store, wait_s=0.0) for rank in range(4)]
    waiting = {"step": 4, "groups": {"0": (8, 7, "", 4)}, "ring": [("all_reduce", "0", 8, "A")]}
    for rank in (3, 2, 0):
        exchanges[rank].publish(_record(rank, **waiting), since_ns=1)
    exchanges[1].publish(_record(1, step=3, module="B", groups={"0": (7, 7, "", 4)}), since_ns=2)
    for exchange in exchanges:
        exchange.poll()
    assert exported == [(0, "hang", (1,), (0, 2, 3), 3)]
    exchanges[0].ended()
    later = {"snapshot": 2, "time_ns": time.time_ns() + 10**6}  # taken after rank 0's stall ended
    exchanges[1].publish(dataclasses.replace(_record(1, step=3, module="C", groups={"0": (7, 7, "", 4)}), **later),
                         since_ns=2)
    for rank in (2, 3):
        exchanges[rank].publish(dataclasses.replace(_record(rank, **waiting), **later), since_ns=1)
    for exchange in exchanges:
        exchange.poll()
    assert exported[1:] == [(1, "hang", (1,), (2, 3), 3)]
    for exchange in exchanges:
        exchange.stop()
    assert store.num_keys() == 0


def test_no_verdict_from_records_all_taken_before_a_rank_s_stall_ended():
    """Ranks 0-2 wait in all_reduce #4, rank 3 holds the GIL: "missing". Rank 3's watchdog then runs and publishes
    its stall (between steps) as the collective completes; rank 0's stall ends, and rank 1, now the lowest with a
    record, would say rank 3 is behind and rank 0 silent, in a stall that is over: nothing more is said."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import StoreExchange

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    exported = []
    exchanges = [StoreExchange(lambda rank=rank: _info(rank, 4), lambda own: "job-5",
                               lambda v, s, rank=rank: exported.append((rank, v.kind, v.behind)),
                               lambda timeout_s: store, wait_s=0.0) for rank in range(4)]
    waiting = {"groups": {"0": (4, 3, "", 4)}, "ring": [("all_reduce", "0", 4, "A")]}
    for rank in (0, 1, 2):
        exchanges[rank].publish(_record(rank, **waiting), since_ns=1)
    exchanges[0].poll()
    assert exported == [(0, "missing", (3,))]
    now = time.time_ns()
    exchanges[3].publish(dataclasses.replace(_record(3, between=True, groups={"0": (3, 3, "", 4)}), time_ns=now),
                         since_ns=2)
    exchanges[0].ended()
    for exchange in exchanges:
        exchange.poll()
    assert exported == [(0, "missing", (3,))]
    for exchange in exchanges:
        exchange.stop()
    assert store.num_keys() == 0


def test_a_verdict_that_changes_while_the_stall_lasts_is_exported_again(receiver, capfd):
    """Rank 2 sleeps in layers.0, then in layers.1 (9.6 s each): the snapshots at 2, 4 and 8 s see it in layers.0,
    the one at 16 s in layers.1, 3.2 s before the stall ends (snapshots at 2T, 4T, 8T... of the stall on every rank:
    at twice the age instead, late looks on a loaded machine put the fourth past 19.2 s, and no change was said)."""
    outcomes = run_job("two", 4, 2, receiver)
    assert outcomes == dict.fromkeys(range(4), "finished")
    verdicts = sorted(_verdicts(receiver), key=lambda span: span["end_ns"])
    said = [(v["attributes"][semconv.VERDICT_SEQ], v["attributes"][semconv.VERDICT_MODULE],
             v["attributes"][semconv.VERDICT_WAITING_MODULE]) for v in verdicts]
    seq = STUCK_STEP * PER_STEP
    # First and last; between them a record sampled as the rank moved on (its place read just before it issued
    # seq 4, its seqs just after, on a loaded machine) may give one more, corrected at the next snapshot.
    assert said[0] == (seq, "Net.layers.0", "Net.layers.0") and said[-1] == (seq + 1, "Net.layers.1", "Net.layers.1")
    assert len(said) <= 3 and all(a != b for a, b in itertools.pairwise(said))  # said again only when it changed
    assert len({v["trace_id"] for v in verdicts}) == 1
    err = capfd.readouterr().err
    assert [err.count(v["attributes"][semconv.VERDICT_SUMMARY]) for v in verdicts] == [1] * len(verdicts)


def test_a_lower_rank_that_publishes_late_does_not_say_the_same_verdict_again():
    """Rank 1 says rank 2 is behind on group 1; rank 0 (not in group 1) comes late and takes over: same verdict."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import StoreExchange

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    exported = []
    exchanges = [StoreExchange(lambda rank=rank: _info(rank, 3), lambda own: "job-3",
                               lambda v, s, rank=rank: exported.append((rank, v.kind, v.behind, v.waiting)),
                               lambda timeout_s: store, wait_s=0.0) for rank in range(3)]
    exchanges[1].publish(_record(1, groups={"1": (6, 5, "tp", 2)}, ring=[("all_gather", "1", 6, "A")]), since_ns=1)
    exchanges[2].publish(_record(2, module="B", groups={"1": (5, 5, "tp", 2)}), since_ns=1)
    exchanges[1].poll()
    exchanges[0].publish(_record(0, groups={"0": (3, 3, "", 3)}), since_ns=1)
    exchanges[0].poll()
    exchanges[1].poll()
    assert exported == [(1, "hang", (2,), (1,))]


def test_a_record_of_another_format_or_damaged_is_counted_and_its_rank_read_as_absent(caplog):
    """Rank 2 runs another version (format 1's positional lists), rank 3's record is damaged: both are left out
    and counted, said once, and the verdict is formed from the others (it names them missing), not turned off."""
    import torch.distributed as dist

    from commdebug_otel.stall.verdict import KEY_ROOT, StoreExchange

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    exported = []
    exchange = StoreExchange(lambda: _info(0, 4), lambda own: "job-9", lambda v, s: exported.append(v),
                             lambda timeout_s: store, wait_s=0.0)
    prefix = f"{KEY_ROOT}/job-9/stall/"
    store.set(f"{prefix}r/2", json.dumps({"format": 1, "rank": 2, "groups": {"0": [4, 3, "", [[4, "all_reduce"]]]}}))
    store.set(f"{prefix}r/3", '{"format": 2, "rank": 3}')
    store.append(f"{prefix}index", "2,3,")
    waiting = {"groups": {"0": (4, 3, "", 4)}, "ring": [("all_reduce", "0", 4, "A")]}
    with caplog.at_level("WARNING", logger="commdebug_otel.stall.verdict"):
        exchange.publish(_record(0, **waiting), since_ns=1)
        exchange.poll()
    assert exchange.on and exchange.ignored == 2
    assert [(v.kind, v.behind) for v in exported] == [("missing", (1, 2, 3))]
    assert [record.getMessage() for record in caplog.records if "not of format" in record.getMessage()] == [
        "commdebug-otel: stall verdict: a rank's record is not of format 2 (another commdebug-otel version, or "
        "damaged): that rank reads as absent"]
    exchange.stop()
