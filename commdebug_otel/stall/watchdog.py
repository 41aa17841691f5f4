"""Where a rank is, and where it is stuck: progress on every step, stall snapshots off the training thread.

:class:`~commdebug_otel.core.progress.Progress` (``core/progress.py``) is what the recorder keeps on every
step; the watchdog reads it.

:class:`StallWatch` is a daemon thread per rank that reads it. When the step (or
the gap between steps) has lasted ``OTEL_PYTHON_COMMDEBUG_STALL_AFTER`` seconds,
it has the recorder export a snapshot at once (:meth:`Recorder.stall_snapshot`):
the step's spans so far, open ones ended at the snapshot and marked
``commdebug.span.incomplete``, and a ``stalled`` span holding the ring, each
collective marked in flight or completed; then it flushes traces and metrics.
It repeats at 2T, 4T, 8T... (T the threshold) while the stall lasts. Collectives complete
in issue order on a process group, so "in flight" is every collective of a group
after its last known completed one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture import intercept
from commdebug_otel.capture._torch import MODULE_CALL_CODE, default_store_client
from commdebug_otel.config import SETUP_FLOOR_S
from commdebug_otel.core.fact import stall_step_text
from commdebug_otel.core.protocols import StallSource
from commdebug_otel.core.stall_snapshot import StallPlace
from commdebug_otel.core.thread_signals import start_quiet
from commdebug_otel.stall.straggler import POLL_S, StragglerExchange, StragglerVerdict
from commdebug_otel.stall.verdict import StoreExchange, Verdict, progress_record

_logger = logging.getLogger(__name__)

MAX_SNAPSHOTS = 12  # per stall: at T, 2T, 4T, ... (12 reach 2048 T)
STACK_FRAMES = 32  # code locations of the training thread kept in a snapshot
MAX_FAILURES = 3  # the watchdog stops after this many failed checks in a row

_CALL_IMPL = MODULE_CALL_CODE
_OUR_FILES = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BACKWARD_FRAMES = frozenset({"_engine_run_backward", "backward", "grad"})


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


# Where a thread blocks on a peer: our collective kernels and wait wrappers, and c10d's own calls (the store-based
# barrier of init_process_group, object collectives).
_COMMUNICATING_FILES = (os.path.abspath(intercept.__file__),
                        os.path.join("torch", "distributed", "distributed_c10d.py"))


def communicating(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is inside a collective, a wait on one, or a c10d call now
    (its Python stack; False when the thread is gone)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COMMUNICATING_FILES):
            return True
        frame = frame.f_back
    return False


def next_due_s(age_s: float, threshold_s: float) -> float:
    """The stall age (seconds) of the next snapshot after one taken at ``age_s``: the first of
    ``2T, 4T, 8T, ...`` (``T`` = ``threshold_s`` > 0) past ``age_s``.

    On this fixed grid a late poll (a loaded machine) does not push every later snapshot back, and
    the ranks of one stall take their n-th snapshot together, so the verdict's rounds read records
    sampled at the same time (twice the age drifted apart: 2.4, 4.8, 9.6, 19.2 s at T = 2 s).
    """
    due = threshold_s * 2
    while due <= age_s:
        due *= 2
    return due


class StallWatch:
    """A daemon thread that has the recorder export a snapshot when this rank stops making progress.

    Args:
        recorder: the rank's ``Recorder`` (``progress``, ``thread_id``, ``stall_snapshot``, ``hook_failed``).
        setting: ``Settings.stall_after_s``: seconds, or ``"auto"``; None: no stall snapshots (the thread
            runs for the straggler verdict alone).
        flush: ``flush()``, exporting what the providers buffer (called on this thread, bounded).
        fqn_of: ``fqn_of(module)``, the module tracker's name of a module, or None.
        on_snapshot: called on this thread after each snapshot, before the flush (torch's Flight Recorder dump).
        exchange: the cross-rank verdict's store exchange (stall/verdict.py); by default one through the
            job's c10d store, exporting with ``recorder.stall_verdict``. Its store calls run on this
            thread only.
        straggler: whether this thread also runs the live straggler verdict's exchange (stall/straggler.py,
            :attr:`stragglers`), waking every ``straggler.POLL_S`` seconds at least.
    """

    def __init__(self, recorder: StallSource, setting: float | str | None, flush: Callable[[], Any],
                 fqn_of: Callable[[torch.nn.Module], str | None],
                 on_snapshot: Callable[[], Any] = lambda: None, exchange: StoreExchange | None = None,
                 straggler: bool = False) -> None:
        self._recorder = recorder
        self._on_snapshot = on_snapshot
        self._setting = setting
        self._flush = flush
        self._fqn_of = fqn_of
        self.exchange = exchange if exchange is not None else StoreExchange(
            lambda: recorder.rank(), lambda store: recorder.job_id(store), self._export_verdict, default_store_client)
        self.stragglers: StragglerExchange | None = StragglerExchange(
            lambda: recorder.rank(), lambda: list(recorder.progress.busy), self.exchange.store,
            self._export_straggler, places=lambda: list(recorder.progress.places),
            trace=self._trace_steps) if straggler else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stall_since = 0  # since_ns of the stall being reported
        self._due_s = 0.0
        self._snapshots = 0
        # What the debug page shows (debug_page.py): the last snapshot's place and the last verdict this rank formed.
        self.last_stall = ""
        self.last_verdict = ""

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="commdebug-otel-stall-watch", daemon=True)
        start_quiet(self._thread)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop watching: the thread wakes at once and ends; waited for at most ``timeout_s``
        (a snapshot being exported then finishes on its own)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _poll_s(self) -> float:
        """Seconds between the stall watchdog's looks (None setting: an hour, no look does anything)."""
        if self._setting is None:
            return 3600.0
        return min(1.0, max(0.05, self._recorder.progress.threshold_s(self._setting) / 4))

    def _run(self) -> None:
        failures = 0
        exchange = self.exchange
        look_at = time.monotonic() + self._poll_s()
        # The straggler exchange wakes the thread every POLL_S; the stall looks keep their own cadence.
        while not self._stop.wait(min(max(0.0, look_at - time.monotonic()),
                                      POLL_S if self.stragglers is not None else 3600.0)):
            if self.stragglers is not None:
                self.stragglers.poll()  # (never raises)
            if time.monotonic() < look_at:
                continue
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
            look_at = time.monotonic() + self._poll_s()
        exchange.stop()  # on this thread too: its keys go with the tracer

    def _export_verdict(self, verdict: Verdict, start_ns: int) -> None:
        """The exchange formed a verdict on this rank: its span, then the flush."""
        self.last_verdict = verdict.summary
        if self._recorder.stall_verdict(verdict.step, start_ns, time.time_ns(), verdict.attributes()):
            self._flush()

    def _trace_steps(self, steps: tuple[int, int]) -> None:
        """The straggler verdict asks for steps ``first`` to ``last`` traced: the training thread reads this
        tuple as each step opens (``StepLifecycle.open_step``)."""
        self._recorder.progress.trace_steps = steps

    def _export_straggler(self, verdict: StragglerVerdict) -> None:
        """This rank judged a change of the straggler answer: its span, then the flush."""
        self.last_verdict = verdict.summary
        now = time.time_ns()
        if self._recorder.stall_verdict(verdict.step, now, now, verdict.attributes(),
                                        semconv.SPAN_STRAGGLER_VERDICT):
            self._flush()

    def _publish(self, now: int, age_s: float, snapshot: int, place: StallPlace) -> None:
        """This rank's record for the cross-rank verdict (stall/verdict.py), before its own snapshot is exported."""
        if not self.exchange.ready():
            return
        progress = self._recorder.progress
        record = progress_record(self._recorder.rank().rank, place.step, now, age_s, snapshot, not place.between_steps,
                                 (place.module, place.pass_, place.stack), progress.seqs(), progress.ring)
        self.exchange.publish(record, progress.since_ns)

    def check(self, now: int | None = None) -> bool:
        """Export a snapshot if one is due now. True if one was exported."""
        if self._setting is None:
            return False
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
        if (self._recorder.steps_taken == 0 and age_s < max(threshold_s, SETUP_FLOOR_S)
                and not communicating(self._recorder.thread_id)):
            return False  # setting up (imports, compilation), not waiting for a peer
        if age_s < self._due_s or self._snapshots >= MAX_SNAPSHOTS:
            return False
        # Worked out once: the span, the verdict's record and the line below say the same step and module.
        place = self._recorder.stall_place(training_thread_location(self._recorder.thread_id, self._fqn_of))
        self._publish(now, age_s, self._snapshots + 1, place)
        if not self._recorder.stall_snapshot(now, age_s, threshold_s, self._snapshots + 1, place):
            return False
        self._snapshots += 1  # only once exported: a failed snapshot is tried again at the next poll
        self._due_s = next_due_s(age_s, threshold_s)
        # The place as diagnose words it (core/fact.py): "in step 2 at M forward", "before step 0, ...".
        at = f" at {place.module} {place.pass_}".rstrip() if place.module else ", outside any module"
        text = stall_step_text(place.between_steps, place.step)
        self.last_stall = f"no progress for {age_s:.1f} s ({text}{at})"
        if self._snapshots == 1:
            # Every rank of a hung job says this (the ones waiting too): diagnose tells which one is behind.
            _logger.warning("commdebug-otel: rank %d made no progress for %.1f s (%s%s); a stall snapshot "
                            "(span `stalled`) was exported with the metrics, again at 2, 4, 8... times the "
                            "threshold while it lasts; `commdebug-otel diagnose` on the traces names the rank the "
                            "others wait for", self._recorder.rank().rank, age_s, text, at)
        self._on_snapshot()
        self._flush()
        return True
