"""Put on PYTHONPATH by ``commdebug-otel run``: start tracing, then chain to any other sitecustomize.

Every Python process of the job runs it, also an interpreter that lacks the package (another
virtual environment, the system's Python): there it starts nothing and only chains. The other
sitecustomize is found as the interpreter would have found it (a module, a package, one in a zip
on the path) and becomes the ``sitecustomize`` module, so ``import sitecustomize`` gives the
script its own.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import commdebug_otel._autostart  # noqa: F401  (starts tracing when enabled)
except ImportError:  # not installed for this interpreter: it runs as without us
    pass


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [entry for entry in sys.path if not entry or os.path.abspath(entry) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["sitecustomize"]  # as a failed import leaves it: site.py says the error
        raise


_chain()
