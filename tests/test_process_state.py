"""Tracing never changes what the script does with its process: its signal handlers and its exit.

Real subprocesses: a script's own SIGTERM handling (installed after tracing started, by the script or
a library) runs as if we were not there, and finished steps are on disk however the process ends, a
2-rank gloo DDP job's ranks killed or stuck right after ``destroy_process_group`` included.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from commdebug_otel import semconv

from tools import default_signal_actions

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # Files; nothing exported by the batch processor's timer before the end (only a flush writes them).
    env.update({"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), "OTEL_BSP_SCHEDULE_DELAY": "600000",
                "OTEL_METRICS_EXPORTER": "none", **extra})
    return env


def _steps_on_disk(tmp_path: pathlib.Path) -> list[int]:
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    return sorted(span["attributes"][semconv.STEP] for span in load_spans([str(run)]) if span["name"] == "train_step")


def _signal_then_go_on(tmp_path: pathlib.Path, mode: str) -> tuple[int, str, str]:
    """Run own_handler.py MODE, send SIGTERM once it is READY, wait past the rescue thread's grace, let it go on."""
    from commdebug_otel.otel.telemetry import _SignalRescue

    process = subprocess.Popen([sys.executable, str(SCRIPTS / "own_handler.py"), mode], env=_env(tmp_path),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signal_actions)
    try:
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(signal.SIGTERM)
        time.sleep(4 * _SignalRescue.GRACE_S)  # the old rescue thread ended the process after the grace
        try:
            process.stdin.write("go\n")
            process.stdin.flush()
        except BrokenPipeError:  # ended by then: the assertions below say how
            pass
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stdout, stderr


@pytest.mark.parametrize("mode", ["late", "after_block", "chained"])
def test_the_scripts_own_sigterm_handler_runs_and_the_process_trains_on(tmp_path, mode):
    """Installed after tracing started (also after a ``with CommTracer()`` block ended, or chaining to ours as
    Lightning's does): the handler runs, the process is not ended, it trains on and exits 0 by itself."""
    returncode, stdout, stderr = _signal_then_go_on(tmp_path, mode)
    assert returncode == 0, stderr
    assert stdout.split() == ["HANDLED", str(int(signal.SIGTERM)), "DONE"]
    # Every traced step reached the file: at exit, or at the block's end (its later steps are untraced).
    assert _steps_on_disk(tmp_path) == ([0, 1, 2] if mode == "after_block" else [0, 1, 2, 3, 4, 5, 6])


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    returncode, stdout, stderr = _signal_then_go_on(tmp_path, "ignored")
    assert returncode == 0, stderr
    assert stdout.split() == ["DONE"]
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4, 5, 6]


def _sigterm_when_ready(tmp_path, mode: str, before=lambda: None) -> tuple[int, str]:
    """Run own_handler.py ``mode``; once it says READY (and ``before()`` returned), send SIGTERM. Returns its
    exit status and stderr."""
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "own_handler.py"), mode], env=_env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signal_actions)
    try:
        assert process.stdout.readline().strip() == "READY"
        before()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stderr


def test_after_asyncio_removes_its_sigterm_handler_the_default_action_still_keeps_finished_steps(tmp_path):
    """``loop.remove_signal_handler`` sets ``SIG_DFL`` and clears the wakeup fd: the next step boundary chains our
    flush again, so SIGTERM ends the process by the signal, as without us, with the finished steps on disk."""
    returncode, stderr = _sigterm_when_ready(tmp_path, "asyncio")
    assert returncode == -signal.SIGTERM, stderr
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4]


def test_an_ignored_sigterm_after_an_event_loops_handler_stays_ignored(tmp_path):
    returncode, stdout, stderr = _signal_then_go_on(tmp_path, "asyncio_ignored")
    assert returncode == 0, stderr
    assert stdout.split() == ["DONE"]
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4, 5, 6]


def test_after_asyncio_removes_its_sigterm_handler_after_the_last_step_the_finished_steps_are_flushed(tmp_path):
    """No step boundary follows the reset to ``SIG_DFL`` (which would chain our flush again): the rescue thread
    sees the reset and flushes what is finished, so a SIGTERM that then ends the process at once loses none."""
    def flushed() -> None:
        for _ in range(600):  # the flush comes within about a second (longer on a loaded machine)
            if list(tmp_path.glob("run-*/traces*")) and _steps_on_disk(tmp_path):
                return
            time.sleep(0.1)

    returncode, stderr = _sigterm_when_ready(tmp_path, "asyncio_last", flushed)
    assert returncode == -signal.SIGTERM, stderr
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4]


