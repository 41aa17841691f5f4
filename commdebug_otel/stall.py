"""Where a rank is, and where it is stuck: progress on every step, stall snapshots off the training thread.

:class:`Progress` is what the recorder keeps on every step, traced or not, at
about Flight Recorder's cost (one tuple per collective in a bounded ring):

* the recent collectives (op, process group, seq, dtype, shape, issuing module, issue time);
* per process group, the last seq issued and the last known completed: a
  collective is known complete when the training thread's wait on it returned
  (``Work.wait``, ``wait_tensor``), when its c10d ``Work`` future completed (the
  steps timed to completion), or when its step ended;
* when the current step began (or, between steps, when the last one ended),
  the time the training thread spent waiting in collectives, the recent step times.

Under ``auto``, time between steps with no collective in flight (data loading,
checkpoints, evaluation) is held to a much larger floor than a step
(:data:`AUTO_BETWEEN_STEPS_S`): a hang shows as a collective in flight on the
ranks that wait, and those report it at the step threshold.

:class:`StallWatch` is a daemon thread per rank that reads it. When the step (or
the gap between steps) has lasted ``OTEL_PYTHON_COMMDEBUG_STALL_AFTER`` seconds,
it has the recorder export a snapshot at once (:meth:`Recorder.stall_snapshot`):
the step's spans so far, open ones ended at the snapshot and marked
``commdebug.span.incomplete``, and a ``stalled`` span holding the ring, each
collective marked in flight or completed; then it flushes traces and metrics.
It repeats at twice the age each time while the stall lasts. Collectives complete
in issue order on a process group, so "in flight" is every collective of a group
after its last known completed one.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import semconv
from ._torch import MODULE_CALL_CODE, default_store_client
from .config import (  # the auto rule's numbers live in config: diagnose repeats the rule without torch
    AUTO_BETWEEN_STEPS_S,
    AUTO_FACTOR,
    AUTO_FIRST_S,
    AUTO_FLOOR_S,
    AUTO_MIN_STEPS,
    RECENT_STEPS,
    STALL_AUTO,
)
from .core_fact import CollectiveFact, ring_event_attributes
from .core_protocols import StallSource
from .verdict import StoreExchange, Verdict, progress_record

_logger = logging.getLogger(__name__)

RING_SIZE = 64  # recent collectives kept per rank, exported with each snapshot
SLOW_STEP_FACTOR = 2.0  # commdebug.step.slow: longer than this times the recent median...
SLOW_AFTER_STEPS = 8  # ...once this many steps have ended
MAX_SNAPSHOTS = 12  # per stall: at T, 2T, 4T, ... (12 reach 2048 T)
MAX_PENDING_WAITS = 4096  # issued collectives whose wait has not been seen (cleared at each step end)
STACK_FRAMES = 32  # code locations of the training thread kept in a snapshot
MAX_FAILURES = 3  # the watchdog stops after this many failed checks in a row

_CALL_IMPL = MODULE_CALL_CODE
_OUR_FILES = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BACKWARD_FRAMES = frozenset({"_engine_run_backward", "backward", "grad"})


class Progress:
    """One rank's progress: written by the training thread, read by the watchdog and the metric reader.

    Attributes:
        next_seq: per process group name, the seq the next collective gets (the recorder's counter).
        completed: per process group name, the last seq known complete (absent: none known).
        ring: the last :data:`RING_SIZE` collectives, as their :class:`~commdebug_otel.core_fact.CollectiveFact`.
        since_ns: ``time.time_ns()`` when the current step began, or the last one ended.
        in_step: whether a step is open.
        wait_ns: nanoseconds the training thread waited in collectives since the step began.
    """

    def __init__(self, dim_name: Callable[[str], str] = lambda group: "") -> None:
        """``dim_name(group name)``: the mesh dimensions the group serves (``GroupResolver.dim_name``)."""
        self._dim_name = dim_name
        self.next_seq: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.ring: collections.deque = collections.deque(maxlen=RING_SIZE)
        self.since_ns = time.time_ns()
        self.in_step = False
        self.step_index = 0
        self.wait_ns = 0
        self.durations: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self._pending: dict[int, tuple[str, int]] = {}  # id(functional output) -> (group, seq)

    def remember(self, fact: CollectiveFact, out: Any) -> None:
        """A collective was issued on the training thread (every step: kept cheap); ``out``: what the op returned."""
        self.ring.append(fact)
        if type(out) is torch.Tensor:  # a functional collective's output: wait_tensor takes this object
            pending = self._pending
            if len(pending) >= MAX_PENDING_WAITS:
                pending.clear()  # never waited on (compiled code waits on its own buffers): forget them
            pending[id(out)] = (fact.group.name, fact.seq)

    def waited(self, handle: Any, duration_ns: int) -> None:
        """The training thread waited ``duration_ns`` on ``handle``: a ``Work`` (whose collective is not
        known here: c10d ones are known complete from their future, on timed steps) or a functional
        collective's output (``wait_tensor``: that collective is complete)."""
        self.wait_ns += duration_ns
        found = self._pending.pop(id(handle), None)
        if found is not None:
            self.complete(*found)

    def complete(self, group: str, seq: int) -> None:
        """Collective ``seq`` of ``group`` is known complete (and so, in order, every earlier one)."""
        if seq > self.completed.get(group, -1):
            self.completed[group] = seq

    def step_began(self, now: int, index: int) -> None:
        self.since_ns, self.in_step, self.step_index, self.wait_ns = now, True, index, 0

    def step_ended(self, now: int, training: bool) -> tuple[float, bool]:
        """The step ended: its collectives are complete. Returns its duration in seconds, and whether
        it was slow for this rank (``commdebug.step.slow``, training steps)."""
        duration_s = (now - self.since_ns) / 1e9
        slow = False
        if training:
            slow = self.slow(duration_s)
            self.durations.append(duration_s)
        for group, following in self.next_seq.items():
            self.complete(group, following - 1)
        self._pending.clear()
        self.since_ns, self.in_step = now, False
        return duration_s, slow

    def slow(self, duration_s: float) -> bool:
        """Whether a step of ``duration_s`` is slow for this rank (``commdebug.step.slow``)."""
        recent = self.durations
        return len(recent) > SLOW_AFTER_STEPS and duration_s > SLOW_STEP_FACTOR * statistics.median(recent)

    def threshold_s(self, setting: float | str) -> float:
        """The stall threshold in seconds: ``setting``, or the auto rule (see the config option).

        Under auto, time between steps (or before the first) with no collective in flight counts
        against at least :data:`AUTO_BETWEEN_STEPS_S`: a planned pause is not a stall.
        """
        if setting != STALL_AUTO:
            return float(setting)
        recent = list(self.durations)
        if len(recent) < AUTO_MIN_STEPS:
            threshold = AUTO_FIRST_S
        else:
            threshold = max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(recent))
        if not self.in_step and not self.in_flight():
            return max(threshold, AUTO_BETWEEN_STEPS_S)
        return threshold

    def in_flight(self) -> bool:
        """Whether a collective this rank issued is not known complete (a peer may be what it waits for)."""
        completed = self.completed
        return any(following - 1 > completed.get(group, -1) for group, following in list(self.next_seq.items()))

    def age_s(self, now: int | None = None) -> float:
        return ((now or time.time_ns()) - self.since_ns) / 1e9

    def seqs(self) -> list[tuple[str, int, int, str]]:
        """``(group, last issued seq, last completed seq, mesh dimension name or "")`` per process group; -1: none."""
        return [(group, following - 1, self.completed.get(group, -1), self._dim_name(group))
                for group, following in list(self.next_seq.items())]

    def ring_events(self, now: int) -> list[tuple[str, dict[str, Any], int]]:
        """The ring as span events ``(name, attributes, time)``, each in flight or completed."""
        completed = dict(self.completed)
        return [(fact.op, ring_event_attributes(fact, fact.seq <= completed.get(fact.group.name, -1), now),
                 fact.time_ns) for fact in list(self.ring)]


