"""The recorder's collective path: sequence numbers, the three paths of a collective, waits, op events.

``Recorder.collective`` hands every collective of its process here. Cheapest first: another
thread's and a quiet step's are metric points (and, on the training thread, the stall ring's
entry); the rest keep records: a :class:`~commdebug_otel.core.fact.CollectiveFact` with its
owner, pass and "why", metric points with module label and exemplar, the observers, and on a
traced step the span event on its owner's record. What it needs of the steps and the module
owners it asks through :class:`~commdebug_otel.core.protocols.CollectiveHost`.
"""

from __future__ import annotations

import logging
import threading
import time
from operator import attrgetter
from typing import Any

import torch
from torch.compiler import is_compiling

from commdebug_otel import semconv
from commdebug_otel.capture._torch import graph_task_id
from commdebug_otel.capture.ops import CollectiveSpec, GroupResolver, Message, compiler_traced, message, plain_payload
from commdebug_otel.config import variable
from commdebug_otel.core import ids
from commdebug_otel.core.collectives import (
    C10D_CAUSES,
    PASS_NONE,
    CollectiveCounter,
    CompiledWhys,
    Why,
    _set_peer,
    dispatched_op_why,
    peer_when_received,
    quiet_fact,
    recorded_fact,
)
from commdebug_otel.core.fact import GroupFacts, MetricsSink, event_attributes
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.protocols import CollectiveHost
from commdebug_otel.core.records import Record, SpanKind, Step, dtensor_facts
from commdebug_otel.core.thread_role import one_role_holder

_logger = logging.getLogger(__name__)


