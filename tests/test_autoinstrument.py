"""Unmodified scripts traced from the environment: torchrun, `commdebug-otel run`, opentelemetry-instrument, spawn."""

import collections
import importlib.machinery
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from commdebug_otel import semconv
from commdebug_otel.testing.otlp_receiver import OtlpReceiver

from distributed import free_port
from tools import default_signal_actions

SCRIPT = str(pathlib.Path(__file__).parent / "scripts" / "train.py")
BIN = pathlib.Path(sys.executable).parent
# Per traced TP step and rank (2 ranks): forward all_reduce x5 + all_gather x1, backward all_reduce x11.
TP_EVENTS_PER_STEP = 17


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


def launch(command, receiver, tmp_path, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_SERVICE_NAME="train")
    env.update(env_extra)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def torchrun(nproc=2, steps=2, *extra):
    return [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *extra, SCRIPT, str(steps)]


def steps_by_rank(spans):
    """{step: {rank: collective events in that rank's step trace}} and {step: trace ids}."""
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    events, trace_ids = {}, collections.defaultdict(set)
    for span in spans:
        if span["name"] == "train_step":
            step, rank = span["attributes"][semconv.STEP], span["resource"][semconv.RANK]
            trace_ids[step].add(span["trace_id"])
            events.setdefault(step, {})[rank] = sum(
                1 for s in by_trace[span["trace_id"]] if s["resource"][semconv.RANK] == rank
                for e in s["events"] if semconv.COLLECTIVE_OP in e["attributes"])
    return events, trace_ids


def check_tp_run(receiver, steps, ranks=(0, 1), events_per_step=TP_EVENTS_PER_STEP):
    spans = receiver.spans()
    events, trace_ids = steps_by_rank(spans)
    assert sorted(events) == list(steps)
    for step in steps:
        assert events[step] == {rank: events_per_step for rank in ranks}
        assert len(trace_ids[step]) == 1  # one trace per step, holding every rank's step span
    assert len({span["resource"]["process.pid"] for span in spans}) == len(ranks)  # launcher exports nothing
    return spans


@pytest.mark.parametrize("variable, said", [
    ("OTEL_PYTHON_COMMDEBUG_TRACE_EVRY", "ignoring OTEL_PYTHON_COMMDEBUG_TRACE_EVRY: no such variable"),
    ("OTEL_PYTHON_COMMDEBUG_ENABLED", "ignoring OTEL_PYTHON_COMMDEBUG_ENABLED='ture': expected true, 1, yes or on")])
def test_a_bad_variable_is_said_once_per_job_not_by_the_launcher_too(receiver, tmp_path, variable, said):
    result = launch(torchrun(steps=1), receiver, tmp_path, **{variable: "ture"})
    assert (result.stdout + result.stderr).count(said) == 1


def test_environment_variables_alone_trace_torchrun_workers(receiver, tmp_path):
    launch(torchrun(steps=12), receiver, tmp_path, OTEL_PYTHON_COMMDEBUG_ENABLED="true",
           OTEL_PYTHON_COMMDEBUG_TRACE_EVERY="10")
    check_tp_run(receiver, steps=[0, 10])


def test_commdebug_otel_run_wrapper(receiver, tmp_path):
    launch([str(BIN / "commdebug-otel"), "run", "--trace-every", "1", "--", *torchrun(steps=2)],
           receiver, tmp_path)
    check_tp_run(receiver, steps=[0, 1])
    operations = [p for p in receiver.metrics() if p["name"] == semconv.METRIC_OPERATIONS]
    assert {p["resource"][semconv.RANK] for p in operations} == {0, 1}


def test_opentelemetry_instrument(receiver, tmp_path):
    launch([str(BIN / "opentelemetry-instrument"), *torchrun(steps=2)], receiver, tmp_path)
    check_tp_run(receiver, steps=[0, 1])


def test_opentelemetry_instrument_with_enabled_too(receiver, tmp_path):
    # The environment start fired inside opentelemetry-instrument's own start (both import torch) and waited
    # for its lock forever: the workers never trained.
    launch([str(BIN / "opentelemetry-instrument"), *torchrun(steps=2)], receiver, tmp_path,
           OTEL_PYTHON_COMMDEBUG_ENABLED="true")
    check_tp_run(receiver, steps=[0, 1])


