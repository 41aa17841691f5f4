"""A step's trace id: the same on every rank (of a trace block) for the same step, from the job's nonce.

``OTEL_PYTHON_COMMDEBUG_TRACE_SCOPE=job`` (the default): the job nonce is agreed through the
process group's store once it exists (``steps.job_nonce``); before that, this rank's own nonce
stands in (a step opened before ``init_process_group`` is given the job's id again at its end).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.config import Settings, TraceScope
from commdebug_otel.core.job_identity import RankInfo, job_nonce, job_trace_id, outside_step_label, settled
from commdebug_otel.core.records import SpanKind, Step


class StepTraceIds:
    """The trace ids of one recorder's steps.

    Args:
        settings: ``trace_scope`` and ``ranks_per_trace``.
        rank: ``rank() -> RankInfo`` (``job_identity.RankCache``).
    """

    def __init__(self, settings: Settings, rank: Callable[[], RankInfo]) -> None:
        self._settings = settings
        self._rank = rank
        self.nonce: str | None = None  # the job's, once agreed
        self._provisional_nonce: str | None = None  # this rank's own, until the process group exists

    def job_id(self, store: Any = None) -> str:
        """The job nonce every rank agrees on (``steps.job_nonce``, through ``store``: the default group's, or a
        thread's own clone of it); ask once settled."""
        if self.nonce is None:
            self.nonce = job_nonce(store)
        return self.nonce

    @property
    def job_scoped(self) -> bool:
        return self._settings.trace_scope is TraceScope.JOB

    def trace_id(self, step: Step, steps_taken: int) -> int | None:
        """``step``'s trace id (128-bit int), or None where trace ids are not the job's (random ones then).

        ``steps_taken``: optimizer steps ended, which name an ``outside_step`` segment. A job cut into
        trace blocks: the root gets ``commdebug.trace.block``.
        """
        if not self.job_scoped:
            return None
        nonce = self.nonce
        if nonce is None:
            if settled(self._rank()):
                nonce = self.nonce = job_nonce()  # agreed by every rank
            else:  # before init_process_group: no store to agree through (core/job_identity.py)
                nonce = self._provisional_nonce = self._provisional_nonce or job_nonce()
        if step.kind is SpanKind.OUTSIDE_STEP:
            # The count cannot change while an outside_step is open: a step's opening closes it first.
            label: int | str = outside_step_label(steps_taken)
        else:
            label = f"inference-{step.index}" if step.inference else step.index
        trace_id, block = job_trace_id(self._rank(), nonce, label, self._settings.ranks_per_trace)
        if block is not None:  # a job cut into trace blocks: the root names its block
            step.root.attrs[semconv.TRACE_BLOCK] = block
        return trace_id
