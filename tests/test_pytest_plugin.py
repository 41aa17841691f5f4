"""The ``comm_signature`` fixture (pytest plugin, entry point ``pytest11``), in real inner pytest runs (pytester):
world size 1 on gloo (eager and compiled blocks), and both ranks of a 2-rank DTensor test under torchrun."""

import json
import sys

import pytest

from commdebug_otel.offline import signature
from commdebug_otel.pytest_plugin import CommSignature

from distributed import free_port

pytest_plugins = ["pytester"]

_GROUP = '''
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


@pytest.fixture(scope="module", autouse=True)
def group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the store binds a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, reduces=1):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reduces = reduces

    def forward(self, x):
        out = self.lin(x)
        for _ in range(self.reduces):
            dist.all_reduce(out.detach())
        return out


class Compiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        out = self.lin(x)
        return out + funcol.all_reduce(out.detach(), "sum", dist.group.WORLD)
'''

_TESTS = '''

def test_eager(comm_signature):
    net = Net(reduces=REDUCES)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with comm_signature("eager"):
        for _ in range(2):
            net(torch.ones(2, 4)).sum().backward()
            optimizer.step()


def test_compiled(comm_signature):
    model = torch.compile(Compiled(), backend="aot_eager")
    with comm_signature("compiled"):
        model(torch.ones(3, 4)).sum().backward()
'''


def _entry(module, nbytes, dtype="float32", ranks=(0,), count=1, mesh_dim="", cause="", source="", target=""):
    return {"module": module, "pass": "forward", "op": "all_reduce", "group": "0", "mesh_dim": mesh_dim,
            "dtype": dtype, "cause": cause, "source_placements": source, "target_placements": target,
            "count_per_step": count, "bytes_per_step": nbytes, "ranks": list(ranks)}


def _write(pytester, reduces):
    pytester.makepyfile(test_blocks=_GROUP + _TESTS.replace("REDUCES", str(reduces)))


def test_update_writes_baselines_then_a_change_fails_with_the_diff(pytester):
    _write(pytester, reduces=1)
    result = pytester.runpytest_subprocess("--comm-update")
    result.assert_outcomes(passed=2)
    folder = pytester.path / "comm_signatures"
    eager = json.loads((folder / "eager.json").read_text())
    # Two steps of one (2, 4) float32 all_reduce in Net's forward.
    assert eager == {"format": signature.FORMAT, "world_size": 1, "entries": [_entry("Net", 32)], "first_step": [],
                     "last_step": [], "other_steps": []}
    # The compiled block's functional all_reduce, from its compiled code (the compiled module is one span).
    compiled = json.loads((folder / "compiled.json").read_text())
    assert compiled["entries"] == [_entry("Compiled", 48)]

    pytester.runpytest_subprocess().assert_outcomes(passed=2)

    # One run for both failures (an inner run costs a torch import and a compile): the eager block changed,
    # the compiled block's baseline gone.
    _write(pytester, reduces=2)
    (folder / "compiled.json").unlink()
    result = pytester.runpytest_subprocess("-v")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*::test_eager FAILED*", "*::test_compiled FAILED*"])
    result.stdout.fnmatch_lines([
        "*communication differs (this run against comm_signatures/eager.json): 0 appeared, 0 disappeared, 1 changed",
        "~ Net forward  all_reduce  group 0  float32: count 1 -> 2 per step, bytes 32 -> 64 per step  ranks 0",
        "(pytest --comm-update writes this run's signature as the baseline)",
    ])
    assert json.loads((folder / "eager.json").read_text()) == eager  # comparing never writes
    result.stdout.fnmatch_lines(["*comm_signature: no baseline comm_signatures/compiled.json; run pytest "
                                 "--comm-update to write it"])
    assert not (folder / "compiled.json").exists()


_TP_TEST = '''
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo")
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["tp", "tp_old"])
def test_tp(mesh, comm_signature, name):
    model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    with comm_signature(name):
        model(torch.rand(4, 10)).sum().backward()
    print(f"RANK {dist.get_rank()} CHECKED {name}.")
'''


