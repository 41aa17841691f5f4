"""Put on PYTHONPATH by ``commdebug-otel run``: start tracing, then chain to any other sitecustomize.

Every Python process of the job runs it, also an interpreter that lacks the package (another
virtual environment, the system's Python): there it starts nothing and only chains.
"""

import importlib.util
import os
import sys

try:
    import commdebug_otel._autostart  # noqa: F401  (starts tracing when enabled)
except ImportError:  # not installed for this interpreter: it runs as without us
    pass

_here = os.path.dirname(os.path.abspath(__file__))
for _path in sys.path:
    if _path and os.path.abspath(_path) != _here:
        _candidate = os.path.join(_path, "sitecustomize.py")
        if os.path.isfile(_candidate):
            _spec = importlib.util.spec_from_file_location("_chained_sitecustomize", _candidate)
            if _spec is not None and _spec.loader is not None:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            break
