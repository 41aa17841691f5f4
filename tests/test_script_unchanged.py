"""A traced script behaves as the same script untraced, in the forms a fifth adversarial round compared.

Real subprocesses and real gloo groups of one rank: no thread of ours outlives tracing, ...
"""

import os
import pathlib
import subprocess
import sys

import pytest

from commdebug_otel import semconv

from tools import default_signal_actions

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def _env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path), **extra})
    return env


def _steps_on_disk(tmp_path: pathlib.Path) -> list[int]:
    from commdebug_otel.offline.summary import load_spans

    [run] = tmp_path.glob("run-*")
    return sorted(span["attributes"][semconv.STEP] for span in load_spans([str(run)]) if span["name"] == "train_step")


@pytest.mark.parametrize("start", ["env", "api"])
def test_a_script_that_joins_every_thread_at_its_end_ends_with_its_steps_exported(tmp_path, start):
    """Once tracing stops (the default group destroyed under the environment start, or ``CommTracer.stop``), no
    thread of ours is alive: the SDK's export threads, our metrics worker and stall watch have ended. Under the
    environment start a second process group is traced anew, into the same files."""
    extra = {"OTEL_PYTHON_COMMDEBUG_ENABLED": "true"} if start == "env" else {}
    result = subprocess.run([sys.executable, str(SCRIPTS / "join_threads.py"), start],
                            env=_env(tmp_path, OTEL_PYTHON_COMMDEBUG_STALL_AFTER="30", **extra),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "ALIVE \n"), result.stderr[-3000:]
    # Steps are numbered per tracer: the environment start's second tracer counts from 0 again.
    assert _steps_on_disk(tmp_path) == ([0, 0, 1, 1, 2] if start == "env" else [0, 1])


_ENVIRON = """
import json, os, sys
import torch
from commdebug_otel.config import ExportEnv

torch.nn.Linear(2, 2)(torch.ones(1, 2))  # the environment start's trigger: tracing starts here
interval_ms = ExportEnv.from_env().sdk_millis("OTEL_METRIC_EXPORT_INTERVAL")
print(json.dumps({"environ": dict(os.environ), "interval_ms": interval_ms}))
"""


def test_the_scripts_environment_under_commdebug_otel_run_is_its_own_but_for_pythonpath_and_enabled(tmp_path):
    """``os.environ`` as the script sees it, started plain and under ``commdebug-otel run``: the same, but for
    the documented two (PYTHONPATH with our start-up folder first, and OTEL_PYTHON_COMMDEBUG_ENABLED, which every
    process of the job needs); no standard variable, which the script's own libraries would read too. Our metric
    interval under ``run`` is still 5 s."""
    import json

    from commdebug_otel.config import BOOTSTRAP_DIR

    env = _env(tmp_path)
    plain = subprocess.run([sys.executable, "-c", _ENVIRON], env=env, capture_output=True, text=True, timeout=120)
    run = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "run", "--", sys.executable, "-c", _ENVIRON],
                         env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == run.returncode == 0, (plain.stderr[-2000:], run.stderr[-2000:])
    seen_plain, seen_run = json.loads(plain.stdout), json.loads(run.stdout)
    differ = {name for name in {*seen_plain["environ"], *seen_run["environ"]}
              if seen_plain["environ"].get(name) != seen_run["environ"].get(name)}
    assert differ == {"PYTHONPATH", "OTEL_PYTHON_COMMDEBUG_ENABLED"}
    theirs = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []  # (none in a fresh venv with the package installed)
    first, *rest = seen_run["environ"]["PYTHONPATH"].split(os.pathsep)
    # Our start-up folder first: the checkout's or the installed package's, whichever `run` imported.
    assert pathlib.Path(first).parts[-2:] == pathlib.Path(BOOTSTRAP_DIR).parts[-2:] and rest == theirs
    assert seen_run["environ"]["OTEL_PYTHON_COMMDEBUG_ENABLED"] == "true"
    assert (seen_plain["interval_ms"], seen_run["interval_ms"]) == (60000, 5000)


