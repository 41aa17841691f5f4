"""The recorder: the one object the hooks report to, a small facade over the parts that know which span is open where.

The module tracker (``capture/tracker.py``), the dispatch mode (``capture/mode.py``), the collective kernels
(``capture/intercept.py``) and the stall watchdog (``stall/watchdog.py``) only report facts here, each through the
typed protocol of what it may call (``protocols.py``): a module pass began or ended, a collective
or op ran, a rank stalled. The recorder hands each to its part:

* the step lifecycle (``step_lifecycle.StepLifecycle``): steps open and close, sampling,
  ``outside_step`` and ``train_step_tail``, step parts, export to the span sink
  (``spans.SpanBuilder.emit``), stall snapshots;
* module and backward ownership (``ownership.ModuleOwnership``);
* the collective path (``collective_path.CollectivePath``);
* the record pool (``record_pool.RecordPool``) and failure accounting (``failures.Failures``);
* the training thread's role (``thread_role.ThreadRole``) and trace ids (``trace_ids``).

Building spans at the end of the step lets backward spans nest by the module tree whatever order
autograd fires the hooks in, and keeps the per-op hot path free of OTel calls. Ownership rules:
docs/architecture.md, "Ownership rules".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture.sinks import RecorderObserver, SpanSink
from commdebug_otel.config import Settings
from commdebug_otel.core.collectives import Why
from commdebug_otel.core.fact import PASS_NONE, MetricsSink
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.job_identity import RankCache
from commdebug_otel.core.ownership import NO_OPTIMIZER_CYCLES
from commdebug_otel.core.progress import Progress
from commdebug_otel.core.record_pool import RecordPool
from commdebug_otel.core.records import Record, Step
from commdebug_otel.core.stall_snapshot import StallPlace, stall_place
from commdebug_otel.core.step_lifecycle import StepLifecycle

__all__ = ["NO_OPTIMIZER_CYCLES", "PASS_NONE", "Recorder"]


class Recorder:
    """Owns open spans, step boundaries and the collective sequence numbers (through its parts).

    Args:
        settings: frozen :class:`Settings`.
        spans: where finished steps go (:class:`~commdebug_otel.capture.sinks.SpanSink`,
            e.g. ``spans.SpanBuilder``); None: no spans, metrics only.
        metrics: where metric points go (``fact.MetricsSink``: ``metrics.LazyCollectiveMetrics``), or None.
        observers: told what the recorder sees
            (:class:`~commdebug_otel.capture.sinks.RecorderObserver`; its docstring
            says when each callback runs and what happens if one raises).

    Attributes:
        why: the DTensor op behind the collectives issued now
            (:class:`~commdebug_otel.core.collectives.Why`): ``with recorder.why(op, args): ...``.
        active: False once the tracer stopped: reporters ignore their hooks then.
        rank: ``rank() -> steps.RankInfo``, asked again until torch.distributed is initialized.
    """

    def __init__(self, settings: Settings, spans: SpanSink | None, metrics: MetricsSink | None,
                 observers: Sequence[RecorderObserver] = ()) -> None:
        self.settings = settings
        self._spans = spans
        self._metrics = metrics
        observers = tuple(observers)
        # An observer told of collectives, ops or first calls: sampled steps keep records for it even
        # where spans go nowhere (a tracer that only counts).
        listening = any(_listens(observer) for observer in observers)
        self.rank = RankCache()
        self._failures = Failures(metrics)
        # Module records of closed steps are reused where nothing outside keeps them: a span sink
        # that says so, no observer handed records (record_pool.py).
        self._pool = RecordPool(spans is not None and not getattr(spans, "keeps_records", True) and not listening)
        steps = self._steps = StepLifecycle(settings, spans, metrics, observers, listening, self.rank,
                                            self._failures, self._pool)
        self._ownership, self._path = steps.ownership, steps.path
        self.why: Why = steps.why
        self.active = True
        # The hooks' calls, handed straight to the part that takes them (no second call per hook).
        self.module_pre = self._ownership.module_pre
        self.module_post = self._ownership.module_post
        self.backward_began = self._ownership.backward_began
        self.backward_ended = self._ownership.backward_ended
        self.collective = self._path.collective
        self.waited = self._path.waited
        self.op_event = self._path.op_event
        self.keep_hook = steps.keep_hook
        self.hook_free_step = self._ownership.hook_free_step
        self.optimizer_step_done = steps.optimizer_step_done
        self.tracks_thread = steps.role.tracks_thread
        self.role = steps.role  # the hooks hold it still while they record (thread_role.one_role_holder)
        self.hook_failed = self._failures.hook_failed

    # Bound methods set in __init__ (typed here for readers and checkers).
    module_pre: Callable[..., Record | None]
    module_post: Callable[[torch.nn.Module, Record | None], None]
    backward_began: Callable[[Record], None]
    backward_ended: Callable[[Record], None]
    collective: Callable[..., None]
    waited: Callable[[Any, int], None]
    op_event: Callable[[Any, tuple, bool], None]
    keep_hook: Callable[[Any], None]
    hook_free_step: Callable[[], bool]
    optimizer_step_done: Callable[[], None]
    tracks_thread: Callable[..., bool]
    hook_failed: Callable[[str, BaseException], None]

    def reset_after_fork(self) -> None:
        """A forked child starts with no open spans and learns its own rank."""
        self._steps.reset()
        if self._metrics is not None:
            self._metrics.reset()

    def activate(self) -> None:
        """The tracer starts: this thread trains, and a "why" may be recorded (set-up is traced)."""
        self.active = True
        self._steps.activate()

    # ----------------------------------------------------------------- queries
    @property
    def resume_module_hooks(self) -> Any:
        """Called (no arguments) when a step whose module calls ran hook-free closes (``hook_free_step``)."""
        return self._ownership.resume_module_hooks

    @resume_module_hooks.setter
    def resume_module_hooks(self, resume: Any) -> None:
        self._ownership.resume_module_hooks = resume

    @property
    def first_call(self) -> Any:
        """Called once, at the first module call that opens a step; True: stop recording (a data worker)."""
        return self._steps.first_call

    @first_call.setter
    def first_call(self, check: Any) -> None:
        self._steps.first_call = check

    @property
    def thread_id(self) -> int:
        """The training thread: the tracer's starting thread, or another thread that trains
        (``tracks_thread``). Module calls and optimizer steps on other threads (but autograd's) are
        ignored; their collectives are counted in metrics only: no module, pass ``none``, no span event."""
        return self._steps.role.thread_id

    @property
    def thread_changes(self) -> int:
        """How often the training thread's role changed hands (the tracker resets its call stack)."""
        return self._steps.role.changes

    @property
    def thread_settled(self) -> bool:
        """Whether the training thread is known (False while another thread borrows the role)."""
        return not self._steps.role.borrowing

    def finish(self, error: BaseException | None = None) -> None:
        """Tracing stops: every open span closes (``error``: the exception ending the process goes on the open
        step), and the file the training thread's CPU wait is read from is closed."""
        self._steps.finish(error)
        self._steps.progress.close()

    @property
    def progress(self) -> Progress:
        """Where this rank is (``stall.Progress``), kept on every step."""
        return self._steps.progress

    @property
    def steps_taken(self) -> int:
        """How many optimizer steps have ended (``torch.step`` of the next one)."""
        return self._steps.steps_taken

    @property
    def step_open(self) -> bool:
        """Whether a step (training or inference) is open now."""
        return self._steps.current_step is not None

    @property
    def current_step(self) -> Step | None:
        """The open step (or step part), None between steps."""
        return self._steps.current_step

    def state_sizes(self) -> dict[str, int]:
        """How many entries each piece of per-run state holds, by name (for leak checks)."""
        step = self._steps.current_step
        return {
            "step records": len(step.records) if step is not None else 0,
            "step hooks": len(step.hooks) + len(step.tensor_hooks) // 2 if step is not None else 0,
            **self._ownership.state_sizes(),
            "sequenced groups": len(self.progress.next_seq),
            "resolved groups": len(self._path.groups),
            "recvs awaiting their source": len(self._path.awaiting_source),
            "spare records": len(self._pool),
        }

    # ------------------------------------------------------------------ stalls
    def stall_place(self, where: tuple[str, str, list[str]]) -> StallPlace:
        """Where this rank is stalled (``core/stall_snapshot.py:stall_place``), from the watchdog's thread:
        ``where`` is ``(module FQN, pass, code locations)`` of the training thread
        (``stall.training_thread_location``), the innermost open module record naming the module where it
        names none."""
        return stall_place(self.progress, where, self._steps.innermost_open(), self._steps.steps_taken)

    def stall_snapshot(self, now: int, age_s: float, threshold_s: float, snapshot: int, place: StallPlace) -> bool:
        """Export, from the watchdog's thread, what this rank is doing now (stall/watchdog.py) at ``place``
        (:meth:`stall_place`). True if exported. The step's records are copied, never changed: the training
        thread may still be running it.
        """
        if self._spans is None or not self.active:
            return False
        return self._steps.exports.stall_snapshot(now, age_s, threshold_s, snapshot, place)

    def job_id(self, store: Any = None) -> str:
        """The job nonce every rank agrees on (``steps.job_nonce``, through ``store``: the default group's, or a
        thread's own clone of it); ask once settled."""
        return self._steps.exports.job_id(store)

    def stall_verdict(self, step_index: int, start_ns: int, now: int, attrs: dict[str, Any],
                      name: str = semconv.SPAN_STALL_VERDICT) -> bool:
        """Export a cross-rank verdict from the watchdog's thread: a root span ``name`` (``stall_verdict``,
        stall/verdict.py; ``straggler_verdict``, stall/straggler.py) in step ``step_index``'s trace (trace scope
        ``job``; else a trace of its own) from ``start_ns`` (the earliest stall's start) to ``now``. True if
        handed to the span sink."""
        if self._spans is None or not self.active:
            return False
        return self._steps.exports.stall_verdict(step_index, start_ns, now, attrs, name)


def _listens(observer: RecorderObserver) -> bool:
    """Whether ``observer`` overrides a callback that reports what records carry."""
    kind = type(observer)
    return any(getattr(kind, name) is not getattr(RecorderObserver, name)
               for name in ("on_collective", "on_op", "on_first_call"))