class CollectivePath:
    """Collectives, waits and op events of one recorder.

    Args:
        host: the steps and module owners (the recorder).
        metrics: where metric points go (``fact.MetricsSink``: ``metrics.LazyCollectiveMetrics``), or None.
        failures: the recorder's failure accounting.

    Attributes:
        why: the DTensor "why" (:class:`~commdebug_otel.core.collectives.Why`): the recorder's ``why``.
        counter: metric points and completion timing (:class:`~commdebug_otel.core.collectives.CollectiveCounter`).
        groups: the process groups seen (:class:`~commdebug_otel.capture.ops.GroupResolver`).
    """

    def __init__(self, host: CollectiveHost, metrics: MetricsSink | None, failures: Failures) -> None:
        self._host = host
        self._failures = failures
        self._settings = host.settings
        self._observers = host.observers
        self.counter = CollectiveCounter(metrics, host.rank, failures.hook_failed, self._completed)
        self._count = self.counter.count  # the quiet path's one call
        self.groups = GroupResolver()
        self.why = Why()
        self._compiled_whys = CompiledWhys()
        self.reset()

    def reset(self) -> None:
        """The state a process starts with, and a forked child starts again with."""
        self.awaiting_source: dict[int, tuple[Any, dict[str, Any]]] = {}  # recv from any source, not yet waited (gloo)
        self.counter.timed = True
        self.why.clear()

    def step_closed(self) -> None:
        """A step (or segment) closed: what was kept for its records goes."""
        self.awaiting_source.clear()

    @one_role_holder(attrgetter("_host.role"))
    def collective(self, spec: CollectiveSpec, args: tuple, duration_ns: int, out: Any = None,
                   start_ns: int = 0) -> None:
        """A collective was issued (``duration_ns``: issue time on the CPU, in nanoseconds).

        ``out`` is what the op returned: for c10d ops it holds the ``Work``,
        whose future times completion without blocking (``start_ns`` is the
        ``time.perf_counter_ns()`` at issue). Three paths, cheapest first:
        another thread's and a quiet step's collectives are metric points
        only; the rest keep records (:meth:`_record`).
        """
        plain = plain_payload(spec, args)  # one eager tensor, the usual case: never traced by torch.compile
        if is_compiling() or (plain is None and compiler_traced(args)):
            # Run on fake tensors while torch.compile builds a graph (dynamo, or AOTAutograd's backward):
            # the compiled code issues the real one. Its "why" is known only now: kept for it.
            self._compiled_whys.trace(spec, self.groups.resolve(spec, args), args, out, self.why)
            return
        group = self.groups.resolve(spec, args)
        host = self._host
        in_backward = graph_task_id() != -1
        if not in_backward and threading.get_ident() != host.thread_id:
            # Another thread (not autograd's): the training thread's open spans are not its
            # owners, and its sequence numbers (which match collectives across ranks) stay its own.
            self._count(quiet_fact(spec, args, out, group, -1, PASS_NONE, duration_ns, plain), spec, out, start_ns)
            return
        progress = host.progress
        seqs = progress.next_seq
        seq = seqs.get(group.name, 0)
        seqs[group.name] = seq + 1
        step = host.current_step
        if (step is not None and step.quiet) or not self._keeps_records(step, in_backward):
            # An untraced step (the hot path of always-on tracing), between untraced steps,
            # or a backward outside any step: metric points only.
            fact = quiet_fact(spec, args, out, group, seq, host.pass_by_depth(in_backward), duration_ns, plain)
            progress.remember(fact, out, start_ns + duration_ns if start_ns else 0)
            self._count(fact, spec, out, start_ns)
            return
        self._record(spec, args, out, group, seq, duration_ns, start_ns, in_backward)

    def _keeps_records(self, step: Step | None, in_backward: bool) -> bool:
        """Whether a collective outside a quiet step is traced, observed, or module-labelled."""
        if step is not None:
            traced = step.traced
        elif in_backward:
            traced = False  # a backward outside any step: counted in metrics only
        else:
            traced = self._host.outside_step(time.time_ns()).traced
        return traced or self._host.every_event or bool(self._settings.metric_module_depth)

    def _record(self, spec: CollectiveSpec, args: tuple, out: Any, group: GroupFacts, seq: int,
                duration_ns: int, start_ns: int, in_backward: bool) -> None:
        """Its fact (owner, pass, why), metric points with module label and exemplar, the observers, then
        the span event."""
        now = time.time_ns()
        host = self._host
        owner, step = host.owner()
        if owner is not None and owner.kind is SpanKind.MODULE:
            pass_ = owner.pass_
        else:
            pass_ = host.pass_by_depth(in_backward)
        # Where its event goes: the owner, else (no step open) the segment between steps.
        target, target_step = owner, step
        if step is None and not in_backward:
            target_step = host.outside_step(now)
            target = target_step.root
        traced = target_step is not None and target_step.traced and target is not None
        msg = message(spec, args, out, group.size)
        why = self._why_of(spec, group, msg, target) if traced and target is not None else None
        fact = recorded_fact(spec, args, group, seq, msg, now, duration_ns, owner.fqn if owner is not None else "",
                             pass_, why)
        host.progress.remember(fact, out, start_ns + duration_ns if start_ns else 0)
        if not fact.fake:
            span_ref = None
            if step is not None and step.trace_id and owner is not None:
                span_ref = self.exemplar_span(owner, step)
            self.counter.count(fact, spec, out, start_ns, span_ref)
        for observer in self._observers:
            observer.on_collective(spec, owner, pass_)
        if not traced or target is None or target_step is None:  # (traced says both are set)
            return
        attrs = event_attributes(fact)
        peer_when_received(spec.op, out, attrs, self._failures.hook_failed, self.awaiting_source)
        self.add_event(target, spec.op, attrs, now)
        if target_step.kind is SpanKind.STEP:
            target_step.fingerprint(group.name, seq, spec.op, fact.dtype, msg.shape, fact.reduce_op)

    def _why_of(self, spec: CollectiveSpec, group: GroupFacts, msg: Message, target: Record) -> dict[str, Any] | None:
        """The "why" of a traced collective: DTensor's redistribution, the one seen when compiled code was
        traced, or the DTensor op on the stack; None if none (or the facts failed: the event goes without)."""
        try:
            why = None
            if spec.functional or self.why.cause in C10D_CAUSES:
                why = self.why.attributes()
                if why is None and target.compiled:  # compiled code: DTensor ran when it was traced
                    why = self._compiled_whys.lookup(spec, group, msg)
            if why is None:  # a DTensor op that issues collectives itself (loss_parallel's handlers)
                why = dispatched_op_why()
            return why
        except Exception as error:
            self._failures.hook_failed("DTensor redistribution facts", error)
            return None

    def _completed(self, group: str, seq: int) -> None:
        """A c10d ``Work`` future completed (on the backend's thread)."""
        if seq >= 0:
            self._host.progress.complete(group, seq)

    def waited(self, handle: Any, duration_ns: int) -> None:
        """A thread waited ``duration_ns`` on a collective (``Work.wait()``, or ``wait_tensor`` on its output)."""
        if threading.get_ident() == self._host.thread_id or graph_task_id() != -1:
            self._host.progress.waited(handle, duration_ns)
        if self.awaiting_source:
            found = self.awaiting_source.pop(id(handle), None)
            if found is not None:
                _set_peer(*found, self._failures.hook_failed)

    def exemplar_span(self, owner: Record, step: Step) -> tuple[int, int]:
        """``(trace id, span id)`` of ``owner``'s future span, so metric points get exemplars (the metrics
        worker makes the OTel context of it: the core builds none)."""
        if not owner.span_id:
            owner.span_id = ids.span_id()
        return step.trace_id, owner.span_id

    def op_event(self, func: Any, args: tuple, is_dtensor: bool) -> None:
        """An op ran at detail ``dtensor`` or above: an event named after the overload."""
        owner, step = self._host.owner()
        for observer in self._observers:
            observer.on_op(func, args, is_dtensor, owner)
        if step is None or not step.traced or owner is None:
            return
        for observer in self._observers:
            if not observer.op_event_wanted(func, is_dtensor):
                return
        name = str(func)
        attrs: dict[str, Any] = {semconv.OP_NAME: name}
        if is_dtensor:
            attrs.update(dtensor_facts(args))
        else:
            shapes = [str(list(arg.shape)) for arg in args if isinstance(arg, torch.Tensor)]
            if shapes:  # never an empty array: ops on tensor lists (_foreach_*) have no top-level tensor
                attrs[semconv.OP_INPUT_SHAPES] = shapes
        self.add_event(owner, name, attrs, time.time_ns())

    def add_event(self, owner: Record, name: str, attrs: dict, now: int) -> None:
        """Add an event to ``owner``'s record, up to ``max_events_per_span`` (the rest counted, said once)."""
        events = owner.events
        limit = self._settings.max_events_per_span
        if len(events) < limit:
            if isinstance(events, list):  # else the empty tuple every record starts with
                events.append((name, attrs, now))
            else:
                owner.events = [(name, attrs, now)]
            return
        owner.dropped_events += 1
        self._failures.count_dropped(semconv.DROPPED_KIND_EVENT)
        if owner.dropped_events == 1 and self._failures.first(variable("max_events_per_span")):
            _logger.warning("commdebug-otel: span %r reached %s=%d events; later ones are dropped, counted on the "
                            "span (%s) and in %s (kind %s)", owner.name, variable("max_events_per_span"),
                            limit, semconv.SPAN_DROPPED_EVENTS, semconv.METRIC_DROPPED,
                            semconv.DROPPED_KIND_EVENT)
