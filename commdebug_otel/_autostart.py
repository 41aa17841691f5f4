"""Start tracing in processes that import torch, when ``OTEL_PYTHON_COMMDEBUG_ENABLED`` is set.

Imported by ``commdebug_otel.pth`` (installed into site-packages: environment
variables alone switch tracing on, no wrapper) and by the ``sitecustomize``
that ``commdebug-otel run`` puts on ``PYTHONPATH``. With no ``OTEL_PYTHON_COMMDEBUG_*``
variable set (or all empty), the ``.pth`` line costs one pass over the environment's
names and never imports this module. Any such variable brings it in, so that a
mistyped name (``..._ENABLE``) is reported once torch is imported, though tracing stays off.

When it is set, every Python process started with that environment imports
this module: pip, a launcher's helper processes, a shell's ``python -c``. So
importing it does almost nothing: a post-import hook (a ``sys.meta_path`` finder
that wraps torch's loader) runs right after ``import torch`` finishes, once, and
removes itself. A process that never imports torch never imports torch, the
settings or the SDK.

Nor does a process that imports torch and never uses it for training (a data-prep
script, an evaluation tool's helper): after ``import torch`` two cheap triggers are
armed (:func:`start_when_used`), and tracing starts at the first of

* the default process group's creation (``init_process_group``, ``init_device_mesh``,
  any path: c10d's ``_update_default_pg``), right after it, before any collective;
* the first ``nn.Module`` call (a global forward pre-hook that, having started
  tracing, runs the tracer's own pre-hooks for that call), so a job of one process,
  or a warm-up forward before ``init_process_group``, is traced from its first module;

and both triggers go (with ``ENABLED`` unset, only other variables of ours, nothing is armed: the
settings are read at once and say which name is unknown). Only then are the settings, the SDK and DTensor imported: the
options table reads ``ENABLED`` like every other setting, and
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` and the torchrun launcher's no-op apply.
Tracing starts on the thread that fires a trigger (the main thread, in a training script).

When ``destroy_process_group`` destroys the default group, tracing stops there (what was traced is
exported, and no thread or file of ours stays: a script that joins every thread at its end ends as
untraced), and the first trigger is armed again: a later process group is traced anew.
"""

from __future__ import annotations

import os
import sys
import threading

TARGET = "torch"  # the module whose import arms the triggers
PREFIX = "OTEL_PYTHON_COMMDEBUG_"
ENABLED = PREFIX + "ENABLED"


def maybe_start() -> None:
    """Instrument this process through ``CommDebugInstrumentor`` unless ``ENABLED`` is false,
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` lists ``commdebug``, or this is a torchrun launcher
    (the instrumentor's no-op). Never raises: a failure logs one warning and the program runs on."""
    try:
        from commdebug_otel import config

        config.warn_unknown_variables()
        if not config.read_option("enabled") or config.instrumentation_disabled():
            return
        from commdebug_otel.instrumentor import CommDebugInstrumentor, instrument

        if CommDebugInstrumentor().is_instrumented_by_opentelemetry:
            return  # started before a trigger fired (opentelemetry-instrument, the script): nothing to warn
        instrument(after_teardown=_stop_after_teardown)
    except Exception as error:  # start-up must never break the user's program
        _warn("could not start tracing", error)


def _stop_after_teardown() -> None:
    """The job's default process group was destroyed: tracing stops (spans exported, hooks removed, our threads
    and files gone, as :meth:`CommTracer.stop`), and starts again at the next default group's creation (not at a
    module call). Never raises."""
    try:
        from commdebug_otel.instrumentor import CommDebugInstrumentor

        instrumentor = CommDebugInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        if _triggers is not None:
            _triggers.rearm()
    except Exception as error:  # start-up must never break the user's program
        _warn("could not start tracing", error)


def _warn(what: str, error: BaseException) -> None:
    try:
        import logging

        logging.getLogger(__name__).warning("commdebug-otel: %s: %s: %s", what, type(error).__name__, error)
    except Exception:  # logging itself broken (e.g. at interpreter exit): stay silent, never raise
        pass


