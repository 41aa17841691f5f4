"""The collective path: metric points, completion timing, span-event attributes, and the "why".

``Recorder.collective`` classifies each collective (another thread, a quiet
step, or one that keeps records) and hands it here:

* :class:`CollectiveCounter` records its metric points, and times c10d
  collectives to completion without waiting for them;
* :func:`event_attributes` builds the span event of a traced collective from
  one :class:`Collective` (built only on paths that keep records: the quiet
  path allocates nothing per collective);
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

from . import _torch, semconv
from .ops import CollectiveSpec, GroupFacts, Message, message, payload_bytes, reduce_op_name
from .records import ATTR_MAX_CHARS, Record, dtensor_facts, mesh_facts
from .redact import describe

_logger = logging.getLogger(__name__)

PASS_NONE = "none"  # a collective outside any module pass (set-up, optimizer, logging)


class Collective:
    """One collective that keeps records (a traced step, an observer, or module labels on metrics)."""

    __slots__ = (
        "args",
        "dtype",
        "duration_ns",
        "group",
        "message",
        "out",
        "owner",
        "pass_",
        "seq",
        "spec",
        "start_ns",
    )

    def __init__(self, spec: CollectiveSpec, args: tuple, group: GroupFacts, seq: int,
                 duration_ns: int, out: Any, start_ns: int) -> None:
        self.spec = spec
        self.args = args
        self.group = group
        self.seq = seq  # per process group, how many collectives this rank issued on it before
        self.duration_ns = duration_ns  # issue time on the CPU
        self.out = out  # what the op returned (a c10d op's holds its Work)
        self.start_ns = start_ns  # time.perf_counter_ns() at issue
        self.pass_ = PASS_NONE
        self.owner: Record | None = None
        self.message: Message = message(spec, args, out, group.size)

    @property
    def fake(self) -> bool:
        """Fake or meta tensors: traced shapes that move no bytes."""
        return self.message.fake


class CollectiveCounter:
    """Metric points of collectives, and their completion times.

    Args:
        metrics: a ``metrics.LazyCollectiveMetrics`` (or anything with its
            ``collective`` and ``completion`` methods), or None for no metrics.
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
        self, metrics: Any, rank: Callable[[], Any], hook_failed: Callable[[str, BaseException], None],
        completed: Callable[[str, int], None] = lambda group, seq: None,
    ) -> None:
        self._metrics = metrics
        self._rank = rank
        self._hook_failed = hook_failed
        self._completed = completed
        self._untimed: set[str] = set()  # overloads whose Work has no future on this backend
        self.timed = True

    def count(self, spec: CollectiveSpec, args: tuple, group: GroupFacts, pass_: str, duration_ns: int,
              out: Any, start_ns: int, seq: int, plain: Any) -> None:
        """The points of a collective that keeps no records: the quiet path, kept short on purpose.

        ``plain``: ``ops.plain_payload(spec, args)``, which the recorder has already asked.
        """
        if self._metrics is None:
            return
        nbytes, fake = payload_bytes(spec, args, out, plain)
        if fake:
            return
        rank = self._rank().rank
        timed = self.timed
        self._metrics.collective(spec.op, pass_, group, rank, nbytes, duration_ns / 1e9 if timed else None, "",
                                 context=None)
        if timed and not spec.functional and out is not None:
            self._time_completion(out, spec, pass_, group, rank, "", start_ns, seq)

    def count_recorded(self, collective: Collective, fqn: str, context: Any) -> None:
        """The points of a recorded collective: ``fqn`` for module labels, ``context`` for exemplars."""
        if self._metrics is None or collective.fake:
            return
        spec, pass_, group = collective.spec, collective.pass_, collective.group
        rank = self._rank().rank
        timed = self.timed
        self._metrics.collective(spec.op, pass_, group, rank, collective.message.nbytes,
                                 collective.duration_ns / 1e9 if timed else None, fqn, context=context)
        if timed and not spec.functional and collective.out is not None:
            self._time_completion(collective.out, spec, pass_, group, rank, fqn, collective.start_ns,
                                  collective.seq)

    def _time_completion(self, out: Any, spec: CollectiveSpec, pass_: str, group: GroupFacts, rank: int,
                         fqn: str, start_ns: int, seq: int) -> None:
        """Record issue-to-completion time when the c10d ``Work``'s future completes (never waits).

        Some backends' works have no future (gloo's ``_reduce_scatter_base_`` raises
        "Work::getFuture not implemented"): that overload is not timed from then on.
        """
        if spec.overload_name in self._untimed:
            return
        work = boxed_work(out)
        if work is None:
            return
        try:
            future = _torch.work_future(work)
        except Exception as error:
            self._untimed.add(spec.overload_name)
            _logger.debug("commdebug-otel: %s is not timed to completion: %s", spec.overload_name, describe(error))
            return
        try:
            completion = _Completion(self, spec.op, pass_, group, rank, fqn, start_ns, seq)
            future.add_done_callback(OnBackendThread(completion))
        except Exception as error:
            self._untimed.add(spec.overload_name)
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

    __slots__ = ("counter", "fqn", "group", "op", "pass_", "rank", "seq", "start_ns")

    def __init__(self, counter: CollectiveCounter, op: str, pass_: str, group: GroupFacts, rank: int,
                 fqn: str, start_ns: int, seq: int) -> None:
        self.counter, self.op, self.pass_, self.group = counter, op, pass_, group
        self.rank, self.fqn, self.start_ns, self.seq = rank, fqn, start_ns, seq

    def __call__(self, _future: Any) -> None:
        try:
            self.counter._completed(self.group.name, self.seq)
            self.counter._metrics.completion(self.op, self.pass_, self.group, self.rank,
                                             (time.perf_counter_ns() - self.start_ns) / 1e9, self.fqn)
        except Exception as error:
            self.counter._hook_failed("completion time", error)