_SIGNAL_VIEW = """
import json, os, signal, socket, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
net = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
net(torch.ones(1, 2)).sum().backward()
optimizer.step()  # a step: our providers exist, and our flush on SIGTERM is chained
term = signal.getsignal(signal.SIGTERM)
reader, writer = socket.socketpair()
writer.setblocking(False)
view = {
    "== SIG_DFL": term == signal.SIG_DFL, "SIG_DFL ==": signal.SIG_DFL == term,
    "not in (None, SIG_DFL)": term not in (None, signal.SIG_DFL),  # Lightning's SignalConnector._has_already_handler
    "in {SIG_DFL}": term in {signal.SIG_DFL}, "callable": callable(term) and term != signal.SIG_DFL,
    "set_wakeup_fd(-1)": signal.set_wakeup_fd(-1),
    "trio's take": signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False),  # trio warns if not -1
    "given back": signal.set_wakeup_fd(-1) == writer.fileno(),
}
print(json.dumps(view), flush=True)
old = signal.getsignal(signal.SIGTERM)  # save, install one's own, restore: SIGTERM then acts as before
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
signal.signal(signal.SIGTERM, old)
net(torch.ones(1, 2)).sum().backward()
optimizer.step()
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_the_script_sees_its_signal_dispositions_and_wakeup_fd_as_untraced(tmp_path):
    """While our flush is chained on SIGTERM, what the script reads of it compares as the default action (as
    code that decides by ``getsignal(s) == SIG_DFL`` expects), and the wakeup fd reads as none (-1); a handler
    saved, replaced and restored leaves SIGTERM ending the process by the signal, with the finished steps."""
    import json

    def view(traced: bool) -> tuple[int, dict]:
        env = _env(tmp_path / ("traced" if traced else "plain"),
                   **({"OTEL_PYTHON_COMMDEBUG_ENABLED": "true"} if traced else {}))
        result = subprocess.run([sys.executable, "-c", _SIGNAL_VIEW], env=env, capture_output=True, text=True,
                                timeout=120, preexec_fn=default_signal_actions)
        return result.returncode, json.loads(result.stdout.splitlines()[0])

    plain, traced = view(False), view(True)
    assert plain == (-15, {"== SIG_DFL": True, "SIG_DFL ==": True, "not in (None, SIG_DFL)": False,
                           "in {SIG_DFL}": True, "callable": False, "set_wakeup_fd(-1)": -1, "trio's take": -1,
                           "given back": True})
    assert traced == plain
    assert _steps_on_disk(tmp_path / "traced") == [0, 1]


_RAISING = {
    # The script's own SIGTERM handler, installed before tracing started (ours runs it after the flush), raises.
    "signal handler": """
import os, signal, torch, torch.distributed as dist
def mine(signum, frame):
    raise RuntimeError("from the handler")
signal.signal(signal.SIGTERM, mine)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
net = torch.nn.Linear(2, 2)
net(torch.ones(1, 2)).sum().backward()
torch.optim.SGD(net.parameters(), lr=0.1).step()
os.kill(os.getpid(), signal.SIGTERM)
""",
    # A collective that fails in the backend (our dispatcher kernel is in its path), then destroy_process_group
    # (ours wraps it) of a group destroyed already.
    "collective": """
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.nn.Linear(2, 2)(torch.ones(1, 2))
try:
    dist.all_reduce(torch.ones(4, 4).t())
except Exception:
    import traceback; traceback.print_exc()
group = dist.new_group([0])
dist.destroy_process_group(group)
dist.destroy_process_group(group)
""",
    # torch's import fails (a broken torch first on the path): the environment start's loader is in its path.
    "import torch": """
import os, sys
folder = sys.argv[1]
os.makedirs(os.path.join(folder, "torch"), exist_ok=True)
with open(os.path.join(folder, "torch", "__init__.py"), "w") as source:
    source.write("raise ImportError('a broken torch')\\n")
sys.path.insert(0, folder)
import torch
""",
}


def _frames(stderr: str) -> list[str]:
    """The traceback entries (``File "...", line N, in f``) of ``stderr``, torch's rank prefix removed."""
    lines = [line.removeprefix("[rank0]: ").strip() for line in stderr.splitlines()]
    return [line for line in lines if line.startswith("File ")]


@pytest.mark.parametrize("form", list(_RAISING))
def test_tracebacks_show_the_frames_they_show_untraced(tmp_path, form):
    """An exception that passes through code of ours (our signal handler, a dispatcher kernel, our wrapper of
    ``destroy_process_group``, the environment start's torch loader) reaches the script with the traceback it has
    untraced: the same frames, none of ours, and the same exit status."""
    runs = []
    for traced in (False, True):
        env = _env(tmp_path, **({"OTEL_PYTHON_COMMDEBUG_ENABLED": "true"} if traced else {}))
        runs.append(subprocess.run([sys.executable, "-c", _RAISING[form], str(tmp_path / "broken")], env=env,
                                   capture_output=True, text=True, timeout=120, preexec_fn=default_signal_actions))
    (plain, traced) = runs
    assert _frames(plain.stderr), plain.stderr[-2000:]  # the script's own traceback is there to compare
    assert _frames(traced.stderr) == _frames(plain.stderr), traced.stderr[-3000:]
    assert "commdebug_otel" not in "\n".join(_frames(traced.stderr))
    assert traced.returncode == plain.returncode == 1


_FORK = """
import os, sys, threading, time, torch
net = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(2):
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
pid = os.fork()
if pid == 0:  # a child that never calls a module: nothing of ours runs in it
    time.sleep(1.0)  # the SDK starts its threads again for the parent's providers right after the fork
    print(sorted(thread.name for thread in threading.enumerate()), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_runs_no_thread_of_the_parents_telemetry(tmp_path):
    """The SDK starts the parent's export threads again in a forked child (``_at_fork_reinit``): they ended at
    once there, and exported the parent's metric points again, under the parent's resource, every interval."""
    for traced in (False, True):
        env = _env(tmp_path, OTEL_METRIC_EXPORT_INTERVAL="200",
                   **({"OTEL_PYTHON_COMMDEBUG_ENABLED": "true"} if traced else {}))
        result = subprocess.run([sys.executable, "-c", _FORK], env=env, capture_output=True, text=True, timeout=120)
        assert (result.returncode, result.stdout) == (0, "['MainThread']\n"), (traced, result.stderr[-2000:])
