"""Collectives counted at the dispatcher; the dispatch mode only on traced steps, under user modes."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils import _python_dispatch as python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from commdebug_otel import semconv

from models import AllReduceLinear


def _has_kernel(op="c10d::allreduce_"):
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "BackendSelect")


def _operations(telemetry):
    return {(labels[semconv.COLLECTIVE_OP], labels[semconv.MODULE_PASS]): value
            for labels, value in telemetry.metric_points(semconv.METRIC_OPERATIONS)}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_only_started_tracers_are_told_and_the_kernels_stay(single_rank_group):
    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.capture.sinks import RecorderObserver
    from commdebug_otel.testing import InMemoryTelemetry

    class Seen(RecorderObserver):
        def __init__(self):
            self.ops = []

        def on_collective(self, spec, owner, pass_):
            self.ops.append(spec.op)

    first, seen = InMemoryTelemetry(), Seen()
    exporting = CommTracer(Settings(), tracer_provider=first.tracer_provider, meter_provider=first.meter_provider)
    counting = CommTracer(Settings(), observer=seen, exports=False)  # a second tracer may only count
    exporting.start()
    assert _has_kernel() and _has_kernel("_c10d_functional::all_gather_into_tensor")
    counting.start()
    dist.all_reduce(torch.ones(2))  # both
    counting.stop()
    dist.all_reduce(torch.ones(2))  # the first only
    exporting.stop()
    dist.all_reduce(torch.ones(2))  # nobody
    # Deregistering a kernel another thread may be running is not safe: it stays, passing through.
    assert _has_kernel()
    assert _operations(first) == {("all_reduce", "none"): 2}
    assert seen.ops == ["all_reduce"]


def test_untraced_steps_run_without_a_mode_and_still_count(telemetry, tracer_factory, single_rank_group):
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stacks = []
    model.lin.register_forward_hook(lambda *_: stacks.append(len(_get_current_dispatch_mode_stack())))
    with tracer_factory(trace_every=2, detail="dtensor"):  # op events need the mode on traced steps
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            dist.all_reduce(torch.ones(3))  # between the backward and the optimizer step
            optimizer.step()
        assert _get_current_dispatch_mode_stack() == []  # the last step (3) closed untraced
    assert stacks == [1, 0, 1, 0]
    assert [s.attributes[semconv.STEP] for s in telemetry.by_name("train_step")] == [0, 2]
    assert _operations(telemetry) == {("all_reduce", "forward"): 4, ("all_reduce", "none"): 4}


def test_dtensor_redistributions_are_watched_on_traced_steps_only(tracer_factory, single_rank_group):
    from torch.distributed.tensor._dispatch import OpDispatcher

    original = OpDispatcher.__dict__["redistribute_local_args"]
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watched = []
    model.lin.register_forward_hook(
        lambda *_: watched.append(OpDispatcher.__dict__["redistribute_local_args"] is not original))
    with tracer_factory(trace_every=2):
        set_up = OpDispatcher.__dict__["redistribute_local_args"] is not original
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        between = OpDispatcher.__dict__["redistribute_local_args"] is not original  # after step 3 (untraced)
    assert (set_up, watched, between) == (True, [True, False, True, False], False)
    assert OpDispatcher.__dict__["redistribute_local_args"] is original


def test_collectives_under_inference_mode_are_counted(telemetry, tracer_factory, single_rank_group):
    with tracer_factory(), torch.inference_mode():
        dist.all_reduce(torch.ones(2))
        funcol.all_reduce(torch.ones(2), "sum", single_rank_group).wait()
    # The functional collective's own c10d call inside it is not counted again.
    assert _operations(telemetry) == {("all_reduce", "none"): 2}
    names = [e.attributes[semconv.OP_NAME] for e in telemetry.one("outside_step").events]
    assert names == ["c10d.allreduce_.default", "_c10d_functional.all_reduce.default"]


def test_a_user_mode_exited_inside_a_traced_step_keeps_the_stack_in_order(telemetry, tracer_factory,
                                                                          single_rank_group):
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = OpCounter()
    with tracer_factory(detail="dtensor"):
        for _ in range(2):
            with counter:  # entered before our mode is pushed, exited before it is removed
                loss = model(torch.ones(2, 4)).sum()
                inside = _get_current_dispatch_mode_stack()
            assert inside[-1] is counter and len(inside) == 2  # ours sits under the user's mode
            after = _get_current_dispatch_mode_stack()
            assert len(after) == 1 and after[0] is not counter  # the user's exit popped the user's mode
            loss.backward()
            optimizer.step()
            assert _get_current_dispatch_mode_stack() == []
            # torch's process-wide "a mode is active" flag follows the stack, not enter/exit order
            assert python_dispatch._is_in_torch_dispatch_mode is False
    assert "c10d.allreduce_.default" in counter.ops  # the user's mode still saw every op
    assert [len(s.events) for s in telemetry.by_name("AllReduceLinear forward")] == [1, 1]


def test_a_user_mode_entered_in_a_step_and_left_open_is_kept(tracer_factory, single_rank_group):
    model = AllReduceLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = OpCounter()
    with tracer_factory(detail="dtensor"):
        model(torch.ones(2, 4)).sum().backward()
        counter.__enter__()  # on top of ours, still open when the step ends
        try:
            optimizer.step()
            assert _get_current_dispatch_mode_stack() == [counter]
        finally:
            counter.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == []


class StackRecordingSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.stacks = []

    def step(self, closure=None):
        self.stacks.append(len(_get_current_dispatch_mode_stack()))
        return super().step(closure)


def test_detail_collectives_never_pushes_a_mode(tracer_factory, single_rank_group):
    model = AllReduceLinear()
    optimizer = StackRecordingSGD(model.parameters())
    stacks = []
    model.lin.register_forward_hook(lambda *_: stacks.append(len(_get_current_dispatch_mode_stack())))
    with tracer_factory(detail="collectives"):
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    assert stacks == [0, 0] and optimizer.stacks == [0, 0]


def test_the_optimizer_step_keeps_the_mode_where_ops_are_events(tracer_factory, single_rank_group):
    model = AllReduceLinear()
    for detail, expected in (("dtensor", [1, 1]), ("ops", [1, 1])):
        optimizer = StackRecordingSGD(model.parameters())
        with tracer_factory(detail=detail):
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
        assert optimizer.stacks == expected, detail


def test_a_step_ended_inside_backward_leaves_one_mode_at_most(tracer_factory, single_rank_group):
    """Optimizer-in-backward: the step closes inside the pass, where autograd owns the mode stack."""
    model = AllReduceLinear()
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for param in optimizers:
        param.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
    stacks = []
    model.lin.register_forward_hook(lambda *_: stacks.append(len(_get_current_dispatch_mode_stack())))
    with tracer_factory(detail="dtensor", trace_every=2):
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
    assert stacks == [1, 0, 1, 0]
    assert _get_current_dispatch_mode_stack() == []
