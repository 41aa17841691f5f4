"""Records: the spans-to-be of one step, the step's span tree, and a record's attributes.

The recorder (``core/recorder.py``) fills a :class:`Step` with :class:`Record` objects
while the step runs; when the step closes, :func:`span_tree` arranges them
into (roots, children) and the span sink (``spans.SpanBuilder.emit``) turns each into
an OTel span with :func:`span_attributes`. Nothing here touches OTel.
"""

from __future__ import annotations

import enum
import hashlib
import time
import weakref
from collections.abc import Iterator
from operator import attrgetter
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.detail import dtensor_inputs

ATTR_MAX_CHARS = 1024  # bound on any string attribute we build


class SpanKind(enum.Enum):
    """What a record (or a step) stands for."""

    MODULE = "module"  # a module's forward, backward or recompute pass
    STEP = "step"  # the ``train_step`` root
    OUTSIDE_STEP = "outside_step"  # the root of collectives outside any step (set-up), or a step's tail
    INFERENCE = "inference"  # a step without ``train_step``: each top-level forward is a root



class Record:
    """A span-to-be. Times are ``time.time_ns()`` nanoseconds (``end_ns`` 0: still open)."""

    __slots__ = (
        "attrs",
        "backward_hook",
        "call_index",
        "compiled",
        "depth",
        "dropped_events",
        "end_hook",
        "end_ns",
        "error",
        "events",
        "fqn",
        "fwd",
        "graph_task",
        "handling",
        "hidden",
        "input_hooked",
        "kids",
        "kind",
        "last_bw",
        "module_type",
        "name",
        "open_bw",
        "params",
        "parent",
        "pass_",
        "prev_bw",
        "span_id",
        "start_ns",
        "unmatched",
    )
    # A tensor hook of ours: pickling a tensor that holds it warns of nothing (torch.utils.hooks.warn_if_has_hooks).
    __torch_unserializable__ = True

    def __init__(self, kind: SpanKind, name: str, start_ns: int) -> None:
        # What a record keeps when it is reused for another call (Recorder._module_record): its
        # attribute dict, its children's list (span_tree) and its backward-end hook (capture/tracker.py).
        # The tracker's other bookkeeping of a call is its own (per-call lists); this hook and
        # backward_hook stay here: elsewhere each is an object more per call alive through the step.
        self.attrs: dict[str, Any] = {}
        self.kids: list[Record] | None = None
        self.end_hook: Any = None
        self.reset(kind, name, start_ns)

    def reset(self, kind: SpanKind, name: str, start_ns: int) -> None:
        """Start afresh, as a new record would (what :meth:`__init__` made is emptied, not made anew)."""
        self.attrs.clear()
        if self.kids:
            self.kids.clear()
        self.kind = kind
        self.name = name
        self.fqn = ""
        self.module_type = ""
        self.pass_ = ""
        self.call_index = 0
        self.depth = 0  # parents above it (train_step: 0); a backward record has its forward's
        self.start_ns = start_ns
        self.end_ns = 0
        self.parent: Record | None = None
        self.fwd: Record | None = None  # backward record -> its forward record
        # Lists and sets are made on first use: a step's records live through several garbage
        # collections, whose cost grows with every container object alive (docs/performance.md).
        self.events: list[tuple[str, dict, int]] | tuple = ()
        self.dropped_events = 0
        self.error: BaseException | None = None
        # (exception, its traceback) being handled when a forward began; None once it ended
        self.handling: tuple[BaseException, Any] | None = None
        self.unmatched = False
        self.params: list[str] | None = None
        self.open_bw: Record | None = None  # forward record -> its open backward record
        # A forward record's backward records, newest first: last_bw, then each one's prev_bw
        # (a chain, not a list: one container object fewer per call; backward_records()).
        self.last_bw: Record | None = None
        self.prev_bw: Record | None = None
        self.graph_task = -1
        self.input_hooked = False
        self.hidden = False
        self.compiled = False  # the module's own code ran compiled (torch.compile): no records inside
        self.span_id = 0  # assigned up front when a metric exemplar points at this span
        self.backward_hook: Any = None  # called with the record when it is called (below)

    def __call__(self, _grad: Any) -> None:
        """A tensor hook on the call's outputs (``capture/tracker.py``): its backward begins.

        The record is the hook itself, one object fewer per call alive through the step.
        """
        hook = self.backward_hook
        if hook is not None:
            hook(self)


