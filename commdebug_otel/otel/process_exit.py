"""How our own providers end: at exit, on a flushing signal, at ``CommTracer.stop``; the bounded budget.

``telemetry.Telemetry`` sets the providers up; once one of our own exists it registers this exit path
(:meth:`ProcessExit.register`): an atexit handler, and our flush on SIGTERM/SIGHUP/SIGQUIT
(``signals.SignalFlush``). Every flush and shutdown of our providers runs through one budget,
``OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT`` for a flush and the exit's shutdown together
(:meth:`ProcessExit.bounded`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from commdebug_otel.core.redact import describe, hide_credentials
from commdebug_otel.core.thread_signals import start_quiet
from commdebug_otel.otel.export_guard import claim_warning
from commdebug_otel.otel.signals import SignalFlush

_logger = logging.getLogger(__name__)


class ExitHost(Protocol):
    """What the exit path asks of its telemetry (``telemetry.Telemetry``)."""

    @property
    def endpoints(self) -> list[str]:
        """OTLP endpoints in use, for the one warning."""
        ...

    def settle_now(self) -> None: ...

    def force_flush(self) -> None: ...

    def shutdown(self) -> None: ...

    def count_unsent_spans(self) -> int:
        """Count the spans still queued in our processors as dropped; return how many."""
        ...


class ProcessExit:
    """The exit path of one telemetry's own providers, and their flush-and-shutdown budget.

    Args:
        telemetry: whose providers (:class:`ExitHost`).
        budget_s: ``shutdown_timeout_s``, in seconds: a flush and the shutdown at exit that follows it, together.

    Attributes:
        before_shutdown: called at exit before the providers shut down (tracers end their open spans there).
        signals: our flush on SIGTERM/SIGHUP/SIGQUIT (``signals.SignalFlush``), armed once :meth:`register` ran.
    """

    def __init__(self, telemetry: ExitHost, budget_s: float) -> None:
        self._telemetry = telemetry
        self._budget_s = budget_s
        self._registered = False
        self.before_shutdown: list[Any] = []
        # SIGTERM/SIGHUP/SIGQUIT: flush, then the signal's own action (armed once our providers exist).
        self.signals = SignalFlush(self.exit, lambda: telemetry.force_flush(), lambda: self._registered)
        self.reset()

    def reset(self) -> None:
        """The budget afresh (a forked child): seconds spent, when the last wait ended, whether one ran out."""
        self._spent_s = 0.0
        self._last_wait_end = float("-inf")
        self._stalled = False

    def register(self) -> None:
        """Our own provider exists: flush it at exit and on a flushing signal (once per process)."""
        if not self._registered:
            self._registered = True
            atexit.register(self.exit)
            self.signals.hold()

    def exit(self) -> None:
        """The atexit path: tracers end their open spans, then one bounded shutdown. Never raises."""
        telemetry = self._telemetry
        try:
            telemetry.settle_now()  # first: the tracers' last spans and points then go straight to the providers
        except Exception as error:
            _logger.debug("commdebug-otel: starting telemetry at exit failed: %s", describe(error))
        for finish in list(self.before_shutdown):
            try:
                finish()
            except Exception as error:
                _logger.debug("commdebug-otel: closing spans at exit failed: %s", describe(error))
        telemetry.shutdown()
        # Nothing left to flush: a hang in the teardown that follows (the interpreter's, the process group's,
        # where our threads cannot run) ends at SIGTERM as without us.
        self.signals.release()

    def bounded(self, what: str, span_call: Callable[[], Any] | None,
                metric_call: Callable[[], Any] | None) -> None:
        """Run the calls off this thread; wait at most what is left of the budget, nothing once one stalled.

        The calls run in daemon threads joined with what is left, so an unreachable or black-holed
        collector costs at most the budget and never blocks exit; once a call has run out of time,
        later ones are not waited for at all, and one warning says so. Metrics go after spans
        (spans dropped at exit are counted in them), but a quarter of the budget (at most 1 s) is
        theirs whatever the spans do: a dead trace endpoint does not cost the metrics, and the spans
        still unsent then are counted as dropped (a collector that answers later gets them, counted
        all the same).
        """
        if span_call is None and metric_call is None:
            return
        budget_s = self._budget_s
        now = time.monotonic()
        if now - self._last_wait_end > budget_s:
            self._spent_s = 0.0  # a flush long ago (an earlier `with` block) is not part of this exit
        left_s = 0.0 if self._stalled else max(0.0, budget_s - self._spent_s)
        spans = _start_bounded(what, span_call)
        if spans is not None:
            spans.join(left_s - min(1.0, left_s / 4) if metric_call is not None else left_s)
        unsent = 0
        if spans is not None and spans.is_alive() and not self._stalled:
            unsent = self._telemetry.count_unsent_spans()  # counted once: later waits are not waited for
        points = _start_bounded(what, metric_call)
        if points is not None:
            points.join(max(0.0, left_s - (time.monotonic() - now)))
        if spans is not None:
            spans.join(max(0.0, left_s - (time.monotonic() - now)))
        finished = not any(worker is not None and worker.is_alive() for worker in (spans, points))
        self._last_wait_end = time.monotonic()
        self._spent_s += self._last_wait_end - now
        if finished or self._stalled:
            return
        self._stalled = True
        endpoints = self._telemetry.endpoints
        unnamed = [endpoint for endpoint in dict.fromkeys(endpoints) if claim_warning(endpoint)]
        where = f" to {', '.join(hide_credentials(endpoint) for endpoint in unnamed)}" if unnamed else ""
        counted = f" ({unsent} spans counted as dropped)" if unsent else ""
        # One warning per process: where the endpoint's own warning came first, this one is detail.
        log = _logger.warning if unnamed or not endpoints else _logger.info
        log("commdebug-otel: telemetry %s did not finish within %.1f s "
            "(OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT, for flush and shutdown together); "
            "unsent telemetry%s is dropped%s", what, budget_s, where, counted)


def _start_bounded(what: str, call: Callable[[], Any] | None) -> threading.Thread | None:
    """Run ``call`` in a daemon thread (None when there is no call); the caller joins it."""
    if call is None:
        return None

    def run() -> None:
        try:
            call()
        except Exception as error:  # exporter failures are counted by the guards
            _logger.debug("commdebug-otel: telemetry %s failed: %s", what, describe(error))

    worker = threading.Thread(target=run, name=f"commdebug-otel-{what}", daemon=True)
    start_quiet(worker)
    return worker