def test_stop_gives_the_signal_handlers_and_the_wakeup_fd_back(tmp_path):
    """What a ``CommTracer`` found is what it leaves: handlers (where still ours) and the wakeup fd. While it runs,
    the script reads them as it would untraced (Python's own table, ``_signal``, holds ours)."""
    script = """
import _signal, signal, sys, torch
from commdebug_otel import CommTracer
def mine(signum, frame): pass
signal.signal(signal.SIGHUP, mine)
before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)]
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    with CommTracer():
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        held = [_signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)]
        assert all(h is not b for h, b in zip(held, (before[0], before[2], before[3]))), held
        seen = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)]
        assert seen == [before[0], before[2], before[3]] and seen[0] is signal.SIG_DFL, seen
        fd = _signal.set_wakeup_fd(-1)
        assert fd != -1  # the rescue thread's
        _signal.set_wakeup_fd(fd)
        assert signal.set_wakeup_fd(-1) == -1  # as the script reads it
        _signal.set_wakeup_fd(fd)
    after = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)]
    assert after == before, (after, before)
    assert [_signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)] == [0, mine]
    assert signal.set_wakeup_fd is _signal.set_wakeup_fd and signal.set_wakeup_fd(-1) == -1
print("OK")
"""
    done = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=120, preexec_fn=default_signal_actions)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OK"]


