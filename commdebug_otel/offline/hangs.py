"""The hang rule: which rank the others wait for, from each rank's record of its stall. Torch-free.

One rule, two callers: the live verdict (:mod:`commdebug_otel.stall.verdict`: each stalled rank publishes a
:class:`StallRecord` in the job's c10d store and one rank forms the verdict) and ``commdebug-otel diagnose``
(:func:`commdebug_otel.offline.diagnose.stalls`: a :class:`StallRecord` per rank from the ``stalled`` spans in the
files). Both call :func:`form_verdict`, so they name the same ranks from the same facts.

Usage::

    from commdebug_otel.offline.hangs import GroupProgress, InFlight, StallRecord, form_verdict

    def record(rank, issued, in_flight=()):
        return StallRecord(rank, 5, 10**18, 30.0, 1, False, "M", "forward", (),
                           {"0": GroupProgress(issued, issued - len(in_flight), "", 2, in_flight)})

    waiting = record(0, 8, (InFlight(8, "all_reduce", "M", "forward", ""),))
    verdict = form_verdict({0: waiting, 1: record(1, 7)}, world_size=2, step=5)
    verdict.kind, verdict.behind, verdict.waiting  # ("hang", (1,), (0,))

What it does not do: read a store, a file or a process (the callers do), or tell a dead rank from a silent
one (the caller's ``absent``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import BETWEEN_STEPS, P2P, ranges_text, versioned_record

__all__ = ["BETWEEN_STEPS", "KIND_DESYNC", "KIND_HANG", "KIND_MISSING", "RECORD_FORMAT", "GroupProgress", "InFlight",
           "StallRecord", "Verdict", "cause_text", "form_verdict", "ranks_text"]

RECORD_FORMAT = 2  # 2: named fields, keyed per job (1: positional in-flight lists, keyed per step)
MAX_RANKS_LISTED = 8  # the summary sentence lists at most this many ranks one by one

KIND_HANG = semconv.VERDICT_KIND_HANG
KIND_DESYNC = semconv.VERDICT_KIND_DESYNC
KIND_MISSING = semconv.VERDICT_KIND_MISSING


# ------------------------------------------------------------------ the record
@dataclasses.dataclass(frozen=True)
class InFlight:
    """A collective a rank issued on a group and does not know complete."""

    seq: int
    op: str
    module: str  # FQN of the module that issued it ("" unknown)
    pass_: str
    cause: str  # its DTensor why in a few words (:func:`cause_text`), "" none


@dataclasses.dataclass(frozen=True)
class GroupProgress:
    """A rank's progress on one process group: per-group seqs are the clock every member shares."""

    issued: int
    completed: int
    mesh_dim: str
    size: int  # members (0: not known from the ring)
    in_flight: tuple[InFlight, ...] = ()

    def entry(self, seq: int) -> InFlight | None:
        """The in-flight collective at ``seq``, or None."""
        return next((entry for entry in self.in_flight if entry.seq == seq), None)