def test_every_rank_of_a_dtensor_test_checks_the_jobs_signature(pytester):
    pytester.makepyfile(test_tp=_TP_TEST)
    folder = pytester.mkdir("comm_signatures")
    # RowwiseParallel's output all-reduce of the (4, 5) float32 output on both ranks, with its why.
    tp = _entry("ToyModel.out_proj", 80, ranks=(0, 1), mesh_dim="tp", cause="redistribute",
                source="(Partial(sum),)", target="(Replicate(),)")
    (folder / "tp.json").write_text(json.dumps({"format": signature.FORMAT, "world_size": 2, "entries": [tp]}))
    (folder / "tp_old.json").write_text(json.dumps({"format": signature.FORMAT, "world_size": 2,
                                                    "entries": [{**tp, "count_per_step": 2}]}))
    result = pytester.run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          "-m", "pytest", "-p", "no:cacheprovider", "-s", "-q", "-rN", "test_tp.py", timeout=300)
    out = result.stdout.str()
    # Each rank's pytest: tp passes, tp_old fails with the same diff (the job's signature, gathered).
    assert out.count("1 failed, 1 passed") == 2, out
    assert out.count("RANK 0 CHECKED tp.") == out.count("RANK 1 CHECKED tp.") == 1, out
    assert out.count("~ ToyModel.out_proj forward  all_reduce  group 0 (tp)  float32  cause redistribute "
                     "(Partial(sum),) -> (Replicate(),): count 2 -> 1 per step  ranks 0-1") == 2, out


@pytest.mark.parametrize("update", [False, True])
@pytest.mark.parametrize("option, value", [("count_tolerance", -1), ("bytes_tolerance", float("nan"))])
def test_a_bad_tolerance_is_said_before_the_block_runs(tmp_path, update, option, value):
    ran = []
    with pytest.raises(ValueError, match=f"^comm_signature: {option} must be a number >= 0, got {value!r}$"):
        with CommSignature(tmp_path, update)("name", **{option: value}):
            ran.append(True)
    assert ran == [] and not list(tmp_path.iterdir())


_LOOP = '''

def test_NAME(comm_signature):
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with comm_signature("loop", typical_only=TYPICAL_ONLY):
        for step in range(STEPS):
            loss = net(torch.ones(2, 4)).sum()
            loss.backward()
            if step == 0 and LAZY:
                dist.broadcast(torch.zeros(3), 0)  # lazy initialisation, in the first step only
            optimizer.step()
            optimizer.zero_grad()
            if step < STEPS - 1:
                dist.all_reduce(loss.detach())  # logs the loss, after every step but the last
'''

_DUPLICATE = '''

def test_duplicate(comm_signature):
    with comm_signature("duplicate"):
        Net()(torch.ones(2, 4))
'''


def _loop(name, steps, lazy=True, typical_only=False):
    """A test named ``test_<name>`` holding ``steps`` steps of a loop under the baseline name ``loop``."""
    return (_LOOP.replace("NAME", name).replace("STEPS", str(steps)).replace("LAZY", str(lazy))
            .replace("TYPICAL_ONLY", str(typical_only)))


def _apart(module, pass_, op, count, nbytes):
    entry = {**_entry(module, nbytes), "pass": pass_, "op": op, "count_delta": count, "bytes_delta": nbytes}
    del entry["count_per_step"], entry["bytes_per_step"]
    entry["ranks"] = entry.pop("ranks")
    return entry


