"""Auto-instrumentation: ``opentelemetry-instrument``, ``instrument()`` / ``uninstrument()``.

``CommDebugInstrumentor`` is registered under the ``opentelemetry_instrumentor``
entry point ``commdebug``, so ``opentelemetry-instrument torchrun ... train.py``
traces every worker of an unmodified script, and
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=commdebug`` turns it off.

Usage::

    from commdebug_otel.instrumentor import CommDebugInstrumentor

    CommDebugInstrumentor().instrument()     # settings from OTEL_PYTHON_COMMDEBUG_*
    ...                                      # train
    CommDebugInstrumentor().uninstrument()   # every hook and the dispatch mode removed

Providers: ``tracer_provider=`` / ``meter_provider=`` keyword arguments win;
else the global providers if an SDK was configured (e.g. by a distro); else
our own SDK set-up from the standard ``OTEL_*`` variables (``opentelemetry-instrument``
without a distro configures no SDK).

A torchrun launcher process (which runs the instrumentor too) stays a no-op.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

_logger = logging.getLogger(__name__)

_instruments = ("torch >= 2.6",)
_lock = threading.Lock()
_tracer: Any = None

_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch",
                     "torch.distributed.elastic.agent")


def is_launcher_process(argv: list[str] | None = None) -> bool:
    """True for torchrun / ``python -m torch.distributed.run`` itself (not its workers)."""
    argv = list(sys.orig_argv if argv is None else argv)
    if argv and os.path.basename(argv[0]).startswith("torchrun"):
        return True
    for index, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[index + 1] in _LAUNCHER_MODULES:
            return True
    return any(os.path.basename(arg).startswith("torchrun") for arg in argv[1:2])


def _configured(provider: Any) -> bool:
    name = type(provider).__name__
    return not name.startswith(("Proxy", "NoOp", "_Proxy"))


def instrument(tracer_provider: Any = None, meter_provider: Any = None, settings: Any = None) -> Any:
    """Start the process-wide :class:`~commdebug_otel.CommTracer` (idempotent; warns when already on).

    Returns the tracer, or None in a torchrun launcher process.
    """
    global _tracer
    if is_launcher_process():
        return None
    with _lock:
        if _tracer is not None:
            _logger.warning("commdebug-otel: already instrumented; ignoring instrument()")
            return _tracer
        from opentelemetry import metrics, trace

        from .instrumentation import CommTracer

        if tracer_provider is None and _configured(trace.get_tracer_provider()):
            tracer_provider = trace.get_tracer_provider()
        if meter_provider is None and _configured(metrics.get_meter_provider()):
            meter_provider = metrics.get_meter_provider()
        _tracer = CommTracer(settings, tracer_provider=tracer_provider, meter_provider=meter_provider)
        _tracer.start()
        return _tracer


def uninstrument() -> None:
    """Stop the process-wide tracer: spans end, hooks and the dispatch mode are removed (idempotent)."""
    global _tracer
    with _lock:
        tracer, _tracer = _tracer, None
    if tracer is not None:
        tracer.stop()


def current() -> Any:
    """The process-wide tracer, or None."""
    return _tracer


class CommDebugInstrumentor(BaseInstrumentor):
    """OpenTelemetry instrumentor for PyTorch module passes and collectives."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        instrument(tracer_provider=kwargs.get("tracer_provider"),
                   meter_provider=kwargs.get("meter_provider"),
                   settings=kwargs.get("settings"))

    def _uninstrument(self, **kwargs: Any) -> None:
        uninstrument()
