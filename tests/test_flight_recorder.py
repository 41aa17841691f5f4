"""torch's Flight Recorder beside our stall snapshots, joined by ``diagnose`` (issue 30 item 4).

A real 2-rank gloo job with ``TORCH_FR_BUFFER_SIZE`` set hangs (one rank sleeps in a module while
the other waits in a DTensor redistribution's all_gather): each stall snapshot writes the rank's
Flight Recorder buffer (torch's JSON) to the run folder, and ``diagnose`` names FR's unfinished
entry with our module, step and DTensor why. Hand-made dumps check that no file stops ``diagnose``
and that a pickle is read only when asked for, and then without loading any class or function.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from commdebug_otel import semconv
from commdebug_otel.cli import main
from commdebug_otel.offline import flight_recorder
from commdebug_otel.stall import flight_recorder as live
from tests.distributed import run_ranks
from tests.models import AllReduceLinear, Net

from otlp_files import span as otlp_span
from otlp_files import write_otlp

STEPS = 4
STUCK_STEP = 2
STUCK_S = 6.0
STALL_AFTER_S = 1.5


class Gather(nn.Module):
    """Shard(0) -> Replicate of its input (a DTensor all_gather); sleeps first when told (the stuck rank)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.sleep_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.sleep_s:
            time.sleep(self.sleep_s)
        return DTensor.from_local(x, self.mesh, [Shard(0)]).redistribute(self.mesh, [Replicate()]).to_local()