class Step:
    """One step's records: a training step, an inference forward, or the ``outside_step`` root."""

    __slots__ = (
        "backward_done",
        "fingerprints",
        "had_module",
        "hooks",
        "index",
        "inference",
        "kind",
        "parent_span_id",
        "part",
        "quiet",
        "records",
        "root",
        "stalled",
        "tensor_hooks",
        "trace_id",
        "traced",
    )

    def __init__(self, index: int, traced: bool, root: Record, kind: SpanKind) -> None:
        self.index = index
        self.traced = traced
        self.root = root
        self.records: list[Record] = []
        self.kind = kind  # STEP, OUTSIDE_STEP, or INFERENCE once it closes as one
        self.backward_done = 0  # backward passes completed in this step
        self.had_module = False
        self.trace_id = 0  # known up front for traced steps when span ids can be pre-assigned
        self.parent_span_id = 0  # a train_step_tail: the span id of its step's train_step (its root's parent)
        # Hooks removed when the step closes: tensor hooks as flat (hooks dict, key) pairs (no handle
        # object kept per hook, see Recorder.keep_hook), other handles (multi-grad hooks) as they are.
        self.tensor_hooks: list[Any] = []
        self.hooks: list[Any] = []
        self.inference = False  # a top-level forward without grad: its own root, not a train_step
        # Keeps nothing but metric points (untraced, no module label, no observer of every
        # collective): its collectives take the short path in Recorder.collective().
        self.quiet = False
        # 0, or which part of its step this is: a step past max_spans_per_step goes on in a fresh Step.
        self.part = 0
        self.stalled = 0  # stall snapshots taken during this step
        # Traced steps: per process group, [hash of the ordered (op, dtype, shape), count, first seq].
        self.fingerprints: dict[str, list] = {}

    def fingerprint(self, group: str, seq: int, op: str, dtype: str, shape: list[int], reduce_op: str = "") -> None:
        """Add a collective to its process group's desync fingerprint (traced steps)."""
        entry = self.fingerprints.get(group)
        if entry is None:
            entry = self.fingerprints[group] = [hashlib.blake2b(digest_size=8), 0, seq]
        entry[0].update(f"{op}|{dtype}|{shape}|{reduce_op};".encode())
        entry[1] += 1

    def fingerprint_attributes(self) -> dict[str, Any]:
        """The ``torch.step.collective_*`` arrays, by process group name (none if no collective)."""
        groups = sorted(self.fingerprints)
        if not groups:
            return {}
        entries = [self.fingerprints[group] for group in groups]
        return {
            semconv.STEP_COLLECTIVE_GROUPS: groups,
            semconv.STEP_COLLECTIVE_FINGERPRINTS: [entry[0].hexdigest() for entry in entries],
            semconv.STEP_COLLECTIVE_COUNTS: [entry[1] for entry in entries],
            semconv.STEP_COLLECTIVE_FIRST_SEQ: [entry[2] for entry in entries],
        }


# ------------------------------------------------------------------ the span tree
def span_tree(step: Step) -> tuple[list[Record], dict[int, list[Record]]]:
    """The finished step as ``(roots, children)``: ``children[id(record)]`` in start order.

    Records still open end with the step, marked unmatched. Backward records
    nest by the module tree (not hook order), hidden records (module
    include/exclude) hand their children to the nearest shown ancestor, and
    every span is widened to cover its children.
    """
    children: dict[int, list[Record]] = {}
    root = step.root
    for record in step.records:
        if record.end_ns < record.start_ns:
            # Still open (0), or ended by a clock read before it began (a close on another thread,
            # the wall clock set back): it ends no earlier than it began.
            if record.end_ns == 0:
                record.end_ns, record.unmatched = root.end_ns, True
            if record.end_ns < record.start_ns:
                record.end_ns = record.start_ns
        parent = _parent_of(record, root)
        if record.hidden:
            continue
        # The parent's own list (kept when records are reused): no list made per parent and step.
        kids = parent.kids
        if kids is None:
            kids = parent.kids = []
        if not kids:
            children[id(parent)] = kids
        kids.append(record)
    _widen(root, children)
    if root.end_ns < root.start_ns:
        root.end_ns = root.start_ns
    if step.kind is SpanKind.INFERENCE:  # top-level forwards are the roots
        return children.get(id(root), []), children
    return [root], children


