"""commdebug-otel: PyTorch collectives and module passes as live OpenTelemetry.

Module forward, backward and activation-checkpoint recompute become nested
spans; every collective (and, by detail level, every DTensor op) becomes a
span event with shape, dtype, bytes, placements, device mesh and process
group; collective counts, bytes and durations become metrics. Everything
goes out through the OpenTelemetry SDK: OTLP to a Collector, Jaeger or
Tempo, or OTLP-JSON files when no endpoint is configured.

Usage::

    import commdebug_otel

    with commdebug_otel.CommTracer():        # settings from OTEL_* variables
        for step in range(steps):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()                 # ends the step's train_step trace

    # or as torch's CommDebugMode, plus the same telemetry
    with commdebug_otel.CommDebugMode() as comm_mode:
        model(batch).sum().backward()
    print(comm_mode.get_comm_counts())

What it does not do: it never exports tensor values (only names, shapes,
dtypes, sizes and placements), it does not see inside ``torch.compile``d
regions, and it sees collectives issued through the PyTorch dispatcher on the
thread that started it (see docs/troubleshooting.md).

Importing this package imports neither torch nor the OTel SDK: names load on
first use.
"""

from __future__ import annotations

from commdebug_otel.version import __version__

# Not typing.TYPE_CHECKING: importing typing (with re and enum) would be most of this
# package's import cost while tracing is disabled (docs/performance.md).
TYPE_CHECKING = False

__all__ = ["CommDebugMode", "CommTracer", "Detail", "Settings", "TraceScope", "__version__"]

_LAZY = {
    "CommDebugMode": "compat.debug_mode",
    "CommTracer": "tracer",
    "Detail": "config",
    "Settings": "config",
    "TraceScope": "config",
}

if TYPE_CHECKING:
    from typing import Any

    from commdebug_otel.compat.debug_mode import CommDebugMode
    from commdebug_otel.config import Detail, Settings, TraceScope
    from commdebug_otel.tracer import CommTracer


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'commdebug_otel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value
