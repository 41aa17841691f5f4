"""The recorder: the one object that knows which span is open where.

The module tracker (``tracker.py``), the dispatch mode (``mode.py``) and the
collective kernels (``intercept.py``) only report facts here: a module pass
began or ended, a collective or op ran. The recorder keeps light records
(``records.py``) for the current step; when the step ends it hands them, as a
span tree, to its span sink (``Telemetry.emit``). Building spans at the end
lets backward spans nest by the module tree whatever order autograd fires the
hooks in, and keeps the per-op hot path free of OTel calls. Collectives take
the path in ``collectives.py``.

Ownership rules (DESIGN.md):

* forward / recompute: the innermost module running, its own hooks included;
* backward: the module whose backward began most recently and is still open
  (CommDebugMode's rule, which keeps a ColwiseParallel input-gradient
  all_reduce with that layer and books FSDP2's post-backward reduce-scatter
  to the FSDP unit);
* otherwise the step's ``train_step`` span; when no step is open, the
  ``train_step_tail`` of the training step that closed last (work of its
  iteration after ``optimizer.step()``: logging, ZeRO's parameter all-gather,
  evaluation), or, before the first step, an ``outside_step`` root span
  (model set-up).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from torch.compiler import is_compiling

from . import ids, semconv
from ._torch import graph_task_id, queue_engine_callback, tensor_hook_key
from .collectives import (
    C10D_CAUSES,
    PASS_NONE,
    Collective,
    CollectiveCounter,
    CompiledWhys,
    Why,
    _set_peer,
    dispatched_op_why,
    event_attributes,
    peer_when_received,
)
from .config import Settings, TraceScope, variable
from .observer import RecorderObserver, SpanSink
from .ops import CollectiveSpec, GroupResolver, compiler_traced, plain_payload
from .records import Record, SpanKind, Step, descends_from, dtensor_facts, parameter_facts, snapshot_tree, span_tree
from .redact import code_locations, describe
from .stall import Progress
from .steps import RankInfo, job_nonce, job_trace_id, outside_step_label, rank_info, settled

__all__ = ["NO_OPTIMIZER_CYCLES", "PASS_NONE", "Recorder"]

_logger = logging.getLogger(__name__)

# Before any optimizer.step() is seen, a step ends at the top-level forward after
# this many completed backward passes (scripts that never step an optimizer).
NO_OPTIMIZER_CYCLES = 8
# Finished traced steps of a thread that borrows the training thread's role, kept until it trains.
MAX_HELD_STEPS = 64
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
# Raised by torch.utils.checkpoint to stop a recompute early: control flow, not a failure.
_CONTROL_FLOW_ERRORS = frozenset({"_StopRecomputationError"})


class Recorder:
    """Owns open spans, step boundaries and the collective sequence numbers.

    Args:
        settings: frozen :class:`Settings`.
        spans: where finished steps go (:class:`~commdebug_otel.observer.SpanSink`,
            e.g. ``Telemetry``); None: no spans, metrics only.
        metrics: a ``metrics.LazyCollectiveMetrics``, or None for no metrics.
        observers: told what the recorder sees
            (:class:`~commdebug_otel.observer.RecorderObserver`; its docstring
            says when each callback runs and what happens if one raises).

    Attributes:
        why: the DTensor op behind the collectives issued now
            (:class:`~commdebug_otel.collectives.Why`): ``with recorder.why(op, args): ...``.
        active: False once the tracer stopped: reporters ignore their hooks then.
        thread_id: the training thread: the tracer's starting thread, or another
            thread that trains (:meth:`tracks_thread`). Module calls and optimizer
            steps on other threads (but autograd's) are ignored; their collectives
            are counted in metrics only: no module, pass ``none``, no span event.
    """

    def __init__(self, settings: Settings, spans: SpanSink | None, metrics: Any | None,
                 observers: Sequence[RecorderObserver] = ()) -> None:
        self.settings = settings
        self._spans = spans
        self._metrics = metrics
        self._observers = tuple(observers)
        self._every_event = any(observer.wants_every_event for observer in self._observers)
        # An observer told of collectives, ops or first calls: sampled steps keep records for it even
        # where spans go nowhere (a tracer that only counts).
        self._listening = any(_listens(observer) for observer in self._observers)
        self._exemplars: bool | None = None  # decided at the first traced step (spans.start())
        self._counter = CollectiveCounter(metrics, self.rank, self.hook_failed, self._completed)
        self._max_records = settings.max_spans_per_step  # per step part (_step_full)
        # Module records of closed steps, reused by the next: a record made anew each call lives
        # through the step's collections and is promoted to the oldest generation, whose full
        # collections then come sooner (docs/performance.md). Only where nothing outside keeps them:
        # a span sink that says so, no observer handed records.
        self._spare: list[Record] | None = (
            [] if spans is not None and not getattr(spans, "keeps_records", True) and not self._listening else None)
        self._count = self._counter.count  # the quiet path's one call
        self._groups = GroupResolver()
        self._next_step = 0
        self._next_inference = 0
        self._seen_optimizer = False
        self._params_seen: weakref.WeakSet = weakref.WeakSet()
        self._nonce: str | None = None
        self._provisional_nonce: str | None = None  # this rank's own, until the process group exists
        self._failed: set[str] = set()
        self.why = Why()
        self._compiled_whys = CompiledWhys()
        self._why_on = True  # what the observers were last told (why_wanted)
        self.active = True
        # Called once, at the first module call that opens a step; True: stop recording (a data worker).
        self.first_call: Any = None
        self._start_process_state()

    def _start_process_state(self) -> None:
        """The state a process starts with, and a forked child starts again with."""
        self._step: Step | None = None
        self._outside: Step | None = None
        # Whether the step that closed last was traced: collectives between steps (a logging
        # all_reduce after optimizer.step()) follow it; set-up before the first step is traced.
        self._after_traced = True
        # The training step that closed last, until the next one opens (its collectives meanwhile go
        # to its train_step_tail): Recorder._tail_facts; None before the first step.
        self._tail_of: tuple | None = None
        # Collectives are timed (issue time; c10d ones to completion, a backend-thread callback
        # each) on the steps trace_every picks and one in completion_every, and between steps.
        self._counter.timed = True
        self._fwd_stack: list[Record] = []
        self._open_bw: list[Record] = []  # open backward records, most recently begun last
        self._bw_hint: tuple[Record | None, int] = (None, 0)  # the last record _begin_backward inserted, and where
        self._last_exemplar: tuple = (None, 0, 0, None)  # (owner, its span id, trace id, context)
        self._awaiting_source: dict[int, tuple] = {}  # recv from any source, not yet waited (gloo)
        self._copying = threading.RLock()  # a stall snapshot copying the step's records (a fork may copy it held)
        self._bw_callback_tasks: set[int] = set()  # graph tasks whose end is hooked (nested: reentrant checkpoints)
        self._depth = 0  # module nesting when records are skipped (untraced steps)
        self._call_counts: dict[str, int] = {}  # by span name (FQN and pass): a string key is not GC-tracked
        self._rank: RankInfo | None = None
        self._provisional_step: Step | None = None  # the open step whose trace id was drawn before settling
        # Progress on every step (stall.py); its seq counters match collectives across ranks.
        self.progress = Progress()
        self._seq = self.progress.next_seq
        self.why.clear()
        self.thread_id = self._home_thread = threading.get_ident()
        # Another thread holds the role provisionally (it called a module first) until it trains:
        # its finished steps wait in _held, and the starting thread's first module call takes the
        # role back (_take_back). (step counters when it borrowed the role, held steps)
        self._borrowed: tuple[int, int] | None = None
        self._held: list[Step] = []
        self.thread_changes = 0  # how often the role changed hands (the tracker resets its call stack)
        self._want_why(True)

    def reset_after_fork(self) -> None:
        """A forked child starts with no open spans and learns its own rank."""
        self._start_process_state()
        if hasattr(self._metrics, "reset"):
            self._metrics.reset()

    def activate(self) -> None:
        """The tracer starts: this thread trains, and a "why" may be recorded (set-up is traced)."""
        self.active = True
        self.thread_id = self._home_thread = threading.get_ident()
        self._borrowed = None
        self._why_on = True

    # ----------------------------------------------------------------- queries
    def rank(self) -> RankInfo:
        """This process's rank facts, asked again until torch.distributed is initialized."""
        if self._rank is None or not self._rank.distributed:
            info = rank_info()
            if info.distributed or self._rank is None:
                self._rank = info
        return self._rank

    @property
    def steps_taken(self) -> int:
        """How many optimizer steps have ended (``torch.step`` of the next one)."""
        return self._next_step

    @property
    def step_open(self) -> bool:
        """Whether a step (training or inference) is open now."""
        return self._step is not None

    def state_sizes(self) -> dict[str, int]:
        """How many entries each piece of per-run state holds, by name (for leak checks)."""
        step = self._step
        return {
            "step records": len(step.records) if step is not None else 0,
            "step hooks": len(step.hooks) + len(step.tensor_hooks) // 2 if step is not None else 0,
            "open forward records": len(self._fwd_stack),
            "open backward records": len(self._open_bw),
            "call counts": len(self._call_counts),
            "sequenced groups": len(self._seq),
            "modules seen": len(self._params_seen),
            "resolved groups": len(self._groups),
            "recvs awaiting their source": len(self._awaiting_source),
            "spare records": len(self._spare or ()),
        }

    def _traces_this_rank(self) -> bool:
        """Whether a sampled step (or set-up) is traced here: this rank is traced, and its spans go
        somewhere (``OTEL_TRACES_EXPORTER=none``: they do not) or an observer listens to what records carry."""
        if self._spans is None or not self.settings.traces_rank(self.rank().rank):
            return False
        self._exemplars_on()  # starts the tracer provider: where spans go is known from then on
        try:
            return self._every_event or self._listening or self._spans.exporting
        except Exception as error:
            self.hook_failed("telemetry start", error)
            return False

    # ---------------------------------------------------------------- failures
    def hook_failed(self, where: str, error: BaseException) -> None:
        """Log a hook failure once per place, count it, and go on. Never raises."""
        try:
            if self._metrics is not None:
                self._metrics.dropped(semconv.DROPPED_KIND_HOOK_ERROR, 1)
        except Exception:  # the metrics themselves are broken: logging is all that is left
            pass
        if where not in self._failed:
            self._failed.add(where)
            # Type, redacted message and code locations: never a tensor value (redact.py).
            _logger.warning("commdebug-otel: %s failed (%s); telemetry continues, training is "
                            "unaffected\n%s", where, describe(error), code_locations(error))

    # --------------------------------------------------------------- observers
    def _tell_traced(self, traced: bool) -> None:
        for observer in self._observers:
            try:
                observer.traced_step_changed(traced)
            except Exception as error:
                self.hook_failed("dispatch mode switch", error)

    def _want_why(self, wanted: bool) -> None:
        if wanted != self._why_on:
            self._why_on = wanted
            for observer in self._observers:
                try:
                    observer.why_wanted(wanted)
                except Exception as error:
                    self.hook_failed("DTensor redistribution watch", error)

    # ------------------------------------------------------------------ steps
    def _open_step(self, now: int, inference: bool = False) -> Step:
        if self._outside is not None:
            self._close(self._outside, now)
            self._outside = None
        if not inference:  # the next training step: the tail of the last one is over
            self._tail_of = None
        # Inference/evaluation forwards are counted apart, so torch.step stays the optimizer step.
        index = self._next_inference if inference else self._next_step
        sampled = index % self.settings.trace_every == 0
        traced = sampled and self._traces_this_rank()
        root = Record(SpanKind.STEP, semconv.SPAN_TRAIN_STEP, now)
        root.attrs[semconv.STEP] = index
        step = self._step = Step(index, traced, root, SpanKind.STEP)
        self.progress.step_began(now, index)
        # The same steps on every rank (sampled, not traced): their histograms compare.
        self._counter.timed = sampled or index % self.settings.completion_every == 0
        step.inference = inference
        self._call_counts.clear()
        if traced and self._exemplars_on():
            step.trace_id = self._trace_id(step) or ids.trace_id()
            if self._nonce is None and self.settings.trace_scope is TraceScope.JOB:
                self._provisional_step = step  # opened before the process group: its id is made again at the end
        step.quiet = not (traced or self._every_event or self.settings.metric_module_depth)
        self._tell_traced(traced)  # every opening: a mode left on by a close inside backward goes now
        self._want_why(traced)
        return step

    def _exemplars_on(self) -> bool:
        if self._exemplars is None:
            try:
                self._exemplars = bool(self._spans.start())
            except Exception as error:
                self._exemplars = False
                self.hook_failed("telemetry start", error)
        return self._exemplars

    def _exemplar_context(self, owner: Record, step: Step) -> Any:
        """An OTel context naming ``owner``'s future span, so metric points get exemplars.

        The last one is kept: a module's collectives come one after another (a reused record
        gets a new span id, so the id is compared too).
        """
        last = self._last_exemplar
        if owner.span_id and last[0] is owner and last[1] == owner.span_id and last[2] == step.trace_id:
            return last[3]
        if not owner.span_id:
            owner.span_id = ids.span_id()
        context = set_span_in_context(NonRecordingSpan(SpanContext(
            step.trace_id, owner.span_id, is_remote=False, trace_flags=_SAMPLED)))
        self._last_exemplar = (owner, owner.span_id, step.trace_id, context)
        return context

    def _outside_step(self, now: int) -> Step:
        """The segment that holds collectives while no step is open: a ``train_step_tail`` of the
        training step that closed last, in its trace and under its ``train_step``, or before the
        first step an ``outside_step`` root."""
        if self._outside is None:
            tail = self._tail_of
            if tail is None:
                root = Record(SpanKind.OUTSIDE_STEP, semconv.SPAN_OUTSIDE_STEP, now)
                traced = self._after_traced and self._traces_this_rank()
                self._outside = Step(-1, traced, root, SpanKind.OUTSIDE_STEP)
            else:
                index, traced, trace_id, span_id, block = tail
                root = Record(SpanKind.OUTSIDE_STEP, semconv.SPAN_TRAIN_STEP_TAIL, now)
                root.attrs[semconv.STEP] = index
                if block is not None:
                    root.attrs[semconv.TRACE_BLOCK] = block
                outside = self._outside = Step(index, traced, root, SpanKind.OUTSIDE_STEP)
                outside.trace_id, outside.parent_span_id = trace_id, span_id
        return self._outside

    def optimizer_step_done(self) -> None:
        """``optimizer.step()`` returned: the step ends (if a module ran since the last one).

        Only on the training thread (or inside its backward: optimizer-in-backward):
        an optimizer stepped on another thread (an EMA update) ends nothing.
        """
        if graph_task_id() == -1 and threading.get_ident() != self.thread_id:
            return
        step = self._step
        if self._borrowed is not None:
            if step is None or not step.backward_done:
                return  # no backward on the borrowing thread: not training (an EMA update), it ends nothing
            self._settle_thread()
        self._seen_optimizer = True
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
        self.why.clear()
        self._after_traced = step.traced
        if inference or step.inference:
            step.kind = SpanKind.INFERENCE  # no train_step span: each top-level forward is a root
        else:
            self._tail_of = self._tail_facts(step)
        self._step_signals(step, now)
        self._close(step, now)
        self._want_why(step.traced)  # between steps as the step before (_outside_step)
        # Between steps, always: their few collectives (logging every k steps, checkpoints) would
        # otherwise never be timed where k is a multiple of completion_every.
        self._counter.timed = True

    def _tail_facts(self, step: Step) -> tuple:
        """``(index, traced, trace id, train_step span id, trace block)`` of a closing training step, for
        its ``train_step_tail``: the ids are chosen now (a traced step's) so that the tail can join them."""
        if step.traced:
            if not step.trace_id:
                step.trace_id = self._trace_id(step) or ids.trace_id()
            if not step.root.span_id:
                step.root.span_id = ids.span_id()
        return (step.index, step.traced, step.trace_id, step.root.span_id,
                step.root.attrs.get(semconv.TRACE_BLOCK))

    def _step_signals(self, step: Step, now: int) -> None:
        """Every step: its duration and collective wait (metrics); traced steps: the same on train_step."""
        training = step.kind is SpanKind.STEP
        wait_s = self.progress.wait_ns / 1e9
        duration_s, slow = self.progress.step_ended(now, training)
        if not training:
            return
        if self._metrics is not None:
            try:
                # Traced: the points' exemplars name this step's train_step span.
                context = self._exemplar_context(step.root, step) if step.traced and step.trace_id else None
                self._metrics.step(duration_s, wait_s, context)
            except Exception as error:
                self.hook_failed("metrics", error)
        attrs = step.root.attrs
        if step.traced:
            attrs[semconv.STEP_COLLECTIVE_WAIT] = round(wait_s, 6)
            attrs.update(step.fingerprint_attributes())
        if slow:
            attrs[semconv.STEP_SLOW] = True
        if step.stalled:
            attrs[semconv.STEP_STALLED] = step.stalled

    def keep_hook(self, handle: Any) -> None:
        """Remember a tensor or multi-grad hook handle: it is removed when the step closes.

        A hook left on a tensor that outlives the step (a cached activation, a
        tensor kept by the user) would keep the step's records alive.
        """
        step = self._step
        if step is not None:
            key = tensor_hook_key(handle)
            if key is None:
                step.hooks.append(handle)
            else:  # the handle (and its weak reference) goes now: fewer objects alive through the step
                step.tensor_hooks += key

    def _close(self, step: Step, now: int, mode_stays: bool = False) -> None:
        # A forward still running (the step cut inside a call): its record stays the tracker's.
        reuse = self._spare is not None and not self._fwd_stack
        for record in reversed(self._fwd_stack):
            if record.end_ns == 0:
                record.end_ns, record.unmatched = now, True
        self._fwd_stack.clear()
        self._depth = 0
        _end_backward_records(self._open_bw, now)
        self._open_bw.clear()
        self._bw_hint = (None, 0)
        self._last_exemplar = (None, 0, 0, None)
        self._awaiting_source.clear()
        step.root.end_ns = now
        if self._metrics is not None:
            try:
                self._metrics.flush()
            except Exception as error:
                self.hook_failed("metrics", error)
        hooks = step.tensor_hooks
        for index in range(0, len(hooks), 2):
            hooks[index].pop(hooks[index + 1], None)  # what RemovableHandle.remove() does
        hooks.clear()
        for handle in step.hooks:
            handle.remove()
        step.hooks.clear()
        if step.traced and step.kind is not SpanKind.OUTSIDE_STEP and not mode_stays:
            self._tell_traced(False)
        if step is self._provisional_step:
            self._provisional_step = None
            if not step.stalled and settled(self.rank()):  # (a snapshot's trace keeps its step's spans)
                step.trace_id = self._trace_id(step) or step.trace_id  # the process group came: the job's id
        if (step.traced or step.stalled) and self._spans is not None:
            if self._borrowed is not None:  # a thread that has not trained yet: exported once it does
                self._held.append(step)
                if len(self._held) > MAX_HELD_STEPS:  # bounded: the oldest goes, counted
                    oldest = self._held.pop(0)
                    self._count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, len(oldest.records) + 1)
                    self._release(oldest, False)
                return
            self._emit(step)
        self._release(step, reuse)

    def _emit(self, step: Step) -> None:
        try:
            # An untraced step that stalled: its train_step alone (its snapshots hold the rest).
            roots, children = span_tree(step) if step.traced else ([step.root], {})
            self._emit_tree(roots, children, step.trace_id or self._trace_id(step), step)
        except Exception as error:
            self.hook_failed("building spans", error)

    def _release(self, step: Step, reuse: bool) -> None:
        """Unlink a closed step's records (its spans are built or dropped); reuse them where ``reuse``."""
        # Not while a stall snapshot copies them (the watchdog's thread): then they are not reused.
        # Never waited for: the training thread goes on.
        reuse = reuse and self._copying.acquire(blocking=False)
        try:
            for record in step.records:  # nothing outlives the step through these links
                record.parent = record.fwd = record.open_bw = record.handling = record.last_bw = None
                record.prev_bw = record.call_args = None  # call_args: a call whose forward hook never came
                record.events = ()
                if reuse:  # nothing of the step kept alive by a spare record (an error's traceback, its frames)
                    record.error = None  # (its children list is emptied when it is reused: Record.reset)
                else:  # the sink may keep the children lists it was given; the hook refers to the record
                    record.kids = record.end_hook = None
            step.root.kids = None
            if reuse:  # at most as many spare as this step used
                spare = self._spare
                spare.extend(step.records)
                del spare[len(step.records):]
        finally:
            if reuse:
                self._copying.release()
        step.records.clear()

    def _emit_tree(self, roots: list[Record], children: dict[int, list[Record]], trace_id: int | None,
                   step: Step) -> None:
        """Hand ``step``'s span tree to the sink, under its parent span when it has one (a tail)."""
        if step.parent_span_id:
            self._spans.emit(roots, children, trace_id, parent_span_id=step.parent_span_id)
        else:
            self._spans.emit(roots, children, trace_id)

    def _step_full(self, step: Step, now: int, in_backward: bool) -> Step | None:
        """``step`` holds ``max_spans_per_step`` records: cut it, go on, or record no more of this pass.

        At a top-level forward (no pass open) the step so far is closed and exported as
        one part, its ``train_step`` marked ``commdebug.step.truncated``, its tensor hooks
        removed (so nothing of it stays alive, and backward spans of its passes are lost),
        and the step goes on in a fresh part with the same ``torch.step``: returns that
        part. Inside a pass nothing can be cut: the pass stays whole (returns ``step``)
        up to twice the bound, past which it is not recorded (returns None). Cuts and
        passes not recorded are counted on traced steps, and said once.
        """
        top_level = not self._fwd_stack and self._depth == 0 and not in_backward
        if not top_level and len(step.records) < 2 * self._max_records:
            return step
        if step.traced:
            self._count_dropped(semconv.DROPPED_KIND_STEP_SPLIT if top_level else semconv.DROPPED_KIND_STEP_FULL)
            if variable("max_spans_per_step") not in self._failed:
                self._failed.add(variable("max_spans_per_step"))
                _logger.warning(
                    "commdebug-otel: step %d reached %s=%d module-pass spans (forward passes with grad "
                    "that never reach optimizer.step(), e.g. evaluation without torch.no_grad()); it is "
                    "exported in parts marked %s, and what each cut loses is counted in %s (kinds %s, %s)",
                    step.index, variable("max_spans_per_step"), self._max_records, semconv.STEP_TRUNCATED,
                    semconv.METRIC_DROPPED, semconv.DROPPED_KIND_STEP_SPLIT, semconv.DROPPED_KIND_STEP_FULL)
        if not top_level:
            return None
        step.root.attrs[semconv.STEP_TRUNCATED] = True
        self._close(step, now, mode_stays=True)  # exports this part, removes its hooks
        root = Record(SpanKind.STEP, semconv.SPAN_TRAIN_STEP, now)
        root.attrs.update(step.root.attrs)
        del root.attrs[semconv.STEP_TRUNCATED]
        part = self._step = Step(step.index, step.traced, root, SpanKind.STEP)
        part.part = root.attrs[semconv.STEP_PART] = step.part + 1
        part.trace_id, part.inference, part.quiet = step.trace_id, step.inference, step.quiet
        part.had_module, part.backward_done = step.had_module, step.backward_done
        return part

    def _count_dropped(self, kind: str, count: int = 1) -> None:
        if self._metrics is not None:
            try:
                self._metrics.dropped(kind, count)
            except Exception as error:
                self.hook_failed("metrics", error)

    def _trace_id(self, step: Step) -> int | None:
        if self.settings.trace_scope is not TraceScope.JOB:
            return None
        nonce = self._nonce
        if nonce is None:
            if settled(self.rank()):
                nonce = self._nonce = job_nonce()  # agreed by every rank
            else:  # before init_process_group: no store to agree through (steps.py)
                nonce = self._provisional_nonce = self._provisional_nonce or job_nonce()
        if step.kind is SpanKind.OUTSIDE_STEP:
            # The count cannot change while an outside_step is open: a step's opening closes it first.
            label = outside_step_label(self._next_step)
        else:
            label = f"inference-{step.index}" if step.inference else step.index
        trace_id, block = job_trace_id(self.rank(), nonce, label, self.settings.ranks_per_trace)
        if block is not None:  # a job cut into trace blocks: the root names its block
            step.root.attrs[semconv.TRACE_BLOCK] = block
        return trace_id

    def finish(self) -> None:
        """Close whatever is open (at exit or uninstrument) so every started span ends."""
        now = time.time_ns()
        if self._step is not None:
            inference = not self._seen_optimizer and not self._step.backward_done
            self._close_step(now, inference=inference)
        if self._outside is not None:
            outside, self._outside = self._outside, None
            self._close(outside, now)
        if self._borrowed is not None:  # no other thread came to train: the borrower's steps are the run's
            self._settle_thread()

    # ---------------------------------------------------------------- modules
    def tracks_thread(self, claim: bool = True) -> bool:
        """Whether module calls on the calling thread are tracked: the training thread's, and autograd's.

        The training thread is the one that trains. The tracer's starting thread holds
        the role; another thread may borrow it (if ``claim``) before the first optimizer
        step, when no step and no module call is open (a script that trains on a thread
        other than the tracer's), and keeps it once a backward pass of its own step ends
        (:meth:`_settle_thread`). Until then its finished steps are held, not exported:
        if the starting thread calls a module first, it takes the role back and the
        borrower's steps are dropped (counted as ``other_thread``). So a side thread
        (inference, EMA, evaluation) that happens to call first never takes the training
        thread's steps; once the role is settled, other threads' calls are ignored.
        """
        ident = threading.get_ident()
        if ident == self.thread_id or graph_task_id() != -1:
            return True
        if not claim:
            return False
        if ident == self._home_thread and self._borrowed is not None:
            self._take_back(time.time_ns())
            return True
        if self._seen_optimizer or self._step is not None or self._fwd_stack or self._depth:
            return False
        if ident != self._home_thread:
            self._borrowed = (self._next_step, self._next_inference)
        self.thread_id = ident
        self.thread_changes += 1
        return True

    @property
    def thread_settled(self) -> bool:
        """Whether the training thread is known (False while another thread borrows the role)."""
        return self._borrowed is None

    def _settle_thread(self) -> None:
        """The borrowing thread trains: it keeps the role, and the steps it finished so far are exported."""
        self._borrowed = None
        held, self._held = self._held, []
        for step in held:
            self._emit(step)
            self._release(step, False)

    def _take_back(self, now: int) -> None:
        """The starting thread calls a module while another thread borrows the role, untrained: the
        starting thread trains. The borrower's open and held steps are dropped, counted, and its
        step numbers given back."""
        dropped = 0
        for step in (self._step, self._outside):
            if step is not None:
                self._close(step, now)  # held, not exported (the role is still borrowed)
        self._step = self._outside = None
        for step in self._held:
            dropped += len(step.records) + 1
            self._release(step, False)
        self._held = []
        self._next_step, self._next_inference = self._borrowed
        self._borrowed = None
        self._after_traced = True
        self.thread_id = self._home_thread
        self.thread_changes += 1
        if dropped:
            self._count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, dropped)

    def module_pre(self, module: torch.nn.Module, fqn: str, args: tuple,
                   compiled: bool = False) -> Record | None:
        """A module's forward (or recompute) begins. Returns its record, or None when not recorded.

        ``compiled``: the call runs ``module``'s compiled code (``torch.compile``), which holds
        its collectives; the modules inside it get no records.
        """
        now = time.time_ns()
        self.why.clear()
        in_backward = graph_task_id() != -1
        step = self._step
        if step is None:
            check = self.first_call
            if check is not None:
                self.first_call = None
                if check():
                    return None
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
        if len(step.records) >= self._max_records:  # the one compare a recorded call pays for the bound
            step = self._step_full(step, now, in_backward)
            if step is None:
                self._depth += 1
                return None
        pass_ = semconv.PASS_RECOMPUTE if in_backward else semconv.PASS_FORWARD
        record = self._module_record(f"{fqn} {pass_}", now)
        record.fqn = fqn
        record.pass_ = pass_
        record.module_type = f"{type(module).__module__}.{type(module).__qualname__}"
        record.call_index = self._next_call_index(record.name)
        record.hidden = self._hidden(fqn)
        handled = sys.exc_info()[1]
        if handled is not None:  # called inside an ``except`` block (a fallback, a retry)
            record.handling = (handled, handled.__traceback__)
        record.compiled = compiled
        if self._fwd_stack:
            record.parent = self._fwd_stack[-1]
        elif in_backward and self._open_bw:
            record.parent = self._open_bw[-1]
        else:
            record.parent = step.root
        record.depth = record.parent.depth + 1
        if module not in self._params_seen:
            self._params_seen.add(module)
            record.params = parameter_facts(module)
            callers = tuple(self._fwd_stack)
            for observer in self._observers:
                observer.on_first_call(module, fqn, callers)
        self._fwd_stack.append(record)
        step.records.append(record)
        return record

    def _module_record(self, name: str, now: int) -> Record:
        """A fresh module record: a closed step's, reset, when one is spare."""
        spare = self._spare
        if not spare:
            return Record(SpanKind.MODULE, name, now)
        record = spare.pop()
        record.reset(SpanKind.MODULE, name, now)
        return record

    def _next_call_index(self, name: str) -> int:
        """The calls of the span name ``name`` (``"{fqn} {pass}"``) so far this step (then one more)."""
        index = self._call_counts.get(name, 0)
        self._call_counts[name] = index + 1
        return index

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
        self.why.clear()
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
                # Only the call's own exception: not one that its caller was already handling
                # when the call began (a raise through the call gives it a new traceback head).
                handled = record.handling
                if handled is None or error is not handled[0] or error.__traceback__ is not handled[1]:
                    record.error = error
            record.handling = None
        step = self._step
        if step is not None and step.inference and not self._fwd_stack and self._depth == 0:
            self._close_step(now)

    # --------------------------------------------------------------- backward
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
        step = self._step
        if step is not None and len(step.records) >= self._max_records:
            if self._step_full(step, now, in_backward=True) is None:
                forward.graph_task = task  # the call's other outputs are not counted again
                return
        record = self._module_record(f"{forward.fqn} {semconv.PASS_BACKWARD}", now)
        record.fqn, record.module_type, record.compiled = forward.fqn, forward.module_type, forward.compiled
        record.pass_ = semconv.PASS_BACKWARD
        record.fwd, record.graph_task, record.hidden = forward, task, forward.hidden
        record.depth = forward.depth
        record.call_index = self._next_call_index(record.name)
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
        open_bw = self._open_bw
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
            open_bw = self._open_bw
            for index in range(len(open_bw) - 1, -1, -1):  # the most recent end first, usually
                if open_bw[index] is record:
                    del open_bw[index]
                    break

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
            mine = [r for r in self._open_bw if r.graph_task == task]
            inner = {id(r) for r in mine if any(descends_from(r, other.fwd) for other in mine if other is not r)}
            _end_backward_records([r for r in mine if id(r) in inner], now)
            self._open_bw[:] = [r for r in self._open_bw if id(r) not in inner]
            self._bw_hint = (None, 0)
            queue_engine_callback(functools.partial(self._backward_finally, task))
        except Exception as error:
            self.hook_failed("backward end", error)

    def _backward_finally(self, task: int) -> None:
        try:
            _end_backward_records([r for r in self._open_bw if r.graph_task == task], time.time_ns())
            self._open_bw[:] = [r for r in self._open_bw if r.graph_task != task]
            self._bw_hint = (None, 0)
            self._bw_callback_tasks.discard(task)
            if self._step is not None and not self._bw_callback_tasks:  # not a pass nested in another
                self._step.backward_done += 1
                if self._borrowed is not None:
                    self._settle_thread()  # the borrowing thread trains
        except Exception as error:
            self.hook_failed("backward end", error)

    # ------------------------------------------------------------- ownership
    def _owner(self) -> tuple[Record | None, Step | None]:
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

    def _pass_by_depth(self, in_backward: bool) -> str:
        """The pass when no module record owns the collective (untraced steps keep only the depth)."""
        if in_backward:
            return semconv.PASS_RECOMPUTE if self._depth else semconv.PASS_BACKWARD
        return semconv.PASS_FORWARD if self._depth else PASS_NONE

    # ------------------------------------------------------------- collectives
    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None:
        """A collective was issued (``duration_ns``: issue time on the CPU, in nanoseconds).

        ``out`` is what the op returned: for c10d ops it holds the ``Work``,
        whose future times completion without blocking (``start_ns`` is the
        ``time.perf_counter_ns()`` at issue). Three paths, cheapest first:
        another thread's and a quiet step's collectives are metric points
        only; the rest keep records (:meth:`_record_collective`).
        """
        plain = plain_payload(spec, args)  # one eager tensor, the usual case: never traced by torch.compile
        if is_compiling() or (plain is None and compiler_traced(args)):
            # Run on fake tensors while torch.compile builds a graph (dynamo, or AOTAutograd's backward):
            # the compiled code issues the real one. Its "why" is known only now: kept for it.
            self._compiled_whys.trace(spec, self._groups.resolve(spec, args), args, out, self.why)
            return
        group = self._groups.resolve(spec, args)
        in_backward = graph_task_id() != -1
        if not in_backward and threading.get_ident() != self.thread_id:
            # Another thread (not autograd's): the training thread's open spans are not its
            # owners, and its sequence numbers (which match collectives across ranks) stay its own.
            self._count(spec, args, group, PASS_NONE, duration_ns, out, start_ns, -1, plain)
            return
        seq = self._seq.get(group.name, 0)
        self._seq[group.name] = seq + 1
        step = self._step
        if (step is not None and step.quiet) or not self._keeps_records(step, in_backward):
            # An untraced step (the hot path of always-on tracing), between untraced steps,
            # or a backward outside any step: metric points only.
            pass_ = self._pass_by_depth(in_backward)
            self.progress.remember(spec, group, seq, args, out, "", pass_, plain)
            self._count(spec, args, group, pass_, duration_ns, out, start_ns, seq, plain)
            return
        self._record_collective(Collective(spec, args, group, seq, duration_ns, out, start_ns), in_backward)

    def _keeps_records(self, step: Step | None, in_backward: bool) -> bool:
        """Whether a collective outside a quiet step is traced, observed, or module-labelled."""
        if step is not None:
            traced = step.traced
        elif in_backward:
            traced = False  # a backward outside any step: counted in metrics only
        else:
            traced = (self._outside or self._outside_step(time.time_ns())).traced
        return traced or self._every_event or bool(self.settings.metric_module_depth)

    def _record_collective(self, collective: Collective, in_backward: bool) -> None:
        """Metric points with module label and exemplar, the observers, then the span event."""
        now = time.time_ns()
        spec = collective.spec
        owner, step = self._owner()
        if owner is not None and owner.kind is SpanKind.MODULE:
            collective.pass_ = owner.pass_
        else:
            collective.pass_ = self._pass_by_depth(in_backward)
        self.progress.remember(spec, collective.group, collective.seq, collective.args, collective.out,
                               owner.fqn if owner is not None else "", collective.pass_)
        if not collective.fake:
            context = None
            if step is not None and step.trace_id and owner is not None:
                context = self._exemplar_context(owner, step)
            self._counter.count_recorded(collective, owner.fqn if owner is not None else "", context)
        for observer in self._observers:
            observer.on_collective(spec, owner, collective.pass_)
        if step is None:
            if in_backward:
                return  # a backward outside any step: counted in metrics only
            step = self._outside_step(now)
            owner = step.root
        if not step.traced or owner is None:
            return
        why = None
        try:
            if spec.functional or self.why.cause in C10D_CAUSES:
                why = self.why.attributes()
                if why is None and owner.compiled:  # compiled code: DTensor ran when it was traced
                    why = self._compiled_whys.lookup(collective)
            if why is None:  # a DTensor op that issues collectives itself (loss_parallel's handlers)
                why = dispatched_op_why()
        except Exception as error:  # the event goes without its "why"
            self.hook_failed("DTensor redistribution facts", error)
        attrs = event_attributes(collective, why)
        if why:
            self.progress.caused(collective.group.name, collective.seq, why)
        peer_when_received(collective, attrs, self.hook_failed, self._awaiting_source)
        self._add_event(owner, spec.op, attrs, now)
        if step.kind is SpanKind.STEP:
            message = collective.message
            step.fingerprint(collective.group.name, collective.seq, spec.op, message.dtype, message.shape,
                             attrs.get(semconv.COLLECTIVE_REDUCE_OP, ""))

    def _completed(self, group: str, seq: int) -> None:
        """A c10d ``Work`` future completed (on the backend's thread)."""
        if seq >= 0:
            self.progress.complete(group, seq)

    def waited(self, handle: Any, duration_ns: int) -> None:
        """A thread waited ``duration_ns`` on a collective (``Work.wait()``, or ``wait_tensor`` on its output)."""
        if threading.get_ident() == self.thread_id or graph_task_id() != -1:
            self.progress.waited(handle, duration_ns)
        if self._awaiting_source:
            found = self._awaiting_source.pop(id(handle), None)
            if found is not None:
                _set_peer(*found, self.hook_failed)

    # ------------------------------------------------------------------ stalls
    def stall_snapshot(self, now: int, age_s: float, threshold_s: float, snapshot: int,
                       where: tuple[str, str, list[str]]) -> bool:
        """Export, from the watchdog's thread, what this rank is doing now (stall.py). True if exported.

        ``where``: ``(module FQN, pass, code locations)`` of the training thread
        (``stall.training_thread_location``). The step's records are copied, never
        changed: the training thread may still be running it.
        """
        if self._spans is None or not self.active:
            return False
        progress = self.progress
        module, pass_, stack = where
        if not module:  # no module on the Python stack (a backward pass): the open record, if traced
            open_records = self._fwd_stack or self._open_bw
            if open_records:
                module, pass_ = open_records[-1].fqn, open_records[-1].pass_
        stalled = Record(SpanKind.MODULE, semconv.SPAN_STALLED, progress.since_ns)
        stalled.end_ns = now
        seqs = progress.seqs()
        stalled.attrs.update({
            semconv.STEP: progress.step_index if progress.in_step else self._next_step,
            semconv.STALL_AGE: round(age_s, 3),
            semconv.STALL_THRESHOLD: round(threshold_s, 3),
            semconv.STALL_SNAPSHOT: snapshot,
            semconv.STALL_MODULE: module,
            semconv.STALL_PASS: pass_,
        })
        if stack:
            stalled.attrs[semconv.STALL_STACK] = stack
        if seqs:
            stalled.attrs[semconv.STALL_GROUPS] = [entry[0] for entry in seqs]
            stalled.attrs[semconv.STALL_ISSUED_SEQ] = [entry[1] for entry in seqs]
            stalled.attrs[semconv.STALL_COMPLETED_SEQ] = [entry[2] for entry in seqs]
        if not progress.in_step:
            stalled.attrs[semconv.STALL_BETWEEN_STEPS] = True
        stalled.events = progress.ring_events(now)[-self.settings.max_events_per_span:]
        step = self._step or self._outside
        if step is None:  # between steps, no collective since the last one: the stalled span alone
            gap = Step(-1, True, Record(SpanKind.OUTSIDE_STEP, semconv.SPAN_OUTSIDE_STEP, now), SpanKind.OUTSIDE_STEP)
            self._spans.emit([stalled], {}, self._trace_id(gap))
            return True
        step.stalled = snapshot
        if not step.trace_id:  # the step's export at its end joins the snapshot's trace
            step.trace_id = self._trace_id(step) or ids.trace_id()
        with self._copying:  # the training thread may close the step meanwhile: no record is reused mid-copy
            roots, children, root = snapshot_tree(step, list(step.records), now, snapshot)
        root.attrs[semconv.STEP_STALLED] = snapshot
        children.setdefault(id(root), []).append(stalled)
        self._emit_tree(roots, children, step.trace_id, step)
        return True

    def job_id(self, store: Any = None) -> str:
        """The job nonce every rank agrees on (``steps.job_nonce``, through ``store``: the default group's, or a
        thread's own clone of it); ask once settled."""
        if self._nonce is None:
            self._nonce = job_nonce(store)
        return self._nonce

    def stall_verdict(self, step_index: int, start_ns: int, now: int, attrs: dict[str, Any]) -> bool:
        """Export the cross-rank verdict (verdict.py) from the watchdog's thread: a ``stall_verdict`` root
        span in step ``step_index``'s trace (trace scope ``job``; else a trace of its own) from ``start_ns``
        (the earliest stall's start) to ``now``. True if handed to the span sink."""
        if self._spans is None or not self.active:
            return False
        verdict = Record(SpanKind.MODULE, semconv.SPAN_STALL_VERDICT, start_ns)
        verdict.end_ns = now
        verdict.attrs.update(attrs)
        step = self._step
        if step is not None and step.kind is SpanKind.STEP and step.index == step_index and step.trace_id:
            trace_id = step.trace_id  # the stalled step's own (its snapshot set it)
        else:
            same = Step(step_index, True, Record(SpanKind.STEP, semconv.SPAN_TRAIN_STEP, start_ns), SpanKind.STEP)
            trace_id = self._trace_id(same)
        self._spans.emit([verdict], {}, trace_id)
        return True

    # ------------------------------------------------------------------ ops
    def op_event(self, func: Any, args: tuple, is_dtensor: bool) -> None:
        """An op ran at detail ``dtensor`` or above: an event named after the overload."""
        owner, step = self._owner()
        for observer in self._observers:
            observer.on_op(func, args, is_dtensor, owner)
        if step is None or not step.traced or owner is None:
            return
        for observer in self._observers:
            if not observer.op_event_wanted(func, is_dtensor):
                return
        name = str(func)
        attrs: dict[str, Any] = {semconv.OP_NAME: name}
        if is_dtensor:
            attrs.update(dtensor_facts(args))
        else:
            shapes = [str(list(arg.shape)) for arg in args if isinstance(arg, torch.Tensor)]
            if shapes:  # never an empty array: ops on tensor lists (_foreach_*) have no top-level tensor
                attrs[semconv.OP_INPUT_SHAPES] = shapes
        self._add_event(owner, name, attrs, time.time_ns())

    def _add_event(self, owner: Record, name: str, attrs: dict, now: int) -> None:
        events = owner.events
        if len(events) < self.settings.max_events_per_span:
            if events:
                events.append((name, attrs, now))
            else:
                owner.events = [(name, attrs, now)]
            return
        owner.dropped_events += 1
        self._count_dropped(semconv.DROPPED_KIND_EVENT)
        if owner.dropped_events == 1 and variable("max_events_per_span") not in self._failed:
            self._failed.add(variable("max_events_per_span"))
            _logger.warning("commdebug-otel: span %r reached %s=%d events; later ones are dropped, counted on the "
                            "span (%s) and in %s (kind %s)", owner.name, variable("max_events_per_span"),
                            self.settings.max_events_per_span, semconv.SPAN_DROPPED_EVENTS, semconv.METRIC_DROPPED,
                            semconv.DROPPED_KIND_EVENT)


def _listens(observer: RecorderObserver) -> bool:
    """Whether ``observer`` overrides a callback that reports what records carry."""
    kind = type(observer)
    return any(getattr(kind, name) is not getattr(RecorderObserver, name)
               for name in ("on_collective", "on_op", "on_first_call"))


def _end_backward_records(records: list[Record], now: int) -> None:
    for record in records:
        record.end_ns = now
        record.unmatched = record.fwd is not None and record.fwd.input_hooked
        if record.fwd is not None:
            record.fwd.open_bw = None
