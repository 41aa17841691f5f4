"""The ``stalled`` span of a stall snapshot: where the training thread is, and the ring of recent collectives.

Built on the watchdog's thread (``stall.StallWatch`` → ``Recorder.stall_snapshot``) from what the
training thread keeps (``stall.Progress``): read, never changed.
"""

from __future__ import annotations

from commdebug_otel import semconv
from commdebug_otel.core.progress import Progress
from commdebug_otel.core.records import Record, SpanKind


def stalled_record(progress: Progress, where: tuple[str, str, list[str]], open_record: Record | None, now: int,
                   age_s: float, threshold_s: float, snapshot: int, steps_taken: int, max_events: int) -> Record:
    """The ``stalled`` span's record, from the step's (or gap's) start to ``now`` (``time.time_ns()``); its events,
    the ring of recent collectives issued by ``now``, may reach back past its start (earlier steps').

    ``where``: ``(module FQN, pass, code locations)`` of the training thread
    (``stall.training_thread_location``); with no module on its Python stack (a backward pass),
    ``open_record`` (the innermost open module record of a traced step) names it. ``steps_taken``:
    the ``torch.step`` between steps; ``max_events``: the ring events kept (the latest).
    """
    module, pass_, stack = where
    if not module and open_record is not None:
        module, pass_ = open_record.fqn, open_record.pass_
    # (A step that began after the watchdog read ``now``: the stall ended meanwhile; the span does not end
    # before it starts.)
    stalled = Record(SpanKind.MODULE, semconv.SPAN_STALLED, min(progress.since_ns, now))
    stalled.end_ns = now
    seqs = progress.seqs()
    stalled.attrs.update({
        semconv.STEP: progress.step_index if progress.in_step else steps_taken,
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
    stalled.events = progress.ring_events(now)[-max_events:]
    return stalled
