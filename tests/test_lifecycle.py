"""A job's identity is settled when its process group appears, whatever ran before; data workers stay silent.

Unmodified scripts (tests/scripts/lifecycle.py) started with ``OTEL_PYTHON_COMMDEBUG_ENABLED=true`` alone,
writing the embedded default (OTLP-JSON files): under torchrun, a forward and an optimizer step, or a pause
long enough for stall snapshots, before ``init_process_group``; as a ``torch.multiprocessing.spawn`` parent,
DataLoaders with ``spawn``, ``forkserver`` and ``fork`` workers whose dataset calls a module.
"""

import collections
import os
import pathlib
import subprocess
import sys

from commdebug_otel import semconv
from commdebug_otel.offline.otlp_json import metrics_from_otlp_json, spans_from_otlp_json

from distributed import free_port

SCRIPT = str(pathlib.Path(__file__).parent / "scripts" / "lifecycle.py")
BIN = pathlib.Path(sys.executable).parent
STEPS = 3
RANK_FILES = ["metrics-rank0.jsonl", "metrics-rank1.jsonl", "traces-rank0.jsonl", "traces-rank1.jsonl"]


def run_job(command, tmp_path, **env_extra):
    """Run ``command`` under the environment start; returns the one run folder's {file name: lines}."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(out),
               OTEL_PYTHON_COMMDEBUG_TRACE_EVERY="1", **env_extra)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    folders = sorted(path.name for path in out.iterdir())
    assert len(folders) == 1, folders  # one run folder for the job: not one per rank, none per data worker
    [folder] = out.iterdir()
    files = {path.name: path.read_text().splitlines() for path in folder.iterdir()}
    assert sorted(files) == RANK_FILES  # the two ranks' files only
    return files


def spans_by_rank(files):
    by_rank = {}
    for rank in (0, 1):
        spans = [span for line in files[f"traces-rank{rank}.jsonl"] for span in spans_from_otlp_json(line)]
        metrics = [point for line in files[f"metrics-rank{rank}.jsonl"] for point in metrics_from_otlp_json(line)]
        assert spans and metrics
        for item in (*spans, *metrics):  # the settled resource: this rank, the backend; one process per rank
            assert item["resource"][semconv.RANK] == rank
            assert item["resource"][semconv.BACKEND] == "gloo"
        assert len({item["resource"]["process.pid"] for item in (*spans, *metrics)}) == 1
        by_rank[rank] = spans
    return by_rank


def step_trace_ids(by_rank):
    """{step: [rank 0's train_step trace id, rank 1's]}."""
    ids = collections.defaultdict(list)
    for rank in (0, 1):
        for span in by_rank[rank]:
            if span["name"] == "train_step":
                ids[span["attributes"][semconv.STEP]].append(span["trace_id"])
    return ids


def torchrun(*args):
    return [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), SCRIPT, str(STEPS), *args]


def test_a_step_before_init_process_group_leaves_the_job_one_run_with_shared_step_traces(tmp_path):
    by_rank = spans_by_rank(run_job(torchrun("--before", "step"), tmp_path))
    ids = step_trace_ids(by_rank)
    assert sorted(ids) == list(range(STEPS + 1))  # the step before the process group is step 0
    for step in range(1, STEPS + 1):
        assert len(ids[step]) == 2 and len(set(ids[step])) == 1  # one trace per step, both ranks in it
    # Step 0 ended before the ranks could agree on a nonce: its trace is each rank's own.
    assert len(set(ids[0])) == 2


def test_a_pause_before_init_process_group_is_set_up_not_a_stall(tmp_path):
    """Past the threshold before the process group exists, nothing in flight: set-up (no snapshot); the job's
    steps are one run with shared step traces."""
    by_rank = spans_by_rank(run_job(torchrun("--before", "stall"), tmp_path,
                                    OTEL_PYTHON_COMMDEBUG_STALL_AFTER="2", PAUSE_S="5"))
    # The pause is well past the threshold; the threshold is past the ranks' skew at their first collective (DDP's
    # shape check) on a loaded machine, which is a real wait for a peer.
    for rank in (0, 1):
        assert [span for span in by_rank[rank] if span["name"] == semconv.SPAN_STALLED] == []
    ids = step_trace_ids(by_rank)
    assert sorted(ids) == list(range(STEPS))
    assert all(len(ids[step]) == 2 and len(set(ids[step])) == 1 for step in ids)


def test_data_loader_workers_stay_silent_and_spawned_ranks_are_traced(tmp_path):
    # Two spawn ranks, each iterating DataLoaders with spawn, forkserver and fork workers (a module in the dataset).
    by_rank = spans_by_rank(run_job([sys.executable, SCRIPT, str(STEPS), "--spawn", "2", "--loaders"], tmp_path))
    ids = step_trace_ids(by_rank)
    assert sorted(ids) == list(range(STEPS))
    assert all(len(ids[step]) == 2 and len(set(ids[step])) == 1 for step in ids)
    for rank in (0, 1):  # the rank's own module calls on the batches are there; no worker's Scale transform
        names = {span["name"] for span in by_rank[rank]}
        assert "Sequential forward" in names and not any(name.startswith("Scale") for name in names)


def test_which_processes_are_data_workers_and_fork_servers():
    import multiprocessing

    from torch.utils.data._utils.worker import _worker_loop

    from commdebug_otel.capture._torch import is_data_worker
    from commdebug_otel.instrumentor import is_fork_server

    def train(rank):
        return rank

    assert is_data_worker(multiprocessing.get_context("spawn").Process(target=_worker_loop))
    assert not is_data_worker(multiprocessing.get_context("spawn").Process(target=train))
    assert not is_data_worker()  # this process: pytest's main process
    assert is_fork_server([sys.executable, "-c", "from multiprocessing.forkserver import main; main(3, 4, [])"])
    assert not is_fork_server([sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
                               "--multiprocessing-fork"])