class _StartAfterImport:
    """Wraps torch's loader: runs it, then :func:`start_when_used` once torch's ``__init__`` has run.

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
        try:
            self._loader.exec_module(module)  # type: ignore[attr-defined]
        except BaseException as error:  # torch's errors are the script's: raised as without us, this frame left out
            from commdebug_otel.core.frames import without_frames_of

            error.__traceback__ = without_frames_of(error.__traceback__, __file__)
            raise
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
                if finder is self or find is None:  # type: ignore[comparison-overlap]
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
        start_when_used()

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)  # type: ignore[arg-type]
        except ValueError:
            pass


class _Triggers:
    """The two cheap triggers of :func:`start_when_used`; the first to fire removes both and starts tracing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fired = False
        self._c10d: object = None  # torch.distributed.distributed_c10d, when its function is wrapped
        self._update_default_pg: object = None  # c10d's own
        self._wrapper: object = None  # ours, in its place
        self._pre_hook: object = None  # the global forward pre-hook's handle

    def arm(self) -> None:
        import torch

        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            maybe_start()  # a late import of this module: the process already joined its group
            return
        self._arm_group(c10d)
        from torch.nn.modules.module import register_module_forward_pre_hook

        from commdebug_otel.capture._torch import own_global_hooks

        self._pre_hook = register_module_forward_pre_hook(self._first_module_call)  # type: ignore[arg-type]
        own_global_hooks(self._pre_hook)  # a script's torch.compile(model) must not warn of it (-W error)

    def _arm_group(self, c10d: object) -> None:
        original = getattr(c10d, "_update_default_pg", None)
        if original is not None:
            def _update_default_pg(pg: object) -> None:
                try:
                    original(pg)
                except BaseException as error:  # torch's: raised as without us
                    from commdebug_otel.core.frames import without_frames_of

                    error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                    raise
                if pg is not None:
                    self.fire()

            self._c10d, self._update_default_pg, self._wrapper = c10d, original, _update_default_pg
            setattr(c10d, "_update_default_pg", _update_default_pg)  # noqa: B010  (called by name from c10d's own functions)

    def rearm(self) -> None:
        """Tracing stopped with the default group: the next group's creation starts it again."""
        with self._lock:
            self._fired = False
        self._arm_group(sys.modules.get("torch.distributed.distributed_c10d"))

    def _first_module_call(self, module: object, args: object) -> object:
        from commdebug_otel.capture._torch import global_forward_pre_hooks

        before = set(global_forward_pre_hooks())
        self.fire()
        # torch took its list of this call's global pre-hooks before ours ran: run the ones tracing added.
        replaced = None
        try:
            for key, hook in list(global_forward_pre_hooks().items()):
                if key in before:
                    continue
                result = hook(module, args if replaced is None else replaced)
                if result is not None:
                    replaced = result if isinstance(result, tuple) else (result,)
        except Exception as error:  # the script's first forward goes on, whatever tracing did
            _warn("could not trace the first module call", error)
        return replaced

    def fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        self.disarm()
        maybe_start()

    def disarm(self) -> None:
        """Remove both triggers. c10d's function is put back where it is still our wrapper (one wrapped over ours
        keeps calling it: it passes straight through once fired)."""
        try:
            if self._pre_hook is not None:
                from commdebug_otel.capture._torch import disown_global_hooks

                self._pre_hook.remove()  # type: ignore[attr-defined]
                disown_global_hooks(self._pre_hook)
                self._pre_hook = None
            if self._c10d is not None and getattr(self._c10d, "_update_default_pg", None) is self._wrapper:
                self._c10d._update_default_pg = self._update_default_pg  # type: ignore[attr-defined]
            self._c10d = None
        except Exception as error:
            _warn("could not remove the start triggers", error)


_triggers: _Triggers | None = None
_LAUNCHERS = ("torch/distributed/run.py", "torch/distributed/launch.py", "/torchrun")


def _launcher() -> bool:
    """Whether this process is torchrun's agent (``torchrun``, ``python -m torch.distributed.run`` or ``.launch``),
    which starts the ranks and traces nothing."""
    return bool(sys.argv) and ("/" + sys.argv[0].replace(os.sep, "/")).endswith(_LAUNCHERS)


def start_when_used() -> None:
    """After ``import torch``: arm the triggers that start tracing when this process joins a process group or
    first calls a module (the module docstring). Cheap: imports nothing beyond torch. Never raises."""
    global _triggers
    try:
        if not os.environ.get(ENABLED, "").strip():
            if not any(value.strip() for name, value in os.environ.items() if name.startswith(PREFIX)):
                return  # `commdebug-otel run`'s bootstrap with no variable of ours: nothing to say or start
            # Only other variables of ours (a mistyped ENABLE): tracing cannot start, and the settings say which
            # name is unknown now, where torch is imported; torchrun's agent leaves it to its rank 0 (said once).
            if not _launcher():
                maybe_start()
            return
        if _triggers is None:
            _triggers = _Triggers()
            _triggers.arm()
    except Exception as error:
        _warn("could not hook the start of training", error)


def install() -> None:
    """Arm the start triggers if torch is imported, else hook its import (once per process). Never raises."""
    try:
        if TARGET in sys.modules:
            start_when_used()
        elif not any(isinstance(finder, TorchImportHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, TorchImportHook())  # type: ignore[arg-type]
    except Exception as error:
        _warn("could not hook the torch import", error)


install()