def event_attributes(collective: Collective, why: dict[str, Any] | None) -> dict[str, Any]:
    """The span-event attributes of a traced collective (docs/semantic-conventions.md, "Collectives").

    ``why``: the attributes of the DTensor op behind it (:meth:`Why.attributes`), or None.
    """
    spec, group, args, msg = collective.spec, collective.group, collective.args, collective.message
    attrs: dict[str, Any] = {
        semconv.COLLECTIVE_OP: spec.op,
        semconv.OP_NAME: spec.overload_name,
        semconv.COLLECTIVE_BYTES: msg.nbytes,
        semconv.COLLECTIVE_INPUT_ELEMENTS: msg.input_elements,
        semconv.COLLECTIVE_OUTPUT_ELEMENTS: msg.output_elements,
        semconv.COLLECTIVE_DTYPE: msg.dtype,
        semconv.PROCESS_GROUP_NAME: group.name,
        semconv.PROCESS_GROUP_SIZE: group.size,
        semconv.COLLECTIVE_SEQ: collective.seq,
        semconv.MODULE_PASS: collective.pass_,
        semconv.COLLECTIVE_DURATION: collective.duration_ns / 1e9,
    }
    if msg.shape:  # a 0-d tensor's shape is empty: the key is left out
        attrs[semconv.COLLECTIVE_SHAPE] = msg.shape
    if group.dim_name:
        attrs[semconv.DEVICE_MESH_DIM_NAME] = group.dim_name
    if msg.fake:
        attrs[semconv.COLLECTIVE_FAKE] = True
    if 0 <= spec.reduce_index < len(args):
        attrs[semconv.COLLECTIVE_REDUCE_OP] = reduce_op_name(args[spec.reduce_index])
    if 0 <= spec.peer_index < len(args):
        attrs[semconv.COLLECTIVE_PEER] = int(args[spec.peer_index])
    if why:
        attrs.update(why)
    return attrs


def boxed_work(out: Any) -> Any:
    """The boxed c10d ``Work`` a c10d op returned (alone, or last in a tuple); None for other results."""
    work = out[-1] if isinstance(out, tuple) and out else out
    return work if isinstance(work, torch.ScriptObject) else None


def peer_when_received(collective: Collective, attrs: dict[str, Any],
                       hook_failed: Callable[[str, BaseException], None], awaiting: dict[int, tuple]) -> None:
    """A ``recv`` from any source (``dist.recv(buf)`` without ``src``): its peer is added to ``attrs``
    once received (``Work.source_rank()``, a rank in the group), if before the step ends: when its
    ``Work`` future completes or, where the backend's work has no future (gloo), when ``Work.wait()``
    returns (``awaiting``: ``id(work) -> (work, attrs)``, which ``Recorder.waited`` reads)."""
    if collective.spec.op != semconv.RECV or semconv.COLLECTIVE_PEER in attrs:
        return
    work = boxed_work(collective.out)
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
    runs on this thread's stack (:func:`~commdebug_otel._torch.dtensor_op_on_stack`), with its input
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

    def lookup(self, collective: Collective) -> dict[str, Any] | None:
        if not self._by_key:
            return None
        return self._by_key.get(self._key(collective.spec, collective.group, collective.message,
                                          _torch.in_backward()))

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