def test_disabled_instrumentations_turns_it_off(receiver, tmp_path):
    launch([str(BIN / "opentelemetry-instrument"), *torchrun(steps=1)], receiver, tmp_path,
           OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="commdebug")
    assert receiver.spans() == []


def test_two_nodes_fsdp2_and_tp(receiver, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_PYTHON_COMMDEBUG_ENABLED="true")
    port = free_port()
    nodes = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), SCRIPT, "2"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    for node in nodes:
        output, _ = node.communicate(timeout=300)
        assert node.returncode == 0, output[-5000:]
    spans = receiver.spans()
    events, trace_ids = steps_by_rank(spans)
    assert sorted(events) == [0, 1]
    for step in (0, 1):
        assert sorted(events[step]) == [0, 1, 2, 3]
        assert len(set(events[step].values())) == 1  # every rank issued the same collectives
        assert len(trace_ids[step]) == 1
    node_ranks = {(s["resource"][semconv.RANK], s["resource"][semconv.NODE_RANK]) for s in spans}
    assert node_ranks == {(0, 0), (1, 0), (2, 1), (3, 1)}
    ops = {e["name"] for s in spans for e in s["events"]}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= ops


def test_spawn_children_export_their_own_spans(receiver, tmp_path):
    launch([sys.executable, SCRIPT, "2", "--spawn", "2"], receiver, tmp_path,
           OTEL_PYTHON_COMMDEBUG_ENABLED="true")
    check_tp_run(receiver, steps=[0, 1])


def test_instrumentor_api_is_idempotent_and_uninstrument_removes_everything(caplog):
    import torch

    from commdebug_otel.instrumentor import CommDebugInstrumentor, current
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    instrumentor = CommDebugInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider,
                            meter_provider=telemetry.meter_provider)
    instrumentor.instrument()  # BaseInstrumentor warns and does nothing
    tracer = current()
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model(torch.ones(1, 2))
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert current() is None and not tracer.started
    assert [s.name for s in telemetry.spans()] == ["Linear forward"]
    with torch.no_grad():
        model(torch.ones(1, 2))
    assert len(telemetry.spans()) == 1
    assert not model._forward_hooks


AUTOSTARTED = """
import json, sys
import torch
from torch.nn.modules import module
from commdebug_otel.instrumentor import CommDebugInstrumentor, current

def hooks():
    return len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)

model = torch.nn.Linear(2, 2)
with torch.no_grad():
    model(torch.ones(1, 2))  # the first module call starts tracing
tracer = current()
started, hooks_on = tracer is not None and tracer.started, hooks()
CommDebugInstrumentor().uninstrument()
with torch.no_grad():
    model(torch.ones(1, 2))  # after the stop: no span
json.dump({"started": started, "hooks_on": hooks_on, "hooks_off": hooks(), "current": current() is None,
           "still_started": tracer.started}, sys.stdout)
"""


