"""After ``stop()`` nothing of ours is left in the process: hooks, dispatch mode, patches, exit handlers.

Compares torch's own global registries before ``start()`` and after ``stop()``, after a traced step that
used every part of the tracer (module hooks, tensor hooks, the dispatch mode at detail ``dtensor``, the
collective kernels, the optimizer-step hooks, DTensor's redistribution watches, exit handlers). Leaving any one of them
installed makes this test fail.
"""

import atexit

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from commdebug_otel import CommTracer, Settings

_MODULE_REGISTRIES = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks",
    "_global_module_registration_hooks", "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _process_state() -> dict:
    from torch.distributed.tensor import DTensor, _api, _dispatch, _redistribute
    from torch.distributed.tensor._dispatch import OpDispatcher

    state = {name: dict(getattr(module_hooks, name)) for name in _MODULE_REGISTRIES
             if hasattr(module_hooks, name)}
    state["_has_any_global_hook"] = module_hooks._has_any_global_hook  # torch.compile's warning asks it
    state["optimizer pre"] = dict(optimizer_hooks._global_optimizer_pre_hooks)
    state["optimizer post"] = dict(optimizer_hooks._global_optimizer_post_hooks)
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    state["redistribute_local_args"] = OpDispatcher.__dict__["redistribute_local_args"]
    state["redistribute_local_tensor"] = [module.__dict__["redistribute_local_tensor"]
                                          for module in (_redistribute, _api, _dispatch)]
    state["full_tensor"] = DTensor.__dict__["full_tensor"]
    return state


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        dist.all_reduce(hidden.detach())
        return self.second(hidden)


def test_stop_removes_every_hook_mode_patch_and_exit_handler(telemetry, single_rank_group, monkeypatch):
    exit_handlers = []  # (CPython's atexit cannot list its handlers: watch what is added and removed)
    register, unregister = atexit.register, atexit.unregister

    def add(function, *args, **kwargs):
        exit_handlers.append(function)
        return register(function, *args, **kwargs)

    def remove(function):
        exit_handlers[:] = [handler for handler in exit_handlers if handler != function]
        unregister(function)

    monkeypatch.setattr(atexit, "register", add)
    monkeypatch.setattr(atexit, "unregister", remove)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    mesh = init_device_mesh("cpu", (1,))
    before = _process_state()
    tracer = CommTracer(Settings(detail="dtensor"), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider)
    tracer.start()
    kept = []
    for _ in range(2):
        out = net(torch.ones(2, 4, requires_grad=True))
        kept.append(out)  # a tensor that outlives the step, with the hooks it had
        sharded = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        sharded.redistribute(mesh, [Replicate()])  # DTensor's redistribution paths
        sharded.full_tensor()
        (sharded.to_local().sum() + out.sum()).backward()
        optimizer.step()
    assert _process_state() != before and exit_handlers  # what follows can fail: things were installed
    tracer.stop()

    assert _process_state() == before
    assert exit_handlers == []
    for module in net.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for tensor in kept:
        assert not tensor._backward_hooks
    spans, points = len(telemetry.spans()), telemetry.metric_points("torch.collective.operations")
    net(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    dist.all_reduce(torch.ones(1))
    assert len(telemetry.spans()) == spans  # nothing traced after stop
    assert telemetry.metric_points("torch.collective.operations") == points  # nor counted


def _our_threads() -> list[str]:
    import threading

    return sorted(thread.name for thread in threading.enumerate() if thread.name.startswith("commdebug-otel"))


def test_tracers_started_and_stopped_leave_no_thread(telemetry, single_rank_group):
    """Each tracer's metrics worker and stall watchdog end with it: 30 tracers leave no thread of ours behind."""
    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    before = _our_threads()
    for _ in range(30):
        with CommTracer(Settings(stall_after_s=30.0), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider):
            net(torch.ones(2, 4, requires_grad=True)).sum().backward()  # all_reduce: metric points
            optimizer.step()
            assert "commdebug-otel-metrics" in _our_threads()  # the worker really ran
    assert _our_threads() == before
    assert len(telemetry.metric_points("torch.collective.operations")) == 1  # every tracer's points recorded
    assert telemetry.metric_points("torch.collective.operations")[0][1] == 30


def test_torch_compiles_global_hook_warning_counts_the_scripts_hooks_not_ours(telemetry):
    """``torch.compile(module)``'s call warns when ``_has_any_global_hook()``: ours are not counted (no warning
    of ours reaches a ``-W error`` script), a hook of the script's still is."""
    tracer = CommTracer(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider).start()
    try:
        assert module_hooks._global_forward_pre_hooks and not module_hooks._has_any_global_hook()
        handle = module_hooks.register_module_forward_hook(lambda module, args, output: None)
        assert module_hooks._has_any_global_hook()
        handle.remove()
        assert not module_hooks._has_any_global_hook()
    finally:
        tracer.stop()


_CYCLES = """
import gc, json, os, sys, threading, weakref
import torch
import torch.distributed as dist
from commdebug_otel import CommTracer, Settings

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
net = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)


def cycle():
    tracer = CommTracer(Settings(output_dir=sys.argv[1], stall_after_s=30.0))
    with tracer:
        net(torch.ones(1, 2)).sum().backward()
        dist.all_reduce(torch.ones(1))
        optimizer.step()
    return weakref.ref(tracer)


def fds():
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return sorted(names)


def state():
    gc.collect()
    return {"threads": sorted(thread.name for thread in threading.enumerate()), "fds": fds(),
            "modules": len(sys.modules), "keys": store.num_keys()}


first = cycle()  # the process-wide telemetry (providers, their threads and files) is made once, here
after_first = state()
later = [cycle() for _ in range(3)]
json.dump({"first": after_first, "later": state(), "tracers_alive": [ref() is not None for ref in [first, *later]]},
          sys.stdout)
"""


def test_start_stop_cycles_leave_nothing_behind(tmp_path):
    """After a tracer stops, nothing of it stays: no reference (atexit, fork and signal registries, the store),
    and later cycles add no thread, file descriptor, module or store key to what the first one set up (the
    process-wide telemetry: its SDK threads and OTLP-JSON files are reused by every tracer of the process)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", _CYCLES, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout)
    assert state["later"] == state["first"]
    assert state["tracers_alive"] == [False] * 4