def _two_ranks(tmp_path: pathlib.Path, *args: str, timeout: float = 120) -> list[tuple[int, str, str]]:
    """ddp_teardown.py ARGS on two gloo ranks (plain processes, environment start); (returncode, stdout, stderr)."""
    from tests.distributed import free_port

    port = free_port()
    processes = []
    for rank in range(2):
        env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_METRICS_EXPORTER="file",
                   OTEL_METRIC_EXPORT_INTERVAL="600000", OTEL_PYTHON_COMMDEBUG_COMPLETION_EVERY="1")
        processes.append(subprocess.Popen([sys.executable, str(SCRIPTS / "ddp_teardown.py"), *args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            results.append((process.returncode, stdout, stderr))
    finally:
        for process in processes:
            process.kill()
    return results


def _steps_per_rank(tmp_path: pathlib.Path) -> dict[int, list[int]]:
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    steps: dict[int, list[int]] = {}
    for span in load_spans([str(run)]):
        if span["name"] == "train_step":
            steps.setdefault(span["resource"][semconv.RANK], []).append(span["attributes"][semconv.STEP])
    return {rank: sorted(found) for rank, found in steps.items()}


def test_ranks_killed_right_after_destroy_process_group_have_delivered_their_finished_steps(tmp_path):
    """A rank that dies (or hangs) in the process group's teardown has already delivered its finished steps:
    ``destroy_process_group`` flushes first. (The batch processor's timer is off: only a flush writes.)"""
    results = _two_ranks(tmp_path, "3", "killed")
    for returncode, stdout, stderr in results:
        assert returncode == -signal.SIGKILL, stderr
        assert stdout.split() == ["DESTROYED"]
    assert _steps_per_rank(tmp_path) == {0: [0, 1, 2], 1: [0, 1, 2]}


def test_ranks_stuck_in_teardown_holding_the_gil_end_at_sigterm_with_their_finished_steps(tmp_path):
    """A teardown stuck holding the GIL (DDP's Reducer freed after ``destroy_process_group``, joining gloo's
    threads) runs neither our handler nor our rescue thread: the handlers are the script's again by then, so
    SIGTERM ends the rank as without us (before, it ignored SIGTERM and outlived torchrun)."""
    from tests.distributed import free_port

    port = free_port()
    processes = []
    for rank in range(2):
        env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), OTEL_PYTHON_COMMDEBUG_ENABLED="true")
        processes.append(subprocess.Popen([sys.executable, str(SCRIPTS / "ddp_teardown.py"), "3", "stuck"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          preexec_fn=default_signal_actions))
    try:
        for process in processes:
            assert process.stdout.readline().split() == ["DESTROYED"]
            assert process.stdout.readline().split() == ["STUCK"]
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == -signal.SIGTERM, stderr
    finally:
        for process in processes:
            process.kill()
    assert _steps_per_rank(tmp_path) == {0: [0, 1, 2], 1: [0, 1, 2]}


def test_a_collectives_work_keeps_no_dispatch_mode_of_ours(telemetry, single_rank_group):
    """gloo's ``AsyncWork`` keeps the ``at::ThreadLocalState`` of its creation (dispatch modes included) until
    its worker thread frees it, which then needs the GIL. Our mode handles a collective popped off the stack,
    so the work holds none of ours: after stop it is collectable while the work lives (a guard)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = CommTracer(Settings(detail="dtensor"), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider).start()
    works = []
    for _ in range(2):
        out = model(torch.ones(2, 4))
        works.append(dist.all_reduce(out.detach().clone(), async_op=True))  # created on a traced step
        out.sum().backward()
        optimizer.step()
    mode = weakref.ref(tracer._mode)
    tracer.stop()
    del tracer, out
    gc.collect()
    assert mode() is None
    for work in works:
        work.wait()


def _c_handler(tmp_path: pathlib.Path, mode: str, traced: bool, signum: int) -> tuple[int, str, str]:
    """Run c_handler.py MODE TRACED, send ``signum`` once it is READY, then let it go on (if it lives)."""
    process = subprocess.Popen([sys.executable, str(SCRIPTS / "c_handler.py"), mode, "1" if traced else "0"],
                               env=_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=default_signal_actions)
    try:
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(signum)
        time.sleep(1.0)  # faulthandler dumps at once; the signal ends the process or not before the line
        try:
            process.stdin.write("go\n")
            process.stdin.flush()
        except BrokenPipeError:  # ended by the signal: the assertions say how
            pass
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stdout, stderr


# What the untraced script does (the reference rows, run too): faulthandler's stacks, then the process goes on
# (SIGQUIT) or the default action ends it after them (SIGTERM, chain=True).
C_HANDLER_CASES = [("before", signal.SIGQUIT, 0, ["DONE"]),
                   ("chain", signal.SIGTERM, -signal.SIGTERM, []),
                   ("after_block", signal.SIGQUIT, 0, ["DONE"]),
                   ("late_stop", signal.SIGQUIT, 0, ["DONE"]),
                   ("over_python", signal.SIGTERM, 0, ["HANDLED", str(int(signal.SIGTERM)), "DONE"])]


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize(("mode", "signum", "returncode", "lines"), C_HANDLER_CASES,
                         ids=[case[0] for case in C_HANDLER_CASES])
def test_faulthandlers_handler_dumps_the_stacks_and_the_process_ends_or_goes_on_as_untraced(
        tmp_path, mode, signum, returncode, lines, traced):
    """``faulthandler.register`` installs its handler by ``sigaction``: ``signal.getsignal`` still says SIG_DFL.
    Registered before tracing starts it is left in force (not replaced by ours); registered after, our ``stop()``
    does not overwrite it; after a ``with CommTracer()`` block it is the one in force again."""
    code, stdout, stderr = _c_handler(tmp_path, mode, traced, signum)
    assert (code, stdout.split()) == (returncode, lines), stderr
    assert stderr.count("most recent call first") >= 1, stderr  # faulthandler's dump: one per thread


_MASKS = """
import signal, threading, time, torch
from commdebug_otel import CommTracer
tracer = CommTracer().start()
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
for thread in threading.enumerate():
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        blocked = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    print(thread.name, *sorted(int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1,
                                                  signal.SIGSEGV, signal.SIGPROF) if blocked >> (s - 1) & 1))
tracer.stop()
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").exists(), reason="reads the threads' masks from /proc")
def test_every_thread_tracing_starts_leaves_the_scripts_signals_to_the_scripts_threads(tmp_path):
    """A launcher's SIGTERM goes to a thread of the script: a C-level handler (faulthandler's) never runs on one of
    ours mid-bytecode. Ours and the SDK's block the signals sent to the process, not those a fault raises nor a
    profiler's timer."""
    env = _env(tmp_path, OTEL_METRICS_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
               OTEL_PYTHON_COMMDEBUG_STALL_AFTER="60")
    done = subprocess.run([sys.executable, "-c", _MASKS], env=env, capture_output=True, text=True, timeout=120)
    masks = dict((line.split()[0], line.split()[1:]) for line in done.stdout.splitlines())
    assert masks.pop("MainThread") == [], done.stderr
    assert {"commdebug-otel-stall-watch", "commdebug-otel-signals", "OtelBatchSpanRecordProcessor",
            "OtelPeriodicExportingMetricReader"} <= set(masks), done.stdout
    blocked = [str(s) for s in sorted(int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1))]
    assert masks == dict.fromkeys(masks, blocked), done.stdout