def training_thread_location(thread_id: int, fqn_of: Callable[[torch.nn.Module], str | None]
                             ) -> tuple[str, str, list[str]]:
    """``(module FQN, pass, code locations)`` of what the training thread runs now.

    The module is the innermost ``nn.Module`` call on its Python stack (FQN from
    ``fqn_of``, else the class name): a forward, or a recompute inside backward.
    With no module call inside a backward pass the pass is ``backward`` and the
    FQN empty (autograd runs module backward in C++). Code locations are
    ``file:line in function``, innermost last: never a value.
    """
    frame = sys._current_frames().get(thread_id)
    stack: list[str] = []
    module, pass_ = "", ""
    while frame is not None:
        code = frame.f_code
        if len(stack) < STACK_FRAMES and not code.co_filename.startswith(_OUR_FILES):  # not our wait wrapper
            stack.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        if code is _CALL_IMPL and not module:
            instance = frame.f_locals.get("self")
            if isinstance(instance, torch.nn.Module):
                module = fqn_of(instance) or type(instance).__name__
                pass_ = semconv.PASS_FORWARD
        elif code.co_name in _BACKWARD_FRAMES and "autograd" in code.co_filename:
            if pass_ == semconv.PASS_FORWARD:
                pass_ = semconv.PASS_RECOMPUTE
            elif not pass_:
                pass_ = semconv.PASS_BACKWARD
        frame = frame.f_back
    stack.reverse()
    return module, pass_, stack


