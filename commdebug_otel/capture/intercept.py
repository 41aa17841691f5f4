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

Waits are timed too, for each step's ``torch.step.collective_wait``: a kernel
at the same key for ``_c10d_functional.wait_tensor`` (functional collectives,
DTensor, compiled code), and ``Work.wait`` wrapped while a recorder is
subscribed (``dist.*`` calls, FSDP2's unshard); subscribers get
``waited(handle, duration_ns)``.

Ops that are not collectives never reach Python. A collective issued inside
another (the c10d op a functional collective's kernel calls) is not counted
twice: a per-thread flag marks the outer one in progress.

The "why" of a collective comes from DTensor's own redistribution steps:

* ``OpDispatcher.redistribute_local_args`` (torch/distributed/tensor/_dispatch.py),
  which DTensor's dispatch calls (from ``_dispatch_get_local_results_slow_path``)
  only when an op's inputs must move: while it runs, subscribers hold the op
  and its input specs;
* ``redistribute_local_tensor(local, current_spec, target_spec)``, which every
  redistribution runs, wrapped in each module that calls it (``_torch.dtensor_redistribute_sites``):
  subscribers hold the source and target placements, the mesh, and the
  cause (``redistribute`` for ``DTensor.redistribute()`` and its backward,
  ``from_local`` for ``from_local``'s backward, the op inside a dispatch);
* ``DTensor.full_tensor``, which names itself the cause of the redistribution it makes;
* ``distribute_tensor`` (wrapped in each module that holds it: the parallel styles call it
  when ``parallelize_module`` shards parameters, and, for a ``distribute_tensor`` held
  since before the tracer started, the placements' own makers it calls per mesh
  dimension): its c10d scatter or broadcast from the source rank names it, with the
  target placements and the mesh (the source is a plain tensor: placements ``()``);
* an op whose DTensor code issues collectives itself, not by redistributing (its custom
  handler: ``loss_parallel()``'s log_softmax and nll_loss, convolution, argmin/argmax; the
  dispatcher's Python tail for ``aten.equal``): DTensor's dispatch is C++ and reads its
  handlers' dict on each call, so nothing is wrapped; the recorder finds the op on the
  issuing thread's stack, for a traced collective that has no other "why"
  (``collectives.dispatched_op_why``).

DTensor redistributes about 30 times per step of the demo transformer under
tensor parallel, so the wrappers are in place only while some subscriber may
record a "why" (:meth:`CollectiveInterceptor.want_why`): an untraced step
calls torch's own. Where torch lacks ``redistribute_local_args``, :attr:`names_dtensor_ops` is False and the
tracer falls back to its dispatch mode on traced steps; where it lacks the others, only an op's
redistributions have a "why".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commdebug_otel.capture import _torch
from commdebug_otel.capture.ops import MESHES, CollectiveSpec
from commdebug_otel.core.collectives import DISTRIBUTE_TENSOR, FULL_TENSOR
from commdebug_otel.core.frames import without_frames_of
from commdebug_otel.core.protocols import CollectiveSubscriber
from commdebug_otel.core.redact import describe

_logger = logging.getLogger(__name__)

_KEY = "BackendSelect"


class _InProgress(threading.local):
    busy = False


class CollectiveInterceptor:
    """Process-wide: reports each collective to every subscribed recorder.

    A subscriber (a ``Recorder``) has ``collective(spec, args, duration_ns, out, start_ns)``,
    ``hook_failed(where, error)``, ``thread_id`` and ``why`` (a :class:`~commdebug_otel.core.collectives.Why`).
    Kernels are registered at the first subscription and stay (see :meth:`unsubscribe`).
    """

    def __init__(self, registry: dict[Any, CollectiveSpec]) -> None:
        self._registry = registry
        self._subscribers: tuple[CollectiveSubscriber, ...] = ()
        self._libraries: list[torch.library.Library] = []
        self._lock = threading.Lock()
        self._local = _InProgress()
        self._below = _torch.keys_after_backend_select()
        self._original_redistribute: Any = None  # OpDispatcher.redistribute_local_args, once watched
        self._patches: list[_Patch] = []  # in place while some subscriber wants a "why"
        self._wanting_why: set[int] = set()  # ids of subscribers that may record a "why" now
        self._wait_patch: _Patch | None = None  # Work.wait timed, while someone is subscribed
        self._mesh_patch: _Patch | None = None  # DeviceMesh.__init__ registers meshes, while someone is subscribed

    @property
    def names_dtensor_ops(self) -> bool:
        """True while DTensor redistributions tell subscribers their op (see the module docstring)."""
        return self._original_redistribute is not None

    def subscribe(self, recorder: CollectiveSubscriber) -> bool:
        """Start reporting collectives to ``recorder``. False if the kernels could not be registered."""
        with self._lock:
            if not self._libraries and not self._install():
                return False
            if not self._subscribers:
                self._watch_meshes(True)
            if recorder not in self._subscribers:
                self._subscribers = (*self._subscribers, recorder)
            self._want_why(recorder, True)
            if self._wait_patch is not None:
                self._wait_patch.apply(True)
            return True

    def unsubscribe(self, recorder: CollectiveSubscriber) -> None:
        """Stop reporting to ``recorder``.

        The kernels stay registered for the life of the process: deregistering a
        dispatcher kernel while another thread may be running it is not safe. With
        no subscriber they hand each collective straight on.
        """
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not recorder)
            self._want_why(recorder, False)
            if self._wait_patch is not None and not self._subscribers:
                self._wait_patch.apply(False)
            if not self._subscribers:
                self._watch_meshes(False)

    def want_why(self, recorder: CollectiveSubscriber, wanted: bool) -> None:
        """Whether ``recorder`` may record the DTensor op behind a collective now (a traced step, set-up)."""
        with self._lock:
            self._want_why(recorder, wanted)

    def _want_why(self, recorder: CollectiveSubscriber, wanted: bool) -> None:
        if wanted:
            self._wanting_why.add(id(recorder))
        else:
            self._wanting_why.discard(id(recorder))
        for patch in self._patches:
            patch.apply(bool(self._wanting_why))

    def _install(self) -> bool:
        libraries: dict[str, torch.library.Library] = {}
        try:
            for overload, spec in self._registry.items():
                self._register(libraries, overload, self._kernel(overload, spec))
            self._watch_redistributions()
            self._time_waits(libraries)
        except Exception as error:
            _logger.warning("commdebug-otel: cannot register collective kernels (%s); the "
                            "dispatch mode counts collectives instead, at a cost on every op",
                            describe(error))
            self._uninstall()
            return False
        return True

    def _watch_meshes(self, on: bool) -> None:
        """Keep :data:`~commdebug_otel.capture.ops.MESHES` up to date: the meshes alive now, and each one made
        while ``on`` (``DeviceMesh.__init__`` wrapped), so that groups are named by their mesh dimensions."""
        try:
            if self._mesh_patch is None:
                mesh_class = _torch.device_mesh_class()
                init = mesh_class.__dict__["__init__"]
                self._mesh_patch = _Patch(mesh_class, "__init__", init,
                                          registering_init(init, MESHES.add, "a device mesh"))
            if on:
                MESHES.scan()
            self._mesh_patch.apply(on)
        except Exception as error:  # another torch: groups are named by their group_desc alone
            _logger.debug("commdebug-otel: device meshes not watched: %s", describe(error))

    def _register(self, libraries: dict[str, torch.library.Library], overload: Any, kernel: Any) -> None:
        """Register ``kernel`` for ``overload`` at ``BackendSelect``, in its namespace's one library."""
        library = libraries.get(overload.namespace)
        if library is None:
            library = libraries[overload.namespace] = torch.library.Library(overload.namespace, "IMPL")
            self._libraries.append(library)
        library.impl(_torch.impl_name(overload), kernel, _KEY, with_keyset=True)

    def _time_waits(self, libraries: dict[str, torch.library.Library]) -> None:
        """Time ``wait_tensor`` (a kernel) and ``Work.wait`` (a wrapper): where the training thread blocks."""
        try:
            overload = _torch.wait_tensor_overload()
            self._register(libraries, overload, self._wait_kernel(overload))
            work = _torch.work_class()
            self._wait_patch = _Patch(work, "wait", work.wait, self._wait_wrapper(work.wait))  # type: ignore[attr-defined]
        except Exception as error:  # another torch: steps report no collective wait
            _logger.debug("commdebug-otel: collective waits not timed: %s", describe(error))

    def _tell_waited(self, handle: Any, duration_ns: int) -> None:
        for recorder in self._subscribers:
            try:
                recorder.waited(handle, duration_ns)
            except Exception as error:
                recorder.hook_failed("collective wait", error)

    def _wait_kernel(self, overload: Any) -> Any:
        redispatch = _torch.boxed_redispatch(overload)
        below = self._below

        def kernel(keyset: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                out = redispatch(keyset & below, tensor, *args, **kwargs)
            except BaseException as error:  # a failed wait's own error: no frame of ours in it
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise
            if self._subscribers:
                self._tell_waited(tensor, time.perf_counter_ns() - start)
            return out

        return kernel

    def _wait_wrapper(self, wait: Any) -> Any:
        def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return wait(work, *args, **kwargs)
            except BaseException as error:  # a failed wait (a timeout, a peer gone): torch's traceback
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise
            finally:
                self._tell_waited(work, time.perf_counter_ns() - start)

        return timed_wait

    def _watch_redistributions(self) -> None:
        try:
            dispatcher, original = _torch.dtensor_redistribution()
            redistribute = original.__func__
        except Exception as error:  # another torch: the mode names the ops instead
            _logger.debug("commdebug-otel: DTensor redistributions not watched: %s", describe(error))
            return
        whys = self._whys

        def redistribute_local_args(op_info: Any, suggested_input_schema: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                op, specs = _torch.redistribution_op(op_info, suggested_input_schema)
                scopes = [why(op, specs) for why in whys()]
            except Exception:  # a changed OpInfo: the collectives still count, without a "why"
                scopes = []
            try:
                return _call_within(scopes, redistribute, op_info, suggested_input_schema, *args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise

        self._patches.append(_Patch(dispatcher, "redistribute_local_args", original,
                                    staticmethod(redistribute_local_args)))
        self._original_redistribute = original
        try:
            sites = _torch.dtensor_redistribute_sites()
            dtensor, full_tensor = _torch.dtensor_full_tensor()
        except Exception as error:  # another torch: only redistributions inside an op are named
            _logger.debug("commdebug-otel: explicit DTensor redistributions not watched: %s", describe(error))
            return
        for module, name, function, cause in sites:
            self._patches.append(_Patch(module, name, function, self._redistribution_wrapper(function, cause)))
        self._patches.append(_Patch(dtensor, "full_tensor", full_tensor, self._full_tensor_wrapper(full_tensor)))
        # DTensor.from_local is left as it is: dynamo traces it specially in compiled code (a wrapper
        # changes the compiled graph); its run_check is off by default.
        try:
            distribute_sites = _torch.dtensor_distribute_sites()
        except Exception as error:  # another torch: set-up scatters have no "why"
            _logger.debug("commdebug-otel: distribute_tensor not watched: %s", describe(error))
            return
        for module, name, function in distribute_sites:
            self._patches.append(_Patch(module, name, function, self._placing_wrapper(function, DISTRIBUTE_TENSOR)))
        try:
            makers = _torch.dtensor_placement_makers()
        except Exception as error:
            _logger.debug("commdebug-otel: placement makers not watched: %s", describe(error))
            return
        for owner, name, method, facts in makers:
            self._patches.append(_Patch(owner, name, method, classmethod(self._maker_wrapper(method.__func__, facts))))

    def _whys(self) -> list[Any]:
        """The "why" of each subscriber whose collectives this thread issues now.

        Only a recorder's training thread (or autograd's) sets its "why": another
        thread's redistribution must not name the training thread's collectives.
        """
        thread, in_backward = threading.get_ident(), _torch.in_backward()
        return [recorder.why for recorder in self._subscribers if in_backward or recorder.thread_id == thread]

    def _redistribution_wrapper(self, function: Any, cause: str | None) -> Any:
        """``redistribute_local_tensor`` that gives its placements and mesh (and ``cause``) to the "why"."""
        whys = self._whys

        def redistribute_local_tensor(local_tensor: Any, current_spec: Any, target_spec: Any,
                                      *args: Any, **kwargs: Any) -> Any:
            try:
                source, target, mesh = _torch.redistribution_specs(current_spec, target_spec)
                scopes = [why.redistributing(cause, source, target, mesh) for why in whys()]
            except Exception:  # a changed DTensorSpec: the collectives still count, without a "why"
                scopes = []
            try:
                return _call_within(scopes, function, local_tensor, current_spec, target_spec, *args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise

        return redistribute_local_tensor

    def _placing_wrapper(self, function: Any, cause: str) -> Any:
        """``distribute_tensor``: a plain tensor placed on a mesh, by ``cause``."""
        whys = self._whys

        @functools.wraps(function)
        def place(tensor: Any, device_mesh: Any = None, placements: Any = None, *args: Any, **kwargs: Any) -> Any:
            try:
                target = _torch.placements_of(device_mesh, placements)
                scopes = [why.redistributing(cause, (), target, device_mesh) for why in whys()]
            except Exception:
                scopes = []
            try:
                return _call_within(scopes, function, tensor, device_mesh, placements, *args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise

        return place

    def _maker_wrapper(self, function: Any, facts: Any) -> Any:
        """A placement's maker (one mesh dimension of ``distribute_tensor``): the "why" when none is set,
        with that dimension's placement as the target (a ``distribute_tensor`` we did not wrap)."""
        whys = self._whys

        @functools.wraps(function)
        def make(cls: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                target, mesh = facts(cls, args)
                scopes = [why.redistributing(DISTRIBUTE_TENSOR, (), (target,), mesh) for why in whys()
                          if why.cause is None and why.op is None]
            except Exception:  # keyword arguments, another torch: no "why"
                scopes = []
            try:
                return _call_within(scopes, function, cls, *args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise

        return make

    def _full_tensor_wrapper(self, function: Any) -> Any:
        """``DTensor.full_tensor`` that names itself the cause of the redistribution it makes."""
        whys = self._whys

        @functools.wraps(function)
        def full_tensor(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                scopes = [why.redistributing(FULL_TENSOR, None, None, None) for why in whys()]
            except Exception:
                scopes = []
            try:
                return _call_within(scopes, function, tensor, *args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise

        return full_tensor

    def _uninstall(self) -> None:
        for patch in (*self._patches, self._wait_patch, self._mesh_patch):
            if patch is not None:
                patch.apply(False)
        self._patches = []
        self._wait_patch = self._mesh_patch = None
        self._original_redistribute = None
        libraries, self._libraries = self._libraries, []
        for library in libraries:
            try:
                _torch.destroy_library(library)
            except Exception:  # interpreter shutdown: the registrations go with the process
                pass

    def _kernel(self, overload: Any, spec: CollectiveSpec) -> Any:
        redispatch = _torch.boxed_redispatch(overload)
        below = self._below
        local = self._local

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            subscribers = self._subscribers
            if not subscribers or local.busy:
                try:
                    return redispatch(keyset & below, *args, **kwargs)
                except BaseException as error:  # the collective's own error: no frame of ours in it
                    error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                    raise
            local.busy = True
            start = time.perf_counter_ns()
            try:
                out = redispatch(keyset & below, *args, **kwargs)
            except BaseException as error:
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise
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


class _Patch:
    """One attribute of torch's replaced by our wrapper while a "why" is wanted, and put back after."""

    __slots__ = ("name", "original", "owner", "wrapper")

    def __init__(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        self.owner, self.name, self.original, self.wrapper = owner, name, original, wrapper

    def apply(self, on: bool) -> None:
        setattr(self.owner, self.name, self.wrapper if on else self.original)


_interceptor: CollectiveInterceptor | None = None
_interceptor_lock = threading.Lock()


def interceptor(registry: dict[Any, CollectiveSpec]) -> CollectiveInterceptor:
    """The process's one :class:`CollectiveInterceptor` (kernels are per op, not per tracer)."""
    global _interceptor
    with _interceptor_lock:
        if _interceptor is None:
            _interceptor = CollectiveInterceptor(registry)
        return _interceptor


def registering_init(init: Any, register: Callable[[Any], Any], what: str) -> Any:
    """``init`` (a torch class's ``__init__``) that then hands the new object to ``register``; a failing
    ``register`` logs ``what`` at debug level and never reaches the script."""

    @functools.wraps(init)
    def __init__(made: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(made, *args, **kwargs)
        except BaseException as error:  # torch's: raised as without us
            error.__traceback__ = without_frames_of(error.__traceback__, __file__)
            raise
        try:
            register(made)
        except Exception as error:  # never into the training script
            _logger.debug("commdebug-otel: %s not registered: %s", what, describe(error))

    return __init__


def _call_within(scopes: list, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` inside ``scopes`` (context managers: entered in order, left in
    reverse), as a ``contextlib.ExitStack`` would, without one per call (tens per traced step).

    A scope that fails to enter is left out with those after it: the call runs all the same.
    """
    entered = 0
    try:
        for scope in scopes:
            scope.__enter__()
            entered += 1
    except Exception:
        pass
    try:
        return function(*args, **kwargs)
    finally:
        for index in range(entered - 1, -1, -1):
            scopes[index].__exit__(None, None, None)