def test_started_from_the_environment_stops_through_the_instrumentor(tmp_path):
    """One instrumentation state: what OTEL_PYTHON_COMMDEBUG_ENABLED started, the instrumentor stops."""
    from commdebug_otel.offline.otlp_json import spans_from_otlp_json

    bootstrap = pathlib.Path(semconv.__file__).parent / "_bootstrap"  # what `commdebug-otel run` puts first
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path),
               OTEL_METRICS_EXPORTER="none",
               PYTHONPATH=os.pathsep.join([str(bootstrap), str(pathlib.Path(semconv.__file__).parents[1])]))
    result = subprocess.run([sys.executable, "-c", AUTOSTARTED], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already uninstrumented" not in result.stderr
    state = json.loads(result.stdout)
    assert state == {"started": True, "hooks_on": 2, "hooks_off": 0, "current": True, "still_started": False}
    [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
    names = [span["name"] for line in traces.read_text().splitlines() for span in spans_from_otlp_json(line)]
    assert names == ["Linear forward"]


# ----------------------------------------------------------------- start only where torch is imported
PACKAGE_PARENT = pathlib.Path(semconv.__file__).parents[1]
BOOTSTRAP = pathlib.Path(semconv.__file__).parent / "_bootstrap"  # what `commdebug-otel run` puts first
PTH = "commdebug_otel.pth"

NO_TORCH = """
import json, sys
finders = [type(finder).__name__ for finder in sys.meta_path]
json.dump({"torch": "torch" in sys.modules, "autostart": "commdebug_otel._autostart" in sys.modules,
           "hooked": finders.count("TorchImportHook"),
           "loaded": sorted(m for m in sys.modules if m.startswith(("opentelemetry", "commdebug_otel.config")))},
          sys.stdout)
"""

TRAINS = """
import json, sys
import torch
from commdebug_otel.instrumentor import current
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
json.dump({"started": current() is not None and current().started,
           "hooked": [type(finder).__name__ for finder in sys.meta_path].count("TorchImportHook"),
           "loaders": [type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__]}, sys.stdout)
"""


def start_route_env(route, tmp_path):
    """The environment of a process started with ENABLED=true through the .pth or `commdebug-otel run`'s bootstrap."""
    if route == "pth":
        installed = [path for path in site.getsitepackages() if (pathlib.Path(path) / PTH).is_file()]
        assert installed, f"{PTH} is not in {site.getsitepackages()}: install the package (pip install . or -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    path = [str(BOOTSTRAP)] if route == "run" else []
    env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path),
               OTEL_METRICS_EXPORTER="none", PYTHONPATH=os.pathsep.join([*path, str(PACKAGE_PARENT)]))
    return env


def run_python(code, env, cwd):
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("route", ["pth", "run"])
def test_enabled_imports_nothing_into_processes_without_torch(route, tmp_path):
    """pip, a launcher's helpers, `python -c`: ENABLED=true used to import torch and the SDK into all of them."""
    state, stderr = run_python(NO_TORCH, start_route_env(route, tmp_path), tmp_path)
    assert state == {"torch": False, "autostart": True, "hooked": 1, "loaded": []}
    assert stderr == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("route", ["pth", "run"])