def snapshot_tree(step: Step, records: list[Record], now: int,
                  snapshot: int) -> tuple[list[Record], dict[int, list[Record]], Record]:
    """An open step's records so far as a finished tree, for stall snapshot ``snapshot``.

    Works on copies (the training thread may still be running the step): records
    still open end at the snapshot, marked ``commdebug.span.incomplete``; every copy
    carries ``commdebug.stall.snapshot`` and gets its own span id. ``records``: the step's
    records, listed as the copy begins. ``now``: the watchdog's ``time.time_ns()``; the
    snapshot's time is the later of it and the clock read once everything is copied, so no
    copy ends before it starts or before its events (a record begun, or a collective
    recorded, after the watchdog read ``now``: the training thread went on meanwhile).
    Returns ``(roots, children, the root's copy)`` as :func:`span_tree` does.
    """
    originals = [step.root, *records]
    copies: dict[int, Record] = {}
    still_open = []
    for record in originals:
        copy = Record.__new__(Record)
        for name in Record.__slots__:
            setattr(copy, name, getattr(record, name))
        copy.attrs, copy.kids = dict(record.attrs), None
        copy.attrs[semconv.STALL_SNAPSHOT] = snapshot
        copy.events, copy.span_id = list(record.events), 0
        if copy.end_ns == 0:
            still_open.append(copy)
        copies[id(record)] = copy
    taken = max(now, time.time_ns())  # after the copies: every time they hold was read before it
    for copy in still_open:
        copy.end_ns = max(taken, copy.start_ns)
        copy.attrs[semconv.SPAN_INCOMPLETE] = True
    root = copies[id(step.root)]
    for copy in copies.values():
        if copy is not root:
            copy.parent = copies.get(id(copy.parent), root)
        copy.fwd = copies.get(id(copy.fwd))
        copy.last_bw, copy.prev_bw = _first_copied(copy.last_bw, copies), _first_copied(copy.prev_bw, copies)
    part = Step(step.index, True, root, step.kind)
    part.records = [copies[id(record)] for record in originals[1:]]
    roots, children = span_tree(part)
    return roots, children, root


def _first_copied(record: Record | None, copies: dict[int, Record]) -> Record | None:
    """The copy of ``record``, or of the first record in its ``prev_bw`` chain that has one."""
    while record is not None and id(record) not in copies:
        record = record.prev_bw
    return None if record is None else copies[id(record)]


def backward_records(forward: Record) -> Iterator[Record]:
    """A forward record's backward records, the most recent first."""
    record = forward.last_bw
    while record is not None:
        yield record
        record = record.prev_bw


def self_times(step: Step, end_ns: int) -> dict[tuple[str, str], int]:
    """ns each ``(module FQN, pass)`` of the closing ``step`` spent in its own code, not its shown children's
    (several calls summed; hidden records count in their parent); ``("(train_step)", "")``: the step's time
    outside every module. ``end_ns``: the step's end. Open records are left out. Read before
    :func:`span_tree`, which it does not change."""
    root = step.root
    times: dict[tuple[str, str], int] = {}
    own = f"({semconv.SPAN_TRAIN_STEP})", ""
    times[own] = end_ns - root.start_ns
    for record in step.records:
        if record.hidden or record.kind is not SpanKind.MODULE or record.end_ns < record.start_ns:
            continue
        duration = record.end_ns - record.start_ns
        label = record.fqn, record.pass_
        times[label] = times.get(label, 0) + duration
        parent = _parent_of(record, root)
        above = own if parent is root else (parent.fqn, parent.pass_)
        times[above] = times.get(above, 0) - duration
    return {label: max(0, ns) for label, ns in times.items()}


def _parent_of(record: Record, root: Record) -> Record:
    if record.pass_ == semconv.PASS_BACKWARD:
        ancestor = record.fwd.parent if record.fwd is not None else None
        while ancestor is not None and ancestor.kind is SpanKind.MODULE:
            if ancestor.pass_ == semconv.PASS_BACKWARD:  # a recompute inside a backward (reentrant checkpoint)
                return ancestor if not ancestor.hidden else _parent_of(ancestor, root)
            for candidate in backward_records(ancestor):
                if candidate.graph_task == record.graph_task and not candidate.hidden:
                    return candidate
            ancestor = ancestor.parent
        return root
    parent = record.parent or root
    while parent.hidden and parent.parent is not None:
        parent = parent.parent
    return parent