@dataclasses.dataclass(frozen=True)
class StallRecord:
    """One rank's published record of its stall: where it is, and its progress on every process group.

    ``step`` is the rank's own step count (between steps: the next one); ranks may count steps differently
    (a pipeline stage, a rank one step behind), so the verdict never matches records by it. ``time_ns`` is the
    snapshot's time (ns since the epoch), ``age_s`` the stall's age then (seconds), ``snapshot`` its number in
    this stall (1, 2, ...); ``stack`` the training thread's code locations, innermost last.
    """

    rank: int
    step: int
    time_ns: int
    age_s: float
    snapshot: int
    between_steps: bool
    module: str
    pass_: str
    stack: tuple[str, ...]
    groups: Mapping[str, GroupProgress]

    @property
    def since_ns(self) -> int:
        """When this rank's stall began (ns since the epoch)."""
        return self.time_ns - round(self.age_s * 1e9)

    def to_json(self) -> str:
        """Compact JSON with named fields and ``"format": RECORD_FORMAT``."""
        groups = {name: {"issued": g.issued, "completed": g.completed, "mesh_dim": g.mesh_dim, "size": g.size,
                         "in_flight": [{"seq": e.seq, "op": e.op, "module": e.module, "pass": e.pass_,
                                        "cause": e.cause} for e in g.in_flight]}
                  for name, g in self.groups.items()}
        return json.dumps({"format": RECORD_FORMAT, "rank": self.rank, "step": self.step, "time_ns": self.time_ns,
                           "age_s": self.age_s, "snapshot": self.snapshot, "between_steps": self.between_steps,
                           "module": self.module, "pass": self.pass_, "stack": list(self.stack), "groups": groups},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StallRecord | None:
        """The record in ``text``; None when it is of another format (a rank of another version).

        Raises:
            ValueError, KeyError, TypeError: ``text`` is not a record of this format.
        """
        data = versioned_record(text, RECORD_FORMAT)
        if data is None:
            return None
        groups = {str(name): GroupProgress(int(g["issued"]), int(g["completed"]), str(g["mesh_dim"]), int(g["size"]),
                                           tuple(InFlight(int(e["seq"]), str(e["op"]), str(e["module"]),
                                                          str(e["pass"]), str(e["cause"])) for e in g["in_flight"]))
                  for name, g in data["groups"].items()}
        return cls(int(data["rank"]), int(data["step"]), int(data["time_ns"]), float(data["age_s"]),
                   int(data["snapshot"]), bool(data["between_steps"]), str(data["module"]), str(data["pass"]),
                   tuple(str(line) for line in data["stack"]), groups)

def cause_text(why: Mapping[str, Any] | None) -> str:
    """A collective's DTensor why in a few words (``aten.mm.default (Shard(dim=0),) -> (Replicate(),)``); "" if none."""
    cause = why.get(semconv.DTENSOR_CAUSE) if why else None
    if not cause:
        return ""
    source, target = why.get(semconv.DTENSOR_SOURCE_PLACEMENTS), why.get(semconv.DTENSOR_TARGET_PLACEMENTS)  # type: ignore[union-attr]
    return f"{cause} {source} -> {target}" if source and target else str(cause)


# ------------------------------------------------------------------ the verdict
@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks' records say together. Field names follow the ``commdebug.verdict.*`` attributes.

    ``behind``: ranks that did not reach the collective the others wait in (``missing``: ranks that
    published nothing); ``waiting``: ranks waiting in it; ``seq`` -1 and ``op`` "" when not known;
    ``stack``: the first behind rank's training thread's code locations, innermost last (none for ``missing``);
    ``dead``/``silent``: of the ranks that published nothing, those whose process is gone, and those
    alive but silent (holding the GIL, or stopped), where the forming rank could tell.
    """

    kind: str
    step: int
    behind: tuple[int, ...]
    waiting: tuple[int, ...]
    group: str
    mesh_dim: str
    seq: int
    op: str
    module: str
    waiting_module: str
    cause: str
    summary: str
    world_size: int
    reported: int
    stack: tuple[str, ...] = ()
    dead: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()

    def attributes(self) -> dict[str, Any]:
        """The ``stall_verdict`` span's attributes (no empty value, never None)."""
        attrs: dict[str, Any] = {
            semconv.STEP: self.step,
            semconv.VERDICT_KIND: self.kind,
            semconv.VERDICT_BEHIND_RANKS: list(self.behind),
            semconv.VERDICT_WAITING_RANKS: list(self.waiting),
            semconv.VERDICT_SUMMARY: self.summary,
            semconv.VERDICT_WORLD_SIZE: self.world_size,
            semconv.VERDICT_REPORTED_RANKS: self.reported,
        }
        for name, value in ((semconv.VERDICT_GROUP, self.group), (semconv.VERDICT_MESH_DIM, self.mesh_dim),
                            (semconv.VERDICT_OP, self.op), (semconv.VERDICT_MODULE, self.module),
                            (semconv.VERDICT_WAITING_MODULE, self.waiting_module),
                            (semconv.VERDICT_CAUSE, self.cause)):
            if value:
                attrs[name] = value
        if self.seq >= 0:
            attrs[semconv.VERDICT_SEQ] = self.seq
        if self.stack:
            attrs[semconv.VERDICT_STACK] = list(self.stack)
        if self.dead:
            attrs[semconv.VERDICT_DEAD_RANKS] = list(self.dead)
        if self.silent:
            attrs[semconv.VERDICT_SILENT_RANKS] = list(self.silent)
        return attrs


def ranks_text(ranks: Iterable[int], others_of: int = 0) -> str:
    """``rank 3``, ``ranks 0-2,5``; ``the other N ranks`` when they are all but ``others_of`` of many."""
    ranks = sorted(ranks)
    if others_of and len(ranks) > MAX_RANKS_LISTED and len(ranks) == others_of:
        return f"the other {len(ranks):,} ranks"
    return ("rank " if len(ranks) == 1 else "ranks ") + ranges_text(ranks)


def _where(record: StallRecord) -> str:
    if record.between_steps:
        return BETWEEN_STEPS
    return record.module or semconv.SPAN_TRAIN_STEP


def _first_in_flight(records: list[StallRecord]) -> tuple[str, int] | None:
    """The lowest (group, seq) any of ``records`` has in flight (group order: by name)."""
    found = sorted((group, entry.seq) for record in records for group, facts in record.groups.items()
                   for entry in facts.in_flight)
    return found[0] if found else None


def _waiting_for_unpublished(records: Mapping[int, StallRecord]) -> set[int]:
    """Ranks that wait for ranks that published nothing: a collective in flight on a group with members that
    published nothing (fewer ranks published it than its size), where no rank that published issued more (so
    it is not behind there itself: a rank stuck with an asynchronous collective in flight stays behind)."""
    published: dict[str, int] = {}
    most: dict[str, int] = {}
    for record in records.values():
        for name, facts in record.groups.items():
            published[name] = published.get(name, 0) + 1
            most[name] = max(most.get(name, facts.issued), facts.issued)
    return {rank for rank, record in records.items()
            if any(facts.in_flight and published[name] < facts.size and facts.issued == most[name]
                   for name, facts in record.groups.items())}


def _behind(records: Mapping[int, StallRecord], excused: AbstractSet[int] = frozenset()) -> tuple[list[int], list[str]]:
    """Ranks behind on a group where others issued more, and not ahead on any, ``excused``
    ranks aside; the groups where they are behind (by name)."""
    behind: dict[int, list[str]] = {}
    ahead: set[int] = set()
    for group in sorted({group for record in records.values() for group in record.groups}):
        issued = {rank: record.groups[group].issued for rank, record in records.items() if group in record.groups}
        low = min(issued.values())
        if len(issued) < 2 or max(issued.values()) == low:
            continue
        for rank, seq in issued.items():
            if seq == low and rank not in excused:
                behind.setdefault(rank, []).append(group)
            else:
                ahead.add(rank)
    ranks = sorted(rank for rank in behind if rank not in ahead) or sorted(behind)
    return ranks, sorted({group for rank in ranks for group in behind[rank]})


def _desync(records: Mapping[int, StallRecord]) -> tuple[str, int, dict[str, list[int]]] | None:
    """The lowest (group, seq) that ranks have in flight as different collectives: {op: ranks}."""
    ops: dict[tuple[str, int], dict[str, list[int]]] = {}
    for rank, record in sorted(records.items()):
        for group, facts in record.groups.items():
            for entry in facts.in_flight:
                ops.setdefault((group, entry.seq), {}).setdefault(entry.op, []).append(rank)
    # A send and a recv at one seq are the two ends of one transfer (pipeline stages), not a disagreement.
    split = sorted(key for key, by_op in ops.items() if len(by_op) > 1 and not set(by_op) <= P2P)
    if not split:
        return None
    group, seq = split[0]
    return group, seq, ops[(group, seq)]


@dataclasses.dataclass(frozen=True)
class _Wait:
    """Ranks waiting on ``group`` in the collective at ``seq`` that the behind ranks never entered."""

    group: str
    seq: int
    ranks: list[int]
    op: str
    waiting_module: str
    cause: str
    mesh_dim: str

    def text(self) -> str:
        issued = f", issued by {self.waiting_module}" if self.waiting_module else ""
        because = f" for {self.cause}" if self.cause else ""
        return f"{self.op or 'the collective'} {_at(self.group, self.mesh_dim, self.seq)}{issued}{because}"


def _wait_on(records: Mapping[int, StallRecord], group: str, seq: int, waiting: list[int]) -> _Wait:
    waiter = next((records[rank] for rank in waiting if records[rank].groups[group].entry(seq) is not None), None)
    entry = waiter.groups[group].entry(seq) if waiter is not None else None
    op, module, cause = (entry.op, entry.module or _where(waiter), entry.cause) if entry and waiter else ("", "", "")
    facts = next((records[rank].groups[group] for rank in waiting if group in records[rank].groups), None)
    return _Wait(group, seq, waiting, op, module, cause, facts.mesh_dim if facts else "")


def _first_group(records: Mapping[int, StallRecord], waits: list[_Wait], behind: list[int]) -> _Wait:
    """The wait the behind ranks reach first: the one whose waiters have not reached the other waits' collectives
    either (they issued no more there than the behind ranks), so it comes earlier in the program; then the
    smaller group, then the name."""

    def earlier_than(wait: _Wait) -> int:
        count = 0
        for other in waits:
            if other is wait:
                continue
            # Behind ranks of that group only: on a 2-D mesh each behind rank may be in its own TP group.
            low = max((records[rank].groups[other.group].issued for rank in behind
                       if other.group in records[rank].groups), default=-1)
            if any(other.group in records[rank].groups and records[rank].groups[other.group].issued <= low
                   for rank in wait.ranks):
                count += 1
        return count

    def size(wait: _Wait) -> int:
        return max((records[rank].groups[wait.group].size for rank in wait.ranks), default=0) or 1 << 30

    return min(waits, key=lambda wait: (-earlier_than(wait), size(wait), wait.group))


def _steps(records: Mapping[int, StallRecord], step: int) -> str:
    """``step 5``, or where ranks count steps differently, ``rank 1 in step 3, ranks 0,2-3 in step 4``."""
    by_step: dict[int, list[int]] = {}
    for rank, record in sorted(records.items()):
        by_step.setdefault(record.step, []).append(rank)
    if len(by_step) <= 1:
        return f"step {step}"
    return ", ".join(f"{ranks_text(ranks)} in step {number}" for number, ranks in sorted(by_step.items()))


def form_verdict(records: Mapping[int, StallRecord], world_size: int, step: int,
                 absent: Mapping[int, str] | None = None) -> Verdict | None:
    """The cross-rank verdict from the published records, or None when nothing is to blame.

    Records are matched by per-group seqs only, never by step (ranks may count steps differently).
    Torch-free: ``diagnose`` applies it to the records it reads back from the ``stalled`` spans.

    Args:
        records: ``{rank: StallRecord}`` of the ranks that published, whatever step each is in.
        world_size: ranks in the job (ranks ``0 .. world_size - 1`` are expected).
        step: the forming rank's step; the verdict's ``step`` when no behind rank published (else the
            lowest behind rank's own step: where its stuck code runs).
        absent: for ranks that published nothing, what is known: ``"dead"`` (its process is gone),
            ``"silent"`` (alive: holding the GIL, or stopped), anything else unknown.

    Kinds, first that applies: ``desync`` (ranks have different collectives in flight at the same
    (group, seq): the larger side waits, the other is behind); ``hang`` (ranks behind on process
    groups where the others issued more, and not ahead anywhere: the waiting ranks are those of every
    such group, each group's collective named; else ranks with nothing in flight while others wait in
    a collective); ``missing`` (ranks that published nothing while the others wait in a collective).
    A rank that published is never ``missing``.
    """
    absent = absent or {}
    missing = sorted(set(range(world_size)) - set(records))
    dead = tuple(rank for rank in missing if absent.get(rank) == "dead")
    silent = tuple(rank for rank in missing if absent.get(rank) == "silent")
    published = sorted(records)

    def common(behind: list[int]) -> dict[str, Any]:
        # torch.step: where the (lowest) behind rank is stuck, else the forming rank's.
        at = records[behind[0]].step if behind and behind[0] in records else step
        return {"step": at, "world_size": world_size, "reported": len(records), "dead": dead, "silent": silent}

    split = _desync(records)
    if split is not None:
        group, seq, by_op = split
        sides = sorted(by_op.items(), key=lambda item: (-len(item[1]), item[1][0]))
        op, waiting = sides[0]
        behind = sorted(rank for _, ranks in sides[1:] for rank in ranks)
        theirs = records[behind[0]].groups[group].entry(seq)
        mine = records[waiting[0]].groups[group].entry(seq)
        dim = records[waiting[0]].groups[group].mesh_dim
        parts = [f"{ranks_text(ranks)} issued {name}{_from(records[ranks[0]].groups[group].entry(seq))}"
                 for name, ranks in sides]
        fields = common(behind)
        where = _steps(records, fields["step"])
        where = f"in {where}" if where.startswith("step ") else f"({where})"
        summary = (f"desync at {_at(group, dim, seq)} {where}: " + "; ".join(parts)
                   + f" ({len(records)} of {world_size} ranks reported)")
        return Verdict(KIND_DESYNC, behind=tuple(behind), waiting=tuple(waiting), group=group, mesh_dim=dim,
                       seq=seq, op=op, module=theirs.module if theirs else "",
                       waiting_module=mine.module if mine else "", cause=mine.cause if mine else "", summary=summary,
                       stack=records[behind[0]].stack, **fields)

    behind, groups = _behind(records, _waiting_for_unpublished(records) if missing else set())
    waits: list[_Wait] = []
    if behind:
        for group in groups:
            members = [rank for rank in behind if group in records[rank].groups]
            if not members:
                continue
            seq = max(records[rank].groups[group].issued for rank in members) + 1
            waiting = [rank for rank in published if rank not in behind and group in records[rank].groups
                       and records[rank].groups[group].issued >= seq]
            if any(records[rank].groups[group].completed >= seq for rank in waiting):
                return None  # a waiting rank knows it complete: the behind rank's record is older (said next round)
            if waiting:
                waits.append(_wait_on(records, group, seq, waiting))
    if not waits:
        idle = [rank for rank in published if not any(f.in_flight for f in records[rank].groups.values())]
        busy = [records[rank] for rank in published if rank not in idle]
        first = _first_in_flight(busy)
        if first is None:
            return None  # nobody waits in a collective: not a communication stall
        group, seq = first
        waiting = [record.rank for record in busy if group in record.groups and record.groups[group].entry(seq)]
        behind = idle if (idle and not missing) else []
        if not behind and not missing:
            return None  # every rank waits in the same collective: nobody to blame from here
        waits = [_wait_on(records, group, seq, waiting)]
    main = _first_group(records, waits, behind) if behind else waits[0]
    others = [wait for wait in waits if wait is not main]
    waiting = sorted({rank for wait in waits for rank in wait.ranks})
    blamed = behind or missing
    fields = common(behind)
    where = _steps(records, fields["step"])

    def waiters(wait: _Wait) -> str:
        return f"{ranks_text(wait.ranks, world_size - len(blamed))} {_wait(wait.ranks)}"

    if behind:
        module = _where(records[behind[0]])
        places = sorted({_where(records[rank]) + _pass(records[rank]) for rank in behind})
        summary = (f"{ranks_text(behind)} never entered {main.text()}; "
                   f"{'it is' if len(behind) == 1 else 'they are'} in {' / '.join(places)}; "
                   f"{waiters(main)} in it"
                   + "".join(f"; {waiters(wait)} in {wait.text()}" for wait in others)
                   + (f"; {ranks_text(missing)} published nothing" if missing else "")
                   + f" ({where}, {len(records)} of {world_size} ranks reported)")
        return Verdict(KIND_HANG, behind=tuple(behind), waiting=tuple(waiting), group=main.group,
                       mesh_dim=main.mesh_dim, seq=main.seq, op=main.op, module=module,
                       waiting_module=main.waiting_module, cause=main.cause, summary=summary,
                       stack=records[behind[0]].stack, **fields)
    states = []
    if dead:
        states.append(f"{ranks_text(dead)}: process gone")
    if silent:
        states.append(f"{ranks_text(silent)}: process alive but silent (holding the GIL, stopped, "
                      "or not yet at its own stall threshold)")
    unknown = [rank for rank in missing if rank not in dead and rank not in silent]
    if unknown:
        states.append(f"{ranks_text(unknown)}: dead or holding the GIL, not known from here")
    summary = (f"{ranks_text(missing)} published nothing ({'; '.join(states)}); {waiters(main)} in "
               f"{main.text()} ({where}, {len(records)} of {world_size} ranks reported)")
    return Verdict(KIND_MISSING, behind=tuple(missing), waiting=tuple(waiting), group=main.group,
                   mesh_dim=main.mesh_dim, seq=main.seq, op=main.op, module="", waiting_module=main.waiting_module,
                   cause=main.cause, summary=summary, **fields)


def _wait(ranks: list[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _at(group: str, dim: str, seq: int) -> str:
    return f"#{seq} on group {group}" + (f" ({dim})" if dim else "")


def _pass(record: StallRecord) -> str:
    return f" {record.pass_}" if record.pass_ and not record.between_steps else ""


def _from(entry: InFlight | None) -> str:
    if not entry or not entry.module:
        return ""
    return f" from {entry.module}" + (f" for {entry.cause}" if entry.cause else "")
