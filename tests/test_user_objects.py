"""Nothing of ours stays on, or is pickled or copied with, a user's module, optimizer or tensor.

TorchScript, export, fx, copies and checkpoints inspect a module's hooks: between calls a traced
module holds exactly the hooks it held untraced. A pickle made inside the traced region (between
steps, inside a step, inside the module's own call) loads in a process where commdebug_otel cannot
be imported, and the loaded objects hold nothing of ours.
"""

import copy
import io
import json
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from commdebug_otel import semconv

from models import AllReduceInBackward, Hooked, SavesItself

# Module attributes where torch keeps hooks (``Module.__init__``): a traced module's must equal its untraced own.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


# cloudpickle and dill store a local class's source file, whose path holds the clone's folder name (git's default
# is "commdebug-otel"): the checkout's path is not ours to find.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).encode()


def _holds_ours(blob: bytes) -> bool:
    return b"commdebug" in blob.replace(_CHECKOUT, b"")


def _hooks(model):
    return {name: {attr: dict(getattr(module, attr, {})) for attr in _HOOK_DICTS}
            for name, module in model.named_modules()}


class Head(nn.Module):
    """Its own forward hook, registered after tracing began, all-reduces the output: inside the forward span."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Head())


def _step(model, optimizer):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def test_torch_tooling_works_on_a_traced_model_and_it_holds_its_own_hooks_only(
        telemetry, tracer_factory, single_rank_group):
    # torch.jit.script(model) after traced steps raised "'_PostHook' object has no attribute '__name__'":
    # our forward hook stayed in every module's _forward_hooks, which TorchScript compiles.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    untraced = _hooks(model)
    x = torch.ones(2, 4)
    with tracer_factory():
        _step(model, optimizer)
        assert _hooks(model) == untraced
        model(x).sum().backward()  # inside a step: outputs and inputs hold tensor hooks, modules nothing
        assert _hooks(model) == untraced
        optimizer.step()
        scripted = torch.jit.script(model)
        assert torch.equal(scripted(x), model(x))
        traced = torch.jit.trace(model, x)
        assert torch.equal(traced(x), model(x))
        exported = torch.export.export(model, (x,))
        assert torch.equal(exported.module()(x), model(x))
        assert torch.equal(torch.fx.symbolic_trace(model)(x), model(x))
        try:
            import onnx  # noqa: F401  (torch.onnx.export needs it)
        except ImportError:
            pass
        else:
            torch.onnx.export(model, (x,), io.BytesIO(), dynamo=False)
        assert torch.equal(copy.deepcopy(model)(x), model(x))
        assert set(model.state_dict()) == {"0.weight", "0.bias", "2.lin.weight", "2.lin.bias"}
        assert "Head" in repr(model)
        clone = nn.Sequential()
        clone.__setstate__(model.__getstate__())
        assert torch.equal(clone(x), model(x))
        assert torch.equal(torch.compile(model, backend="eager")(x), model(x))
        _step(model, optimizer)  # the step the calls above were part of ends
        # A hook the module registers after tracing began still runs inside its forward span.
        reduce_output = model[2].register_forward_hook(
            lambda module, args, out: torch.distributed.all_reduce(out.detach()))
        telemetry.clear()
        _step(model, optimizer)
        reduce_output.remove()
        assert _hooks(model) == untraced
    owners = [(span.name, event.name) for span in telemetry.spans() for event in span.events]
    assert owners == [("Sequential.2 forward", "all_reduce")]
    assert [name for _, name in telemetry.tree()] == [
        "train_step", "Sequential forward", "Sequential.0 forward", "Sequential.1 forward", "Sequential.2 forward",
        "Sequential.2.lin forward", "Sequential backward", "Sequential.2 backward", "Sequential.2.lin backward",
        "Sequential.1 backward", "Sequential.0 backward"]


def test_a_scripted_model_is_traced_and_stays_scriptable(telemetry, tracer_factory):
    model = _model()
    scripted = torch.jit.script(model)
    optimizer = torch.optim.SGD(scripted.parameters(), lr=0.1)
    with tracer_factory():
        _step(scripted, optimizer)
        _step(scripted, optimizer)
        assert not scripted._forward_hooks
        torch.jit.script(model)
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 1]
    assert len(telemetry.by_name("RecursiveScriptModule forward")) == 2


# Loads pickles where commdebug_otel cannot be imported, and lists every hook the objects hold.
_LOADER = r"""
import importlib.abc, json, pickle, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "commdebug_otel":
            raise ModuleNotFoundError(f"blocked: {name}")
