"""What leaves the step lifecycle for the span sink: a closed step's span tree, stall snapshots, the
cross-rank verdict, and the step trace ids they go under.

``step_lifecycle.StepLifecycle`` decides when a step opens and closes; this part builds what
each export hands the span sink (``spans.SpanBuilder.emit``): the step's records as a span tree
(:func:`records.span_tree`), a stall snapshot's copies of the open step's records
(:func:`records.snapshot_tree`) with its ``stalled`` span, and a ``stall_verdict`` root. The
last two run on the watchdog's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.capture.sinks import SpanSink
from commdebug_otel.config import Settings
from commdebug_otel.core import ids
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.job_identity import RankInfo
from commdebug_otel.core.protocols import ExportHost
from commdebug_otel.core.record_pool import RecordPool
from commdebug_otel.core.records import Record, SpanKind, Step, snapshot_tree, span_tree
from commdebug_otel.core.stall_snapshot import StallPlace, stalled_record
from commdebug_otel.core.trace_ids import StepTraceIds


class StepExport:
    """The exports of one step lifecycle, and its steps' trace ids.

    Args:
        steps: the step lifecycle (:class:`~commdebug_otel.core.protocols.ExportHost`: the open
            step or segment, steps taken, progress, the innermost open record).
        settings: frozen :class:`Settings` (``max_events_per_span``; the trace scope).
        spans: where finished steps go (:class:`~commdebug_otel.capture.sinks.SpanSink`); None: no spans.
        rank: this process's rank facts (``job_identity.RankCache``).
    """

    def __init__(self, steps: ExportHost, settings: Settings, spans: SpanSink | None,
                 rank: Callable[[], RankInfo], failures: Failures, pool: RecordPool) -> None:
        self._steps = steps
        self._spans = spans
        self._max_events = settings.max_events_per_span
        self._failures = failures
        self._pool = pool
        self.trace_ids = StepTraceIds(settings, rank)

    def trace_id(self, step: Step) -> int | None:
        """``step``'s trace id (``trace_ids.StepTraceIds.trace_id``), None where ids are not the job's."""
        return self.trace_ids.trace_id(step, self._steps.steps_taken)

    def job_id(self, store: Any = None) -> str:
        return self.trace_ids.job_id(store)

    def tail_facts(self, step: Step) -> tuple:
        """``(index, traced, trace id, train_step span id, trace block)`` of a closing training step, for
        its ``train_step_tail``: the ids are chosen now (a traced step's) so that the tail can join them."""
        if step.traced:
            if not step.trace_id:
                step.trace_id = self.trace_id(step) or ids.trace_id()
            if not step.root.span_id:
                step.root.span_id = ids.span_id()
        return (step.index, step.traced, step.trace_id, step.root.span_id,
                step.root.attrs.get(semconv.TRACE_BLOCK))

    def export(self, step: Step) -> None:
        """Build ``step``'s spans and hand them to the span sink (an untraced step that stalled: its root)."""
        try:
            # An untraced step that stalled: its train_step alone (its snapshots hold the rest).
            roots, children = span_tree(step) if step.traced else ([step.root], {})
            self.emit_tree(roots, children, step.trace_id or self.trace_id(step), step)
        except Exception as error:
            self._failures.hook_failed("building spans", error)

    def emit_tree(self, roots: list[Record], children: dict[int, list[Record]], trace_id: int | None,
                  step: Step) -> None:
        """Hand ``step``'s span tree to the sink, under its parent span when it has one (a tail)."""
        if self._spans is None:  # metrics only: the recorder keeps no tree to hand over
            return
        if step.parent_span_id:
            self._spans.emit(roots, children, trace_id, parent_span_id=step.parent_span_id)
        else:
            self._spans.emit(roots, children, trace_id)

    def stall_snapshot(self, now: int, age_s: float, threshold_s: float, snapshot: int, place: StallPlace) -> bool:
        """Export what this rank is doing now (``Recorder.stall_snapshot``). True if exported.

        The step's records are copied, never changed: the training thread may still be running it.
        """
        if self._spans is None:
            return False
        steps = self._steps
        stalled = stalled_record(steps.progress, place, now, age_s, threshold_s, snapshot, self._max_events)
        step = steps.open_segment
        if step is None:  # between steps, no collective since the last one: the stalled span alone
            gap = Step(-1, True, Record(SpanKind.OUTSIDE_STEP, semconv.SPAN_OUTSIDE_STEP, now), SpanKind.OUTSIDE_STEP)
            self._spans.emit([stalled], {}, self.trace_id(gap))
            return True
        step.stalled = snapshot
        if not step.trace_id:  # the step's export at its end joins the snapshot's trace
            step.trace_id = self.trace_id(step) or ids.trace_id()
        with self._pool.copying:  # the training thread may close the step meanwhile: no record is reused mid-copy
            roots, children, root = snapshot_tree(step, list(step.records), now, snapshot)
        root.attrs[semconv.STEP_STALLED] = snapshot
        children.setdefault(id(root), []).append(stalled)
        self.emit_tree(roots, children, step.trace_id, step)
        return True

    def stall_verdict(self, step_index: int, start_ns: int, now: int, attrs: dict[str, Any],
                      name: str = semconv.SPAN_STALL_VERDICT) -> bool:
        """Export a cross-rank verdict (``Recorder.stall_verdict``): in step ``step_index``'s trace."""
        if self._spans is None:
            return False
        verdict = Record(SpanKind.MODULE, name, start_ns)
        verdict.end_ns = max(now, start_ns)  # start_ns: another host's clock may run ahead of ours
        verdict.attrs.update(attrs)
        step = self._steps.current_step
        if step is not None and step.kind is SpanKind.STEP and step.index == step_index and step.trace_id:
            trace_id: int | None = step.trace_id  # the stalled step's own (its snapshot set it)
        else:
            same = Step(step_index, True, Record(SpanKind.STEP, semconv.SPAN_TRAIN_STEP, start_ns), SpanKind.STEP)
            trace_id = self.trace_id(same)
        self._spans.emit([verdict], {}, trace_id)
        return True
