"""What each caller of the recorder may call on it: one typed ``Protocol`` per caller.

The module hooks (``capture/tracker.py``), the collective kernels (``capture/intercept.py``), the dispatch
mode (``capture/mode.py``) and the stall watchdog (``stall/watchdog.py``) each hold the recorder as the
protocol below, never as ``Any`` nor as the whole ``Recorder``: what they may ask of it is
written here, and a type checker holds them to it. ``recorder.Recorder`` satisfies all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # type names only: this module imports nothing of the recorder's at run time
    import torch

    from commdebug_otel.capture.ops import CollectiveSpec
    from commdebug_otel.capture.sinks import RecorderObserver
    from commdebug_otel.config import Settings
    from commdebug_otel.core.collectives import Why
    from commdebug_otel.core.job_identity import RankInfo
    from commdebug_otel.core.progress import Progress
    from commdebug_otel.core.records import Record, Step
    from commdebug_otel.core.stall_snapshot import StallPlace
    from commdebug_otel.core.thread_role import ThreadRole


class FailureSink(Protocol):
    """Where a hook that failed says so: logged once per place, counted, never raised."""

    def hook_failed(self, where: str, error: BaseException) -> None: ...


class CollectiveSubscriber(FailureSink, Protocol):
    """What the collective kernels (``intercept.CollectiveInterceptor``) tell a recorder."""

    why: Why  # the DTensor "why" its wrappers set (only the training thread's, or autograd's)
    @property
    def thread_id(self) -> int:
        """The training thread."""
        ...

    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None: ...

    def waited(self, handle: Any, duration_ns: int) -> None: ...


class OpSubscriber(FailureSink, Protocol):
    """What the dispatch mode (``mode.CollectiveDispatchMode``) tells a recorder."""

    why: Why
    active: bool

    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None: ...

    def op_event(self, func: Any, args: tuple, is_dtensor: bool) -> None: ...


class ModuleHooks(FailureSink, Protocol):
    """What the module tracker (``tracker.ModuleTracker``) tells a recorder, and asks of it."""

    active: bool
    @property
    def thread_changes(self) -> int:
        """How often the training thread's role changed hands."""
        ...
    role: ThreadRole  # its lock holds the role still through a hook (thread_role.one_role_holder)
    resume_module_hooks: Any  # set by the tracker: called when a step that went hook-free closes

    @property
    def step_open(self) -> bool: ...

    @property
    def thread_settled(self) -> bool: ...

    def tracks_thread(self, claim: bool = True) -> bool: ...

    def module_pre(self, module: torch.nn.Module, fqn: str, args: tuple, compiled: bool = False) -> Record | None: ...

    def module_post(self, module: torch.nn.Module, record: Record | None) -> None: ...

    def backward_began(self, forward: Record) -> None: ...

    def backward_ended(self, forward: Record) -> None: ...

    def keep_hook(self, handle: Any) -> None: ...

    def hook_free_step(self) -> bool: ...


class StallSource(FailureSink, Protocol):
    """What the stall watchdog (``stall.StallWatch``) reads of a recorder, and asks it to export."""

    role: ThreadRole  # its lock holds the role still through a hook (thread_role.one_role_holder)

    @property
    def progress(self) -> Progress: ...

    @property
    def thread_id(self) -> int: ...

    @property
    def steps_taken(self) -> int:
        """How many optimizer steps have ended (``torch.step`` of the next one)."""
        ...

    def rank(self) -> RankInfo: ...

    def stall_place(self, where: tuple[str, str, list[str]]) -> StallPlace: ...

    def stall_snapshot(self, now: int, age_s: float, threshold_s: float, snapshot: int, place: StallPlace) -> bool:
        ...

    def job_id(self, store: Any = None) -> str: ...

    def stall_verdict(self, step_index: int, start_ns: int, now: int, attrs: dict[str, Any],
                      name: str = ...) -> bool: ...


class CollectiveHost(FailureSink, Protocol):
    """What the collective path (``collective_path.CollectivePath``) asks of the steps and module owners."""

    settings: Settings
    observers: tuple[RecorderObserver, ...]
    every_event: bool  # an observer wants every event: records are kept on every step
    progress: Progress

    @property
    def thread_id(self) -> int: ...

    def rank(self) -> RankInfo: ...

    @property
    def current_step(self) -> Step | None: ...

    def outside_step(self, now: int) -> Step:
        """The open segment between steps, made if none is open."""
        ...

    def owner(self) -> tuple[Record | None, Step | None]:
        """The record that owns what runs now (or the step's root), and the open step."""
        ...

    def pass_by_depth(self, in_backward: bool) -> str: ...


class OwnershipHost(Protocol):
    """What module and backward ownership (``ownership.ModuleOwnership``) asks of the step lifecycle."""

    why: Why
    first_call: Any  # called once at the first module call that opens a step; True: stop recording
    seen_optimizer: bool
    role: ThreadRole  # its lock holds the role still through a hook (thread_role.one_role_holder)

    @property
    def current_step(self) -> Step | None: ...

    def open_step(self, now: int, inference: bool = False) -> Step: ...

    def close_step(self, now: int, inference: bool = False) -> None: ...

    def without_optimizer(self) -> bool:
        """No ``optimizer.step()`` seen and no optimizer alive: a step may end after ``NO_OPTIMIZER_CYCLES``
        backward passes."""
        ...

    def step_full(self, step: Step, now: int, in_backward: bool) -> Step | None:
        """``step`` holds ``max_spans_per_step`` records: the step part to record in, or None (not recorded)."""
        ...

    def backward_pass_done(self) -> None:
        """An outermost autograd pass of the open step finished."""
        ...


class ExportHost(Protocol):
    """What the exports (``step_export.StepExport``) read of the step lifecycle."""

    progress: Progress

    @property
    def steps_taken(self) -> int: ...

    @property
    def current_step(self) -> Step | None: ...

    @property
    def open_segment(self) -> Step | None:
        """The open step, else the open segment between steps, else None."""
        ...

    def innermost_open(self) -> Record | None:
        """The innermost open forward record, else the most recent open backward one, else None."""
        ...