def _train_with_one_rank_stuck(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import CommTracer

    torch.manual_seed(0)
    model = Net(layers=[AllReduceLinear(8), Gather(init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with CommTracer():
        for step in range(STEPS):
            model.layers[1].sleep_s = STUCK_S if rank == 1 and step == STUCK_STEP else 0.0
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.fixture(scope="module")
def stuck_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fr")
    env = {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(out), "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": str(STALL_AFTER_S),
           "TORCH_FR_BUFFER_SIZE": "256"}
    run_ranks(_train_with_one_rank_stuck, 2, env=env)
    [run] = out.glob("run-*")
    return run


def _diagnose(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "diagnose", *argv],
                          capture_output=True, text=True, timeout=120)


def test_the_stall_snapshot_writes_each_ranks_flight_recorder_json_to_the_run_folder(stuck_run):
    dumps = sorted(path.name for path in stuck_run.glob(f"{semconv.FLIGHT_RECORDER_FILE_PREFIX}*"))
    assert dumps == [f"{semconv.FLIGHT_RECORDER_FILE_PREFIX}{rank}.json" for rank in (0, 1)]
    waiting = json.loads((stuck_run / dumps[0]).read_text())  # torch's own JSON, as torch wrote it
    [pending] = [entry for entry in waiting["entries"] if not entry["retired"]]
    # gloo in torch 2.13: collective_seq_id counts from 1 per group; the state stays "scheduled".
    assert (pending["profiling_name"], pending["collective_seq_id"], pending["process_group"][0]) == (
        "gloo:all_gather", 2 * STUCK_STEP + 2, "0")


def test_diagnose_joins_the_waiting_ranks_fr_entry_with_its_module_step_and_dtensor_why(stuck_run):
    done = _diagnose(str(stuck_run), "--format", "json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["flight_recorder"]
    assert [dump["rank"] for dump in found["dumps"]] == [0, 1]
    # Every FR entry is one of our collectives, at the seq our spans give it, with the same op.
    assert found["joined"] == found["entries"] > 0 and found["disagree"] == []
    [pending] = found["pending"]
    assert (pending["rank"], pending["fr_op"], pending["group"], pending["fr_seq"], pending["seq"]) == (
        0, "gloo:all_gather", "0", 2 * STUCK_STEP + 2, 2 * STUCK_STEP + 1)
    assert (pending["module"], pending["pass"], pending["step"], pending["our_op"]) == (
        "Net.layers.1", "forward", STUCK_STEP, "all_gather")
    assert pending["why"] == {"cause": "redistribute", "source": "(Shard(dim=0),)", "target": "(Replicate(),)"}
    # FR's own progress per group: the stuck rank 1 enqueued one collective less than rank 0 on group 0.
    status = {dump["rank"]: dump["pg_status"]["0"] for dump in found["dumps"]}
    assert status[0]["enqueued"] == status[1]["enqueued"] + 1 == 2 * STUCK_STEP + 2
    text = _diagnose(str(stuck_run))
    assert text.returncode == 0, text.stderr
    assert f"group 0: rank(s) 1 enqueued FR seq {2 * STUCK_STEP + 1}, others up to {2 * STUCK_STEP + 2}" in text.stdout
    assert ("rank 0: gloo:all_gather on group 0 (default_pg), FR seq 6 Float [2, 8], scheduled -> our seq 5 "
            "all_gather in Net.layers.1 (forward), step 2, why: redistribute (Shard(dim=0),) -> (Replicate(),)"
            ) in text.stdout, text.stdout


class Sync(nn.Module):
    """All-reduces a copy of its output on ``group``; with ``skew`` rank 1 broadcasts instead (a desync)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.group = group
        self.skew = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        out = x.detach().clone()
        if self.skew and torch.distributed.get_rank() == 1:
            torch.distributed.broadcast(out, 0, group=self.group)
        else:
            torch.distributed.all_reduce(out, group=self.group)
        return x


def _train_into_a_desync(rank: int, world_size: int) -> str:
    import datetime

    from commdebug_otel import CommTracer

    group = torch.distributed.new_group([0, 1], timeout=datetime.timedelta(seconds=DESYNC_TIMEOUT_S))
    model = nn.Sequential()
    model.add_module("sync", Sync(group))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with CommTracer():
        for step in range(2):
            model.sync.skew = step == 1
            try:
                model(torch.ones(2, 8)).sum().backward()
            except RuntimeError:  # gloo's timeout (or the peer's connection closed by it)
                return "raised"
            optimizer.step()
            optimizer.zero_grad()
    return ""


DESYNC_TIMEOUT_S = 6


def test_a_desync_names_each_ranks_fr_op_at_the_same_seq_with_its_module(tmp_path):
    """rank 0 all-reduces where rank 1 broadcasts: both hang in gloo until the group's timeout, the
    snapshots dump FR on both, and diagnose reads the two ops at FR seq 2 of group 1, each in Sequential.sync."""
    env = {"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), "OTEL_PYTHON_COMMDEBUG_STALL_AFTER": str(STALL_AFTER_S),
           "TORCH_FR_BUFFER_SIZE": "64"}
    raised = run_ranks(_train_into_a_desync, 2, env=env)
    assert raised == ["raised", "raised"]
    [run] = tmp_path.glob("run-*")
    done = _diagnose(str(run), "--format", "json")
    assert done.returncode == 0, done.stderr
    [desync] = json.loads(done.stdout)["flight_recorder"]["desyncs"]
    assert (desync["group"], desync["fr_seq"]) == ("1", 2)
    sides = {rank: (entry["fr_op"], entry["seq"], entry["our_op"], entry["module"])
             for rank, entry in desync["ranks"].items()}
    assert sides == {"0": ("gloo:all_reduce", 1, "all_reduce", "Sequential.sync"),
                     "1": ("gloo:broadcast", 1, "broadcast", "Sequential.sync")}


# ----------------------------------------------------------------- hand-made dumps


def _entry(seq, op="gloo:all_reduce", group="0", retired=True, created=1_500, **extra):
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": op,
            "process_group": [group, "default_pg"], "state": "scheduled", "retired": retired,
            "time_created_ns": created, "input_sizes": [[4]], "input_dtypes": ["Float"], **extra}


def _dump(*entries):
    return {"version": "2.10", "entries": list(entries), "pg_status": {"0": {
        "last_enqueued_collective": str(len(entries)), "last_completed_collective": "1"}}}


def _spans_with_two_all_reduces(folder):
    """Rank 0's spans: all_reduce seq 0 and 1 on group 0, in module M (issued 1,000-2,000 and 3,000-4,000 ns)."""
    events = [(end, {semconv.COLLECTIVE_OP: "all_reduce", semconv.COLLECTIVE_SEQ: seq, semconv.PROCESS_GROUP_NAME: "0",
                     semconv.PROCESS_GROUP_SIZE: 2, semconv.MODULE_PASS: "forward", semconv.COLLECTIVE_DURATION: 1e-6})
              for seq, end in ((0, 2_000), (1, 4_000))]
    spans = [otlp_span(0, "train_step", "1", start=0, end=10_000, world_size=1, **{semconv.STEP: 0}),
             otlp_span(0, "M forward", "2", parent="1", start=500, end=9_000, events=events, world_size=1,
                       **{semconv.MODULE_FQN: "M", semconv.MODULE_PASS: "forward"})]
    write_otlp(spans, folder / "traces-rank0.jsonl")


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


_HOSTILE = {
    "empty": (b"", "not JSON"),
    "NUL bytes": (b"\0" * 64, "not JSON"),
    "broken JSON": (b'{"entries": [', "not valid JSON"),
    "a JSON list": (b"[1, 2]", "no Flight Recorder entries"),
    "entries not a list": (json.dumps({"entries": {"a": 1}}).encode(), "no Flight Recorder entries"),
    "nested 100,000 deep": (b'{"entries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON"),
    "an int of 5,000 digits": (b'{"entries": [], "x": ' + b"7" * 5000 + b"}", "not valid JSON"),
    "a pickle": (pickle.dumps(_dump(_entry(1))), "--flight-recorder-pickle"),
    "not UTF-8": (b'{"entries": ["\xff\xfe"]}', "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_bad_dump_is_skipped_with_why_and_the_good_one_still_joined(case, tmp_path, capsys):
    data, why = _HOSTILE[case]
    _spans_with_two_all_reduces(tmp_path)
    dumps = tmp_path / "fr"
    dumps.mkdir()
    (dumps / "bad_rank_1").write_bytes(data)
    (dumps / "good_rank_0").write_text(json.dumps(_dump(_entry(1), _entry(2, retired=False, created=3_500))))
    assert main(["diagnose", str(tmp_path), "--flight-recorder", str(dumps), "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"commdebug-otel diagnose: skipped Flight Recorder dump {dumps / 'bad_rank_1'}: ")
    assert why in captured.err
    found = json.loads(captured.out)["flight_recorder"]
    [pending] = found["pending"]
    assert (pending["rank"], pending["seq"], pending["module"], found["joined"]) == (0, 1, "M", 2)


def test_bad_entries_are_counted_and_odd_values_kept_in_bounds(tmp_path, capsys):
    _spans_with_two_all_reduces(tmp_path)
    odd = [_entry(1), None, "x", {"collective_seq_id": "seven", "process_group": ["0"]},
           {"collective_seq_id": 2}, _entry(2, op=7, group="g" * 10_000, created="soon", retired="yes",
                                             input_sizes=[["a", 3, True]], input_dtypes="Float"),
           _entry(10**30)]
    path = tmp_path / "fr_rank_0"
    path.write_text(json.dumps({"entries": odd, "pg_status": {"0": "done", "1": {"last_enqueued_collective": []}}}))
    assert main(["diagnose", str(tmp_path), "--flight-recorder", str(path), "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"commdebug-otel diagnose: skipped 4 Flight Recorder entries in {path}: "
                            "no process group or seq\n")
    found = json.loads(captured.out)["flight_recorder"]
    assert found["entries"] == 3 and found["joined"] == 1  # seq 1 = ours 0; the long group and 10**30 are not ours
    assert found["dumps"][0]["pg_status"] == {"1": {"enqueued": -1, "completed": -1}}
    odd_one = next(entry for entry in found["last"] if entry["group"].startswith("g"))
    assert (len(odd_one["group"]), odd_one["fr_op"], odd_one["retired"], odd_one["input_sizes"]) == (
        256, "", False, [[3]])


def test_a_pickle_is_read_only_when_asked_and_then_loads_no_class_or_function(tmp_path, capsys):
    _spans_with_two_all_reduces(tmp_path)
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump(_entry(1))))
    (tmp_path / "fr" / "nccl_trace_rank_1").write_bytes(pickle.dumps({"entries": [_Boom()]}))
    argv = ["diagnose", str(tmp_path), "--flight-recorder", str(tmp_path / "fr"), "--format", "json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "flight_recorder" not in json.loads(captured.out)
    assert captured.err.count("not JSON (a pickled dump? only with --flight-recorder-pickle") == 2
    os.chdir(tmp_path)
    assert main([*argv, "--flight-recorder-pickle"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["flight_recorder"]["joined"] == 1
    assert "refused posix.system: a Flight Recorder dump holds no objects" in captured.err
    assert not (tmp_path / "PWNED").exists()


def test_a_fifo_among_the_dumps_is_not_opened(tmp_path):
    _spans_with_two_all_reduces(tmp_path)
    fifo = tmp_path / "fr_rank_1"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    done = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "diagnose", str(tmp_path),
                           "--flight-recorder", str(fifo)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"skipped Flight Recorder dump {fifo}: not a regular file (not opened)" in done.stderr


def test_the_offset_is_learned_when_our_tracer_started_after_collectives(tmp_path):
    """FR counted 3 collectives before ours began: its seq 4 and 5 are our 0 and 1 (issued while they were)."""
    _spans_with_two_all_reduces(tmp_path)
    spans = __import__("commdebug_otel.offline.summary", fromlist=["load_spans"]).load_spans([tmp_path])
    dump = {"rank": 0, "file": "x", "pg_status": {}, "skipped": 0, "entries": [
        flight_recorder._entry(_entry(seq, created=created)) for seq, created in ((3, 100), (4, 1_500), (5, 3_500))]}
    found = flight_recorder.join(spans, [dump])
    assert [(entry["fr_seq"], entry["seq"]) for entry in found["last"]] == [(5, 1)]
    assert found["joined"] == 2 and found["disagree"] == []


def test_where_the_dump_goes(tmp_path):
    """The dump prefix's folder (TORCH_FR_DUMP_TEMP_FILE, or NCCL's older name), else the run folder."""
    ours = "commdebug-flight-recorder-rank3.json"
    for name in live.DUMP_PREFIX_VARIABLES:
        assert live.dump_path(3, "/elsewhere", {name: str(tmp_path / "dumps" / "trace_")}) == str(
            tmp_path / "dumps" / ours)
    assert live.dump_path(3, str(tmp_path), {"TORCH_FR_BUFFER_SIZE": "2000"}) == str(tmp_path / ours)


def test_only_a_job_that_asks_for_the_flight_recorder_gets_its_dumps():
    """torch records by default, but a run that never named Flight Recorder gets no files of it."""
    assert not live.enabled({})
    assert live.enabled({"TORCH_FR_BUFFER_SIZE": "2000"}) and live.enabled({"TORCH_NCCL_TRACE_BUFFER_SIZE": "5"})
    assert live.enabled({"TORCH_FR_DUMP_TEMP_FILE": "/tmp/trace_"})  # the size left at torch's default
    assert not live.enabled({"TORCH_FR_BUFFER_SIZE": "0"}) and not live.enabled({"TORCH_FR_BUFFER_SIZE": "lots"})
    assert not live.enabled({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "5"})  # the first wins
    assert not live.enabled({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_FR_DUMP_TEMP_FILE": "/tmp/trace_"})  # off


@pytest.mark.parametrize(("name", "value"), [("TORCH_FR_BUFFER_SIZE", "abc"), ("TORCH_FR_BUFFER_SIZE", "-5"),
                                           ("TORCH_NCCL_TRACE_BUFFER_SIZE", "12abc")])
def test_a_bad_buffer_size_is_said_once_with_the_accepted_values_and_means_no_dump(name, value, caplog):
    """torch reads these sizes its own way (``abc`` stops gloo's process group starting, ``-5`` records):
    we name the variable once and write no dump, as for 0."""
    environ = {name: value, "TORCH_FR_DUMP_TEMP_FILE": "/tmp/trace_"}
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        assert not live.enabled(environ) and not live.enabled(environ)
    assert [record.getMessage() for record in caplog.records] == [
        f"commdebug-otel: {name}={value} is not an integer >= 0 (Flight Recorder entries per process; 0: off): "
        "stall snapshots get no Flight Recorder dump"]


def test_a_bad_buffer_size_is_said_when_tracing_starts_and_training_goes_on(tmp_path):
    """Said as the watchdog starts, not at the first stall (which may never come)."""
    code = ("import torch\nfrom commdebug_otel import CommTracer\nmodel = torch.nn.Linear(2, 2)\n"
            "with CommTracer():\n    model(torch.ones(1, 2)).sum().backward()\nprint('trained')\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "TORCH_FR", "TORCH_NCCL"))}
    env.update(OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path), OTEL_PYTHON_COMMDEBUG_STALL_AFTER="60",
               TORCH_FR_BUFFER_SIZE="lots")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert (done.returncode, done.stdout) == (0, "trained\n"), done.stderr
    assert [line for line in done.stderr.splitlines() if "TORCH_FR_BUFFER_SIZE" in line] == [
        "commdebug-otel: TORCH_FR_BUFFER_SIZE=lots is not an integer >= 0 (Flight Recorder entries per process; "
        "0: off): stall snapshots get no Flight Recorder dump"]


def test_the_dump_goes_to_torch_fr_dump_temp_files_folder_and_a_failure_is_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(live, "_failed", False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "16")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "dumps" / "nccl_trace_rank_"))
    path = live.dump_beside_snapshot(2, lambda: pytest.fail("the run folder is not asked"))
    assert path == str(tmp_path / "dumps" / "commdebug-flight-recorder-rank2.json")
    assert json.loads(open(path).read())["version"]  # torch's JSON (no "entries" key: nothing recorded here)
    assert os.listdir(tmp_path / "dumps") == ["commdebug-flight-recorder-rank2.json"]  # nothing left aside
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "file" / "under" / "x_"))
    assert live.dump_beside_snapshot(2, str) is None
    assert live.dump_beside_snapshot(2, str) is None  # given up: not tried, not said again
    [message] = [record.getMessage() for record in caplog.records]
    assert "could not write torch's Flight Recorder dump" in message and "the snapshots go on" in message


def test_a_dump_of_an_empty_buffer_is_read(tmp_path):
    path = tmp_path / "commdebug-flight-recorder-rank1.json"
    path.write_text('{"comm_lib_version":"","nccl_comm_state":{},"pg_config":{},"pg_status":{},"version":"2.10"}')
    dumps, messages = flight_recorder.read_dumps([str(path)])
    assert messages == [] and [(dump["rank"], dump["entries"]) for dump in dumps] == [(1, [])]


def test_no_dump_unless_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "_failed", False)
    for name in (*live.BUFFER_VARIABLES, *live.DUMP_PREFIX_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert live.dump_beside_snapshot(0, lambda: str(tmp_path)) is None
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert live.dump_beside_snapshot(0, lambda: str(tmp_path)) is None
    assert os.listdir(tmp_path) == []
