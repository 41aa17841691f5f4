"""The collective path: metric points, completion timing, span-event attributes, and the "why".

``Recorder.collective`` classifies each collective (another thread, a quiet
step, or one that keeps records) and hands it here:

* :class:`CollectiveCounter` records its metric points, and times c10d
  collectives to completion without waiting for them;
* :func:`quiet_fact` and :func:`recorded_fact` make the one
  :class:`~commdebug_otel.core.fact.CollectiveFact` of a collective (the quiet
  path's counts no elements and reads no reduce op or peer), which
  ``fact`` renders into span events, stall-ring events and metric labels;
* :class:`Why` holds the DTensor op whose redistribution is in progress, the
  "why" of the collectives it issues.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture import _torch
from commdebug_otel.capture.ops import (
    BARRIER_DTYPE,
    NO_TENSOR_DTYPE,
    CollectiveSpec,
    Message,
    is_fake,
    message,
    payload,
    reduce_op_name,
)
from commdebug_otel.core.fact import NOT_COUNTED, PASS_NONE, CollectiveFact, GroupFacts, MetricsSink
from commdebug_otel.core.records import ATTR_MAX_CHARS, dtensor_facts, mesh_facts
from commdebug_otel.core.redact import describe

_logger = logging.getLogger(__name__)

__all__ = ["PASS_NONE", "CollectiveCounter", "Why", "quiet_fact", "recorded_fact"]

_new_fact = tuple.__new__
_DTYPE_NAMES: dict[Any, str] = {}  # torch.dtype -> "float32": one lookup per collective on the quiet path


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def quiet_fact(spec: CollectiveSpec, args: tuple, out: Any, group: GroupFacts, seq: int, pass_: str,
               duration_ns: int, plain: torch.Tensor | None) -> CollectiveFact:
    """The fact of a collective that keeps no records (untraced steps, other threads: on every step, kept short).

    Its element counts are not counted (-1), its reduce op and peer not read; no owner is known.
    ``plain``: ``ops.plain_payload(spec, args)``, which the recorder has already asked.
    """
    shape: tuple[int, ...]  # a torch.Size is one
    if spec.barrier:
        dtype, shape, nbytes, fake = BARRIER_DTYPE, (0,), 0, False
    else:
        nbytes, first = payload(spec, args, out, plain)
        if first is None:
            dtype, shape, fake = NO_TENSOR_DTYPE, (0,), False
        else:
            dtype, shape, fake = _dtype_name(first.dtype), first.shape, plain is None and is_fake(first)
    # tuple.__new__ itself: CollectiveFact(...) runs a Python __new__ per call, on every collective
    return _new_fact(CollectiveFact, (spec.op, spec.overload_name, group, seq, dtype, shape, NOT_COUNTED, NOT_COUNTED,
                                      nbytes, fake, "", NOT_COUNTED, time.time_ns(), duration_ns, "", pass_, None))


def recorded_fact(spec: CollectiveSpec, args: tuple, group: GroupFacts, seq: int, msg: Message, time_ns: int,
                  duration_ns: int, fqn: str, pass_: str, why: dict[str, Any] | None) -> CollectiveFact:
    """The fact of a collective that keeps records: ``msg`` (``ops.message``), its owner's ``fqn`` and ``pass_``,
    and ``why`` (:meth:`Why.attributes`, for traced steps), with its reduce op and peer."""
    reduce_op = reduce_op_name(args[spec.reduce_index]) if 0 <= spec.reduce_index < len(args) else ""
    peer = int(args[spec.peer_index]) if 0 <= spec.peer_index < len(args) else NOT_COUNTED
    return CollectiveFact(spec.op, spec.overload_name, group, seq, msg.dtype, tuple(msg.shape), msg.input_elements,
                          msg.output_elements, msg.nbytes, msg.fake, reduce_op, peer, time_ns, duration_ns, fqn,
                          pass_, why)


class CollectiveCounter:
    """Metric points of collectives, and their completion times.

    Args:
        metrics: where the points go (``fact.MetricsSink``: ``metrics.LazyCollectiveMetrics``), or None
            for no metrics.
        rank: ``rank() -> RankInfo``, called per point (the rank can change once the group is up).
        hook_failed: ``hook_failed(where, error)``, for failures on a backend's thread.
        completed: ``completed(group name, seq)``, told on the backend's thread when a timed
            collective completes (a seq of -1: not counted by the training thread).

    Attributes:
        timed: whether this step's collectives are timed: their issue time
            (``torch.collective.duration``) and, for c10d ones, their completion. The recorder sets it
            per step: ``trace_every``'s and one step in ``completion_every``. Counts and bytes are
            recorded on every step.
    """

    def __init__(
        self, metrics: MetricsSink | None, rank: Callable[[], Any], hook_failed: Callable[[str, BaseException], None],
        completed: Callable[[str, int], None] = lambda group, seq: None,
    ) -> None:
        self._metrics = metrics
        self._rank = rank
        self._hook_failed = hook_failed
        self._completed = completed
        self._untimed: set[str] = set()  # overloads whose Work has no future on this backend
        self.timed = True

    def count(self, fact: CollectiveFact, spec: CollectiveSpec, out: Any, start_ns: int,
              span_ref: tuple[int, int] | None = None) -> None:
        """The metric points of ``fact``; ``out`` (what the op returned) and ``start_ns`` (its
        ``time.perf_counter_ns()`` at issue) time a c10d one to completion; ``span_ref`` (the owning span's
        ``(trace id, span id)``) gives exemplars."""
        if self._metrics is None or fact.fake:
            return
        rank = self._rank().rank
        timed = self.timed
        self._metrics.collective(fact, rank, fact.duration_ns / 1e9 if timed else None, span_ref)
        if timed and not spec.functional and out is not None:
            self._time_completion(out, fact, rank, start_ns)

    def _time_completion(self, out: Any, fact: CollectiveFact, rank: int, start_ns: int) -> None:
        """Record issue-to-completion time when the c10d ``Work``'s future completes (never waits).

        Some backends' works have no future (gloo's ``_reduce_scatter_base_`` raises
        "Work::getFuture not implemented"): that overload is not timed from then on.
        """
        if fact.overload in self._untimed:
            return
        work = boxed_work(out)
        if work is None:
            return
        try:
            future = _torch.work_future(work)
        except Exception as error:
            self._untimed.add(fact.overload)
            _logger.debug("commdebug-otel: %s is not timed to completion: %s", fact.overload, describe(error))
            return
        try:
            future.add_done_callback(OnBackendThread(_Completion(self, fact, rank, start_ns)))
        except Exception as error:
            self._untimed.add(fact.overload)
            self._hook_failed("completion time", error)


class OnBackendThread:
    """A ``Work`` future's done callback of ours, counted until the backend's thread has let it go.

    The backend's thread (gloo's worker) takes the GIL to run it and again to free it, while it
    holds the ``Work``. Tearing the process group down meanwhile (``destroy_process_group``, or DDP's
    ``Reducer`` freed after it: both join that thread holding the GIL) deadlocks it, and on a busy
    machine a step's last callbacks are often still waiting for the GIL when the script ends. The
    tracer waits for :func:`wait_for_backend_callbacks` before the group goes.
    """

    __slots__ = ("call",)

    def __init__(self, call: Callable[[Any], None]) -> None:
        self.call = call
        _LIVE_CALLBACKS.append(None)

    def __call__(self, future: Any) -> None:
        self.call(future)

    def __del__(self) -> None:
        try:
            _LIVE_CALLBACKS.pop()
        except IndexError:  # counted before a fork, freed in the child
            pass


# One entry per live OnBackendThread. No lock: list.append and list.pop are atomic under the GIL, and a
# lock taken in __del__ by a backend thread that finalization stops mid-way would hang the final collection.
_LIVE_CALLBACKS: list[None] = []


def _none_in_child() -> None:
    _LIVE_CALLBACKS.clear()  # the parent's backend threads are not the child's


os.register_at_fork(after_in_child=_none_in_child)


def wait_for_backend_callbacks(timeout_s: float) -> bool:
    """Wait (the GIL released) until every :class:`OnBackendThread` callback has run and been freed by its
    backend's thread, at most ``timeout_s`` seconds (a collective that never completes keeps its own).
    Returns True if none is left; never raises."""
    deadline = time.monotonic() + timeout_s
    while _LIVE_CALLBACKS:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


class _Completion:
    """A ``Work`` future's done callback: runs on the backend's thread and must never raise."""

    __slots__ = ("counter", "fact", "rank", "start_ns")

    def __init__(self, counter: CollectiveCounter, fact: CollectiveFact, rank: int, start_ns: int) -> None:
        self.counter, self.fact, self.rank, self.start_ns = counter, fact, rank, start_ns

    def __call__(self, _future: Any) -> None:
        try:
            fact = self.fact
            self.counter._completed(fact.group.name, fact.seq)
            metrics = self.counter._metrics
            if metrics is not None:  # a completion is timed only where there are metrics
                metrics.completion(fact, self.rank, (time.perf_counter_ns() - self.start_ns) / 1e9)
        except Exception as error:
            self.counter._hook_failed("completion time", error)


def boxed_work(out: Any) -> Any:
    """The boxed c10d ``Work`` a c10d op returned (alone, or last in a tuple); None for other results."""
    work = out[-1] if isinstance(out, tuple) and out else out
    return work if isinstance(work, torch.ScriptObject) else None


def peer_when_received(op: str, out: Any, attrs: dict[str, Any],
                       hook_failed: Callable[[str, BaseException], None], awaiting: dict[int, tuple]) -> None:
    """A ``recv`` from any source (``dist.recv(buf)`` without ``src``): its peer is added to ``attrs``
    once received (``Work.source_rank()``, a rank in the group), if before the step ends: when its
    ``Work`` future completes or, where the backend's work has no future (gloo), when ``Work.wait()``
    returns (``awaiting``: ``id(work) -> (work, attrs)``, which ``Recorder.waited`` reads)."""
    if op != semconv.RECV or semconv.COLLECTIVE_PEER in attrs:
        return
    work = boxed_work(out)
    if work is None:
        return
    try:
        unboxed = _torch.unbox_work(work)
    except Exception as error:
        hook_failed("recv source rank", error)
        return
    try:
        future = unboxed.get_future()
    except Exception:  # gloo: "Work::getFuture not implemented"
        awaiting[id(unboxed)] = (unboxed, attrs)  # held, so wait() gets this same object
        return
    future.add_done_callback(OnBackendThread(functools.partial(_set_peer, unboxed, attrs, hook_failed)))


def _set_peer(work: Any, attrs: dict[str, Any], hook_failed: Callable[[str, BaseException], None],
              _future: Any = None) -> None:
    try:
        attrs[semconv.COLLECTIVE_PEER] = int(work.source_rank())
    except Exception as error:  # on the backend's thread: never raise there
        hook_failed("recv source rank", error)


class Why:
    """What DTensor is redistributing for: the "why" of the collectives issued meanwhile.

    Set in three ways, and read by the recorder only when a functional
    collective follows (its facts are computed then, once per redistribution):

    * ``with why(op, args): ...`` sets the op whose inputs are redistributed
      for the block and restores what was there before (DTensor's dispatch, or
      its ``redistribute_local_args``);
    * ``with why.redistributing(cause, source, target, mesh): ...`` sets one
      redistribution's placements and mesh, and its cause when it is not an op
      (``redistribute``, ``full_tensor``, ``from_local``, ``distribute_tensor``);
    * :meth:`until_local_op` sets the op until DTensor runs the op's local
      version (:meth:`local_op_ran`), a module pass begins or ends, or the step
      ends (:meth:`clear`).

    Attributes:
        op: the ``OpOverload`` being redistributed, or None. Read-only outside this class.
        args: its DTensor arguments or input specs (anything with ``placements`` and ``device_mesh``).
        cause: what asked for a redistribution that is not an op's, or None.
        source, target: the placements (tuples) being redistributed from and to, or None.
        mesh: their ``DeviceMesh``, or None.
    """

    __slots__ = ("_attrs", "_facts_of", "args", "cause", "mesh", "op", "source", "target")

    def __init__(self) -> None:
        self.op: Any = None
        self.args: tuple = ()
        self.cause: str | None = None
        self.source: tuple | None = None
        self.target: tuple | None = None
        self.mesh: Any = None
        self._facts_of: tuple = ()
        self._attrs: dict[str, Any] = {}

    def __call__(self, op: Any, args: tuple) -> _OpScope:
        """A context manager: ``op`` is the why inside the block."""
        return _OpScope(self, op, args)

    def redistributing(self, cause: str | None, source: tuple | None, target: tuple | None,
                       mesh: Any) -> _RedistributionScope:
        """A context manager: one redistribution from ``source`` to ``target`` placements on ``mesh``.

        ``cause`` None keeps the cause already set (an op's, or an outer API's, e.g. ``full_tensor``).
        """
        cause = self.cause if cause is None or self.cause == FULL_TENSOR else cause
        return _RedistributionScope(self, cause, source, target, mesh)

    def until_local_op(self, op: Any, args: tuple) -> None:
        """``op`` is the why until DTensor runs its local op (or a module boundary, or the step end)."""
        self.op, self.args = op, args

    def local_op_ran(self, op: Any) -> None:
        """DTensor runs ``op``'s local version: its redistribution is over."""
        if self.op is op:
            self.op = None

    def clear(self) -> None:
        self.op, self.args = None, ()
        self.cause = self.source = self.target = self.mesh = None

    def attributes(self) -> dict[str, Any] | None:
        """The event attributes of the current why, None when there is none (cached per redistribution)."""
        if self.op is None and self.cause is None:
            return None
        key = (self.op, self.args, self.cause, self.source, self.target)
        if len(key) != len(self._facts_of) or any(a is not b for a, b in zip(key, self._facts_of)):
            self._facts_of = key
            self._attrs = self._build()
        return self._attrs

    def _build(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        by_op = self.cause is None  # an explicit cause inside an op's dispatch is the nearer one
        facts = dtensor_facts(self.args) if by_op else {}
        if by_op:
            attrs[semconv.DTENSOR_OP] = attrs[semconv.DTENSOR_CAUSE] = str(self.op)
            if semconv.DTENSOR_INPUT_PLACEMENTS in facts:
                attrs[semconv.DTENSOR_INPUT_PLACEMENTS] = facts[semconv.DTENSOR_INPUT_PLACEMENTS]
        else:
            attrs[semconv.DTENSOR_CAUSE] = self.cause
        if self.source is not None and self.target is not None:
            attrs[semconv.DTENSOR_SOURCE_PLACEMENTS] = str(self.source)[:ATTR_MAX_CHARS]
            attrs[semconv.DTENSOR_TARGET_PLACEMENTS] = str(self.target)[:ATTR_MAX_CHARS]
        mesh = mesh_facts(self.mesh) if self.mesh is not None else facts
        for key in (semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES):
            if key in mesh:
                attrs[key] = mesh[key]
        return attrs


def dispatched_op_why() -> dict[str, Any] | None:
    """The "why" of a collective that a DTensor op issues itself rather than by redistributing its inputs:
    the op whose Python part (a custom op handler such as ``loss_parallel``'s, or the dispatcher's own)
    runs on this thread's stack (:func:`~commdebug_otel.capture._torch.dtensor_op_on_stack`), with its input
    placements and mesh; None when no such op runs."""
    found = _torch.dtensor_op_on_stack()
    if found is None:
        return None
    op, args = found
    attrs: dict[str, Any] = {semconv.DTENSOR_OP: str(op), semconv.DTENSOR_CAUSE: str(op)}
    facts = dtensor_facts(args)
    for key in (semconv.DTENSOR_INPUT_PLACEMENTS, semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES):
        if key in facts:
            attrs[key] = facts[key]
    return attrs


class CompiledWhys:
    """The "why" of collectives in compiled code, as seen when torch.compile traced them.

    DTensor's dispatch and redistributions run while dynamo and AOTAutograd trace a graph, on
    fake tensors, and not when the compiled code runs: the "why" is known only then. It is kept
    per (pass, op, process group, dtype, shape) and given to a collective of a compiled call
    with the same key at run time (AOTAutograd traces the backward inside autograd, as it later
    runs). A key traced with two different whys, or bucketed by Inductor into another shape,
    gets none: never a guess.
    """

    MAX_KEYS = 4096  # traced collectives remembered (a bound, not a cache of every step)

    def __init__(self) -> None:
        self._by_key: dict[tuple, dict[str, Any] | None] = {}

    def trace(self, spec: CollectiveSpec, group: GroupFacts, args: tuple, out: Any, why: Why) -> None:
        """A collective seen while a graph is traced, with the current why."""
        attrs = why.attributes() or dispatched_op_why()
        if attrs is None or len(self._by_key) >= self.MAX_KEYS:
            return
        key = self._key(spec, group, message(spec, args, out, group.size), _torch.in_backward())
        known = self._by_key.get(key, attrs)
        self._by_key[key] = dict(attrs) if known == attrs else None  # ambiguous: none

    def lookup(self, spec: CollectiveSpec, group: GroupFacts, msg: Message) -> dict[str, Any] | None:
        """The why traced for a collective of compiled code with this key, or None."""
        if not self._by_key:
            return None
        return self._by_key.get(self._key(spec, group, msg, _torch.in_backward()))

    @staticmethod
    def _key(spec: CollectiveSpec, group: GroupFacts, msg: Message, in_backward: bool) -> tuple:
        return in_backward, spec.op, group.name, msg.dtype, tuple(msg.shape)


# Causes of redistributions that are not an op's (torch.dtensor.cause).
REDISTRIBUTE = "redistribute"
FULL_TENSOR = "full_tensor"
DISTRIBUTE_TENSOR = "distribute_tensor"
# Causes whose collectives are c10d ops (distribute_tensor's scatter or broadcast from the source rank),
# not functional ones: the recorder gives those a "why" too.
C10D_CAUSES = frozenset({DISTRIBUTE_TENSOR})


class _OpScope:
    """Sets a :class:`Why`'s op for a block and restores the one before (tens per traced step: plain slots)."""

    __slots__ = ("_args", "_op", "_saved", "_why")

    def __init__(self, why: Why, op: Any, args: tuple) -> None:
        self._why, self._op, self._args = why, op, args
        self._saved: tuple = (None, ())

    def __enter__(self) -> None:
        why = self._why
        self._saved = (why.op, why.args)
        why.op, why.args = self._op, self._args

    def __exit__(self, *exc: Any) -> None:
        self._why.op, self._why.args = self._saved


class _RedistributionScope:
    """Sets a :class:`Why`'s redistribution (cause, placements, mesh) for a block and restores it after."""

    __slots__ = ("_saved", "_values", "_why")

    def __init__(self, why: Why, cause: str | None, source: tuple | None, target: tuple | None, mesh: Any) -> None:
        self._why, self._values = why, (cause, source, target, mesh)
        self._saved: tuple = (None, None, None, None)

    def __enter__(self) -> None:
        why = self._why
        self._saved = (why.cause, why.source, why.target, why.mesh)
        why.cause, why.source, why.target, why.mesh = self._values

    def __exit__(self, *exc: Any) -> None:
        why = self._why
        why.cause, why.source, why.target, why.mesh = self._saved
