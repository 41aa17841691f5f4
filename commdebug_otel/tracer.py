"""``CommTracer``: module spans, collective events and metrics, switched on and off as one unit.

Every side effect of :meth:`CommTracer.start` has its undo in :meth:`CommTracer.stop`,
in mirrored order: the optimizer-step hook, the dispatch mode, the collective
kernels, the module hooks.

Collectives are counted by dispatcher kernels (``capture/intercept.py``) that cost
nothing per op, and DTensor's redistribution step names the op behind them.
The dispatch mode, which every op pays for, is needed only for op events
(detail ``dtensor`` and up), and then only while a traced step is open.
Untraced steps pay for module hooks and metrics only.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from commdebug_otel import semconv
from commdebug_otel.capture._torch import in_backward, is_data_worker
from commdebug_otel.capture.intercept import interceptor
from commdebug_otel.capture.mode import (
    COLLECTIVES,
    CollectiveDispatchMode,
    enter_below_user_modes,
    exit_from_stack,
    on_stack,
)
from commdebug_otel.capture.optimizers import OPTIMIZERS
from commdebug_otel.capture.sinks import RecorderObserver
from commdebug_otel.capture.tracker import ModuleTracker
from commdebug_otel.config import Detail, Settings
from commdebug_otel.core.collectives import wait_for_backend_callbacks
from commdebug_otel.core.frames import without_frames_of
from commdebug_otel.core.job_identity import leave_job
from commdebug_otel.core.recorder import Recorder
from commdebug_otel.otel.metrics import LazyCollectiveMetrics
from commdebug_otel.otel.telemetry import Telemetry
from commdebug_otel.stall.flight_recorder import dump_beside_snapshot
from commdebug_otel.stall.flight_recorder import enabled as flight_recorder_enabled
from commdebug_otel.stall.watchdog import StallWatch, communicating, training_thread_location

_logger = logging.getLogger(__name__)

METRICS_DRAIN_S = 1.0  # the most stop() waits for the metrics worker

_shared_lock = threading.Lock()
_shared_telemetry: dict[tuple, Telemetry] = {}


def shared_telemetry(settings: Settings) -> Telemetry:
    """One process-wide :class:`Telemetry` per output settings, so tracers share providers and files.

    It holds no tracer: its rank and its drop counter are its own.
    """
    key = (settings.output_dir, settings.max_events_per_span, settings.shutdown_timeout_s, settings.exception_messages)
    with _shared_lock:
        telemetry = _shared_telemetry.get(key)
        if telemetry is None:
            telemetry = _shared_telemetry[key] = Telemetry(settings)
        return telemetry


_STARTED: weakref.WeakSet = weakref.WeakSet()
# The started tracer that exports this process's telemetry: at most one, so nothing is exported twice.
_EXPORTING: weakref.WeakSet = weakref.WeakSet()
_said_refused = False


def exporting_tracer() -> CommTracer | None:
    """The :class:`CommTracer` that exports this process's telemetry, or None when none is running."""
    for tracer in list(_EXPORTING):
        return tracer
    return None
_fork_hook_installed = False


def _after_fork_in_child() -> None:
    for tracer in list(_STARTED):
        tracer._after_fork_in_child()