class StallWatch:
    """A daemon thread that has the recorder export a snapshot when this rank stops making progress.

    Args:
        recorder: the rank's ``Recorder`` (``progress``, ``thread_id``, ``stall_snapshot``, ``hook_failed``).
        setting: ``Settings.stall_after_s``: seconds, or ``"auto"``.
        flush: ``flush()``, exporting what the providers buffer (called on this thread, bounded).
        fqn_of: ``fqn_of(module)``, the module tracker's name of a module, or None.
        on_snapshot: called on this thread after each snapshot, before the flush (torch's Flight Recorder dump).
        exchange: the cross-rank verdict's store exchange (verdict.py); by default one through the
            job's c10d store, exporting with ``recorder.stall_verdict``. Its store calls run on this
            thread only.
    """

    def __init__(self, recorder: StallSource, setting: float | str, flush: Callable[[], Any],
                 fqn_of: Callable[[torch.nn.Module], str | None],
                 on_snapshot: Callable[[], Any] = lambda: None, exchange: StoreExchange | None = None) -> None:
        self._recorder = recorder
        self._on_snapshot = on_snapshot
        self._setting = setting
        self._flush = flush
        self._fqn_of = fqn_of
        self.exchange = exchange if exchange is not None else StoreExchange(
            lambda: recorder.rank(), lambda store: recorder.job_id(store), self._export_verdict, default_store_client)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stall_since = 0  # since_ns of the stall being reported
        self._due_s = 0.0
        self._snapshots = 0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="commdebug-otel-stall-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop watching: the thread wakes at once and ends; waited for at most ``timeout_s``
        (a snapshot being exported then finishes on its own)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _poll_s(self) -> float:
        return min(1.0, max(0.05, self._recorder.progress.threshold_s(self._setting) / 4))

    def _run(self) -> None:
        failures = 0
        exchange = self.exchange
        while not self._stop.wait(self._poll_s()):
            try:
                self.check()
                failures = 0
            except Exception as error:  # said once; a snapshot racing the step's end may fail now and then
                self._recorder.hook_failed("stall watchdog", error)
                failures += 1
                if failures >= MAX_FAILURES:
                    break  # gives up: training goes on unwatched
            exchange.heartbeat()  # (the exchange's calls never raise: a failure turns it off)
            exchange.poll()
        exchange.stop()  # on this thread too: its keys go with the tracer

    def _export_verdict(self, verdict: Verdict, start_ns: int) -> None:
        """The exchange formed a verdict on this rank: its span, then the flush."""
        if self._recorder.stall_verdict(verdict.step, start_ns, time.time_ns(), verdict.attributes()):
            self._flush()

    def _publish(self, now: int, age_s: float, snapshot: int, where: tuple[str, str, list[str]]) -> None:
        """This rank's record for the cross-rank verdict (verdict.py), before its own snapshot is exported."""
        if not self.exchange.ready():
            return
        progress = self._recorder.progress
        in_step = progress.in_step
        step = progress.step_index if in_step else self._recorder.steps_taken
        record = progress_record(self._recorder.rank().rank, step, now, age_s, snapshot, in_step, where,
                                 progress.seqs(), progress.ring)
        self.exchange.publish(record, progress.since_ns)

    def check(self, now: int | None = None) -> bool:
        """Export a snapshot if one is due now. True if one was exported."""
        progress = self._recorder.progress
        now = now or time.time_ns()
        since = progress.since_ns
        threshold_s = progress.threshold_s(self._setting)
        age_s = (now - since) / 1e9
        if age_s < threshold_s:
            self.exchange.ended()  # a stall being reported is over: its record goes (nothing if none)
            return False
        if since != self._stall_since:
            self._stall_since, self._snapshots, self._due_s = since, 0, threshold_s
        if age_s < self._due_s or self._snapshots >= MAX_SNAPSHOTS:
            return False
        where = training_thread_location(self._recorder.thread_id, self._fqn_of)
        self._publish(now, age_s, self._snapshots + 1, where)
        if not self._recorder.stall_snapshot(now, age_s, threshold_s, self._snapshots + 1, where):
            return False
        self._snapshots += 1  # only once exported: a failed snapshot is tried again at the next poll
        self._due_s = max(age_s, threshold_s) * 2
        if self._snapshots == 1:
            # Every rank of a hung job says this (the ones waiting too): diagnose tells which one is behind.
            _logger.warning("commdebug-otel: rank %d made no progress for %.1f s (%s %s, %s); a stall snapshot "
                            "(span `stalled`) was exported with the metrics, again at twice the age while it "
                            "lasts; `commdebug-otel diagnose` on the traces names the rank the others wait for",
                            self._recorder.rank().rank, age_s, "step" if progress.in_step else "after step",
                            progress.step_index, f"in {where[0]} {where[1]}" if where[0] else "outside any module")
        self._on_snapshot()
        self._flush()
        return True