def test_enabled_starts_tracing_when_the_script_imports_torch(route, tmp_path):
    state, _ = run_python(TRAINS, start_route_env(route, tmp_path), tmp_path)
    # the hook removed itself; torch's loader is torch's own again
    assert state == {"started": True, "hooked": 0, "loaders": ["SourceFileLoader", "SourceFileLoader"]}
    from commdebug_otel.offline.otlp_json import spans_from_otlp_json

    [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
    names = [span["name"] for line in traces.read_text().splitlines() for span in spans_from_otlp_json(line)]
    assert sorted(names) == sorted(["Linear forward", "Linear backward", "train_step"] * 2)


def test_enabled_arms_at_once_when_torch_is_already_imported(tmp_path):
    env = start_route_env("run", tmp_path)
    env["PYTHONPATH"] = str(PACKAGE_PARENT)
    env["OTEL_PYTHON_COMMDEBUG_ENABLED"] = ""  # the .pth does nothing at start-up (no variable of ours is set)
    output_dir = env.pop("OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR")
    code = ("import json, os, sys, torch\n"
            f"os.environ['OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR'] = {output_dir!r}\n"
            "os.environ['OTEL_PYTHON_COMMDEBUG_ENABLED'] = 'true'\n"
            "import commdebug_otel._autostart\n"
            "armed = 'commdebug_otel.tracer' not in sys.modules\n"
            "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
            "from commdebug_otel.instrumentor import current\n"
            "json.dump({'armed': armed, 'started': current() is not None and current().started,\n"
            "           'hooked': [type(f).__name__ for f in sys.meta_path].count('TorchImportHook')}, sys.stdout)")
    state, _ = run_python(code, env, tmp_path)
    assert state == {"armed": True, "started": True, "hooked": 0}


IMPORTS_TORCH = """
import atexit, json, sys, threading
import torch
json.dump({"loaded": sorted(m for m in sys.modules if m.startswith(("opentelemetry", "sympy", "commdebug_otel",
                                                                    "torch.distributed.tensor"))),
           "threads": threading.active_count(), "atexit": atexit._ncallbacks(),
           "meta_path": [type(finder).__name__ for finder in sys.meta_path]}, sys.stdout)
"""


@pytest.mark.parametrize("route", ["pth", "run"])
def test_importing_torch_alone_loads_no_sdk_and_no_dtensor(route, tmp_path):
    """A data-prep script or a tool's helper under ENABLED=true imports torch and never trains: it used to load
    the SDK and DTensor (sympy), about 880 modules and a second or more. Now only the start module is extra."""
    env = start_route_env(route, tmp_path)
    plain_env = {k: v for k, v in env.items() if not k.startswith("OTEL_PYTHON_COMMDEBUG_")}
    plain_env["PYTHONPATH"] = str(PACKAGE_PARENT)  # no bootstrap: plain `import torch`
    plain, _ = run_python(IMPORTS_TORCH, plain_env, tmp_path)
    traced, stderr = run_python(IMPORTS_TORCH, env, tmp_path)
    # The start triggers and the one door to torch's privates (a trigger's global hook must not warn): no SDK.
    assert set(traced["loaded"]) - set(plain["loaded"]) == {"commdebug_otel", "commdebug_otel._autostart",
                                                             "commdebug_otel.version", "commdebug_otel.capture",
                                                             "commdebug_otel.capture._torch"}
    assert set(plain["loaded"]) - set(traced["loaded"]) == set()
    assert {key: traced[key] for key in ("threads", "atexit")} == {key: plain[key] for key in ("threads", "atexit")}
    assert traced["meta_path"] == plain["meta_path"]  # the import hook removed itself
    assert stderr == "" and list(tmp_path.iterdir()) == []


JOINS_A_GROUP = """
import json, os, sys
import torch
import torch.distributed as dist
armed = "commdebug_otel.tracer" not in sys.modules
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from commdebug_otel.instrumentor import current
from torch.distributed import distributed_c10d
from torch.nn.modules import module
started = current() is not None and current().started
dist.all_reduce(torch.ones(1))  # set-up, before any module: an outside_step segment
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(1, 2)).sum().backward()
optimizer.step()
traced = {"c10d": distributed_c10d._update_default_pg.__module__, "pre_hooks": len(module._global_forward_pre_hooks)}
dist.destroy_process_group()
json.dump({"armed": armed, "started": started, "traced": traced, "stopped": current() is None,
           "after": {"c10d": distributed_c10d._update_default_pg.__module__,
                     "pre_hooks": len(module._global_forward_pre_hooks)}}, sys.stdout)
"""


def test_joining_a_process_group_starts_tracing_before_any_collective(tmp_path):
    from commdebug_otel.offline.otlp_json import spans_from_otlp_json

    result = subprocess.run([sys.executable, "-c", JOINS_A_GROUP, str(free_port())], cwd=tmp_path,
                            env=start_route_env("pth", tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # Both triggers went: c10d's own function is back, and only the tracer's pre-hook is left. Destroying the
    # group stopped tracing (no hook of ours) and armed the group trigger again (for a later group).
    assert json.loads(result.stdout) == {
        "armed": True, "started": True, "stopped": True,
        "traced": {"c10d": "torch.distributed.distributed_c10d", "pre_hooks": 1},
        "after": {"c10d": "commdebug_otel._autostart", "pre_hooks": 0}}
    [traces] = tmp_path.glob("run-*/traces-rank0.jsonl")
    spans = [span for line in traces.read_text().splitlines() for span in spans_from_otlp_json(line)]
    assert sorted(span["name"] for span in spans) == sorted(["outside_step", "Linear forward", "Linear backward",
                                                             "train_step"])
    [outside] = [span for span in spans if span["name"] == "outside_step"]
    assert [event["name"] for event in outside["events"]] == ["all_reduce"]


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """The hook aimed at a module of our own (``fake_torch_for_hook``), and the list of start calls."""
    from commdebug_otel import _autostart

    name = "fake_torch_for_hook"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_autostart, "TARGET", name)
    starts = []
    monkeypatch.setattr(_autostart, "start_when_used", lambda: starts.append(sys.modules[name].VALUE))
    hook = _autostart.TorchImportHook()
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    yield tmp_path / f"{name}.py", hook, starts
    sys.modules.pop(name, None)


def test_import_hook_starts_once_after_the_module_ran_and_removes_itself(fake_torch):
    source, hook, starts = fake_torch
    source.write_text("VALUE = 1\n")
    import fake_torch_for_hook

    assert starts == [1]  # after the module's own code ran
    assert hook not in sys.meta_path
    assert type(fake_torch_for_hook.__loader__) is importlib.machinery.SourceFileLoader
    assert fake_torch_for_hook.__spec__.loader is fake_torch_for_hook.__loader__
    importlib.reload(fake_torch_for_hook)
    assert starts == [1]


def test_import_hook_waits_for_an_import_that_succeeds(fake_torch):
    """A failed torch import is the script's own error; the hook stays for the next try."""
    source, hook, starts = fake_torch
    source.write_text("raise ImportError('no libcuda')\n")
    with pytest.raises(ImportError, match="no libcuda"):
        import fake_torch_for_hook
    assert starts == [] and hook in sys.meta_path
    source.write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    import fake_torch_for_hook  # noqa: F401

    assert starts == [2] and hook not in sys.meta_path


def test_a_failed_start_warns_once_and_never_raises(monkeypatch, caplog):
    from commdebug_otel import _autostart, instrumentor

    def broken(**_):
        raise RuntimeError("boom")

    monkeypatch.setenv("OTEL_PYTHON_COMMDEBUG_ENABLED", "true")
    monkeypatch.setattr(instrumentor, "instrument", broken)
    _autostart.maybe_start()
    assert [r.getMessage() for r in caplog.records] == [
        "commdebug-otel: could not start tracing: RuntimeError: boom"]


# ------------------------------------------------------------------------- the .pth in every install
PROJECT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("build", ["build_wheel", "build_editable"])
def test_wheels_ship_the_start_hook(build, tmp_path):
    """`pip install .` and `pip install -e .` both put commdebug_otel.pth at site-packages' top level."""
    project = tmp_path / "project"
    shutil.copytree(PROJECT / "commdebug_otel", project / "commdebug_otel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md", PTH):
        shutil.copy(PROJECT / name, project / name)
    code = f"import sys; from setuptools import build_meta; build_meta.{build}(sys.argv[1])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=project, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(PTH) == (PROJECT / PTH).read_bytes()
        [record] = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
        assert f"{PTH},sha256=" in archive.read(record).decode()  # so pip uninstall removes it


# ----------------------------------------------------------------- the launched command is as a plain launch
def _plain_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(PACKAGE_PARENT)
    return env


def _ours(line):
    return line.startswith(("OTEL_", "PYTHONPATH="))


def test_commdebug_otel_run_launches_with_the_signal_dispositions_and_environment_of_a_plain_launch(tmp_path):
    """Python ignores SIGPIPE and SIGXFSZ at start-up, and an exec'd command inherits ignored signals: the run
    wrapper gives their defaults back. Its environment differs only by our variables (OTEL_*, PYTHONPATH)."""
    probe = ["sh", "-c", "grep -E '^Sig(Blk|Ign|Cgt):' /proc/self/status; env | LC_ALL=C sort"]
    outputs = []
    for wrapper in ([], [str(BIN / "commdebug-otel"), "run", "--"]):
        done = subprocess.run([*wrapper, *probe], cwd=tmp_path, env=_plain_env(), capture_output=True, text=True,
                              timeout=120, preexec_fn=default_signal_actions)
        assert done.returncode == 0, done.stderr
        outputs.append([line for line in done.stdout.splitlines() if not _ours(line)])
    plain, run = outputs
    assert run == plain
    assert [line for line in plain if line.startswith("SigIgn:")] == ["SigIgn:\t0000000000000000"]


def test_a_pipe_closed_early_ends_the_writer_by_sigpipe_under_commdebug_otel_run(tmp_path):
    """``yes | head -1``: ``yes`` ends by SIGPIPE (141), not with "Broken pipe" and status 1."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    probe = [bash, "-c", 'yes | head -n 1 > /dev/null; echo "${PIPESTATUS[0]}"']
    done = subprocess.run([str(BIN / "commdebug-otel"), "run", "--", *probe], cwd=tmp_path, env=_plain_env(),
                          capture_output=True, text=True, timeout=120, preexec_fn=default_signal_actions)
    assert (done.returncode, done.stdout, done.stderr) == (0, "141\n", "")


def test_an_interpreter_without_the_package_runs_its_own_sitecustomize_under_commdebug_otel_run(tmp_path):
    """Another Python in the job (another environment, the system's) finds our bootstrap on PYTHONPATH but not
    the package: it starts nothing, says nothing, and its own sitecustomize runs."""
    import venv

    venv.create(tmp_path / "other", with_pip=False)  # the same Python, none of this environment's packages
    [python] = (tmp_path / "other").glob("bin/python")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("print('THEIRS', flush=True)\n")
    env = _plain_env()
    env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="true", PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(theirs)]))
    done = subprocess.run([str(python), "-c", "print('MAIN')"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.split(), done.stderr) == (0, ["THEIRS", "MAIN"], "")


@pytest.mark.parametrize("form", ["module", "package", "zip"])
def test_the_scripts_own_sitecustomize_runs_and_is_imported_as_itself_under_commdebug_otel_run(tmp_path, form):
    """A sitecustomize module, package or one in a zip on PYTHONPATH runs as without us, and ``import
    sitecustomize`` gives the script its own module (not ours)."""
    import zipfile

    code = "import sys\nsys.THEIRS = True\nFOO = 1\n"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if form == "module":
        (theirs / "sitecustomize.py").write_text(code)
    elif form == "package":
        (theirs / "sitecustomize").mkdir()
        (theirs / "sitecustomize" / "__init__.py").write_text(code)
    else:
        theirs = tmp_path / "theirs.zip"
        with zipfile.ZipFile(theirs, "w") as archive:
            archive.writestr("sitecustomize.py", code)
    probe = "import sys, sitecustomize; print(getattr(sys, 'THEIRS', False), getattr(sitecustomize, 'FOO', None))"
    env = _plain_env()
    env["PYTHONPATH"] = str(theirs)
    plain = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    run = subprocess.run([str(BIN / "commdebug-otel"), "run", "--", sys.executable, "-c", probe], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert (plain.returncode, plain.stdout) == (0, "True 1\n")
    assert (run.returncode, run.stdout, run.stderr) == (plain.returncode, plain.stdout, plain.stderr)


# ----------------------------------------------------------------- warnings: none of ours, no filter left behind
COMPILES = """
import json, sys, warnings
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend="eager") if sys.argv[1] == "compile" else model
for _ in range(2):
    compiled(torch.ones(2, 4)).sum().backward()
    optimizer.step()
filters = [repr(entry) for entry in warnings.filters]
from commdebug_otel.instrumentor import current
json.dump({"traced": current() is not None and current().started, "filters": filters}, sys.stdout)
"""


@pytest.mark.parametrize("how", ["compile", "eager"])
def test_a_script_run_with_w_error_trains_traced_with_the_filters_it_has_untraced(receiver, tmp_path, how):
    """``-W error``: torch.compile(model) warns of global module hooks (ours), and the SDK's ``get_tracer`` and
    logs package add entries to ``warnings.filters``; none of it reaches the script."""
    states = []
    for traced in (False, True):
        env = _plain_env()
        if traced:  # as `commdebug-otel run` starts it, exporting by OTLP (which imports the SDK's logs package)
            env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
                       PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(PACKAGE_PARENT)]))
        done = subprocess.run([sys.executable, "-W", "error", "-c", COMPILES, how], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        states.append(json.loads(done.stdout))
    untraced, traced = states
    assert (untraced["traced"], traced["traced"]) == (False, True)
    assert traced["filters"] == untraced["filters"]
    assert {"Sequential forward", "train_step"} <= {span["name"] for span in receiver.spans()}