def test_a_loops_baseline_holds_whatever_its_length_and_its_first_step_apart(pytester):
    pytester.makepyfile(test_loop=_GROUP + _loop("loop", steps=3))
    pytester.runpytest_subprocess("--comm-update").assert_outcomes(passed=1)
    folder = pytester.path / "comm_signatures"
    # Net's (2, 4) float32 all_reduce and the loss's (4 bytes) in the tail after optimizer.step(): the typical
    # step. The first step broadcasts 12 bytes more; the last step logs nothing.
    assert json.loads((folder / "loop.json").read_text()) == {
        "format": signature.FORMAT, "world_size": 1,
        "entries": [_entry("Net", 32), {**_entry("train_step_tail", 4), "pass": "none"}],
        "first_step": [_apart("train_step", "none", "broadcast", 1, 12)],
        "last_step": [_apart("train_step_tail", "none", "all_reduce", -1, -4)], "other_steps": []}

    # One comparing run (an inner run costs a torch import) for four tests against that baseline: 8 steps hold
    # it; without the lazy broadcast the first step is typical: a difference, unless only the typical step is
    # held. A baseline with one key twice for a rank is refused, naming the key.
    pytester.makepyfile(test_loop=_GROUP + _loop("loop", steps=8) + _loop("first_step_typical", 5, lazy=False)
                        + _loop("typical_only", 5, lazy=False, typical_only=True) + _DUPLICATE)
    entry = _entry("Net", 32)
    (folder / "duplicate.json").write_text(json.dumps({"format": signature.FORMAT, "world_size": 1,
                                                       "entries": [entry, {**entry, "count_per_step": 2}]}))
    result = pytester.runpytest_subprocess("-v")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*::test_loop PASSED*", "*::test_first_step_typical FAILED*",
                                 "*::test_typical_only PASSED*", "*::test_duplicate FAILED*"])
    result.stdout.fnmatch_lines([
        "*communication differs (this run against comm_signatures/loop.json): 0 appeared, 0 disappeared, "
        "0 changed, 1 in the first step",
        "first step ~ train_step none  broadcast  group 0  float32: +1 -> 0 collectives, +12 -> 0 bytes beside "
        "the typical step  ranks 0",
    ])
    assert ("comm_signature: comm_signatures/duplicate.json: 1 key(s) with two entries for one rank (one would "
            "silently win; merge them into one): entries[0] and [1]: Net forward  all_reduce  group 0  float32  "
            "rank 0") in result.stdout.lines


_SHARED = '''

@pytest.mark.parametrize("reduces", [1, 2])
def test_shared(comm_signature, reduces):
    with comm_signature("shared"):
        Net(reduces)(torch.ones(2, 4))


@pytest.mark.parametrize("reduces", [1, 2])
def test_apart(comm_signature, reduces):
    with comm_signature(f"apart_{reduces}"):
        Net(reduces)(torch.ones(2, 4))


def test_twice(comm_signature):
    for reduces in (1, 2):
        with comm_signature("twice"):
            Net(reduces)(torch.ones(2, 4))
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_update_refuses_to_write_one_name_from_two_tests(pytester, workers):
    pytester.makepyfile(test_shared=_GROUP + _SHARED)
    result = pytester.runpytest_subprocess("--comm-update", "-p", "no:cacheprovider", *workers)
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    folder = pytester.path / "comm_signatures"
    shared = json.loads((folder / "shared.json").read_text())
    # The test that wrote it first keeps it (under xdist either may be first); the other fails, naming both.
    count = shared["entries"][0]["count_per_step"]
    assert shared["entries"] == [_entry("Net", 32 * count, count=count)]
    writer, loser = f"test_shared.py::test_shared[{count}]", f"test_shared.py::test_shared[{3 - count}]"
    assert (f"comm_signature: --comm-update: {writer} wrote comm_signatures/shared.json in this run already; "
            f"{loser} would overwrite it: give each test its own name") in out, out
    assert ("comm_signature: --comm-update: test_shared.py::test_twice records two different signatures under "
            "comm_signatures/twice.json: give each block its own name") in out, out
    assert json.loads((folder / "twice.json").read_text())["entries"] == [_entry("Net", 32)]
    for reduces in (1, 2):
        apart = json.loads((folder / f"apart_{reduces}.json").read_text())
        assert apart["entries"] == [_entry("Net", 32 * reduces, count=reduces)]
    # Comparing: both parametrizations against one baseline is allowed (one differs); claims were per run.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "apart", *workers)
    result.assert_outcomes(passed=2)
