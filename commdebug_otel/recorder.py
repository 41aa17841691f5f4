"""The recorder: the one object that knows which span is open where.

The module tracker (``tracker.py``), the dispatch mode (``mode.py``) and the
collective kernels (``intercept.py``) only report facts here: a module pass
began or ended, a collective or op ran. The recorder keeps light records
(``records.py``) for the current step; when the step ends it hands them, as a
span tree, to its span sink (``spans.SpanBuilder.emit``). Building spans at the end
lets backward spans nest by the module tree whatever order autograd fires the
hooks in, and keeps the per-op hot path free of OTel calls. Collectives take
the path in ``collectives.py``.

Ownership rules (docs/architecture.md, "Ownership rules"):

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

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import ids, semconv
from ._torch import graph_task_id, tensor_hook_key
from .config import Settings, TraceScope, variable
from .core_collective_path import CollectivePath
from .core_fact import PASS_NONE
from .core_failures import Failures
from .core_ownership import NO_OPTIMIZER_CYCLES, ModuleOwnership
from .core_record_pool import RecordPool
from .observer import RecorderObserver, SpanSink
from .ops import CollectiveSpec
from .records import Record, SpanKind, Step, snapshot_tree, span_tree
from .stall import Progress
from .steps import RankCache, job_nonce, job_trace_id, outside_step_label, settled

__all__ = ["NO_OPTIMIZER_CYCLES", "PASS_NONE", "Recorder"]

_logger = logging.getLogger(__name__)

# Finished traced steps of a thread that borrows the training thread's role, kept until it trains.
MAX_HELD_STEPS = 64


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
        self.observers = tuple(observers)
        self.every_event = any(observer.wants_every_event for observer in self.observers)
        # An observer told of collectives, ops or first calls: sampled steps keep records for it even
        # where spans go nowhere (a tracer that only counts).
        self._listening = any(_listens(observer) for observer in self.observers)
        self._exemplars: bool | None = None  # decided at the first traced step (spans.start())
        # This process's rank facts, rank() (asked again until torch.distributed is initialized).
        self.rank = RankCache()
        self._failures = Failures(metrics)
        self._max_records = settings.max_spans_per_step  # per step part (step_full)
        # Module records of closed steps are reused where nothing outside keeps them: a span sink
        # that says so, no observer handed records (core_record_pool.py).
        self._pool = RecordPool(spans is not None and not getattr(spans, "keeps_records", True)
                                and not self._listening)
        self._path = CollectivePath(self, metrics, self._failures)
        self._ownership = ModuleOwnership(self, settings, self.observers, self._pool, self._failures)
        self._next_step = 0
        self._next_inference = 0
        self.seen_optimizer = False
        self._nonce: str | None = None
        self._provisional_nonce: str | None = None  # this rank's own, until the process group exists
        self.why = self._path.why
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
        self._path.reset()
        self._pool.reset_after_fork()
        self._ownership.reset()
        self.rank.reset()  # a forked child learns its own rank
        self._provisional_step: Step | None = None  # the open step whose trace id was drawn before settling
        # Progress on every step (stall.py); its seq counters match collectives across ranks.
        self.progress = Progress(self._path.groups.dim_name)
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
            **self._ownership.state_sizes(),
            "sequenced groups": len(self.progress.next_seq),
            "resolved groups": len(self._path.groups),
            "recvs awaiting their source": len(self._path.awaiting_source),
            "spare records": len(self._pool),
        }

    def _traces_this_rank(self) -> bool:
        """Whether a sampled step (or set-up) is traced here: this rank is traced, and its spans go
        somewhere (``OTEL_TRACES_EXPORTER=none``: they do not) or an observer listens to what records carry."""
        if self._spans is None or not self.settings.traces_rank(self.rank().rank):
            return False
        self._exemplars_on()  # starts the tracer provider: where spans go is known from then on
        try:
            return self.every_event or self._listening or self._spans.exporting
        except Exception as error:
            self.hook_failed("telemetry start", error)
            return False

    # ---------------------------------------------------------------- failures
    def hook_failed(self, where: str, error: BaseException) -> None:
        """Log a hook failure once per place, count it, and go on. Never raises."""
        self._failures.hook_failed(where, error)

    # --------------------------------------------------------------- observers
    def _tell_traced(self, traced: bool) -> None:
        for observer in self.observers:
            try:
                observer.traced_step_changed(traced)
            except Exception as error:
                self.hook_failed("dispatch mode switch", error)

    def _want_why(self, wanted: bool) -> None:
        if wanted != self._why_on:
            self._why_on = wanted
            for observer in self.observers:
                try:
                    observer.why_wanted(wanted)
                except Exception as error:
                    self.hook_failed("DTensor redistribution watch", error)

    # ------------------------------------------------------------------ steps
    def open_step(self, now: int, inference: bool = False) -> Step:
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
        self._path.counter.timed = sampled or index % self.settings.completion_every == 0
        step.inference = inference
        self._ownership.step_opened()
        if traced and self._exemplars_on():
            step.trace_id = self._trace_id(step) or ids.trace_id()
            if self._nonce is None and self.settings.trace_scope is TraceScope.JOB:
                self._provisional_step = step  # opened before the process group: its id is made again at the end
        step.quiet = not (traced or self.every_event or self.settings.metric_module_depth)
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

    @property
    def current_step(self) -> Step | None:
        """The open step (or step part), None between steps."""
        return self._step

    def outside_step(self, now: int) -> Step:
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
        self.seen_optimizer = True
        if step is not None and step.had_module:
            self.close_step(time.time_ns())

    def close_step(self, now: int, inference: bool = False) -> None:
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
        self._path.counter.timed = True

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
                context = self._path.exemplar_context(step.root, step) if step.traced and step.trace_id else None
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
        reuse = not self._ownership.close(now) and self._pool.reuses
        self._path.step_closed()
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
                    self._failures.count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, len(oldest.records) + 1)
                    self._pool.release(oldest, False)
                return
            self._emit(step)
        self._pool.release(step, reuse)

    def _emit(self, step: Step) -> None:
        try:
            # An untraced step that stalled: its train_step alone (its snapshots hold the rest).
            roots, children = span_tree(step) if step.traced else ([step.root], {})
            self._emit_tree(roots, children, step.trace_id or self._trace_id(step), step)
        except Exception as error:
            self.hook_failed("building spans", error)

    def _emit_tree(self, roots: list[Record], children: dict[int, list[Record]], trace_id: int | None,
                   step: Step) -> None:
        """Hand ``step``'s span tree to the sink, under its parent span when it has one (a tail)."""
        if step.parent_span_id:
            self._spans.emit(roots, children, trace_id, parent_span_id=step.parent_span_id)
        else:
            self._spans.emit(roots, children, trace_id)

    def step_full(self, step: Step, now: int, in_backward: bool) -> Step | None:
        """``step`` holds ``max_spans_per_step`` records: cut it, go on, or record no more of this pass.

        At a top-level forward (no pass open) the step so far is closed and exported as
        one part, its ``train_step`` marked ``commdebug.step.truncated``, its tensor hooks
        removed (so nothing of it stays alive, and backward spans of its passes are lost),
        and the step goes on in a fresh part with the same ``torch.step``: returns that
        part. Inside a pass nothing can be cut: the pass stays whole (returns ``step``)
        up to twice the bound, past which it is not recorded (returns None). Cuts and
        passes not recorded are counted on traced steps, and said once.
        """
        top_level = self._ownership.idle and not in_backward
        if not top_level and len(step.records) < 2 * self._max_records:
            return step
        if step.traced:
            self._failures.count_dropped(
                semconv.DROPPED_KIND_STEP_SPLIT if top_level else semconv.DROPPED_KIND_STEP_FULL)
            if self._failures.first(variable("max_spans_per_step")):
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
            inference = not self.seen_optimizer and not self._step.backward_done
            self.close_step(now, inference=inference)
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
        if self.seen_optimizer or self._step is not None or not self._ownership.idle:
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
            self._pool.release(step, False)

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
            self._pool.release(step, False)
        self._held = []
        self._next_step, self._next_inference = self._borrowed
        self._borrowed = None
        self._after_traced = True
        self.thread_id = self._home_thread
        self.thread_changes += 1
        if dropped:
            self._failures.count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, dropped)

    def module_pre(self, module: torch.nn.Module, fqn: str, args: tuple,
                   compiled: bool = False) -> Record | None:
        """A module's forward (or recompute) begins: :meth:`ModuleOwnership.module_pre
        <commdebug_otel.core_ownership.ModuleOwnership.module_pre>`. Returns its record, or None."""
        return self._ownership.module_pre(module, fqn, args, compiled)

    def module_post(self, module: torch.nn.Module, record: Record | None) -> None:
        """A module's forward ended (its own forward hooks included)."""
        self._ownership.module_post(module, record)

    def backward_began(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's outputs are ready: its backward begins."""
        self._ownership.backward_began(forward)

    def backward_ended(self, forward: Record) -> None:
        """Gradients w.r.t. a module call's inputs are computed: its backward ends."""
        self._ownership.backward_ended(forward)

    def backward_pass_done(self) -> None:
        """An outermost autograd pass of the open step finished (a borrowing thread that trains keeps the role)."""
        step = self._step
        if step is not None:
            step.backward_done += 1
            if self._borrowed is not None:
                self._settle_thread()  # the borrowing thread trains

    def owner(self) -> tuple[Record | None, Step | None]:
        """The record that owns what runs now (the ownership rules), or the step's root; and the open step."""
        return self._ownership.owner()

    def pass_by_depth(self, in_backward: bool) -> str:
        """The pass when no module record owns the collective (untraced steps keep only the depth)."""
        return self._ownership.pass_by_depth(in_backward)

    # ------------------------------------------------------------- collectives
    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None:
        """A collective was issued: :meth:`CollectivePath.collective <commdebug_otel.core_collective_path.
        CollectivePath.collective>` (``duration_ns``: its issue time on the CPU; ``out``: what the op returned;
        ``start_ns``: ``time.perf_counter_ns()`` at issue)."""
        self._path.collective(spec, args, duration_ns, out, start_ns)

    def waited(self, handle: Any, duration_ns: int) -> None:
        """A thread waited ``duration_ns`` on a collective (``Work.wait()``, or ``wait_tensor`` on its output)."""
        self._path.waited(handle, duration_ns)

    def op_event(self, func: Any, args: tuple, is_dtensor: bool) -> None:
        """An op ran at detail ``dtensor`` or above: an event named after the overload."""
        self._path.op_event(func, args, is_dtensor)

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
            record = self._ownership.innermost_open()
            if record is not None:
                module, pass_ = record.fqn, record.pass_
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
        with self._pool.copying:  # the training thread may close the step meanwhile: no record is reused mid-copy
            roots, children, root = snapshot_tree(step, list(step.records), now, snapshot)
        root.attrs[semconv.STEP_STALLED] = snapshot
        children.setdefault(id(root), []).append(stalled)
        self._emit_tree(roots, children, step.trace_id, step)
        return True

    def job_id(self) -> str:
        """The job nonce every rank agrees on (``steps.job_nonce``, through the store); ask once settled."""
        if self._nonce is None:
            self._nonce = job_nonce()
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


def _listens(observer: RecorderObserver) -> bool:
    """Whether ``observer`` overrides a callback that reports what records carry."""
    kind = type(observer)
    return any(getattr(kind, name) is not getattr(RecorderObserver, name)
               for name in ("on_collective", "on_op", "on_first_call"))
