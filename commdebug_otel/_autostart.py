"""Start tracing at interpreter start-up when ``OTEL_PYTHON_COMMDEBUG_ENABLED=true``.

Imported by ``commdebug_otel.pth`` (installed into site-packages: environment
variables alone switch tracing on, no wrapper) and by the ``sitecustomize``
that ``commdebug-otel run`` puts on ``PYTHONPATH``. With the variable unset,
the ``.pth`` line costs one environment lookup and never imports this module.
"""

from __future__ import annotations

import os

_started = False


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("", "false", "0", "no", "off")


def enabled() -> bool:
    """``OTEL_PYTHON_COMMDEBUG_ENABLED`` is true/1/yes/on; an unknown value warns once and means off."""
    value = os.environ.get("OTEL_PYTHON_COMMDEBUG_ENABLED", "").strip().lower()
    if value not in _TRUE and value not in _FALSE:
        import logging

        logging.getLogger(__name__).warning(
            "commdebug-otel: ignoring OTEL_PYTHON_COMMDEBUG_ENABLED=%r: expected true or false; "
            "tracing stays off", value)
    return value in _TRUE


def maybe_start() -> None:
    """Instrument this process once, unless disabled or a torchrun launcher. Never raises."""
    global _started
    if _started or not enabled():
        return
    _started = True
    disabled = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    if "commdebug" in [name.strip() for name in disabled.split(",")]:
        return
    try:
        from .instrumentor import instrument, is_launcher_process

        if not is_launcher_process():
            instrument()
    except Exception as error:  # start-up must never break the user's program
        import logging

        logging.getLogger(__name__).warning("commdebug-otel: could not start tracing: %s", error)


maybe_start()
