"""The recorder: the one object that knows which span is open where.

The module tracker (``tracker.py``) and the dispatch mode (``mode.py``) only
report facts here: a module pass began or ended, a collective or op ran. The
recorder keeps light :class:`Record` objects for the current step and turns
them into OTel spans when the step ends (``_emit``). Building spans at the end
lets backward spans nest by the module tree whatever order autograd fires the
hooks in, and keeps the per-op hot path free of OTel calls.

Ownership rules (DESIGN.md):

* forward / recompute: the innermost module running, its own hooks included;
* backward: the module whose backward began most recently and is still open
  (CommDebugMode's rule, which keeps a ColwiseParallel input-gradient
  all_reduce with that layer and books FSDP2's post-backward reduce-scatter
  to the FSDP unit);
* otherwise the step's ``train_step`` span, or an ``outside_step`` root span
  when no step is open (model set-up, evaluation between steps).
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from . import semconv
from .config import Settings, TraceScope
from .ops import CollectiveSpec, GroupResolver, payload_bytes, payload_facts, reduce_op_name
from .steps import RankInfo, job_nonce, rank_info, step_trace_id

_logger = logging.getLogger(__name__)

_KIND_MODULE = 0
_KIND_STEP = 1
_KIND_OUTSIDE = 2
_ATTR_MAX_CHARS = 1024  # bound on any string attribute we build
# Before any optimizer.step() is seen, a step ends at the top-level forward after
# this many completed backward passes (scripts that never step an optimizer).
NO_OPTIMIZER_CYCLES = 8
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
PASS_NONE = "none"  # a collective outside any module pass (set-up, optimizer, logging)
# Raised by torch.utils.checkpoint to stop a recompute early: control flow, not a failure.
_CONTROL_FLOW_ERRORS = frozenset({"_StopRecomputationError"})


def _graph_task_id() -> int:
    return torch._C._current_graph_task_id()


class Record:
    """A span-to-be. Times are ``time.time_ns()`` nanoseconds."""

    __slots__ = (
        "kind", "name", "fqn", "module_type", "pass_", "call_index", "start_ns", "end_ns",
        "parent", "fwd", "events", "dropped_events", "error", "unmatched", "params",
        "open_bw", "bw_records", "graph_task", "input_hooked", "hidden", "attrs", "hooked_outputs",
        "span_id",
    )

    def __init__(self, kind: int, name: str, start_ns: int) -> None:
        self.kind = kind
        self.name = name
        self.fqn = ""
        self.module_type = ""
        self.pass_ = ""
        self.call_index = 0
        self.start_ns = start_ns
        self.end_ns = 0
        self.parent: Record | None = None
        self.fwd: Record | None = None  # backward record -> its forward record
        self.events: list[tuple[str, dict, int]] = []
        self.dropped_events = 0
        self.error: BaseException | None = None
        self.unmatched = False
        self.params: list[str] | None = None
        self.open_bw: Record | None = None  # forward record -> its open backward record
        self.bw_records: list[Record] = []
        self.graph_task = -1
        self.input_hooked = False
        self.hidden = False
        self.attrs: dict[str, Any] = {}
        self.hooked_outputs: set[int] | frozenset = set()  # ids of outputs with a backward hook
        self.span_id = 0  # assigned up front when a metric exemplar points at this span


class _Step:
    __slots__ = ("index", "traced", "root", "records", "kind", "backward_done", "had_module",
                 "trace_id", "hooks", "inference", "quiet")

    def __init__(self, index: int, traced: bool, root: Record, kind: int) -> None:
        self.index = index
        self.traced = traced
        self.root = root
        self.records: list[Record] = []
        self.kind = kind
        self.backward_done = 0  # backward passes completed in this step
        self.had_module = False
        self.trace_id = 0  # known up front for traced steps when span ids can be pre-assigned
        self.hooks: list[Any] = []  # multi-grad hook handles, removed when the step closes
        self.inference = False  # a top-level forward without grad: its own root, not a train_step
        # Keeps nothing but metric points (untraced, no module label, no sink): its collectives
        # take the short path in Recorder.collective().
        self.quiet = False


class Recorder:
    """Owns open spans, step boundaries and the collective sequence numbers.

    Args:
        settings: frozen :class:`Settings`.
        emit_step: ``emit_step(root_records, trace_id_or_None)`` turns finished
            records into spans (``telemetry.SpanEmitter``); ``None`` disables spans.
        metrics: a ``metrics.CollectiveMetrics`` or ``None``.
    """

    def __init__(self, settings: Settings, emit_step: Callable | None, metrics: Any | None,
                 preassigned_ids: Callable[[], bool] = lambda: False) -> None:
        self.settings = settings
        self._preassigned_ids = preassigned_ids
        self._exemplars: bool | None = None  # decided at the first traced step
        self._emit_step = emit_step
        self._metrics = metrics
        self._groups = GroupResolver()
        self._seq: dict[str, int] = {}
        self._step: _Step | None = None
        self._outside: _Step | None = None
        self._next_step = 0
        self._next_inference = 0
        self._seen_optimizer = False
        # Whether the step that closed last was traced: collectives between steps (a logging
        # all_reduce after optimizer.step()) follow it; set-up before the first step is traced.
        self._after_traced = True
        # Whether c10d collectives are timed to completion now: the steps trace_every picks and
        # one in completion_every (a backend-thread callback each); between steps, as the step before.
        self._time_completions = True
        self._fwd_stack: list[Record] = []
        self._open_bw: list[Record] = []  # open backward records, most recently begun last
        self._bw_callback_task = -1
        self._depth = 0  # module nesting when records are skipped (untraced steps)
        self._call_counts: dict[tuple[str, str], int] = {}
        self._params_seen: weakref.WeakSet = weakref.WeakSet()
        # The DTensor op whose redistribution is in progress (the "why" of a collective),
        # set by the dispatch mode; its facts are computed only if a collective follows.
        self.why_func: Any = None
        self.why_args: tuple = ()
        self._why_facts_of: Any = None
        self._why_attrs: dict[str, Any] = {}
        self._rank: RankInfo | None = None
        self._nonce: str | None = None
        self._failed: set[str] = set()
        self._untimed: set[str] = set()  # overloads whose Work has no future on this backend
        self.sinks: list[Callable[[CollectiveSpec, Record | None, str], None]] = []
        self.module_sinks: list[Callable[[torch.nn.Module, str], None]] = []
        # op_sinks: (func, args, is_dtensor, owner) for every op_event, traced step or not.
        self.op_sinks: list[Callable[[Any, tuple, bool, Record | None], None]] = []
        # event_filter(func, is_dtensor): which reported ops become span events (None: all);
        # lets the CommDebugMode drop-in see every op while events keep the user's detail.
        self.event_filter: Callable[[Any, bool], bool] | None = None
        # traced_step_changed(traced): a step opened (traced or not), or a traced step
        # closed (False); the tracer keeps its dispatch mode on only while a traced one is open.
        self.traced_step_changed: Callable[[bool], None] | None = None
        # why_wanted(wanted): whether a "why" (why_func) may be recorded now; False while an
        # untraced step is open, so DTensor's redistributions need not report their op then.
        self.why_wanted: Callable[[bool], None] | None = None
        self._why_on = True
        # The training thread: the one that opened the last step. Collectives on other
        # threads are counted in metrics only (no module, pass "none", no span event).
        self.thread_id = threading.get_ident()
        self.active = True

    def reset_after_fork(self) -> None:
        """A forked child starts with no open spans and learns its own rank."""
        self._step = self._outside = None
        self._after_traced = self._time_completions = True  # the child's own set-up
        self._fwd_stack = []
        self._open_bw = []
        self._depth = 0
        self._bw_callback_task = -1
        self._call_counts = {}
        self._rank = None
        self.why_func = None
        self.thread_id = threading.get_ident()
        self._want_why(True)
        if hasattr(self._metrics, "reset"):
            self._metrics.reset()

    # ----------------------------------------------------------------- helpers
    def rank(self) -> RankInfo:
        if self._rank is None or not self._rank.distributed:
            info = rank_info()
            if info.distributed or self._rank is None:
                self._rank = info
        return self._rank

    def _traces_this_rank(self) -> bool:
        return self._emit_step is not None and self.settings.traces_rank(self.rank().rank)

    def hook_failed(self, where: str, error: BaseException) -> None:
        """Log a hook failure once per place, count it, and go on. Never raises."""
        try:
            if self._metrics is not None:
                self._metrics.dropped(semconv.DROPPED_KIND_HOOK_ERROR, 1)
        except Exception:  # the metrics themselves are broken: logging is all that is left
            pass
        if where not in self._failed:
            self._failed.add(where)
            _logger.warning("commdebug-otel: %s failed (%s: %s); telemetry continues, "
                            "training is unaffected", where, type(error).__name__, error,
                            exc_info=error)

    def unobserved(self, what: str) -> None:
        """Something ran that we cannot see into (e.g. a ``torch.compile`` region): say it once, mark the step."""
        if what not in self._failed:
            self._failed.add(what)
            _logger.warning("commdebug-otel: modules inside %s regions are not observed; their "
                            "collectives are booked to the enclosing span (docs/troubleshooting.md)", what)
        step = self._step
        if step is None:
            step = self._open_step(time.time_ns())
        step.had_module = True  # the optimizer step still ends (and exports) this step
        step.root.attrs[semconv.SPAN_UNOBSERVED] = what

    # ------------------------------------------------------------------ steps
    def _open_step(self, now: int, inference: bool = False) -> _Step:
        if self._outside is not None:
            self._close(self._outside, now)
            self._outside = None
        # Inference/evaluation forwards are counted apart, so torch.step stays the optimizer step.
        index = self._next_inference if inference else self._next_step
        sampled = index % self.settings.trace_every == 0
        traced = sampled and self._traces_this_rank()
        root = Record(_KIND_STEP, semconv.SPAN_TRAIN_STEP, now)
        root.attrs[semconv.STEP] = index
        step = self._step = _Step(index, traced, root, _KIND_STEP)
        # The same steps on every rank (sampled, not traced): their histograms compare.
        self._time_completions = sampled or index % self.settings.completion_every == 0
        step.inference = inference
        self._call_counts.clear()
        if _graph_task_id() == -1:  # recompute in backward may run on autograd's thread
            self.thread_id = threading.get_ident()
        if traced and self._exemplars_on():
            step.trace_id = self._trace_id(step) or random.getrandbits(128) or 1
        step.quiet = not (traced or self.sinks or self.settings.metric_module_depth)
        self._tell_traced(traced)  # every opening: a mode left on by a close inside backward goes now
        self._want_why(traced)
        return step

    def _tell_traced(self, traced: bool) -> None:
        if self.traced_step_changed is not None:
            try:
                self.traced_step_changed(traced)
            except Exception as error:
                self.hook_failed("dispatch mode switch", error)

    def watch_why(self, callback: Callable[[bool], None] | None) -> None:
        """Set :attr:`why_wanted`; the callback's side starts out wanting the "why"."""
        self.why_wanted, self._why_on = callback, True

    def _want_why(self, wanted: bool) -> None:
        if wanted != self._why_on and self.why_wanted is not None:
            self._why_on = wanted
            try:
                self.why_wanted(wanted)
            except Exception as error:
                self.hook_failed("DTensor redistribution watch", error)

    def _exemplars_on(self) -> bool:
        if self._exemplars is None:
            try:
                self._exemplars = bool(self._preassigned_ids())
            except Exception as error:
                self._exemplars = False
                self.hook_failed("telemetry start", error)
        return self._exemplars

    def _exemplar_context(self, owner: Record, step: _Step) -> Any:
        """An OTel context naming ``owner``'s future span, so metric points get exemplars."""
        if not owner.span_id:
            owner.span_id = random.getrandbits(64) or 1
        return set_span_in_context(NonRecordingSpan(SpanContext(
            step.trace_id, owner.span_id, is_remote=False, trace_flags=_SAMPLED)))

    def _outside_step(self, now: int) -> _Step:
        if self._outside is None:
            root = Record(_KIND_OUTSIDE, semconv.SPAN_OUTSIDE_STEP, now)
            traced = self._after_traced and self._traces_this_rank()
            self._outside = _Step(-1, traced, root, _KIND_OUTSIDE)
        return self._outside

    def optimizer_step_done(self) -> None:
        """``optimizer.step()`` returned: the step ends (if a module ran since the last one)."""
        self._seen_optimizer = True
        step = self._step
        if step is not None and step.had_module:
            self._close_step(time.time_ns())

    def _close_step(self, now: int, inference: bool = False) -> None:
        step = self._step
        if step is None:
            return
        self._step = None
        if step.inference:
            self._next_inference += 1
        else:
            self._next_step += 1
        self.why_func, self.why_args = None, ()
        self._after_traced = step.traced
        if inference or step.inference:
            step.kind = -1  # no train_step span: each top-level forward is a root
        self._close(step, now)
        self._want_why(step.traced)  # between steps as the step before (_outside_step)

    def keep_hook(self, handle: Any) -> None:
        """Remember a tensor or multi-grad hook handle: it is removed when the step closes.

        A hook left on a tensor that outlives the step (a cached activation, a
        tensor kept by the user) would keep the step's records alive.
        """
        step = self._step
        if step is not None:
            step.hooks.append(handle)

    def _close(self, step: _Step, now: int) -> None:
        for record in reversed(self._fwd_stack):
            if record.end_ns == 0:
                record.end_ns, record.unmatched = now, True
        self._fwd_stack.clear()
        self._depth = 0
        self._end_backward_records(self._open_bw, now)
        self._open_bw.clear()
        step.root.end_ns = now
        if self._metrics is not None:
            try:
                self._metrics.flush()
            except Exception as error:
                self.hook_failed("metrics", error)
        for handle in step.hooks:
            handle.remove()
        step.hooks.clear()
        if step.traced and step.kind != _KIND_OUTSIDE:
            self._tell_traced(False)
        if step.traced and self._emit_step is not None:
            try:
                self._emit(step)
            except Exception as error:
                self.hook_failed("building spans", error)
        for record in step.records:  # nothing outlives the step through these links
            record.parent = record.fwd = record.open_bw = None
            record.bw_records = []
            record.events = []
        step.records.clear()

    def finish(self) -> None:
        """Close whatever is open (at exit or uninstrument) so every started span ends."""
        now = time.time_ns()
        if self._step is not None:
            inference = not self._seen_optimizer and not self._step.backward_done
            self._close_step(now, inference=inference)
        if self._outside is not None:
            outside, self._outside = self._outside, None
            self._close(outside, now)

    # ---------------------------------------------------------------- modules
    def module_pre(self, module: torch.nn.Module, fqn: str, args: tuple) -> Record | None:
        """A module's forward (or recompute) begins. Returns its record, or None when not recorded."""
        now = time.time_ns()
        self.why_func = None
        in_backward = _graph_task_id() != -1
        step = self._step
        if step is None:
            # A top-level forward without grad (inference, evaluation between steps) is its own root.
            step = self._open_step(now, inference=not in_backward and not torch.is_grad_enabled())
        elif (not self._fwd_stack and self._depth == 0 and not in_backward
              and not self._seen_optimizer and step.backward_done >= NO_OPTIMIZER_CYCLES):
            # No optimizer.step() seen yet: bound the step (gradient accumulation of up to
            # NO_OPTIMIZER_CYCLES micro-batches before the first optimizer step stays whole).
            self._close_step(now)
            step = self._open_step(now)
        step.had_module = True
        if not (step.traced or self.settings.metric_module_depth > 0):
            self._depth += 1
            return None
        pass_ = semconv.PASS_RECOMPUTE if in_backward else semconv.PASS_FORWARD
        record = Record(_KIND_MODULE, "", now)
        record.fqn = fqn
        record.pass_ = pass_
        record.module_type = f"{type(module).__module__}.{type(module).__qualname__}"
        key = (fqn, pass_)
        record.call_index = self._call_counts.get(key, 0)
        self._call_counts[key] = record.call_index + 1
        record.name = f"{fqn} {pass_}"
        record.hidden = self._hidden(fqn)
        if self._fwd_stack:
            record.parent = self._fwd_stack[-1]
        elif in_backward and self._open_bw:
            record.parent = self._open_bw[-1]
        else:
            record.parent = step.root
        if module not in self._params_seen:
            self._params_seen.add(module)
            record.params = _parameter_facts(module)
            for sink in self.module_sinks:
                sink(module, fqn)
        self._fwd_stack.append(record)
        step.records.append(record)
        return record

    def _hidden(self, fqn: str) -> bool:
        include, exclude = self.settings.module_include, self.settings.module_exclude
        if not include and not exclude:
            return False
        from fnmatch import fnmatchcase

        if include and not any(fnmatchcase(fqn, pattern) for pattern in include):
            return True
        return any(fnmatchcase(fqn, pattern) for pattern in exclude)

    def module_post(self, module: torch.nn.Module, record: Record | None) -> None:
        """A module's forward ended (its own forward hooks included)."""
        now = time.time_ns()
        self.why_func = None
        if record is None:
            self._depth = max(0, self._depth - 1)
        else:
            stack = self._fwd_stack
            while stack:
                top = stack.pop()
                top.end_ns = now
                if top is record:
                    break
                top.unmatched = True  # a pre-hook whose post-hook never came
            error = sys.exc_info()[1]
            if error is not None and type(error).__name__ not in _CONTROL_FLOW_ERRORS:
                record.error = error
        step = self._step
        if step is not None and step.inference and not self._fwd_stack and self._depth == 0:
            self._close_step(now)

    def backward_began(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's outputs are ready: its backward begins."""
        now = time.time_ns()
        task = _graph_task_id()
        if forward.bw_records and forward.bw_records[-1].graph_task == task:
            return  # another output of the call, or one hooked twice (before and after its own hooks)
        record = Record(_KIND_MODULE, f"{forward.fqn} {semconv.PASS_BACKWARD}", now)
        record.fqn, record.module_type = forward.fqn, forward.module_type
        record.pass_ = semconv.PASS_BACKWARD
        record.fwd, record.graph_task, record.hidden = forward, task, forward.hidden
        key = (forward.fqn, semconv.PASS_BACKWARD)
        record.call_index = self._call_counts.get(key, 0)
        self._call_counts[key] = record.call_index + 1
        forward.open_bw = record
        forward.bw_records.append(record)
        self._begin_backward(record)
        step = self._step
        if step is not None:
            step.records.append(record)
        if self._bw_callback_task != task:
            self._bw_callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)

    def _begin_backward(self, record: Record) -> None:
        """Open ``record``; if a descendant's hook fired first, the descendant stays most recent.

        A module and its last child share the output tensor, and the child's hook,
        registered first, fires first: the parent's backward did not begin "after" it.
        """
        open_bw = self._open_bw
        index = len(open_bw)
        while index > 0 and _descends_from(open_bw[index - 1], record.fwd):
            index -= 1
        open_bw.insert(index, record)

    def backward_ended(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's inputs are computed: its backward ends."""
        record = forward.open_bw
        if record is not None:
            forward.open_bw = None
            record.end_ns = time.time_ns()
            try:
                self._open_bw.remove(record)
            except ValueError:
                pass

    def backward_done(self) -> None:
        """The autograd engine finished computing this backward (an engine final callback).

        Gradient computation is over, so every module's backward but the
        outermost ones ends here. The outermost stay open for one more round
        of final callbacks: callbacks queued later (FSDP2's root post-backward
        reduce-scatter) are booked to the root module's backward.
        """
        try:
            now = time.time_ns()
            outermost = [r for r in self._open_bw if not any(
                _descends_from(r, other.fwd) for other in self._open_bw if other is not r)]
            self._end_backward_records([r for r in self._open_bw if r not in outermost], now)
            self._open_bw[:] = outermost
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finally)
        except Exception as error:
            self.hook_failed("backward end", error)

    def _backward_finally(self) -> None:
        try:
            self._end_backward_records(self._open_bw, time.time_ns())
            self._open_bw.clear()
            self._bw_callback_task = -1
            if self._step is not None:
                self._step.backward_done += 1
        except Exception as error:
            self.hook_failed("backward end", error)

    @staticmethod
    def _end_backward_records(records: list[Record], now: int) -> None:
        for record in records:
            record.end_ns = now
            record.unmatched = record.fwd is not None and record.fwd.input_hooked
            if record.fwd is not None:
                record.fwd.open_bw = None

    # ------------------------------------------------------------- dispatch
    def _owner(self) -> tuple[Record | None, _Step | None]:
        if self._fwd_stack:
            owner = self._fwd_stack[-1]
        elif self._open_bw:
            owner = self._open_bw[-1]
        elif self._step is not None:
            return self._step.root, self._step
        else:
            return None, None
        while owner.hidden and owner.parent is not None:
            owner = owner.parent if owner.fwd is None else owner.fwd.parent or owner.parent
        return owner, self._step


    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None:
        """A collective was issued (``duration_ns``: issue time on the CPU, in nanoseconds).

        ``out`` is what the op returned: for c10d ops it holds the ``Work``,
        whose future times completion without blocking (``start_ns`` is the
        ``time.perf_counter_ns()`` at issue).
        """
        group = self._groups.resolve(spec, args)
        in_backward = _graph_task_id() != -1
        if not in_backward and threading.get_ident() != self.thread_id:
            # Another thread (not autograd's): the training thread's open spans are not its
            # owners, and its sequence numbers (which match collectives across ranks) stay its own.
            self._count(spec, args, group, PASS_NONE, duration_ns, out, start_ns)
            return
        seq = self._seq.get(group.name, 0)
        self._seq[group.name] = seq + 1
        step = self._step
        if step is not None and step.quiet:  # an untraced step: the hot path of always-on tracing
            self._count(spec, args, group, self._pass_by_depth(in_backward), duration_ns, out, start_ns)
            return
        if step is not None:
            quiet = not step.traced
        elif in_backward:
            quiet = True  # a backward outside any step: counted in metrics only
        else:
            quiet = not (self._outside or self._outside_step(time.time_ns())).traced
        if quiet and not self.sinks and not self.settings.metric_module_depth:
            # Between steps, or a backward outside any step: no records either.
            self._count(spec, args, group, self._pass_by_depth(in_backward), duration_ns, out, start_ns)
            return
        now = time.time_ns()
        nbytes, dtype, shape, fake = payload_facts(spec, args)
        owner, step = self._owner()
        if owner is not None and owner.kind == _KIND_MODULE:
            pass_ = owner.pass_
        else:
            pass_ = self._pass_by_depth(in_backward)
        if not fake:  # fake/meta tensors move no bytes
            fqn = owner.fqn if owner is not None else ""
            context = None
            if step is not None and step.trace_id and owner is not None:
                context = self._exemplar_context(owner, step)
            self._count(spec, args, group, pass_, duration_ns, out, start_ns, nbytes, fqn, context)
        for sink in self.sinks:
            sink(spec, owner, pass_)
        if step is None:
            if in_backward:
                return  # a backward outside any step: counted in metrics only
            step = self._outside_step(now)
            owner = step.root
        if not step.traced or owner is None:
            return
        attrs: dict[str, Any] = {
            semconv.COLLECTIVE_OP: spec.op,
            semconv.OP_NAME: spec.overload_name,
            semconv.COLLECTIVE_BYTES: nbytes,
            semconv.COLLECTIVE_DTYPE: dtype,
            semconv.COLLECTIVE_SHAPE: shape,
            semconv.PROCESS_GROUP_NAME: group.name,
            semconv.PROCESS_GROUP_SIZE: group.size,
            semconv.COLLECTIVE_SEQ: seq,
            semconv.MODULE_PASS: pass_,
            semconv.COLLECTIVE_DURATION: duration_ns / 1e9,
        }
        if group.dim_name:
            attrs[semconv.DEVICE_MESH_DIM_NAME] = group.dim_name
        if fake:
            attrs[semconv.COLLECTIVE_FAKE] = True
        if spec.reduce_index >= 0 and spec.reduce_index < len(args):
            attrs[semconv.COLLECTIVE_REDUCE_OP] = reduce_op_name(args[spec.reduce_index])
        if 0 <= spec.peer_index < len(args):
            attrs[semconv.COLLECTIVE_PEER] = int(args[spec.peer_index])
        if spec.functional and self.why_func is not None:
            attrs.update(self._why_facts())
        self._add_event(owner, spec.op, attrs, now)

    def _pass_by_depth(self, in_backward: bool) -> str:
        """The pass when no module record owns the collective (untraced steps keep only the depth)."""
        if in_backward:
            return semconv.PASS_RECOMPUTE if self._depth else semconv.PASS_BACKWARD
        return semconv.PASS_FORWARD if self._depth else PASS_NONE

    def _count(self, spec: CollectiveSpec, args: tuple, group: Any, pass_: str, duration_ns: int,
               out: Any, start_ns: int, nbytes: int = -1, fqn: str = "", context: Any = None) -> None:
        """The collective's metric points (``nbytes`` -1: not computed yet)."""
        if self._metrics is None:
            return
        if nbytes < 0:
            nbytes, fake = payload_bytes(spec, args)
            if fake:
                return
        rank = self.rank().rank
        self._metrics.collective(spec.op, pass_, group, rank, nbytes, duration_ns / 1e9, fqn, context=context)
        if not spec.functional and out is not None and self._time_completions:
            self._time_completion(out, start_ns, spec, pass_, group, rank, fqn)

    def _time_completion(self, out: Any, start_ns: int, spec: CollectiveSpec, pass_: str,
                         group: Any, rank: int, fqn: str) -> None:
        """Record issue-to-completion time when the c10d ``Work``'s future completes (never waits).

        Some backends' works have no future (gloo's ``_reduce_scatter_base_`` raises
        "Work::getFuture not implemented"): that overload is not timed from then on.
        """
        if spec.overload_name in self._untimed:
            return
        work = out[-1] if isinstance(out, tuple) else out
        if not isinstance(work, torch.ScriptObject):
            return
        from torch.distributed import Work

        metrics, op = self._metrics, spec.op

        def done(_future: Any) -> None:  # on the backend's thread: must never raise
            try:
                metrics.completion(op, pass_, group, rank, (time.perf_counter_ns() - start_ns) / 1e9, fqn)
            except Exception as error:
                self.hook_failed("completion time", error)

        try:
            future = Work.unbox(work).get_future()
        except Exception as error:
            self._untimed.add(spec.overload_name)
            _logger.debug("commdebug-otel: %s is not timed to completion: %s", spec.overload_name, error)
            return
        try:
            future.add_done_callback(done)
        except Exception as error:
            self._untimed.add(spec.overload_name)
            self.hook_failed("completion time", error)

    def _why_facts(self) -> dict[str, Any]:
        if self._why_facts_of is not self.why_args:
            self._why_facts_of = self.why_args
            func, args = self.why_func, self.why_args
            facts = _dtensor_facts(args)
            self._why_attrs = {
                semconv.DTENSOR_OP: str(func),
                semconv.DTENSOR_INPUT_PLACEMENTS: facts[semconv.DTENSOR_INPUT_PLACEMENTS],
            }
            if semconv.DEVICE_MESH_SHAPE in facts:
                self._why_attrs[semconv.DEVICE_MESH_SHAPE] = facts[semconv.DEVICE_MESH_SHAPE]
        return self._why_attrs

    def op_event(self, func: Any, args: tuple, is_dtensor: bool) -> None:
        """An op ran at detail ``dtensor`` or above: an event named after the overload."""
        owner, step = self._owner()
        for sink in self.op_sinks:
            sink(func, args, is_dtensor, owner)
        if step is None or not step.traced or owner is None:
            return
        if self.event_filter is not None and not self.event_filter(func, is_dtensor):
            return
        name = str(func)
        attrs: dict[str, Any] = {semconv.OP_NAME: name}
        if is_dtensor:
            attrs.update(_dtensor_facts(args))
        else:
            attrs[semconv.OP_INPUT_SHAPES] = [
                str(list(arg.shape)) for arg in args if isinstance(arg, torch.Tensor)
            ]
        self._add_event(owner, name, attrs, time.time_ns())

    def _add_event(self, owner: Record, name: str, attrs: dict, now: int) -> None:
        if len(owner.events) < self.settings.max_events_per_span:
            owner.events.append((name, attrs, now))
            return
        owner.dropped_events += 1
        if self._metrics is not None:
            try:
                self._metrics.dropped(semconv.DROPPED_KIND_EVENT, 1)
            except Exception as error:
                self.hook_failed("metrics", error)

    # ------------------------------------------------------------ emitting
    def _trace_id(self, step: _Step) -> int | None:
        if self.settings.trace_scope is not TraceScope.JOB or step.kind == _KIND_OUTSIDE:
            return None
        if self._nonce is None:
            self._nonce = job_nonce()
        label = f"inference-{step.index}" if step.inference else step.index
        return step_trace_id(self.rank().run_id, self._nonce, label)

    def _emit(self, step: _Step) -> None:
        children: dict[int, list[Record]] = {}
        root = step.root
        for record in step.records:
            if record.end_ns == 0:
                record.end_ns, record.unmatched = root.end_ns, True
            parent = self._parent_of(record, root)
            if record.hidden:
                continue
            children.setdefault(id(parent), []).append(record)
        _widen(root, children)
        if step.kind == -1:  # inference: top-level forwards are the roots
            roots = children.get(id(root), [])
        else:
            roots = [root]
        trace_id = step.trace_id or self._trace_id(step)
        self._emit_step(roots, children, trace_id)

    @staticmethod
    def _parent_of(record: Record, root: Record) -> Record:
        if record.pass_ == semconv.PASS_BACKWARD:
            ancestor = record.fwd.parent if record.fwd is not None else None
            while ancestor is not None and ancestor.kind == _KIND_MODULE:
                for candidate in reversed(ancestor.bw_records):
                    if candidate.graph_task == record.graph_task and not candidate.hidden:
                        return candidate
                ancestor = ancestor.parent
            return root
        parent = record.parent or root
        while parent.hidden and parent.parent is not None:
            parent = parent.parent
        return parent


