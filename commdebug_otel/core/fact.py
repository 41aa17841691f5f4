"""One collective, once: the fact every output renders, and the one place its names are written and read.

A :class:`CollectiveFact` is made once per collective the training thread issues
(``collectives.quiet_fact`` on every step, ``collectives.recorded_fact`` where
records are kept) and never changed. Everything that tells of a collective renders
it here, so the names on the wire (docs/semantic-conventions.md) are written in one
place: the span event (:func:`event_attributes`), the stall ring's events
(:func:`ring_event_attributes`), and the metric labels (:func:`metric_labels`,
:func:`group_labels`). The offline reader parses an event back with :func:`parse`. Where a
stalled rank is in the step sequence is said here once too (:func:`stall_step_text`): the
watchdog's stderr line and ``diagnose`` word it alike. Metric points take the whole fact (:class:`MetricsSink`).

No torch and no OpenTelemetry here: the offline commands import it, and a compiled
or C++ fast path would fill the same record.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from commdebug_otel import semconv

PASS_NONE = "none"  # a collective outside any module pass (set-up, optimizer, logging)
NOT_COUNTED = -1  # an element count, seq or peer not known (untraced steps count no elements)
#: Point-to-point ops: paired by (group, sender, receiver), never matched as collectives (live and offline).
P2P = frozenset({semconv.SEND, semconv.RECV, semconv.BATCH_P2P})


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """A process group as telemetry sees it: name, size and device-mesh dimension."""

    name: str
    size: int
    # The device-mesh dimensions the group serves (semconv.DEVICE_MESH_DIM_NAME_SEPARATOR between several,
    # in the order the meshes were made); "" when it serves none.
    dim_name: str


class CollectiveFact(NamedTuple):
    """One collective on this rank, without any tensor value. Immutable; made once per collective.

    Attributes:
        op: canonical op (``all_gather``; the event's name).
        overload: the dispatcher overload (``_c10d_functional.all_gather_into_tensor.default``).
        group: its process group (name, size, mesh dimensions).
        seq: collectives this rank issued on the group before this one; -1 on another thread.
        dtype: dtype of the first input tensor, else of the first output tensor (``uint8`` for barrier,
            ``unknown`` for an op with no tensor at all); never empty.
        shape: that tensor's shape (``(0,)`` for barrier; empty for a 0-d tensor or no tensor).
        input_elements, output_elements: the profiler's ``in_msg_nelems``/``out_msg_nelems``;
            -1 (:data:`NOT_COUNTED`) on steps that keep no records.
        nbytes: bytes this rank sends (else receives); 0 for barrier.
        fake: FakeTensor or meta-device payload: no traffic.
        reduce_op: ``sum``...; "" where the op has none.
        peer: send's destination, recv's source (a rank in the group); -1 where unknown or none.
        time_ns: ``time.time_ns()`` when the op returned (its issue ended): the event's time.
        duration_ns: CPU time spent issuing it, in nanoseconds.
        fqn: the owning module's FQN ("" when none is known: untraced steps, no module).
        pass_: ``forward``, ``backward``, ``recompute`` or ``none``.
        why: the DTensor "why" attributes (``torch.dtensor.*``, ``torch.device_mesh.*``), or None.
    """

    op: str
    overload: str
    group: GroupFacts
    seq: int
    dtype: str
    shape: tuple
    input_elements: int
    output_elements: int
    nbytes: int
    fake: bool
    reduce_op: str
    peer: int
    time_ns: int
    duration_ns: int
    fqn: str
    pass_: str
    why: Mapping[str, Any] | None


class MetricsSink(Protocol):
    """Where the recorder's metric points go (``otel.metrics.LazyCollectiveMetrics``): each collective as its
    whole fact, each step's times, and what was dropped. Called on the training thread, except
    :meth:`completion` (the backend's completion thread); none of them may block or raise past the call."""

    def collective(self, fact: CollectiveFact, rank: int, duration_s: float | None,
                   span_ref: tuple[int, int] | None = None) -> None:
        """One collective; ``duration_s``: its issue time in seconds, None on a step that is not timed;
        ``span_ref``: the owning span's ``(trace id, span id)``, for exemplars."""
        ...

    def completion(self, fact: CollectiveFact, rank: int, duration_s: float) -> None:
        """``fact``'s c10d work completed ``duration_s`` seconds after it was issued."""
        ...

    def step(self, duration_s: float, wait_s: float, span_ref: tuple[int, int] | None = None) -> None:
        """A training step ended: its duration and collective wait, in seconds."""
        ...

    def dropped(self, kind: str, count: int) -> None:
        """``count`` items of ``kind`` (``semconv.DROPPED_KIND_*``) were dropped."""
        ...

    def flush(self) -> None: ...

    def reset(self) -> None:
        """Forget the instruments (a forked child makes its own)."""
        ...


def _named(fact: CollectiveFact) -> dict[str, Any]:
    """What a collective's span event and its ring event both say of it: op, group, seq, dtype, shape, bytes."""
    group = fact.group
    attrs: dict[str, Any] = {
        semconv.COLLECTIVE_OP: fact.op,
        semconv.PROCESS_GROUP_NAME: group.name,
        semconv.PROCESS_GROUP_SIZE: group.size,
        semconv.COLLECTIVE_SEQ: fact.seq,
        semconv.COLLECTIVE_DTYPE: fact.dtype,
        semconv.COLLECTIVE_BYTES: fact.nbytes,
    }
    if fact.shape:  # a 0-d tensor's shape is empty: the key is left out (an empty array is never exported)
        attrs[semconv.COLLECTIVE_SHAPE] = list(fact.shape)
    if group.dim_name:
        attrs[semconv.DEVICE_MESH_DIM_NAME] = group.dim_name
    return attrs


def event_attributes(fact: CollectiveFact) -> dict[str, Any]:
    """The span-event attributes of a traced collective (docs/semantic-conventions.md, "Collective events").

    A fresh dict: a recv from any source gets its peer added once received.
    """
    attrs = _named(fact)
    attrs[semconv.OP_NAME] = fact.overload
    attrs[semconv.COLLECTIVE_INPUT_ELEMENTS] = fact.input_elements
    attrs[semconv.COLLECTIVE_OUTPUT_ELEMENTS] = fact.output_elements
    attrs[semconv.MODULE_PASS] = fact.pass_
    attrs[semconv.COLLECTIVE_DURATION] = fact.duration_ns / 1e9
    if fact.fake:
        attrs[semconv.COLLECTIVE_FAKE] = True
    if fact.reduce_op:
        attrs[semconv.COLLECTIVE_REDUCE_OP] = fact.reduce_op
    if fact.peer >= 0:
        attrs[semconv.COLLECTIVE_PEER] = fact.peer
    if fact.why:
        attrs.update(fact.why)
    return attrs


def ring_event_attributes(fact: CollectiveFact, completed: bool, now_ns: int) -> dict[str, Any]:
    """The attributes of a ``stalled`` span's ring event: ``completed`` or in flight, ``now_ns`` the snapshot's
    ``time.time_ns()`` (the age is counted from the fact's time)."""
    attrs = _named(fact)
    attrs[semconv.COLLECTIVE_STATE] = semconv.STATE_COMPLETED if completed else semconv.STATE_IN_FLIGHT
    attrs[semconv.STALL_AGE] = round((now_ns - fact.time_ns) / 1e9, 6)
    if fact.fqn:
        attrs[semconv.MODULE_FQN] = fact.fqn
        attrs[semconv.MODULE_PASS] = fact.pass_
    return attrs


def ranges_text(numbers: Iterable[int], separator: str = ",") -> str:
    """``[5, 0, 1, 2, 7, 8]`` -> ``0-2,5,7-8`` (sorted; ``""`` when empty): ranks and steps as the verdict and
    the offline commands list them."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return separator.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def group_labels(name: str, dim_name: str, rank_label: bool) -> dict[str, Any]:
    """How a metric point names its process group (collective points and the progress gauges alike): by
    name, or, without the rank label, a mesh dimension's group by its dimension (the same on every rank)."""
    if dim_name and not rank_label:
        return {semconv.DEVICE_MESH_DIM_NAME: dim_name}
    return {semconv.PROCESS_GROUP_NAME: name}


def metric_labels(op: str, pass_: str, group: GroupFacts, rank_labels: Mapping[str, Any], module: str,
                  text: Callable[[str], str] = str) -> dict[str, Any]:
    """The labels of a collective's metric points (``torch.collective.*``).

    ``rank_labels``: the rank label, or none (``metric_rank_label``); ``module``: the module label
    ("" for none); ``text`` makes the script's names valid Unicode (``redact.valid_text``).
    """
    dim_name = text(group.dim_name) if group.dim_name else ""
    labels: dict[str, Any] = {semconv.COLLECTIVE_OP: op, semconv.MODULE_PASS: pass_,
                              **group_labels(text(group.name), dim_name, bool(rank_labels)),
                              semconv.PROCESS_GROUP_SIZE: group.size, **rank_labels}
    if dim_name:
        labels[semconv.DEVICE_MESH_DIM_NAME] = dim_name
    if module:
        labels[semconv.MODULE_FQN] = text(module)
    return labels


def parse(attrs: Mapping[str, Any], name: str = "") -> CollectiveFact | None:
    """The fact an exported collective event (span or ring) tells, from its attributes as read back
    (``offline.otlp_json``); None when the event is not a collective's. ``name``: the event's name, the op
    where the attribute is missing. What an event leaves out reads as unknown: ``""``, ``()``, -1."""
    op = attrs.get(semconv.COLLECTIVE_OP, name)
    if not op:
        return None
    why = {key: value for key, value in attrs.items() if key in WHY_ATTRIBUTES}
    return CollectiveFact(
        op=str(op),
        overload=str(attrs.get(semconv.OP_NAME, "")),
        group=GroupFacts(str(attrs.get(semconv.PROCESS_GROUP_NAME, "")), int(attrs.get(semconv.PROCESS_GROUP_SIZE, 0)),
                         str(attrs.get(semconv.DEVICE_MESH_DIM_NAME, ""))),
        seq=int(attrs.get(semconv.COLLECTIVE_SEQ, NOT_COUNTED)),
        dtype=str(attrs.get(semconv.COLLECTIVE_DTYPE, "")),
        shape=tuple(attrs.get(semconv.COLLECTIVE_SHAPE, ())),
        input_elements=int(attrs.get(semconv.COLLECTIVE_INPUT_ELEMENTS, NOT_COUNTED)),
        output_elements=int(attrs.get(semconv.COLLECTIVE_OUTPUT_ELEMENTS, NOT_COUNTED)),
        nbytes=int(attrs.get(semconv.COLLECTIVE_BYTES, 0)),
        fake=attrs.get(semconv.COLLECTIVE_FAKE) is True,
        reduce_op=str(attrs.get(semconv.COLLECTIVE_REDUCE_OP, "")),
        peer=int(attrs.get(semconv.COLLECTIVE_PEER, NOT_COUNTED)),
        time_ns=0,
        duration_ns=round(float(attrs.get(semconv.COLLECTIVE_DURATION, 0.0)) * 1e9),
        fqn=str(attrs.get(semconv.MODULE_FQN, "")),
        pass_=str(attrs.get(semconv.MODULE_PASS, "")),
        why=why or None,
    )


# The "why" of a collective (collectives.Why): read back into CollectiveFact.why.
WHY_ATTRIBUTES = frozenset({
    semconv.DTENSOR_OP, semconv.DTENSOR_CAUSE, semconv.DTENSOR_INPUT_PLACEMENTS, semconv.DTENSOR_SOURCE_PLACEMENTS,
    semconv.DTENSOR_TARGET_PLACEMENTS, semconv.DEVICE_MESH_SHAPE, semconv.DEVICE_MESH_DIM_NAMES,
})


def versioned_record(text: str | bytes, record_format: int) -> dict[str, Any] | None:
    """The JSON object in ``text`` (a rank's record in the job's store) when its ``"format"`` is
    ``record_format``; None when it is another (a rank of another version).

    Raises:
        ValueError: ``text`` is not JSON.
    """
    data = json.loads(text)
    return data if isinstance(data, dict) and data.get("format") == record_format else None


#: The place of time under no span: after one step's end and before the next's first module (data loading,
#: host work), where a straggler's extra time or a stall can be.
BETWEEN_STEPS = "(between steps)"


def stall_step_text(between_steps: bool, step: int | None) -> str:
    """Where a stalled rank is in the step sequence: ``in step 3``, ``before step 0``, ``between step 2 and
    step 3``, or ``between steps`` (step not known).

    ``step``: the ``stalled`` span's ``torch.step``: the open step, or between steps the next one (the
    optimizer steps taken), so a stall before the first optimizer step is ``before step 0``.
    """
    if not between_steps:
        return f"in step {step}"
    if step is None:
        return "between steps"
    return "before step 0" if step == 0 else f"between step {step - 1} and step {step}"
