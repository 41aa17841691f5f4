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

A torchrun launcher process (which runs the instrumentor too) stays a no-op, and so do
data-loading worker processes (``DataLoader(num_workers=...)``, any start method:
``CommTracer`` stops at its first module call in one) and multiprocessing's fork server,
whose children decide when their ``Process`` starts running (its target known then).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

_instruments = ("torch >= 2.6",)
# Re-entrant: starting imports torch.optim, which can fire the environment start's
# post-import hook on this same thread (opentelemetry-instrument with ENABLED=true).
_lock = threading.RLock()
_starting = threading.local()

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


# Targets of data-loading worker processes: torch's DataLoader and torchdata's StatefulDataLoader.
def is_fork_server(argv: list[str] | None = None) -> bool:
    """True in multiprocessing's ``forkserver`` server process (it imports the script's main module, and
    torch with it, to fork the children it is asked for)."""
    argv = list(sys.orig_argv if argv is None else argv)
    return any("multiprocessing.forkserver import main" in arg for arg in argv)


def _in_fork_server_itself() -> bool:
    """Not one of its children: those keep the server's command line, and (the environment start waiting for
    their first module call or process group) may start tracing while their ``Process`` runs."""
    import multiprocessing

    return multiprocessing.parent_process() is None


class _StartWhenRunning:
    """Starts tracing in a fork server's child once its ``Process`` runs, unless it is a data worker.

    ``multiprocessing.util.register_after_fork`` callbacks run there, with the target known
    (``BaseProcess._after_fork``; a ``spawn`` child runs none). The registry holds its object
    weakly: the one instance is kept in :data:`_pending`, and each forked child inherits it.
    """

    def __init__(self, instrumentor: CommDebugInstrumentor, kwargs: dict) -> None:
        self._instrumentor = instrumentor
        self._kwargs = kwargs

    def run(self) -> None:
        try:
            from commdebug_otel.capture._torch import is_data_worker

            with _lock:
                if self._instrumentor.is_instrumented_by_opentelemetry and not is_data_worker():
                    self._instrumentor._start(self._kwargs)
        except Exception as error:  # start-up must never break the child
            import logging

            logging.getLogger(__name__).warning("commdebug-otel: could not start tracing: %s: %s",
                                                type(error).__name__, error)


_pending: _StartWhenRunning | None = None


def _configured(provider: Any) -> bool:
    name = type(provider).__name__
    return not name.startswith(("Proxy", "NoOp", "_Proxy"))


def instrument(tracer_provider: Any = None, meter_provider: Any = None, settings: Any = None,
               after_teardown: Any = None) -> Any:
    """``CommDebugInstrumentor().instrument(...)``: start the process-wide tracer.

    ``after_teardown``: called with no argument once ``destroy_process_group`` destroyed the default group
    (``CommTracer``'s; the environment start stops tracing there).

    Idempotent: when already on, the instrumentor warns and nothing changes. Unlike
    ``opentelemetry-instrument``, it does not check the installed torch against
    ``torch >= 2.6`` (a nightly such as ``2.6.0a0`` would fail that check).

    Returns:
        the process-wide :class:`~commdebug_otel.CommTracer`, or None in a torchrun
        launcher process.
    """
    instrumentor = CommDebugInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider,
                            settings=settings, after_teardown=after_teardown, skip_dep_check=True)
    return instrumentor.tracer


def uninstrument() -> None:
    """``CommDebugInstrumentor().uninstrument()``: spans end, hooks and the dispatch mode are removed.

    Idempotent: when already off, the instrumentor warns and nothing changes.
    """
    CommDebugInstrumentor().uninstrument()


def current() -> Any:
    """The process-wide tracer (``CommDebugInstrumentor().tracer``), or None."""
    return CommDebugInstrumentor().tracer


class CommDebugInstrumentor(BaseInstrumentor):
    """OpenTelemetry instrumentor for PyTorch module passes and collectives.

    A singleton (as every ``BaseInstrumentor``), and the one record of whether this
    process is instrumented: ``instrument()``/``uninstrument()``/``current()`` above,
    ``_autostart`` (``OTEL_PYTHON_COMMDEBUG_ENABLED``) and ``opentelemetry-instrument``
    all go through it, so any of them can stop what another started.

    ``instrument()`` keyword arguments: ``tracer_provider``, ``meter_provider``
    (default: the global providers if an SDK was configured, else our own SDK
    set-up), ``settings`` (default ``Settings.from_env()``) and ``after_teardown``
    (``CommTracer``'s: called once ``destroy_process_group`` destroyed the default group).
    """

    _tracer: Any = None

    @property
    def tracer(self) -> Any:
        """The tracer this instrumentor started, or None (not instrumented, or a launcher process)."""
        return self._tracer

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def instrument(self, **kwargs: Any) -> Any:
        with _lock:  # check-then-start, one thread at a time
            if getattr(_starting, "now", False):
                return None  # a start inside this thread's own start: that one goes on
            _starting.now = True
            try:
                return super().instrument(**kwargs)
            finally:
                _starting.now = False

    def uninstrument(self, **kwargs: Any) -> Any:
        with _lock:
            return super().uninstrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        global _pending
        if is_launcher_process():
            return  # torchrun itself: its workers trace themselves
        if is_fork_server() and _in_fork_server_itself():
            import multiprocessing.util

            _pending = _StartWhenRunning(self, kwargs)
            multiprocessing.util.register_after_fork(_pending, _StartWhenRunning.run)
            return
        from commdebug_otel.capture._torch import is_data_worker

        if is_data_worker():
            return  # a DataLoader worker that imported torch while running: it stays silent
        self._start(kwargs)  # a spawn child still loading its target: CommTracer checks at its first call

    def _start(self, kwargs: dict) -> None:
        from opentelemetry import metrics, trace

        from commdebug_otel.tracer import CommTracer

        tracer_provider = kwargs.get("tracer_provider")
        meter_provider = kwargs.get("meter_provider")
        if tracer_provider is None and _configured(trace.get_tracer_provider()):
            tracer_provider = trace.get_tracer_provider()
        if meter_provider is None and _configured(metrics.get_meter_provider()):
            meter_provider = metrics.get_meter_provider()
        tracer = CommTracer(kwargs.get("settings"), tracer_provider=tracer_provider,
                            meter_provider=meter_provider, after_teardown=kwargs.get("after_teardown"))
        tracer.start()
        self._tracer = tracer

    def _uninstrument(self, **kwargs: Any) -> None:
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.stop()


# The singleton is made here, under the import lock: BaseInstrumentor.__new__ checks and sets
# it unlocked, so two threads making the first one could each get their own.
CommDebugInstrumentor()
