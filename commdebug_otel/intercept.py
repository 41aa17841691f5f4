"""Collectives seen at the dispatcher without a dispatch mode: metrics on every step, no per-op cost.

A ``TorchDispatchMode`` sends *every* aten op through Python, which on small
CPU models costs more than the whole always-on budget (docs/performance.md).
Instead, one Python kernel per collective overload is registered at the
``BackendSelect`` dispatch key with ``torch.library.Library(ns, "IMPL")``:

* ``BackendSelect`` is in every dispatch's TLS-included set
  (``c10::default_included_set``, c10/core/impl/LocalDispatchKeySet.h), so the
  kernel runs for every call of these ops, under ``torch.no_grad`` and
  ``torch.inference_mode`` too, from Python, funcol, DTensor, FSDP2 and DDP's
  C++ reducer alike, on any thread;
* it sits just above the backend kernels and below autograd and the Python
  key (dispatch modes, tensor subclasses), so it sees the same op a dispatch
  mode sees, with the same arguments;
* these ops have no ``BackendSelect`` kernel of their own (it is a
  fallthrough), so nothing of torch's is replaced: the kernel calls
  ``OpOverload.redispatch`` with the keys after ``BackendSelect``.

Ops that are not collectives never reach Python. A collective issued inside
another (the c10d op a functional collective's kernel calls) is not counted
twice: a per-thread flag marks the outer one in progress.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from .ops import CollectiveSpec

_logger = logging.getLogger(__name__)

_KEY = "BackendSelect"


class _InProgress(threading.local):
    busy = False


class CollectiveInterceptor:
    """Process-wide: reports each collective to every subscribed recorder.

    A subscriber has ``collective(spec, args, duration_ns, out, start_ns)`` and
    ``hook_failed(where, error)``. Kernels are registered at the first
    subscription and removed (``Library._destroy``) when the last one leaves.
    """

    def __init__(self, registry: dict[Any, CollectiveSpec]) -> None:
        self._registry = registry
        self._subscribers: tuple = ()
        self._libraries: list[torch.library.Library] = []
        self._lock = threading.Lock()
        self._local = _InProgress()
        self._below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

    @property
    def installed(self) -> bool:
        return bool(self._libraries)

    def subscribe(self, recorder: Any) -> bool:
        """Start reporting collectives to ``recorder``. False if the kernels could not be registered."""
        with self._lock:
            if not self._libraries and not self._install():
                return False
            if recorder not in self._subscribers:
                self._subscribers = (*self._subscribers, recorder)
            return True

    def unsubscribe(self, recorder: Any) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not recorder)
            if not self._subscribers:
                self._uninstall()

    def _install(self) -> bool:
        libraries: dict[str, torch.library.Library] = {}
        try:
            for overload, spec in self._registry.items():
                library = libraries.get(spec.namespace)
                if library is None:
                    library = libraries[spec.namespace] = torch.library.Library(spec.namespace, "IMPL")
                    self._libraries.append(library)
                name = overload._schema.name.split("::", 1)[1]
                if overload._overloadname != "default":
                    name = f"{name}.{overload._overloadname}"
                library.impl(name, self._kernel(overload, spec), _KEY, with_keyset=True)
        except Exception as error:
            _logger.warning("commdebug-otel: cannot register collective kernels (%s: %s); the "
                            "dispatch mode counts collectives instead, at a cost on every op",
                            type(error).__name__, error)
            self._uninstall()
            return False
        return True

    def _uninstall(self) -> None:
        libraries, self._libraries = self._libraries, []
        for library in libraries:
            try:
                library._destroy()
            except Exception:  # interpreter shutdown: the registrations go with the process
                pass

    def _kernel(self, overload: Any, spec: CollectiveSpec) -> Any:
        redispatch = overload._handle.redispatch_boxed  # OpOverload.redispatch without its Python frame
        below = self._below
        local = self._local

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            subscribers = self._subscribers
            if not subscribers or local.busy:
                return redispatch(keyset & below, *args, **kwargs)
            local.busy = True
            start = time.perf_counter_ns()
            try:
                out = redispatch(keyset & below, *args, **kwargs)
            finally:
                local.busy = False
            duration = time.perf_counter_ns() - start
            for recorder in subscribers:
                try:
                    recorder.collective(spec, args, duration, out, start)
                except Exception as error:
                    recorder.hook_failed("collective event", error)
            return out

        return kernel


_interceptor: CollectiveInterceptor | None = None
_interceptor_lock = threading.Lock()


def interceptor(registry: dict[Any, CollectiveSpec]) -> CollectiveInterceptor:
    """The process's one :class:`CollectiveInterceptor` (kernels are per op, not per tracer)."""
    global _interceptor
    with _interceptor_lock:
        if _interceptor is None:
            _interceptor = CollectiveInterceptor(registry)
        return _interceptor
