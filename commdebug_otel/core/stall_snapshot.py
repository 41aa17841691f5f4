"""The ``stalled`` span of a stall snapshot: where the training thread is, and the ring of recent collectives.

Built on the watchdog's thread (``stall.StallWatch`` → ``Recorder.stall_snapshot``) from what the
training thread keeps (``stall.Progress``): read, never changed.
"""

from __future__ import annotations

from typing import NamedTuple

from commdebug_otel import semconv
from commdebug_otel.core.progress import Progress
from commdebug_otel.core.records import Record, SpanKind


class StallPlace(NamedTuple):
    """Where a stalled rank is, worked out once per snapshot: its ``stalled`` span, its record for the cross-rank
    verdict and its stderr line all say this.

    Attributes:
        step: the ``stalled`` span's ``torch.step``: the open step, or between steps the next (the optimizer
            steps taken).
        between_steps: no step is open.
        module, pass_: the module the training thread is in and its pass ("" and "" outside any module).
        stack: the training thread's code locations, innermost last.
    """

    step: int
    between_steps: bool
    module: str
    pass_: str
    stack: list[str]


def stall_place(progress: Progress, where: tuple[str, str, list[str]], open_record: Record | None,
                steps_taken: int) -> StallPlace:
    """The :class:`StallPlace` of a rank now.

    ``where``: ``(module FQN, pass, code locations)`` of the training thread
    (``stall.training_thread_location``); with no module on its Python stack (a backward pass),
    ``open_record`` (the innermost open module record of a traced step) names it. ``steps_taken``:
    the ``torch.step`` between steps.
    """
    module, pass_, stack = where
    if not module and open_record is not None:
        module, pass_ = open_record.fqn, open_record.pass_
    in_step = progress.in_step
    return StallPlace(progress.step_index if in_step else steps_taken, not in_step, module, pass_, stack)


def stalled_record(progress: Progress, place: StallPlace, now: int, age_s: float, threshold_s: float,
                   snapshot: int, max_events: int) -> Record:
    """The ``stalled`` span's record, from the step's (or gap's) start to ``now`` (``time.time_ns()``); its events,
    the ring of recent collectives issued by ``now``, may reach back past its start (earlier steps').

    ``place``: where the rank is (:func:`stall_place`); ``max_events``: the ring events kept (the latest).
    """
    module, pass_, stack = place.module, place.pass_, place.stack
    # (A step that began after the watchdog read ``now``: the stall ended meanwhile; the span does not end
    # before it starts.)
    stalled = Record(SpanKind.MODULE, semconv.SPAN_STALLED, min(progress.since_ns, now))
    stalled.end_ns = now
    seqs = progress.seqs()
    stalled.attrs.update({
        semconv.STEP: place.step,
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
    if place.between_steps:
        stalled.attrs[semconv.STALL_BETWEEN_STEPS] = True
    stalled.events = progress.ring_events(now)[-max_events:]
    return stalled
