"""The step lifecycle: steps open and close, become spans, and are timed; segments between steps.

A step opens at the first module call after the last one closed (``optimizer.step()`` closes a
training step; a top-level forward without grad is an inference root), is sampled
(``TRACE_EVERY``) and traced where this rank's spans go somewhere, and at its close its records
become a span tree handed to the span sink (``spans.SpanBuilder.emit``), after its signals (duration,
collective wait, fingerprint, slow). Between steps, collectives go to the ``train_step_tail`` of the
step that closed last, or before the first step to an ``outside_step`` root. A step that holds
``MAX_SPANS_PER_STEP`` records is cut into parts (:meth:`StepLifecycle.step_full`).

The parts it drives: module ownership (``ownership``), the collective path
(``collective_path``), the record pool, the training thread's role (``thread_role``),
the exports and trace ids (``step_export``); ``recorder.Recorder`` is the facade the hooks call.
"""

from __future__ import annotations

import logging
import threading
import time
from operator import attrgetter
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.capture._torch import graph_task_id
from commdebug_otel.capture.optimizers import OPTIMIZERS
from commdebug_otel.capture.sinks import RecorderObserver, SpanSink
from commdebug_otel.config import Settings, variable
from commdebug_otel.core import ids
from commdebug_otel.core.collective_path import CollectivePath
from commdebug_otel.core.fact import MetricsSink
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.job_identity import RankCache, settled
from commdebug_otel.core.ownership import NO_OPTIMIZER_CYCLES, ModuleOwnership
from commdebug_otel.core.progress import Progress
from commdebug_otel.core.record_pool import RecordPool
from commdebug_otel.core.records import Record, SpanKind, Step, self_times
from commdebug_otel.core.step_export import StepExport
from commdebug_otel.core.step_signals import keep_hook, remove_hooks, step_signals
from commdebug_otel.core.thread_role import ThreadRole, one_role_holder

_logger = logging.getLogger(__name__)
# An untraced step's metric points are handed to the metrics worker at its close only if this long (ns) has
# passed since the last hand-over; else the worker takes them itself once idle for a second (``IDLE_TAKE_S``).
# Waking it costs a fast step tens of microseconds of its own thread, more than the rest of its close.
QUIET_FLUSH_NS = 1_000_000_000


