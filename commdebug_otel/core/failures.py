"""Failure accounting of the recorder: a hook that failed is logged once per place and counted; drops are counted.

Nothing here raises: a broken metrics pipeline leaves the log line.
"""

from __future__ import annotations

import logging

from commdebug_otel import semconv
from commdebug_otel.core.fact import MetricsSink
from commdebug_otel.core.redact import code_locations, describe

_logger = logging.getLogger(__name__)


class Failures:
    """Hook failures and drops of one recorder.

    Args:
        metrics: where drops are counted (``fact.MetricsSink``: its ``dropped(kind, count)``), or None.
    """

    def __init__(self, metrics: MetricsSink | None) -> None:
        self._metrics = metrics
        self._said: set[str] = set()  # places (and bounds) already logged

    def hook_failed(self, where: str, error: BaseException) -> None:
        """Log a hook failure once per place, count it, and go on. Never raises."""
        try:
            if self._metrics is not None:
                self._metrics.dropped(semconv.DROPPED_KIND_HOOK_ERROR, 1)
        except Exception:  # the metrics themselves are broken: logging is all that is left
            pass
        if self.first(where):
            # Type, redacted message and code locations: never a tensor value (core/redact.py).
            _logger.warning("commdebug-otel: %s failed (%s); telemetry continues, training is "
                            "unaffected\n%s", where, describe(error), code_locations(error))

    def count_dropped(self, kind: str, count: int = 1) -> None:
        """Count ``count`` items of telemetry dropped, by ``kind`` (``commdebug.telemetry.dropped``)."""
        if self._metrics is not None:
            try:
                self._metrics.dropped(kind, count)
            except Exception as error:
                self.hook_failed("metrics", error)

    def first(self, key: str) -> bool:
        """True the first time ``key`` (a place, or a bound's variable) is asked: say it once."""
        if key in self._said:
            return False
        self._said.add(key)
        return True
