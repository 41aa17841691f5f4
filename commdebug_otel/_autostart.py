"""Start tracing in processes that import torch, when ``OTEL_PYTHON_COMMDEBUG_ENABLED`` is set.

Imported by ``commdebug_otel.pth`` (installed into site-packages: environment
variables alone switch tracing on, no wrapper) and by the ``sitecustomize``
that ``commdebug-otel run`` puts on ``PYTHONPATH``. With no ``OTEL_PYTHON_COMMDEBUG_*``
variable set (or all empty), the ``.pth`` line costs one pass over the environment's
names and never imports this module. Any such variable brings it in, so that a
mistyped name (``..._ENABLE``) is reported once torch is imported, though tracing stays off.

When it is set, every Python process started with that environment imports
this module: pip, a launcher's helper processes, a shell's ``python -c``. So
importing it does almost nothing: if torch is already imported, tracing starts
now; otherwise a post-import hook (a ``sys.meta_path`` finder that wraps torch's
loader) starts it right after ``import torch`` finishes, once, and removes itself.
A process that never imports torch never imports torch, the settings or the SDK.
At that point the options table reads ``ENABLED`` like every other setting, and
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` and the torchrun launcher's no-op apply.
Tracing starts on the thread that imports torch (the main thread, in a training script).
"""

from __future__ import annotations

import sys

TARGET = "torch"  # the module whose import starts tracing


def maybe_start() -> None:
    """Instrument this process through ``CommDebugInstrumentor`` unless ``ENABLED`` is false,
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` lists ``commdebug``, or this is a torchrun launcher
    (the instrumentor's no-op). Never raises: a failure logs one warning and the program runs on."""
    try:
        from commdebug_otel import config

        config.warn_unknown_variables()
        if not config.read_option("enabled") or config.instrumentation_disabled():
            return
        from commdebug_otel.instrumentor import instrument

        instrument()
    except Exception as error:  # start-up must never break the user's program
        _warn("could not start tracing", error)


def _warn(what: str, error: BaseException) -> None:
    try:
        import logging

        logging.getLogger(__name__).warning("commdebug-otel: %s: %s: %s", what, type(error).__name__, error)
    except Exception:  # logging itself broken (e.g. at interpreter exit): stay silent, never raise
        pass


class _StartAfterImport:
    """Wraps torch's loader: runs it, then :func:`maybe_start` once torch's ``__init__`` has run.

    Everything else (``get_source``, ``is_package``, resource readers ...) goes to the wrapped
    loader, and the module's ``__loader__`` / ``__spec__.loader`` are put back to it before
    torch's own code runs, so nothing outside sees the wrapper.
    """

    def __init__(self, loader: object, hook: TorchImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)

    def create_module(self, spec: object) -> object:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: object) -> None:
        try:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader  # type: ignore[attr-defined]
            spec = getattr(module, "__spec__", None)
            if getattr(spec, "loader", None) is self:
                spec.loader = self._loader  # type: ignore[union-attr]
        except Exception:  # a module that refuses attributes keeps the wrapper: harmless
            pass
        self._loader.exec_module(module)  # type: ignore[attr-defined]  # torch's errors are the script's
        if sys.modules.get(TARGET) is module:  # not someone's private module_from_spec copy
            self._hook.fire()


class TorchImportHook:
    """The ``sys.meta_path`` finder: hands the ``torch`` spec of the other finders back with its
    loader wrapped (:class:`_StartAfterImport`); returns None for every other name at the cost of
    one string comparison. Removed from ``sys.meta_path`` when it fires."""

    def __init__(self) -> None:
        self._searching = False
        self._fired = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != TARGET or self._searching:
            return None
        # The module lock for "torch" is held here, so one thread at a time; the flag stops
        # recursion through finders that call importlib.util.find_spec themselves.
        self._searching = True
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None  # torch is not installed: the import fails as it would have
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                spec.loader = _StartAfterImport(loader, self)
            return spec
        except Exception as error:  # a broken finder: let the normal import machinery try
            _warn("could not hook the torch import", error)
            self.remove()
            return None
        finally:
            self._searching = False

    def fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        self.remove()
        maybe_start()

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Start now if torch is imported, else hook its import (once per process). Never raises."""
    try:
        if TARGET in sys.modules:
            maybe_start()
        elif not any(isinstance(finder, TorchImportHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, TorchImportHook())
    except Exception as error:
        _warn("could not hook the torch import", error)


install()