def _descends_from(record: Record, forward: Record | None) -> bool:
    """True if ``record`` (a backward record) belongs to a module call inside ``forward``'s call."""
    ancestor = record.fwd.parent if record.fwd is not None else None
    while ancestor is not None:
        if ancestor is forward:
            return True
        ancestor = ancestor.parent
    return False


def _widen(record: Record, children: dict[int, list[Record]]) -> None:
    """Make every span cover its children (backward hooks can fire child-first)."""
    kids = children.get(id(record))
    if not kids:
        return
    kids.sort(key=lambda child: child.start_ns)
    for child in kids:
        _widen(child, children)
        if child.start_ns < record.start_ns:
            record.start_ns = child.start_ns
        if child.end_ns > record.end_ns:
            record.end_ns = child.end_ns


def _placements_text(tensor: Any) -> str:
    return str(tuple(tensor.placements))


def _dtensor_facts(args: tuple) -> dict[str, Any]:
    shapes: list[str] = []
    placements: list[str] = []
    mesh = None
    for arg in args:
        if hasattr(arg, "placements") and hasattr(arg, "device_mesh"):
            shapes.append(str(list(arg.shape)))
            placements.append(_placements_text(arg)[:_ATTR_MAX_CHARS])
            mesh = arg.device_mesh
    facts: dict[str, Any] = {
        semconv.DTENSOR_INPUT_SHAPES: shapes,
        semconv.DTENSOR_INPUT_PLACEMENTS: placements,
    }
    if mesh is not None:
        facts[semconv.DEVICE_MESH] = str(mesh)[:_ATTR_MAX_CHARS]
        facts[semconv.DEVICE_MESH_SHAPE] = [int(size) for size in mesh.shape]
        facts[semconv.DEVICE_MESH_DIM_NAMES] = list(mesh.mesh_dim_names or ())
    return facts


def _parameter_facts(module: torch.nn.Module) -> list[str]:
    """``"name [shape] placements"`` per direct parameter; no values."""
    facts = []
    for name, param in module.named_parameters(recurse=False):
        text = f"{name} {list(param.shape)}"
        if hasattr(param, "placements"):
            text += " " + _placements_text(param)
        facts.append(text[:_ATTR_MAX_CHARS])
    return facts