sys.meta_path.insert(0, Blocker())
for name in [name for name in sys.modules if name.split(".")[0] == "commdebug_otel"]:
    del sys.modules[name]
import torch
report = {}
for index, blob in enumerate(pickle.load(sys.stdin.buffer)):
    zipped = blob[:2] == b"PK"  # torch.save's, else pickle's
    loaded = torch.load(__import__("io").BytesIO(blob), weights_only=False) if zipped else pickle.loads(blob)
    hooks = []
    for value in (loaded if isinstance(loaded, (list, tuple)) else [loaded]):
        modules = value.modules() if isinstance(value, torch.nn.Module) else []
        for module in modules:
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
                hooks += [f"{attr}: {type(hook).__module__}.{getattr(hook, '__qualname__', type(hook).__name__)}"
                          for hook in getattr(module, attr).values()]
        if isinstance(value, torch.Tensor):
            hooks += [repr(hook) for hook in (value._backward_hooks or {}).values()]
        if isinstance(value, torch.optim.Optimizer):
            hooks += [repr(h) for h in (*value._optimizer_step_pre_hooks.values(),
                                        *value._optimizer_step_post_hooks.values())]
    report[index] = hooks
report["ours imported"] = [name for name in sys.modules if name.startswith("commdebug_otel")]
print(json.dumps(report))
"""


def _clean_env():
    """Ours, without the tracer's variables, with tests/models.py importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])}


def _load_elsewhere(blobs):
    """Load each of ``blobs`` (``torch.save`` or ``pickle`` bytes) in a fresh process without commdebug_otel."""
    done = subprocess.run([sys.executable, "-c", _LOADER], input=pickle.dumps(blobs), capture_output=True,
                          env=_clean_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_pickles_made_while_traced_load_without_the_package_and_hold_nothing_of_ours(telemetry, tracer_factory):
    # torch.save(model) inside the traced region wrote our forward hooks into the checkpoint: loading it needed
    # commdebug_otel, and where installed gave the loaded model stray hooks.
    model = Hooked()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    mid_call = []
    saver = SavesItself(mid_call)
    with tracer_factory():
        _step(model, optimizer)
        between_steps = [_saved(model), pickle.dumps(model), _saved(optimizer), pickle.dumps(optimizer),
                         _saved(optimizer.state_dict())]
        kept = []
        out = model(torch.ones(2, 4), keep=kept)
        assert model.position.table._backward_hooks and out._backward_hooks  # ours, through the step
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns of hooks it does not pickle: none of ours must warn
            tensors = [model.position.table, out, *kept]
            inside_step = [_saved(model), pickle.dumps(model), _saved(tensors), pickle.dumps(tensors),
                           pickle.dumps(copy.copy(model))]
            # A leaf tensor's copy keeps no hook (torch's); the model's copy holds nothing of ours.
            leaf_copy = copy.deepcopy(model.position.table)
        saver(torch.ones(1, 4))
        out.sum().backward()
        optimizer.step()
    everything = [*between_steps, *inside_step, *mid_call]
    assert not any(_holds_ours(blob) for blob in everything)
    report = _load_elsewhere(everything)
    assert report.pop("ours imported") == []
    # Inside its own call a module holds our forward hook: its pickle holds a no-op of Python's own in its place.
    assert report.pop(str(len(everything) - 1)) == ["_forward_hooks: builtins.Exception.__init__"]
    assert report == {str(index): [] for index in range(len(everything) - 1)}
    assert not leaf_copy._backward_hooks
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 1]