_START = attrgetter("start_ns")  # a sort key that is no Python call per record


def _widen(record: Record, children: dict[int, list[Record]]) -> None:
    """Make every span cover its children (backward hooks can fire child-first)."""
    kids = children.get(id(record))
    if not kids:
        return
    kids.sort(key=_START)
    for child in kids:
        _widen(child, children)
        if child.start_ns < record.start_ns:
            record.start_ns = child.start_ns
        if child.end_ns > record.end_ns:
            record.end_ns = child.end_ns


def descends_from(record: Record, forward: Record | None) -> bool:
    """True if ``record`` (a backward record) belongs to a module call inside ``forward``'s call.

    Walks up only as far as ``forward``'s depth: the cost is the depth between the two, not to the root.
    """
    if forward is None:
        return False
    ancestor = record.fwd.parent if record.fwd is not None else None
    depth = forward.depth
    while ancestor is not None and ancestor.depth >= depth:
        if ancestor is forward:
            return True
        ancestor = ancestor.parent
    return False


# ------------------------------------------------------------------ attributes
def span_attributes(record: Record) -> dict[str, Any]:
    """The span attributes of a finished record (a fresh dict; docs/semantic-conventions.md, "Span attributes")."""
    attributes = dict(record.attrs)
    if record.fqn:
        attributes[semconv.MODULE_FQN] = record.fqn
        attributes[semconv.MODULE_TYPE] = record.module_type
        attributes[semconv.MODULE_PASS] = record.pass_
        attributes[semconv.MODULE_DEPTH] = record.fqn.count(".")
        attributes[semconv.MODULE_CALL_INDEX] = record.call_index
    if record.params:
        attributes[semconv.MODULE_PARAMETERS] = record.params
    if record.compiled:
        attributes[semconv.MODULE_COMPILED] = True
    if record.unmatched:
        attributes[semconv.SPAN_UNMATCHED] = True
    if record.dropped_events:
        attributes[semconv.SPAN_DROPPED_EVENTS] = record.dropped_events
    return attributes


def _placements_text(tensor: Any) -> str:
    return str(tuple(tensor.placements))


def dtensor_facts(args: tuple) -> dict[str, Any]:
    """Event attributes describing the DTensor arguments in ``args``: shapes, placements, mesh.

    Keys whose value would be an empty array are left out (a ``_foreach_*`` op's
    DTensors sit in lists, a mesh may have no dimension names).
    """
    shapes, placements, mesh = dtensor_inputs(args)
    facts: dict[str, Any] = {}
    if shapes:
        facts[semconv.DTENSOR_INPUT_SHAPES] = [str(list(shape)) for shape in shapes]
        facts[semconv.DTENSOR_INPUT_PLACEMENTS] = [
            str(tuple(placement))[:ATTR_MAX_CHARS] for placement in placements]
    if mesh is not None:
        facts.update(mesh_facts(mesh))
    return facts


def mesh_facts(mesh: Any) -> dict[str, Any]:
    """``torch.device_mesh``, its shape, and its dimension names when it has any.

    The same dict for the same mesh (a mesh does not change; its text costs tens of
    microseconds per collective): copy from it, never change it.
    """
    try:
        facts = _MESH_FACTS.get(mesh)
    except TypeError:  # not weakly referenceable or not hashable: not cached
        return _mesh_facts(mesh)
    if facts is None:
        facts = _MESH_FACTS[mesh] = _mesh_facts(mesh)
    return facts


_MESH_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_facts(mesh: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        semconv.DEVICE_MESH: str(mesh)[:ATTR_MAX_CHARS],
        semconv.DEVICE_MESH_SHAPE: [int(size) for size in mesh.shape],
    }
    if mesh.mesh_dim_names:
        facts[semconv.DEVICE_MESH_DIM_NAMES] = list(mesh.mesh_dim_names)
    return facts


def parameter_facts(module: torch.nn.Module) -> list[str]:
    """``"name [shape] placements"`` per direct parameter; no values."""
    facts = []
    for name, param in module.named_parameters(recurse=False):
        text = f"{name} {list(param.shape)}"
        if hasattr(param, "placements"):
            text += " " + _placements_text(param)
        facts.append(text[:ATTR_MAX_CHARS])
    return facts