class StepLifecycle:
    """The steps of one recorder, and the parts they drive.

    Args:
        settings: frozen :class:`Settings`.
        spans: where finished steps go (:class:`~commdebug_otel.capture.sinks.SpanSink`); None: no spans.
        metrics: where metric points go (``fact.MetricsSink``: ``metrics.LazyCollectiveMetrics``), or None.
        observers: told what the recorder sees (:class:`~commdebug_otel.capture.sinks.RecorderObserver`).
        listening: an observer is told of collectives, ops or first calls (sampled steps keep records for it).
        rank: this process's rank facts (``job_identity.RankCache``).

    Attributes:
        ownership, path, role, exports: the parts (module ownership, collective path, thread role, span exports).
        first_call: called once, at the first module call that opens a step; True: stop recording.
        seen_optimizer: whether an ``optimizer.step()`` has ended a step.
    """

    def __init__(self, settings: Settings, spans: SpanSink | None, metrics: MetricsSink | None,
                 observers: tuple[RecorderObserver, ...], listening: bool, rank: RankCache,
                 failures: Failures, pool: RecordPool) -> None:
        self.settings = settings
        self._spans = spans
        self._metrics = metrics
        self.observers = observers
        self.every_event = any(observer.wants_every_event for observer in observers)
        self._listening = listening
        self._exemplars: bool | None = None  # decided at the first traced step (spans.start())
        self.rank = rank
        self._failures = failures
        self._pool = pool
        self._max_records = settings.max_spans_per_step  # per step part (step_full)
        self.exports = StepExport(self, settings, spans, rank, failures, pool)
        self._trace_id = self.exports.trace_id
        self.export = self.exports.export  # the thread role's too (a held step, exported once it trains)
        self.path = self._path = CollectivePath(self, metrics, failures)
        self.why = self._path.why  # the one "why", cleared in place, never replaced
        self.ownership = ModuleOwnership(self, settings, observers, pool, failures)
        self.role = ThreadRole(self, pool, failures)
        self.innermost_open = self.ownership.innermost_open  # (the exports' stall snapshots)
        self._next_step = 0
        self._next_inference = 0
        self._flushed_ns = 0  # when metric points were last handed to the worker at a step's close
        self.seen_optimizer = False
        self.why_on = True  # what the observers were last told (why_wanted)
        self.first_call: Any = None
        self.reset()

    def reset(self) -> None:
        """The state a process starts with, and a forked child starts again with."""
        self._step: Step | None = None
        self._outside: Step | None = None
        # Whether the step that closed last was traced: collectives between steps (a logging
        # all_reduce after optimizer.step()) follow it; set-up before the first step is traced.
        self._after_traced = True
        # The training step that closed last, until the next one opens (its collectives meanwhile go
        # to its train_step_tail): StepExport.tail_facts; None before the first step.
        self._tail_of: tuple | None = None
        # Collectives are timed (issue time; c10d ones to completion, a backend-thread callback
        # each) on the steps trace_every picks and one in completion_every, and between steps.
        self._path.reset()
        self._pool.reset_after_fork()
        self.ownership.reset()
        self.rank.reset()  # a forked child learns its own rank
        self._provisional_step: Step | None = None  # the open step whose trace id was drawn before settling
        # Progress on every step (stall/watchdog.py); its seq counters match collectives across ranks.
        self.progress = Progress(self._path.groups.dim_name)
        self.role.reset()
        self.want_why(True)

    def activate(self) -> None:
        """The tracer starts: this thread trains, and a "why" may be recorded (set-up is traced)."""
        self.role.activate()
        self.why_on = True

    @property
    def thread_id(self) -> int:
        return self.role.thread_id

    @property
    def steps_taken(self) -> int:
        return self._next_step

    # ------------------------------------------------------ what the parts ask
    @property
    def idle(self) -> bool:
        return not self.seen_optimizer and self._step is None and self.ownership.idle

    @property
    def counters(self) -> tuple[int, int]:
        return self._next_step, self._next_inference

    def keep_hook(self, handle: Any) -> None:
        """Remember a tensor or multi-grad hook handle: removed when the step closes (``step_signals``)."""
        keep_hook(self._step, handle)

    def drop_open(self, now: int) -> None:
        for step in (self._step, self._outside):
            if step is not None:
                self._close(step, now)
        self._step = self._outside = None
        if self.ownership.hooks_off:
            self.ownership.hooks_back()

    def restore(self, counters: tuple[int, int] | None) -> None:
        if counters is not None:
            self._next_step, self._next_inference = counters
        self._after_traced = True

    def owner(self) -> tuple[Record | None, Step | None]:
        return self.ownership.owner()

    def pass_by_depth(self, in_backward: bool) -> str:
        return self.ownership.pass_by_depth(in_backward)

    def hook_failed(self, where: str, error: BaseException) -> None:
        self._failures.hook_failed(where, error)

    def without_optimizer(self) -> bool:
        """Whether no optimizer exists: none has stepped (on the training thread) and none is alive
        (``optimizers.OPTIMIZERS``). Only then does a step end after ``NO_OPTIMIZER_CYCLES`` backward passes."""
        return not self.seen_optimizer and not OPTIMIZERS.any_alive()

    def backward_pass_done(self) -> None:
        """An outermost autograd pass of the open step finished (a borrowing thread that trains keeps the role)."""
        step = self._step
        if step is not None:
            step.backward_done += 1
            role = self.role
            if step.backward_done >= NO_OPTIMIZER_CYCLES and not role.fixed:
                # This thread trains without an optimizer (a borrower: settled): it keeps the role, and
                # the hooks take no lock from now on. One backward is not training (a saliency map on
                # a serving thread): an optimizer step after it settles the role.
                if role.borrowing:
                    role.settle()
                role.fixed = True

    # ------------------------------------------------------------------ steps
    def _traces_this_rank(self) -> bool:
        """Whether a sampled step (or set-up) is traced here: this rank is traced, and its spans go
        somewhere (``OTEL_TRACES_EXPORTER=none``: they do not) or an observer listens to what records carry."""
        if self._spans is None or not self.settings.traces_rank(self.rank().rank):
            return False
        self._exemplars_on()  # starts the tracer provider: where spans go is known from then on
        try:
            return self.every_event or self._listening or self._spans.exporting
        except Exception as error:
            self._failures.hook_failed("telemetry start", error)
            return False

    def tell_traced(self, traced: bool) -> None:
        for observer in self.observers:
            try:
                observer.traced_step_changed(traced)
            except Exception as error:
                self._failures.hook_failed("dispatch mode switch", error)

    def want_why(self, wanted: bool) -> None:
        if wanted != self.why_on:
            self.why_on = wanted
            for observer in self.observers:
                try:
                    observer.why_wanted(wanted)
                except Exception as error:
                    self._failures.hook_failed("DTensor redistribution watch", error)

    # ------------------------------------------------------------------ steps
    def open_step(self, now: int, inference: bool = False) -> Step:
        if self._outside is not None:
            self._close(self._outside, now)
            self._outside = None
        if not inference:  # the next training step: the tail of the last one is over
            self._tail_of = None
        # Inference/evaluation forwards are counted apart, so torch.step stays the optimizer step.
        index = self._next_inference if inference else self._next_step
        first, last = self.progress.trace_steps  # the live straggler verdict's request (one tuple read)
        sampled = index % self.settings.trace_every == 0 or first <= index <= last
        traced = sampled and self._traces_this_rank()
        root = Record(SpanKind.STEP, semconv.SPAN_TRAIN_STEP, now)
        root.attrs[semconv.STEP] = index
        step = self._step = Step(index, traced, root, SpanKind.STEP)
        self.progress.step_began(now, index, traced or self.settings.straggler)
        # The same steps on every rank (sampled, not traced): their histograms compare.
        self._path.counter.timed = sampled or index % self.settings.completion_every == 0
        step.inference = inference
        self.ownership.step_opened()
        if traced and self._exemplars_on():
            step.trace_id = self._trace_id(step) or ids.trace_id()
            if self.exports.trace_ids.nonce is None and self.exports.trace_ids.job_scoped:
                self._provisional_step = step  # opened before the process group: its id is made again at the end
        step.quiet = not (traced or self.every_event or self.settings.metric_module_depth)
        self.tell_traced(traced)  # every opening: a mode left on by a close inside backward goes now
        self.want_why(traced)
        return step

    def _exemplars_on(self) -> bool:
        if self._exemplars is None:
            try:
                self._exemplars = self._spans is not None and bool(self._spans.start())
            except Exception as error:
                self._exemplars = False
                self._failures.hook_failed("telemetry start", error)
        return self._exemplars

    @property
    def current_step(self) -> Step | None:
        """The open step (or step part), None between steps."""
        return self._step

    @property
    def open_segment(self) -> Step | None:
        """The open step, else the open segment between steps, else None."""
        return self._step or self._outside

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

    @one_role_holder(attrgetter("role"))
    def optimizer_step_done(self) -> None:
        """``optimizer.step()`` returned: the step ends (if a module ran since the last one).

        Only on the training thread (or inside its backward: optimizer-in-backward):
        an optimizer stepped on another thread (an EMA update) ends nothing.
        """
        role = self.role
        if graph_task_id() == -1 and threading.get_ident() != role.thread_id:
            return
        step = self._step
        if role.borrowing:
            if step is None or not step.backward_done:
                return  # no backward on the borrowing thread: not training (an EMA update), it ends nothing
            role.settle()
        self.seen_optimizer = role.fixed = True
        if step is not None and step.had_module:
            self.close_step(time.time_ns())

    def close_step(self, now: int, inference: bool = False) -> None:
        step = self._step
        if step is None:
            return
        self._step = None
        if self.ownership.hooks_off:
            self.ownership.hooks_back()
        if step.inference:
            self._next_inference += 1
        else:
            self._next_step += 1
        self._path.why.clear()
        self._after_traced = step.traced
        if inference or step.inference:
            step.kind = SpanKind.INFERENCE  # no train_step span: each top-level forward is a root
        else:
            self._tail_of = self.exports.tail_facts(step)
        if step.traced and step.kind is SpanKind.STEP and not step.part and self.settings.straggler:
            _keep_places(step, now, self.progress, self._failures)
        step_signals(step, now, self.progress, self._metrics, self._path.exemplar_span, self._failures.hook_failed)
        self._close(step, now)
        self.want_why(step.traced)  # between steps as the step before (_outside_step)
        # Between steps, always: their few collectives (logging every k steps, checkpoints) would
        # otherwise never be timed where k is a multiple of completion_every.
        self._path.counter.timed = True

    def _close(self, step: Step, now: int, mode_stays: bool = False) -> None:
        # A forward still running (the step cut inside a call): its record stays the tracker's.
        reuse = not self.ownership.close(now) and self._pool.reuses
        self._path.step_closed()
        step.root.end_ns = now
        if self._metrics is not None and (not step.quiet or now - self._flushed_ns >= QUIET_FLUSH_NS):
            self._flushed_ns = now
            try:
                self._metrics.flush()
            except Exception as error:
                self._failures.hook_failed("metrics", error)
        remove_hooks(step)
        if step.traced and step.kind is not SpanKind.OUTSIDE_STEP and not mode_stays:
            self.tell_traced(False)
        if step is self._provisional_step:
            self._provisional_step = None
            if not step.stalled and settled(self.rank()):  # (a snapshot's trace keeps its step's spans)
                step.trace_id = self._trace_id(step) or step.trace_id  # the process group came: the job's id
        if (step.traced or step.stalled or step.root.error is not None) and self._spans is not None:
            if self.role.hold(step):  # a thread that has not trained yet: exported once it does
                return
            self.export(step)
        self._pool.release(step, reuse)

    def step_full(self, step: Step, now: int, in_backward: bool) -> Step | None:
        """``step`` holds ``max_spans_per_step`` records: cut it, go on, or record no more of this pass.

        At a top-level forward the step so far is exported as one part (``train_step`` marked truncated, its
        tensor hooks removed: backward spans of its passes are lost) and a fresh part with the same
        ``torch.step`` is returned. Inside a pass the pass stays whole (returns ``step``) up to twice the
        bound, then is not recorded (returns None). Cuts and passes not recorded are counted, and said once.
        """
        top_level = self.ownership.idle and not in_backward
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

    def finish(self, error: BaseException | None = None) -> None:
        """Close whatever is open (at exit or uninstrument) so every started span ends; ``error`` (the exception
        ending the process) goes on the open step's root unless one of its spans holds it (then exported)."""
        now = time.time_ns()
        if self._step is not None and error is not None and all(r.error is not error for r in self._step.records):
            self._step.root.error = error
        if self._step is not None:
            inference = not self.seen_optimizer and not self._step.backward_done
            self.close_step(now, inference=inference)
        if self._outside is not None:
            outside, self._outside = self._outside, None
            self._close(outside, now)
        if self.role.borrowing:  # no other thread came to train: the borrower's steps are the run's
            self.role.settle()


def _keep_places(step: Step, now: int, progress: Progress, failures: Failures) -> None:
    """Where a traced step's time went, for the live straggler verdict to name a module (stall/straggler.py)."""
    try:
        progress.places.append((step.index, self_times(step, now)))
    except Exception as error:
        failures.hook_failed("straggler places", error)