@pytest.mark.parametrize("library", ["cloudpickle", "dill"])
def test_other_picklers_made_while_traced_hold_nothing_of_ours(telemetry, tracer_factory, library):
    """cloudpickle and dill (Ray's, multiprocessing helpers') pickle more than pickle does (functions, closures,
    classes by value): between steps, inside a step and from inside a module's own call, nothing of ours."""
    pickler = pytest.importorskip(library)
    model = Hooked()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mid_call = []

    class PicklesItself(SavesItself):  # a local class: both pickle it by value
        def forward(self, x):
            out = self.lin(x)
            self.into.append(pickler.dumps(self))
            return out

    saver = PicklesItself(mid_call)
    with tracer_factory():
        _step(model, optimizer)
        blobs = [pickler.dumps(model)]  # (dill cannot pickle an optimizer, traced or not)
        kept = []
        out = model(torch.ones(2, 4), keep=kept)
        blobs += [pickler.dumps(model), pickler.dumps([model.position.table, out, *kept])]
        saver(torch.ones(1, 4))
        out.sum().backward()
        optimizer.step()
    blobs += mid_call
    assert len(blobs) == 4
    assert not any(_holds_ours(blob) for blob in blobs)
    assert _hooks(pickler.loads(blobs[1])) == _hooks(Hooked())  # pickled inside a step


def test_copies_made_while_traced_hold_nothing_of_ours(telemetry, tracer_factory):
    model = Hooked()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    untraced = _hooks(model)
    with tracer_factory():
        _step(model, optimizer)
        ema = copy.deepcopy(model)
        shallow = copy.copy(model)
        optimizer_copy = copy.deepcopy(optimizer)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert _hooks(ema) == _hooks(shallow) == untraced
    assert not optimizer_copy._optimizer_step_post_hooks and not optimizer_copy._optimizer_step_pre_hooks
    assert len(telemetry.by_name("Hooked forward")) == 2  # the copies were never called: the model's own spans


def test_a_checkpoint_made_with_dcp_while_traced_loads_without_the_package(telemetry, tracer_factory, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model = Hooked()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        _step(model, optimizer)
        out = model(torch.ones(2, 4))  # the parameter Position returns holds our hook now
        saved = model.position.table.detach().flatten().tolist()
        dcp.save({"model": model.state_dict(), "table": model.position.table}, checkpoint_id=str(tmp_path),
                 no_dist=True)
        out.sum().backward()
        optimizer.step()
    loader = f"""
import importlib.abc, json, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "commdebug_otel":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Blocker())
for name in [name for name in sys.modules if name.split(".")[0] == "commdebug_otel"]:
    del sys.modules[name]
import torch, torch.distributed.checkpoint as dcp
state = {{"table": torch.zeros(2, 4)}}
dcp.load(state, checkpoint_id={str(tmp_path)!r}, no_dist=True)
print(json.dumps([state["table"].flatten().tolist(), [n for n in sys.modules if n.startswith("commdebug_otel")]]))
"""
    done = subprocess.run([sys.executable, "-c", loader], capture_output=True, env=_clean_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout.decode().strip().splitlines()[-1]) == [saved, []]
    for path in tmp_path.iterdir():
        assert not _holds_ours(path.read_bytes())


class Reduces(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return AllReduceInBackward.apply(self.lin(x))


def test_a_collective_in_backward_of_a_module_pickled_mid_step_stays_its_own(telemetry, tracer_factory,
                                                                               single_rank_group):
    model = nn.Sequential(Reduces(), nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer_factory():
        out = model(torch.ones(2, 4, requires_grad=True))
        pickle.loads(pickle.dumps(model))
        copy.deepcopy(model)
        out.sum().backward()
        optimizer.step()
    owners = [(span.name, event.name) for span in telemetry.spans() for event in span.events]
    assert owners == [("Sequential.0 backward", "all_reduce")]


def test_a_copy_made_inside_its_own_call_is_traced_like_any_module(telemetry, tracer_factory):
    # The copy holds a no-op under our hook's id: our hook must replace it when the copy is called.
    copies = []
    saver = SavesItself(copies)
    with tracer_factory():
        saver(torch.ones(1, 4))
        copied = pickle.loads(copies[0])
        assert [type(hook).__name__ for hook in copied._forward_hooks.values()] == ["method-wrapper"]
        optimizer = torch.optim.SGD(copied.parameters(), lr=0.1)
        copied(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        assert not copied._forward_hooks  # our hook took the no-op's place and went with the call
    assert telemetry.tree() == [
        (0, "train_step"), (1, "SavesItself forward"), (2, "SavesItself.lin forward"),  # the saver's call
        (1, "SavesItself forward"), (2, "SavesItself.lin forward"),  # the copy's
        (1, "SavesItself backward"), (2, "SavesItself.lin backward")]

