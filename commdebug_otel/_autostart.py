"""Start tracing at interpreter start-up when ``OTEL_PYTHON_COMMDEBUG_ENABLED`` is true.

Imported by ``commdebug_otel.pth`` (installed into site-packages: environment
variables alone switch tracing on, no wrapper) and by the ``sitecustomize``
that ``commdebug-otel run`` puts on ``PYTHONPATH``. With the variable unset (or
empty), the ``.pth`` line costs one environment lookup and never imports this
module; when it is set, the options table parses it like every other setting.
"""

from __future__ import annotations


def maybe_start() -> None:
    """Instrument this process through ``CommDebugInstrumentor`` unless ``ENABLED`` is false,
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` lists ``commdebug``, or this is a torchrun launcher
    (the instrumentor's no-op). Never raises."""
    try:
        from . import config

        if not config.read_option("enabled") or config.instrumentation_disabled():
            return
        from .instrumentor import instrument

        instrument()
    except Exception as error:  # start-up must never break the user's program
        import logging

        logging.getLogger(__name__).warning("commdebug-otel: could not start tracing: %s", error)


maybe_start()