def _install_fork_hook() -> None:
    """One process-wide at-fork hook (it cannot be unregistered, so it holds no tracer)."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        _fork_hook_installed = True
        os.register_at_fork(after_in_child=_after_fork_in_child)


class CommTracer:
    """Traces nn.Module passes as spans and collectives as span events, and records metrics.

    Args:
        settings: :class:`Settings`; default ``Settings.from_env()``.
        tracer_provider: an OTel ``TracerProvider``; default: our own SDK set-up
            from the standard ``OTEL_*`` variables (see ``otel/telemetry.py``).
        meter_provider: an OTel ``MeterProvider``; same default.
        telemetry: a ``Telemetry`` to use instead (its providers, exporters and
            span building), e.g. a private one that :meth:`stop` does not share.
        observer: a :class:`~commdebug_otel.capture.sinks.RecorderObserver` told
            what the recorder sees (the ``CommDebugMode`` drop-in's counts).
        exports: False for a tracer that only feeds ``observer`` and exports
            nothing (the drop-in inside a running tracer).
        after_teardown: called with no argument right after
            ``torch.distributed.destroy_process_group`` destroyed the default group
            while this tracer runs (the environment start stops tracing there); what it
            raises is counted as a ``hook_error``, never raised to the script.

    One tracer exports per process: :meth:`start` on a second exporting tracer
    while one runs (started from the environment, by ``opentelemetry-instrument``
    or by the script) warns once and does nothing, so no span, event or metric
    is exported twice.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    Collectives are counted on every thread; those on a thread other than the
    training thread (the one that trains) or autograd's are metrics
    only (docs/troubleshooting.md). A dispatch mode, when detail needs one, is
    pushed on the training thread's stack.

    Example::

        with CommTracer():
            for batch in data:
                model(batch).sum().backward()
                optimizer.step()   # ends the step: its spans are exported
    """

    def __init__(self, settings: Settings | None = None, *, tracer_provider: Any = None,
                 meter_provider: Any = None, telemetry: Telemetry | None = None,
                 observer: RecorderObserver | None = None, exports: bool = True,
                 after_teardown: Callable[[], None] | None = None) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self._after_teardown = after_teardown
        self._exports = exports
        self._refused = False
        if not exports:
            self.telemetry = Telemetry.silent(self.settings)
        elif telemetry is not None:
            self.telemetry = telemetry
        elif tracer_provider is None and meter_provider is None:
            self.telemetry = shared_telemetry(self.settings)
        else:
            self.telemetry = Telemetry(self.settings, self._rank, tracer_provider, meter_provider)
        metrics = LazyCollectiveMetrics(self.telemetry.meter, self.settings.metric_module_depth, self._rank,
                                        self.settings.metric_rank_label_on, self._progress,
                                        getattr(self.telemetry, "metrics_ready", None), lambda: _lost(self))
        self._metrics = metrics
        observers = (_ModeSwitch(self),) if observer is None else (_ModeSwitch(self), observer)
        self.recorder = Recorder(self.settings, self.telemetry.spans, metrics, observers)
        self._tracker = ModuleTracker(self.recorder)
        self._stall_watch: StallWatch | None = None
        self._mode: CollectiveDispatchMode | None = None
        self._mode_follows_steps = False  # the dispatch mode is on only while a traced step is open
        self._wants_every_op = observer is not None and observer.wants_every_event
        self._intercepted = False
        self._optimizer_handle: Any = None  # torch's RemovableHandle, once installed
        self._optimizer_pre_handle: Any = None
        self._started = False
        self._fork_hook = False
        self._teardown_watch: _TeardownWatch | None = None

    def _rank(self) -> Any:
        return self.recorder.rank()

    def _progress(self) -> tuple[int, float, list[tuple[str, int, int, str]]]:
        """(rank, current step age in seconds, ``Progress.seqs()``): what the progress gauges read."""
        progress = self.recorder.progress
        return self.recorder.rank().rank, progress.age_s(), progress.seqs()

    @property
    def started(self) -> bool:
        return self._started

    def state_sizes(self) -> dict[str, int]:
        """How many entries each piece of per-run state of the recorder and module hooks holds (leak checks)."""
        return {**self.recorder.state_sizes(), **self._tracker.state_sizes()}

    def torch_fqn(self, fqn: str) -> str:
        """A module FQN of ours (``Net.blocks.0``: the root's class as the user wrote it) as torch's CommDebugMode
        writes it (``type(root).__name__``: ``FSDPNet.blocks.0`` under ``fully_shard``); others as they are."""
        return self._tracker.torch_fqn(fqn)

    def start(self) -> CommTracer:
        """Install the module hooks, the collective kernels, the dispatch mode and the optimizer-step hook.

        The dispatch mode is pushed on this thread now only if it must see every
        op (the CommDebugMode drop-in's reports) or the collective kernels could
        not be registered; otherwise it is pushed when a traced step opens.
        """
        if self._started:
            _logger.warning("commdebug-otel: CommTracer.start() called twice; ignored")
            return self
        if self._exports and exporting_tracer() is not None:
            self._refuse()
            return self
        self._started = True
        self.recorder.activate()
        self.recorder.first_call = self._first_call
        self._tracker.install()
        kernels = interceptor(COLLECTIVES)
        self._intercepted = kernels.subscribe(self.recorder)
        self._mode = CollectiveDispatchMode(self.recorder, self.settings.detail,
                                            collectives=not self._intercepted)
        if not self._intercepted or self._wants_every_op:
            self._enter_mode()  # every op, every step
        elif self.settings.detail >= Detail.DTENSOR or not kernels.names_dtensor_ops:
            self._mode_follows_steps = True
            if self.settings.detail < Detail.DTENSOR:
                # The optimizer's ops (a large share of a step's) need no mode when it is
                # only there to name the DTensor op behind a redistribution.
                self._optimizer_pre_handle = register_optimizer_step_pre_hook(self._optimizer_step_pre_hook)
        else:
            self._mode = None  # detail "collectives": no dispatch mode at all
        self._optimizer_handle = register_optimizer_step_post_hook(self._optimizer_step_post_hook)
        OPTIMIZERS.watch(True)  # an optimizer made but not yet stepped: its first step stays whole
        if (self.settings.stall_after_s is not None or self.settings.straggler) and self._exports:
            flight_recorder_enabled()  # a bad buffer size is said at start, not at the first stall
            self._stall_watch = StallWatch(self.recorder, self.settings.stall_after_s,
                                           self.telemetry.flush_from_watchdog, self._tracker.known_fqn,
                                           self._dump_flight_recorder, straggler=self.settings.straggler)
            self._stall_watch.start()
        atexit.register(self._stop_at_exit)
        self.telemetry.before_shutdown.append(self._stop_at_exit)
        if self._exports:
            self.telemetry.hold_signals()  # again after a stop; before the first span, at the first span
            self._teardown_watch = _TeardownWatch(self._before_teardown, self._torn_down).install()
        _STARTED.add(self)  # weakly: a tracer that is dropped can be collected
        if self._exports:
            _EXPORTING.add(self)
        _install_fork_hook()
        if not self._fork_hook:
            self._fork_hook = True
            import multiprocessing.util

            multiprocessing.util.register_after_fork(self, CommTracer._flush_before_mp_exit)  # weak too
        return self

    def _dump_flight_recorder(self) -> None:
        """torch's Flight Recorder buffer beside a stall snapshot (:mod:`.flight_recorder`), if it records."""
        dump_beside_snapshot(self.recorder.rank().rank, self.telemetry.run_directory)

    def _refuse(self) -> None:
        global _said_refused
        self._refused = True
        if not _said_refused:
            _said_refused = True
            _logger.warning("commdebug-otel: a CommTracer already exports this process's telemetry (started "
                            "from the environment, by opentelemetry-instrument or by the script); this one "
                            "does nothing, so nothing is exported twice")

    def _after_fork_in_child(self) -> None:
        """Forked children export their own spans: fresh state, providers with their own pid and rank."""
        if not self._started:
            return
        try:
            self.recorder.reset_after_fork()
            self.recorder.first_call = self._first_call  # a forked data worker's first call: stay silent
            self.telemetry.reset_after_fork()
        except Exception as error:
            self.recorder.hook_failed("fork handler", error)

    def _flush_before_mp_exit(self) -> None:
        """multiprocessing fork children end in ``os._exit`` (no atexit) after running finalizers.

        Registered through ``register_after_fork``, which runs after the child
        clears the finalizers it inherited. A data-loading worker (its target is a
        DataLoader's worker loop) stays silent instead: its tracer stops, exporting nothing.
        """
        import multiprocessing.util

        if is_data_worker():
            self._stay_silent()
            return

        multiprocessing.util.Finalize(self, CommTracer.stop, args=(self,), exitpriority=100)

    def _stay_silent(self) -> None:
        """A data-loading worker: the tracer stops, and this process's providers never start (no run folder)."""
        self.telemetry.disabled = True
        self.stop(flush=False)

    def _first_call(self) -> bool:
        """The first module call with no step open (``Recorder.first_call``): in a data-loading worker
        (a spawn child whose target was not known when tracing started), stay silent. True if so."""
        from torch.utils.data import get_worker_info

        if get_worker_info() is None and not is_data_worker():
            return False
        self._stay_silent()
        return True

    def _optimizer_step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self._exit_mode()
        except Exception as error:
            self.recorder.hook_failed("optimizer step hook", error)

    def _optimizer_step_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self.recorder.optimizer_step_done()
            if self._exports:
                self.telemetry.keep_signals()  # our flush again where a handler was reset to the default
        except Exception as error:
            self.recorder.hook_failed("optimizer step hook", error)

    def _stop_at_exit(self) -> None:
        self._at_exit = True  # its exit handler flushes; the store may be held by a wait that never returns
        self.stop(flush=False)

    def stop(self, flush: bool = True) -> None:
        """End every open span, remove every hook, and (``flush``) export within the shutdown timeout.

        Never raises: each undo runs on its own, so a failure in one (logged once and counted
        as a ``hook_error``) leaves the others done, and the script's own exit is unchanged.
        """
        self._refused = False
        if not self._started:
            return
        self._started = False
        _STARTED.discard(self)
        _EXPORTING.discard(self)
        # Flushing: what waits for the process group goes out with what is known now (otel/telemetry.py).
        settle = getattr(self.telemetry, "settle_now", None) if flush else None
        for where, undo in (("exit handlers", self._unregister_exit),
                            ("telemetry", settle),
                            ("closing spans", lambda: self.recorder.finish(
                                _ending_exception() if getattr(self, "_at_exit", False) else None)),
                            # Before the process group goes (at exit, when the script never destroyed it).
                            ("backend callbacks", lambda: wait_for_backend_callbacks(
                                min(self.settings.shutdown_timeout_s, METRICS_DRAIN_S))),
                            # The metrics worker records what the closed step left, then its thread ends (in-memory
                            # SDK calls: a short bound, so an SDK that hangs does not double the exit budget).
                            ("metrics", lambda: self._metrics.close(
                                min(self.settings.shutdown_timeout_s, METRICS_DRAIN_S))),
                            ("removing hooks", self._remove_hooks),
                            # Providers shut down: no thread or file of ours outlives tracing (remade at a start).
                            ("flush", (lambda: _end_telemetry(self.telemetry, self._metrics)) if flush else None),
                            # After the flush (the run folder's name may still read the nonce).
                            ("job's store keys", None if getattr(self, "_at_exit", False) else _leave_job_if_last),
                            # Last: a signal during the flush still flushes and ends the process as before.
                            ("signal handlers", self.telemetry.release_signals if self._exports else None)):
            self._run_step("CommTracer.stop", where, undo)

    def _run_step(self, caller: str, where: str, call: Any) -> None:
        """One step of a teardown sequence: skipped when ``call`` is None; a failure is counted, never raised."""
        if call is None:
            return
        try:
            call()
        except Exception as error:
            self.recorder.hook_failed(f"{caller}: {where}", error)

    def _unregister_exit(self) -> None:
        atexit.unregister(self._stop_at_exit)
        if self._stop_at_exit in self.telemetry.before_shutdown:
            self.telemetry.before_shutdown.remove(self._stop_at_exit)

    def _before_teardown(self, whole_job: bool) -> None:
        """Before ``destroy_process_group``: our callbacks off the backend's threads, finished steps exported (a rank
        killed in the teardown has delivered them). ``whole_job``: the signal handlers are given back too (a teardown
        hanging with the GIL held runs neither our handler nor our rescue thread: SIGTERM must end it). Never raises."""
        bound_s = min(self.settings.shutdown_timeout_s, METRICS_DRAIN_S)
        for where, call in (("backend callbacks", lambda: wait_for_backend_callbacks(bound_s)),
                            ("metrics", lambda: self.flush_metrics(bound_s)),
                            ("flush", self.telemetry.force_flush),
                            # While the store is there: a stop after the teardown cannot reach it.
                            ("job's store keys", leave_job if whole_job else None),
                            ("signal handlers", self.telemetry.release_signals if whole_job else None)):
            self._run_step("destroy_process_group", where, call)

    def _torn_down(self) -> None:
        """``destroy_process_group`` destroyed the default group: the ``after_teardown`` callback. Never raises."""
        self._run_step("destroy_process_group", "after the teardown", self._after_teardown)

    def _remove_hooks(self) -> None:
        """Undo :meth:`start`'s hooks in mirrored order: teardown watch, optimizer hooks, dispatch mode, kernels,
        module hooks."""
        if self._teardown_watch is not None:
            self._teardown_watch.remove()
            self._teardown_watch = None
        self.recorder.active = False
        self._mode_follows_steps = False
        if self._stall_watch is not None:
            self._stall_watch.stop()
            self._stall_watch = None
        if self._optimizer_handle is not None:
            OPTIMIZERS.watch(False)
        for handle in (self._optimizer_handle, self._optimizer_pre_handle):
            if handle is not None:
                handle.remove()
        self._optimizer_handle = self._optimizer_pre_handle = None
        self._exit_mode()
        self._mode = None
        if self._intercepted:
            self._intercepted = False
            interceptor(COLLECTIVES).unsubscribe(self.recorder)
        self._tracker.remove()

    def flush_metrics(self, timeout_s: float | None = None) -> bool:
        """Record every metric point so far in the SDK's instruments, waiting at most ``timeout_s`` seconds.

        Points reach the SDK on a worker thread, so a reader collecting mid-run may see the last step late (a
        periodic exporter sends it next time); :meth:`stop` does this itself. Defaults to
        ``OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT``. Returns False if the worker did not finish in time; never raises.
        """
        try:
            return self._metrics.drain(self.settings.shutdown_timeout_s if timeout_s is None else timeout_s)
        except Exception as error:
            self.recorder.hook_failed("metrics", error)
            return False

    def _traced_step_changed(self, traced: bool) -> None:
        """A step opened (traced or not) or a traced step closed: the mode follows, on this thread."""
        if not self._mode_follows_steps:
            return
        if traced:
            self._enter_mode()
        elif not in_backward():
            # Inside backward (optimizer-in-backward) the engine restores the modes: the next step takes it off.
            self._exit_mode()

    def _enter_mode(self) -> None:
        if self._mode is not None and not on_stack(self._mode):
            enter_below_user_modes(self._mode)

    def _exit_mode(self) -> None:
        # Mode stacks are per thread. A mode on another thread's stack stays there, inert once
        # the tracer stops (recorder.active is False), rather than pop someone else's mode.
        if self._mode is not None:
            exit_from_stack(self._mode)

    def __enter__(self) -> CommTracer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        except Exception as error:  # stop() never raises; should it, the script's own exit still wins
            self.recorder.hook_failed("CommTracer.stop", error)


def _end_telemetry(telemetry: Any, metrics: Any) -> None:
    """Flush and end our providers (``Telemetry.end``); the metrics' instruments are remade if the meter ended."""
    end = getattr(telemetry, "end", None)
    if end is None:  # a telemetry of the script's own making (tests): a flush is all it offers
        telemetry.force_flush()
    elif end():
        metrics.reset()  # its instruments were the ended meter's


def _leave_job_if_last() -> None:
    """The process's last running tracer stopped: its keys in the job's store go (``job_identity.leave_job``)."""
    if not _STARTED:
        leave_job()


def _lost(tracer: CommTracer) -> dict[int, float]:
    """``{rank: s per step}`` the live straggler verdict reports (rank 0; else empty): the metric's values."""
    watch = tracer._stall_watch
    return watch.stragglers.lost_by_rank() if watch is not None and watch.stragglers is not None else {}


def debug_state(tracer: CommTracer) -> dict[str, Any]:
    """Where ``tracer``'s rank is now, for torch's debug server (``debug_page.py``): JSON-ready, names and numbers.

    Keys: ``rank``, ``world_size``, ``step`` (the open step, or between steps the next), ``in_step``, ``age_s``
    (seconds since the step began or the last ended), ``module`` and ``pass`` (the training thread's innermost
    module call, "" outside any), ``communicating`` (blocked in a collective or a c10d call), ``groups`` (per
    process group: ``group``, ``mesh_dim``, ``issued`` and ``completed`` seq, -1 for none), ``stall`` (the
    last stall snapshot's place, "" when none), ``verdict`` (the last stall verdict this rank formed) and
    ``straggler`` (the live straggler verdict this rank judged, while it names a rank slow; "" otherwise).
    """
    recorder, progress, watch = tracer.recorder, tracer.recorder.progress, tracer._stall_watch
    module, pass_, _ = training_thread_location(recorder.thread_id, tracer._tracker.known_fqn)
    info = recorder.rank()
    return {
        "rank": info.rank, "world_size": info.world_size,
        "step": progress.step_index if progress.in_step else recorder.steps_taken,
        "in_step": progress.in_step, "age_s": round(progress.age_s(), 3),
        "module": module, "pass": pass_, "communicating": communicating(recorder.thread_id),
        "groups": [{"group": group, "mesh_dim": dim, "issued": issued, "completed": completed}
                   for group, issued, completed, dim in progress.seqs()],
        "stall": watch.last_stall if watch is not None else "",
        "verdict": watch.last_verdict if watch is not None else "",
        "straggler": _current_straggler(watch),
    }


def _current_straggler(watch: Any) -> str:
    """The last live straggler verdict judged here (rank 0) while it stands (not ``recovered``), else ""."""
    exchange = getattr(watch, "stragglers", None)
    said = exchange.said if exchange is not None else []
    return said[-1][0].summary if said and said[-1][0].kind == semconv.VERDICT_KIND_STRAGGLER else ""


class _TeardownWatch:
    """``torch.distributed.destroy_process_group`` wrapped to call ``before(whole_job)`` first, while a tracer
    runs (``whole_job``: the default group is destroyed), and ``after()`` once it destroyed the default group.

    torch offers no hook there. Put back at :meth:`remove` wherever it is still ours; a script that took
    its own reference to the function before the tracer started (``from torch.distributed import
    destroy_process_group`` with the tracer started later) calls torch's own (the exit flush remains).
    """

    _MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")

    def __init__(self, before: Any, after: Any = None) -> None:
        self._before = before
        self._after = after
        self._installed: list[tuple[Any, Any]] = []  # (module, torch's function)

    def install(self) -> _TeardownWatch | None:
        import importlib

        for name in self._MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # a torch built without distributed
                continue
            original = getattr(module, "destroy_process_group", None)
            if original is None or getattr(original, "__commdebug_before__", None) is not None:
                continue  # torch without distributed; or another tracer's (it wraps torch's already)
            setattr(module, "destroy_process_group", self._wrap(original))  # noqa: B010
            self._installed.append((module, original))
        return self

    def _wrap(self, original: Any) -> Any:
        before, after = self._before, self._after

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            group = args[0] if args else kwargs.get("group")
            whole_job = group is None or group is _world_group()
            before(whole_job)
            try:
                result = original(*args, **kwargs)
            except BaseException as error:  # torch's: raised as without us
                error.__traceback__ = without_frames_of(error.__traceback__, __file__)
                raise
            if whole_job and after is not None:
                after()
            return result

        setattr(destroy_process_group, "__commdebug_before__", before)  # noqa: B010  (another tracer looks for it)
        return destroy_process_group

    def remove(self) -> None:
        for module, original in reversed(self._installed):
            current = getattr(module, "destroy_process_group", None)
            if getattr(current, "__commdebug_before__", None) is self._before:
                module.destroy_process_group = original
        self._installed.clear()


def _world_group() -> Any:
    try:
        from torch.distributed import GroupMember

        return GroupMember.WORLD
    except Exception:
        return None


class _ModeSwitch(RecorderObserver):
    """The tracer's own observer: its dispatch mode and DTensor's redistribution watch follow the steps."""

    def __init__(self, tracer: CommTracer) -> None:
        self._tracer = tracer

    def traced_step_changed(self, traced: bool) -> None:
        self._tracer._traced_step_changed(traced)

    def why_wanted(self, wanted: bool) -> None:
        if self._tracer._intercepted:
            interceptor(COLLECTIVES).want_why(self._tracer.recorder, wanted)


def _ending_exception() -> BaseException | None:
    """At exit: the exception the main thread did not handle (Python keeps it as ``sys.last_exc``,
    ``sys.last_value`` before 3.12, once it is printed), None after a normal end or ``sys.exit``."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return error if isinstance(error, BaseException) and not isinstance(error, SystemExit) else None

