"""What a :class:`~commdebug_otel.core.recorder.Recorder` is given: a span sink, and observers.

Both are passed at construction (``Recorder(settings, spans, metrics, observers)``);
nothing is assigned onto the recorder from outside.

* :class:`SpanSink` turns a finished step's records into spans
  (``telemetry.Telemetry`` is the one we ship).
* :class:`RecorderObserver` is told what the recorder sees. Subclass it and
  override what you need; every method defaults to doing nothing. The tracer
  (``tracer.py``) observes step changes to switch its dispatch mode;
  the ``CommDebugMode`` drop-in (``compat/debug_mode.py``) observes every collective,
  module and op to build torch's counts and reports.

Callback rules, for every method of both:

* They run synchronously on the thread that reported the fact: the training
  thread, or autograd's engine thread in backward. Keep them short: most run
  inside module hooks or the dispatcher, once per collective or op.
* They must not raise. If one does, the recorder (or the hook that reported
  the fact) catches it, logs it once per place and counts it as
  ``commdebug.telemetry.dropped`` with kind ``hook_error``; training goes on,
  and that fact may be half recorded (e.g. counted in metrics, without its
  span event).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from commdebug_otel.capture.ops import CollectiveSpec
    from commdebug_otel.core.records import Record


class SpanSink(Protocol):
    """Where finished records go. ``Telemetry`` implements it.

    A sink whose class sets ``keeps_records = False`` holds no record past :meth:`emit`:
    the recorder then reuses the records of closed steps. Without it, they are never reused.
    """

    def start(self) -> bool:
        """Start the tracer provider if needed (once, at the first traced step).

        Returns:
            True when span ids the recorder chooses up front are honoured,
            so metric exemplars can point at spans that are built later.
        """

    @property
    def exporting(self) -> bool:
        """Whether spans go anywhere (asked after :meth:`start`, as each sampled step opens).

        False (e.g. ``OTEL_TRACES_EXPORTER=none``): the recorder keeps no records for
        spans (steps are untraced unless an observer overrides ``on_collective``,
        ``on_op`` or ``on_first_call``; metrics go on).
        """

    def emit(self, roots: list[Record], children: dict[int, list[Record]], trace_id: int | None,
             parent_span_id: int = 0) -> None:
        """Turn one finished step into spans, each with its record's own timestamps.

        Args:
            roots: the root records (``train_step``, ``outside_step``, ``train_step_tail``, or the
                top-level forwards of an inference step).
            children: ``children[id(record)]`` is the records under ``record``, in start order.
            trace_id: the step's 128-bit trace id, or None for a random one.
            parent_span_id: the 64-bit span id of an exported span whose children the roots are (a
                ``train_step_tail``'s ``train_step``), with ``trace_id``; passed only when not 0.
        """


class RecorderObserver:
    """Told what the recorder sees; every method is a no-op until overridden.

    Runs on the reporting thread and must not raise (see the module docstring).

    Attributes:
        wants_every_event: True when :meth:`on_collective` and :meth:`on_op`
            must run on every step, traced or not (the drop-in's counts). It
            costs: untraced steps leave the short "quiet" path of
            collectives, and the tracer keeps its dispatch mode on throughout.
            Read once, when the recorder is built.
    """

    wants_every_event: bool = False

    def on_collective(self, spec: CollectiveSpec, owner: Record | None, pass_: str) -> None:
        """A collective ran on the training thread (or autograd's), outside a quiet step.

        Args:
            spec: the collective overload's facts (``spec.op`` is the canonical name).
            owner: the record it is booked to (a module pass, or the step's
                root), or None in a backward outside any step.
            pass_: ``forward``, ``backward``, ``recompute`` or ``none``.
        """

    def on_first_call(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        """``module`` runs for the first time in a recorded step, before its record is opened.

        Args:
            module: the module; hold it weakly if at all.
            fqn: its CommDebugMode-style name (root class name, then the dotted path).
            callers: the forward records open around the call, outermost first
                (empty for a top-level call; in recompute, the recompute's records).
        """

    def on_op(self, func: Any, args: tuple, is_dtensor: bool, owner: Record | None) -> None:
        """The dispatch mode reported an op (detail ``dtensor`` and up), traced step or not.

        Args:
            func: the ``OpOverload``.
            args: its positional arguments (DTensors when ``is_dtensor``).
            is_dtensor: whether the op ran on DTensors (before DTensor's own dispatch).
            owner: the record the op is booked to, or None outside any step.
        """

    def op_event_wanted(self, func: Any, is_dtensor: bool) -> bool:
        """Whether a reported op becomes a span event in a traced step (default: every op reported)."""
        return True

    def traced_step_changed(self, traced: bool) -> None:
        """A step opened (``traced`` says whether it is traced), or a traced step closed (False)."""

    def why_wanted(self, wanted: bool) -> None:
        """Whether the recorder may record a "why" now; called only when that changes.

        False while an untraced step is open, so DTensor's redistributions
        need not report their op then (see ``Recorder.why``).
        """
