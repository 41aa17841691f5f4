"""Module and backward ownership: which module record is open where, and so which one owns what runs now.

The module tracker's hooks report here (through the recorder): a forward (or recompute) began or
ended, a module's backward began or ended, an autograd pass finished. The rules (docs/architecture.md,
"Ownership rules"):

* forward / recompute: the innermost module running, its own hooks included;
* backward: the module whose backward began most recently and is still open (CommDebugMode's
  rule, which keeps a ColwiseParallel input-gradient all_reduce with that layer and books FSDP2's
  post-backward reduce-scatter to the FSDP unit);
* otherwise the step's root (``train_step``), or none between steps.

Opening and closing steps is the step lifecycle's (``recorder.Recorder``), asked through
:class:`~commdebug_otel.core.protocols.OwnershipHost`.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from operator import attrgetter
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture._torch import graph_task_id, in_module_call, queue_engine_callback, user_class_name
from commdebug_otel.capture.sinks import RecorderObserver
from commdebug_otel.config import Settings
from commdebug_otel.core.fact import PASS_NONE
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.protocols import OwnershipHost
from commdebug_otel.core.record_pool import RecordPool
from commdebug_otel.core.records import Record, Step, descends_from, parameter_facts
from commdebug_otel.core.thread_role import one_role_holder

# Where no optimizer exists (none alive, none stepped), a step ends at the top-level forward
# after this many completed backward passes (scripts that never step an optimizer).
NO_OPTIMIZER_CYCLES = 8
# The hooks' ThreadRole (thread_role.one_role_holder): a getter that is no Python call per hook.
_ROLE = attrgetter("_host.role")
# Raised by torch.utils.checkpoint to stop a recompute early: control flow, not a failure.
_CONTROL_FLOW_ERRORS = frozenset({"_StopRecomputationError"})


class ModuleOwnership:
    """The open module records of the training thread, and the owner of what runs now.

    Attributes:
        fwd_stack: open forward (and recompute) records, innermost last.
        open_bw: open backward records, most recently begun last.
        depth: module nesting where records are skipped (untraced steps).
        hooks_off: the open step's module calls run without our hooks (:meth:`hook_free_step`):
            ``depth`` counts only the first call, the pass is read from the Python stack.
        resume_module_hooks: called (no arguments) when such a step closes, or the state resets: the
            module tracker's global hooks come back; None: nothing to call.
    """

    def __init__(self, host: OwnershipHost, settings: Settings, observers: tuple[RecorderObserver, ...],
                 pool: RecordPool, failures: Failures) -> None:
        self._host = host
        self._settings = settings
        self._observers = observers
        self._pool = pool
        self._failures = failures
        self._max_records = settings.max_spans_per_step  # per step part (Recorder.step_full)
        self._filtered = bool(settings.module_include or settings.module_exclude)  # else no record is hidden
        self._params_seen: weakref.WeakSet = weakref.WeakSet()
        self.resume_module_hooks: Any = None
        self.reset()

    def reset(self) -> None:
        """The state a process starts with, and a forked child starts again with."""
        self.fwd_stack: list[Record] = []
        self.open_bw: list[Record] = []
        self._bw_hint: tuple[Record | None, int] = (None, 0)  # the last record _begin_backward inserted, and where
        self._bw_callback_tasks: set[int] = set()  # graph tasks whose end is hooked (nested: reentrant checkpoints)
        self.depth = 0
        self._call_counts: dict[str, int] = {}  # by span name (FQN and pass): a string key is not GC-tracked
        self.hooks_back()

    def hook_free_step(self) -> bool:
        """Whether the open step's module calls may run with no hook of ours from now until it closes (then
        ``resume_module_hooks``): an untraced training step that keeps no records, once ``optimizer.step()``
        ends steps on a training thread known for good. Nothing then needs a module call: the step is open,
        and its close, time, collectives and the watchdog need none (the pass is read from the stack)."""
        host = self._host
        step, role = host.current_step, host.role
        if (step is None or not step.quiet or step.inference or not host.seen_optimizer or not role.fixed
                or role.borrowing or host.first_call is not None or self.resume_module_hooks is None):
            return False
        self.hooks_off = True
        return True

    def hooks_back(self) -> None:
        """The module calls run our hooks again (the step that went hook-free closed, or the state resets)."""
        self.hooks_off = False
        resume = self.resume_module_hooks
        if resume is not None:
            try:
                resume()
            except Exception as error:
                self._failures.hook_failed("module hooks resume", error)

    @property
    def idle(self) -> bool:
        """No module call open (recorded or not)."""
        return not self.fwd_stack and self.depth == 0

    def state_sizes(self) -> dict[str, int]:
        return {"open forward records": len(self.fwd_stack), "open backward records": len(self.open_bw),
                "call counts": len(self._call_counts), "modules seen": len(self._params_seen)}

    def step_opened(self) -> None:
        self._call_counts.clear()

    def close(self, now: int) -> bool:
        """The step closes now: every open record ends (a forward still running is marked unmatched; its
        record stays the tracker's). Returns whether a forward was open."""
        forward_open = bool(self.fwd_stack)
        for record in reversed(self.fwd_stack):
            if record.end_ns == 0:
                record.end_ns, record.unmatched = now, True
        self.fwd_stack.clear()
        self.depth = 0
        _end_backward_records(self.open_bw, now)
        self.open_bw.clear()
        self._bw_hint = (None, 0)
        return forward_open

    def innermost_open(self) -> Record | None:
        """The innermost open forward record, else the most recent open backward one, else None."""
        open_records = self.fwd_stack or self.open_bw
        return open_records[-1] if open_records else None

    def module_pre(self, module: torch.nn.Module, fqn: str, args: tuple,
                   compiled: bool = False) -> Record | None:
        """A module's forward (or recompute) begins. Returns its record, or None when not recorded.

        ``compiled``: the call runs ``module``'s compiled code (``torch.compile``), which holds
        its collectives; the modules inside it get no records.
        """
        now = time.time_ns()
        self._host.why.clear()
        in_backward = graph_task_id() != -1
        step = self._host.current_step
        if step is None:
            check = self._host.first_call
            if check is not None:
                self._host.first_call = None
                if check():
                    return None
            # A top-level forward without grad (inference, evaluation between steps) is its own root.
            step = self._host.open_step(now, inference=not in_backward and not torch.is_grad_enabled())
        elif (not self.fwd_stack and self.depth == 0 and not in_backward and not self._host.seen_optimizer
              and step.backward_done >= NO_OPTIMIZER_CYCLES and self._host.without_optimizer()):
            # No optimizer at all: bound the step. Where one exists, its step() ends the step however
            # many backward passes come first (accumulation, a chunked loss), bounded by step_full.
            self._host.close_step(now)
            step = self._host.open_step(now)
        step.had_module = True
        if not (step.traced or self._settings.metric_module_depth > 0):
            self.depth += 1
            return None
        if len(step.records) >= self._max_records:  # the one compare a recorded call pays for the bound
            step = self._host.step_full(step, now, in_backward)
            if step is None:
                self.depth += 1
                return None
        pass_ = semconv.PASS_RECOMPUTE if in_backward else semconv.PASS_FORWARD
        record = self._pool.module_record(f"{fqn} {pass_}", now)
        record.fqn = fqn
        record.pass_ = pass_
        record.module_type = user_class_name(type(module))  # Net, not fully_shard's FSDPNet
        counts = self._call_counts  # the calls of this span name so far this step, then one more
        record.call_index = index = counts.get(record.name, 0)
        counts[record.name] = index + 1
        record.hidden = self._filtered and self._hidden(fqn)
        handled = sys.exc_info()[1]
        if handled is not None:  # called inside an ``except`` block (a fallback, a retry)
            record.handling = (handled, handled.__traceback__)
        record.compiled = compiled
        if self.fwd_stack:
            record.parent = self.fwd_stack[-1]
        elif in_backward and self.open_bw:
            record.parent = self.open_bw[-1]
        else:
            record.parent = step.root
        record.depth = record.parent.depth + 1
        if module not in self._params_seen:
            self._params_seen.add(module)
            record.params = parameter_facts(module)
            callers = tuple(self.fwd_stack)
            for observer in self._observers:
                observer.on_first_call(module, fqn, callers)
        self.fwd_stack.append(record)
        step.records.append(record)
        return record

    def _hidden(self, fqn: str) -> bool:
        include, exclude = self._settings.module_include, self._settings.module_exclude
        if not include and not exclude:
            return False
        from fnmatch import fnmatchcase

        if include and not any(fnmatchcase(fqn, pattern) for pattern in include):
            return True
        return any(fnmatchcase(fqn, pattern) for pattern in exclude)

    def module_post(self, module: torch.nn.Module, record: Record | None) -> None:
        """A module's forward ended (its own forward hooks included)."""
        now = time.time_ns()
        self._host.why.clear()
        if record is None:
            self.depth = max(0, self.depth - 1)
        else:
            stack = self.fwd_stack
            while stack:
                top = stack.pop()
                top.end_ns = now
                if top is record:
                    break
                top.unmatched = True  # a pre-hook whose post-hook never came
            error = sys.exc_info()[1]
            if error is not None and type(error).__name__ not in _CONTROL_FLOW_ERRORS:
                # Only the call's own exception: not one that its caller was already handling
                # when the call began (a raise through the call gives it a new traceback head).
                handled = record.handling
                if handled is None or error is not handled[0] or error.__traceback__ is not handled[1]:
                    record.error = error
            record.handling = None
        step = self._host.current_step
        if step is not None and step.inference and not self.fwd_stack and self.depth == 0:
            self._host.close_step(now)

    # --------------------------------------------------------------- backward
    @one_role_holder(_ROLE)
    def backward_began(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's outputs are ready: its backward begins."""
        now = time.time_ns()
        task = graph_task_id()
        if forward.last_bw is not None and forward.last_bw.graph_task == task:
            return  # another output of the call, or one hooked twice (before and after its own hooks)
        if forward.graph_task == task:
            # A forward record's own graph_task marks "no backward recorded for this call in
            # this pass": its input gradients were computed already (an output that passes an
            # input through in a way the tracker cannot see), or the step was full.
            return
        step = self._host.current_step
        if step is not None and len(step.records) >= self._max_records:
            if self._host.step_full(step, now, in_backward=True) is None:
                forward.graph_task = task  # the call's other outputs are not counted again
                return
        record = self._pool.module_record(f"{forward.fqn} {semconv.PASS_BACKWARD}", now)
        record.fqn, record.module_type, record.compiled = forward.fqn, forward.module_type, forward.compiled
        record.pass_ = semconv.PASS_BACKWARD
        record.fwd, record.graph_task, record.hidden = forward, task, forward.hidden
        record.depth = forward.depth
        counts = self._call_counts  # as in module_pre
        record.call_index = index = counts.get(record.name, 0)
        counts[record.name] = index + 1
        forward.open_bw = record
        record.prev_bw, forward.last_bw = forward.last_bw, record
        self._begin_backward(record)
        if step is not None:
            step.records.append(record)
        if task not in self._bw_callback_tasks:
            self._bw_callback_tasks.add(task)
            queue_engine_callback(functools.partial(self.backward_done, task))

    def _begin_backward(self, record: Record) -> None:
        """Open ``record``; if a descendant's hook fired first, the descendant stays most recent.

        A module and its last child share the output tensor, and the child's hook,
        registered first, fires first: the parent's backward did not begin "after" it.
        """
        open_bw = self.open_bw
        index = len(open_bw)
        # The last record inserted, if it still stands where it went and descends from this one
        # (a chain of modules sharing one output: hooks fire innermost first): everything above
        # it descends from it, so the search starts below it. Deep chains cost O(1) per record.
        hint, at = self._bw_hint
        if at < index and open_bw[at] is hint and descends_from(hint, record.fwd):
            index = at
        while index > 0 and descends_from(open_bw[index - 1], record.fwd):
            index -= 1
        open_bw.insert(index, record)
        self._bw_hint = (record, index)

    @one_role_holder(_ROLE)
    def backward_ended(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's inputs are computed: its backward ends."""
        record = forward.open_bw
        if record is None:
            # Input gradients before any output gradient: nothing of this call runs later in
            # this pass, so a late output hook must not open a backward that never ends.
            forward.graph_task = graph_task_id()
        else:
            forward.open_bw = None
            record.end_ns = time.time_ns()
            open_bw = self.open_bw
            for index in range(len(open_bw) - 1, -1, -1):  # the most recent end first, usually
                if open_bw[index] is record:
                    del open_bw[index]
                    break

    @one_role_holder(_ROLE)
    def backward_done(self, task: int) -> None:
        """The autograd engine finished computing backward pass ``task`` (an engine final callback).

        Gradient computation is over, so every module's backward of that pass but the
        outermost ones ends here. The outermost stay open for one more round
        of final callbacks: callbacks queued later (FSDP2's root post-backward
        reduce-scatter) are booked to the root module's backward. Another pass's
        records stay open: a reentrant checkpoint's backward runs inside the pass
        that called it.
        """
        try:
            now = time.time_ns()
            mine = [r for r in self.open_bw if r.graph_task == task]
            inner = {id(r) for r in mine if any(descends_from(r, other.fwd) for other in mine if other is not r)}
            _end_backward_records([r for r in mine if id(r) in inner], now)
            self.open_bw[:] = [r for r in self.open_bw if id(r) not in inner]
            self._bw_hint = (None, 0)
            queue_engine_callback(functools.partial(self._backward_finally, task))
        except Exception as error:
            self._failures.hook_failed("backward end", error)

    @one_role_holder(_ROLE)
    def _backward_finally(self, task: int) -> None:
        try:
            _end_backward_records([r for r in self.open_bw if r.graph_task == task], time.time_ns())
            self.open_bw[:] = [r for r in self.open_bw if r.graph_task != task]
            self._bw_hint = (None, 0)
            self._bw_callback_tasks.discard(task)
            if not self._bw_callback_tasks:  # not a pass nested in another
                self._host.backward_pass_done()
        except Exception as error:
            self._failures.hook_failed("backward end", error)

    def owner(self) -> tuple[Record | None, Step | None]:
        """The record that owns what runs now (ownership rules above), or the step's root; and the open step."""
        step = self._host.current_step
        if self.fwd_stack:
            owner = self.fwd_stack[-1]
        elif self.open_bw:
            owner = self.open_bw[-1]
        elif step is not None:
            return step.root, step
        else:
            return None, None
        while owner.hidden and owner.parent is not None:
            owner = owner.parent if owner.fwd is None else owner.fwd.parent or owner.parent
        return owner, step

    def pass_by_depth(self, in_backward: bool) -> str:
        """The pass when no module record owns the collective (untraced steps keep only the depth; where
        their module calls run hook-free, the stack tells whether one is in progress)."""
        inside = self.depth > 0 or (self.hooks_off and in_module_call())
        if in_backward:
            return semconv.PASS_RECOMPUTE if inside else semconv.PASS_BACKWARD
        return semconv.PASS_FORWARD if inside else PASS_NONE


def _end_backward_records(records: list[Record], now: int) -> None:
    for record in records:
        record.end_ns = now
        record.unmatched = record.fwd is not None and record.fwd.input_hooked
        if record.fwd is not None:
            record.fwd.open_bw = None
