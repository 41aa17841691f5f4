"""The live cross-rank verdict of a stall: who is stuck, in what, and who waits for it.

When a rank's stall snapshot fires (``stall.StallWatch``), its watchdog thread
publishes one small record (:class:`StallRecord`, JSON with named fields and a
``format`` number) in the job's own c10d store: the store keeps answering while
collectives hang, and no collective is ever issued. Keys live under one prefix
per job (the agreed job nonce), never per step: ranks may count steps
differently (a rank one step behind, a pipeline stage), and per-group seqs are
the clock they share.

* ``commdebug_otel/verdict/<nonce>/alive/<rank>``: written once per job, at the
  watchdog's first look after the default group exists (host and pid): a rank
  that never publishes a record but wrote this is alive-but-silent or dead,
  which the rank forming the verdict tells apart on its own host;
* ``.../stall/r/<rank>``: the record, rewritten at each snapshot of the stall;
* ``.../stall/index`` (ranks appended), ``count``, ``leader`` (the lowest rank
  with a live record, by ``compare_set``; a rank that finds the leader's record
  gone takes over if it is the lowest), ``round/<n>`` (ranks that published
  their n-th snapshot's record: snapshots fall at T, 2T, 4T... of each rank's
  stall, so a round is the records sampled together, whatever step each rank
  is in), ``said`` (the last verdict exported, so a lower rank that publishes
  late and takes over does not say it again) and ``left`` (cleanup).

One rank leads the whole job's stall (a subgroup's stuck rank and a world
barrier's waiters get one verdict). It forms the verdict (:func:`form_verdict`)
once every rank published or :data:`VERDICT_WAIT_S` after its own record,
whichever comes first, and again at each of its later snapshots once every rank
that published has published that round too, or :data:`VERDICT_WAIT_S` after
its own (so records of one round are read together); it exports a
``stall_verdict`` span and one stderr line only when the verdict changed. The
span's ``torch.step`` is the lowest behind rank's own step (its stuck code runs
there, and its ``stalled`` span is in that step's trace), else the leader's.
Each rank deletes its record when its stall ends (or its tracer stops); the last
one out deletes the shared keys.

Store calls run on the watchdog thread only, through a client of its own with a
short timeout (:data:`STORE_TIMEOUT_S`): a store that fails costs one message
and the exchange is off for the job; the per-rank snapshots go on as before. A
job of one process, or one without a default group, has no exchange at all.

Store traffic per verdict: each stalled rank makes 5 calls the first time
(set, append, add, compare_set, add), a set and an add per later snapshot, and
after each a look at the leader (a ``compare_set`` that reads it; a rank not
leading checks that the leader's record is live, and takes over if not);
the leader reads the round's count once per watchdog poll while it waits, then
the index and every record in one ``multi_get`` (a check and a get per rank
instead when a rank's record went since it was indexed). Nothing happens on
healthy steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import P2P, CollectiveFact, ranges_text

_logger = logging.getLogger(__name__)

KEY_ROOT = "commdebug_otel/verdict"
RECORD_FORMAT = 2  # 2: named fields, keyed per job (1: positional in-flight lists, keyed per step)
STORE_TIMEOUT_S = 5.0  # each store call of the watchdog thread, at most
VERDICT_WAIT_S = 4.0  # the leader waits this long after its own record for the other ranks' records
IN_FLIGHT_KEPT = 8  # per process group: the first and the last this many collectives in flight
STACK_KEPT = 8  # the training thread's innermost code locations in a record
MAX_RANKS_LISTED = 8  # the summary sentence lists at most this many ranks one by one
MAX_ROUNDS = 12  # snapshots per stall (stall.MAX_SNAPSHOTS): a round key each

BETWEEN_STEPS = "(between steps)"
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
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            return None
        groups = {str(name): GroupProgress(int(g["issued"]), int(g["completed"]), str(g["mesh_dim"]), int(g["size"]),
                                           tuple(InFlight(int(e["seq"]), str(e["op"]), str(e["module"]),
                                                          str(e["pass"]), str(e["cause"])) for e in g["in_flight"]))
                  for name, g in data["groups"].items()}
        return cls(int(data["rank"]), int(data["step"]), int(data["time_ns"]), float(data["age_s"]),
                   int(data["snapshot"]), bool(data["between_steps"]), str(data["module"]), str(data["pass"]),
                   tuple(str(line) for line in data["stack"]), groups)


def progress_record(rank: int, step: int, now_ns: int, age_s: float, snapshot: int, in_step: bool,
                    where: tuple[str, str, list[str]], seqs: Iterable[tuple[str, int, int, str]],
                    ring: Iterable[CollectiveFact]) -> StallRecord:
    """One rank's published record: a few hundred bytes of JSON per process group.

    Args:
        rank, step: this rank, and the step it is stalled in (between steps: the next one).
        now_ns, age_s, snapshot: the snapshot's time (ns since the epoch), the stall's age in
            seconds, and its number in this stall (1, 2, ...).
        in_step: whether a step is open (else the rank is between steps).
        where: ``(module FQN, pass, code locations innermost last)`` of the training thread.
        seqs: ``Progress.seqs()``: ``(group, last issued seq, last completed seq, mesh dimension)``.
        ring: ``Progress.ring``, the recent collectives' facts (a traced one's carries its DTensor why).

    Returns:
        The :class:`StallRecord`; per group, in flight: the collectives after its last known completed
        one, the first and last :data:`IN_FLIGHT_KEPT`.
    """
    module, pass_, stack = where
    known = {name: (issued, completed, dim) for name, issued, completed, dim in seqs}
    sizes: dict[str, int] = {}
    flying: dict[str, list[InFlight]] = {name: [] for name in known}
    for fact in list(ring):
        name = fact.group.name
        if name not in known:
            continue
        sizes[name] = fact.group.size
        if fact.seq > known[name][1]:
            flying[name].append(InFlight(fact.seq, fact.op, fact.fqn, fact.pass_, cause_text(fact.why)))
    groups = {}
    for name, (issued, completed, dim) in known.items():
        kept = flying[name]
        if len(kept) > 2 * IN_FLIGHT_KEPT:
            kept = kept[:IN_FLIGHT_KEPT] + kept[-IN_FLIGHT_KEPT:]
        groups[name] = GroupProgress(issued, completed, dim, sizes.get(name, 0), tuple(kept))
    return StallRecord(rank, step, now_ns, round(age_s, 3), snapshot, not in_step, module, pass_,
                       tuple(stack[-STACK_KEPT:]), groups)


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
    """Ranks behind on a group where others issued more, and not ahead on any (diagnose's rule), ``excused``
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
            low = max(records[rank].groups[other.group].issued for rank in behind)
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
    Torch-free: an offline tool can apply the same rule to the same records.

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


def process_state(host: str, pid: int) -> str:
    """``dead``, ``silent`` (alive, or stopped) or ``unknown`` (another host) for a rank's process."""
    if host != socket.gethostname() or pid <= 0:
        return "unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except OSError:  # another user's process: it exists
        return "silent"
    try:  # a zombie is gone too (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            if handle.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
                return "dead"
    except OSError:
        pass
    return "silent"


# ------------------------------------------------------------------ the exchange
class StoreExchange:
    """One rank's side of the exchange through the job's c10d store. Used by the watchdog thread only.

    Args:
        rank_of: ``() -> RankInfo``: the rank and world size (settled once the default group exists).
        job_id: ``(store) -> str``: the job nonce every rank agrees on, agreed through ``store`` if not yet.
        export: ``export(verdict, start_ns)``: the ``stall_verdict`` span and the flush (the recorder's).
        connect: ``(timeout_s) -> store or None``: a client of the job's store for this thread
            (``_torch.default_store_client``).
        wait_s: how long the leader waits for the other ranks' records after its own.

    No method raises: a failed store call says so once (``logging.WARNING``) and the exchange is
    off for the rest of the job.
    """

    def __init__(self, rank_of: Callable[[], Any], job_id: Callable[[Any], str],
                 export: Callable[[Verdict, int], Any], connect: Callable[[float], Any],
                 wait_s: float = VERDICT_WAIT_S) -> None:
        self._rank_of = rank_of
        self._job_id = job_id
        self._export = export
        self._connect = connect
        self._wait_s = wait_s
        self._store: Any = None
        self._root = ""
        self._off = False
        self._prefix = ""  # the stall being reported: its step's prefix ("" none)
        self._step = -1
        self._since_ns = 0
        self._decide_at = 0.0  # monotonic time the leader forms the verdict ("0": not pending)
        self._first_round = False  # the first snapshot of the stall: decided early once every rank published
        self._round = 0  # this rank's snapshot number in the stall (the others' of the same number are awaited)
        self._last: str | None = None  # what the last verdict exported for this stall said
        self.exported = 0  # verdicts exported (tests)
        self.ignored = 0  # records of another format, or damaged, left out of a verdict

    @property
    def on(self) -> bool:
        return not self._off

    def ready(self) -> bool:
        """Whether the exchange is connected: once the default group exists in a job of several ranks, it
        connects (a client of its own) and writes this rank's alive key, the first time it is asked."""
        if self._off:
            return False
        if self._store is not None:
            return True
        try:
            info = self._rank_of()
            if not info.distributed or info.world_size <= 1:
                return False
            store = self._connect(STORE_TIMEOUT_S)
            if store is None:
                return False
            self._root = f"{KEY_ROOT}/{self._job_id(store)}/"
            store.set(f"{self._root}alive/{info.rank}",
                      json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time_ns": time.time_ns()}))
            self._store = store
        except Exception as error:
            self._fail("connecting to the job's c10d store", error)
            return False
        return True

    def _fail(self, what: str, error: BaseException) -> None:
        self._off = True
        self._store = None
        _logger.warning("commdebug-otel: the cross-rank stall verdict is off for this rank: %s failed (%s: %s); "
                        "the per-rank stall snapshots go on", what, type(error).__name__, error)

    def store(self) -> tuple[Any, str] | None:
        """``(store client, key root of the job)`` once connected (:meth:`ready`), else None: for the other
        exchanges of this thread (``stall/straggler.py``)."""
        return (self._store, self._root) if self.ready() else None

    def heartbeat(self) -> None:
        """At each watchdog poll: connect and write the alive key once the default group exists (cheap after)."""
        self.ready()

    def publish(self, record: StallRecord, since_ns: int) -> None:
        """Publish this rank's ``record`` (:func:`progress_record`) for the stall that began at ``since_ns``."""
        if not self.ready():
            return
        if since_ns != self._since_ns:
            self.ended()  # a new stall: the previous one's record goes
            if self._off:
                return
        try:
            store, rank = self._store, record.rank
            first = not self._prefix
            prefix = f"{self._root}stall/"  # per job, never per step: ranks may count steps differently
            store.set(f"{prefix}r/{rank}", record.to_json())
            if first:
                self._prefix, self._since_ns = prefix, since_ns
                store.append(f"{prefix}index", f"{rank},")
                store.add(f"{prefix}count", 1)
                self._elect(prefix, rank, "")
            self._step = record.step
            round_ = min(record.snapshot, MAX_ROUNDS)
            if first or round_ != self._round:  # (a snapshot that failed to export is published again)
                self._round = round_
                store.add(f"{prefix}round/{round_}", 1)  # ranks whose record of this round is in
            self._decide_at, self._first_round = time.monotonic() + self._wait_s, first
        except Exception as error:
            self._fail("publishing this rank's stall record", error)

    def _elect(self, prefix: str, rank: int, expected: str) -> str:
        """Make ``leader`` the lowest publishing rank (``compare_set`` from ``expected`` until it is at most
        ``rank``); the leader then."""
        store, key = self._store, f"{prefix}leader"
        current = expected
        for _ in range(64):  # each round another rank lowered it: bounded by the ranks racing
            current = _text(store.compare_set(key, expected, str(rank)))
            if current == str(rank) or (current and int(current) < rank):
                return current
            expected = current
        return current

    def _leads(self, prefix: str, rank: int) -> bool:
        """Whether this rank leads the job's current stall: the lowest rank with a live record. A leader whose
        record is gone (its stall ended, its keys were cleared) is replaced by the lowest rank still stalled."""
        leader = self._elect(prefix, rank, "")  # one compare_set: the leader's name (this rank's if none yet)
        if leader == str(rank):
            return True
        if self._store.check([f"{prefix}r/{leader}"]):
            return False
        return self._elect(prefix, rank, leader) == str(rank)

    def poll(self) -> None:
        """At each watchdog poll: the leader forms the verdict when it is due. Cheap when nothing is pending."""
        if not self._decide_at or self._off or self._store is None:
            return
        try:
            store, prefix = self._store, self._prefix
            info = self._rank_of()
            if not self._leads(prefix, info.rank):
                self._decide_at = 0.0  # a lower rank published: it decides
                return
            if time.monotonic() < self._decide_at:
                # Early once every rank has published this round (the first: every rank of the job).
                expected = info.world_size if self._first_round else int(store.add(f"{prefix}count", 0))
                if int(store.add(f"{prefix}round/{self._round}", 0)) < expected:
                    return
            self._decide_at = 0.0
            records = self._records(prefix)
            absent = self._absent(set(range(info.world_size)) - set(records))
            verdict = form_verdict(records, info.world_size, self._step, absent)
            if verdict is None:
                return
            said = repr(dataclasses.astuple(dataclasses.replace(verdict, summary="", reported=0, stack=())))
            if said == self._last or (store.check([f"{prefix}said"]) and _text(store.get(f"{prefix}said")) == said):
                self._last = said
                return  # repeated only when it changes (also when another rank said it: a lower one came late)
            self._last = said
            store.set(f"{prefix}said", said)
        except Exception as error:
            self._fail("forming the stall verdict from the ranks' records", error)
            return
        start_ns = min(record.since_ns for record in records.values())
        _logger.warning("commdebug-otel: stall verdict: %s", verdict.summary)
        self.exported += 1
        self._export(verdict, start_ns)

    def _records(self, prefix: str) -> dict[int, StallRecord]:
        """The live records of the ranks in the index: one ``multi_get``, or (when a rank's stall ended since
        it was indexed) a check and a get per rank, as ``multi_get`` would wait for a deleted key."""
        store = self._store
        ranks = sorted({int(part) for part in _text(store.get(f"{prefix}index")).split(",") if part})
        keys = [f"{prefix}r/{rank}" for rank in ranks]
        if not keys:
            return {}
        if store.check(keys):
            values = store.multi_get(keys)
        else:
            values = [store.get(key) for key in keys if store.check([key])]
        records = {}
        for value in values:
            try:
                record = StallRecord.from_json(_text(value))
            except (ValueError, KeyError, TypeError, AttributeError):
                record = None  # a damaged record: that rank reads as absent, the verdict goes on
            if record is None:  # (or a rank of another version publishes another format)
                self._ignore()
                continue
            records[record.rank] = record
        return records

    def _ignore(self) -> None:
        """Count a record of another format (or damaged) left out of the verdict; say so once."""
        if not self.ignored:
            _logger.warning("commdebug-otel: stall verdict: a rank's record is not of format %d (another "
                            "commdebug-otel version, or damaged): that rank reads as absent", RECORD_FORMAT)
        self.ignored += 1

    def _absent(self, ranks: set[int]) -> dict[int, str]:
        """What is known of ranks that published nothing, from their alive keys (one check each)."""
        out = {}
        for rank in sorted(ranks):
            key = f"{self._root}alive/{rank}"
            if not self._store.check([key]):
                out[rank] = "unknown"  # never reached its watchdog's first look: not started, or gone early
                continue
            facts = json.loads(_text(self._store.get(key)))
            out[rank] = process_state(str(facts.get("host", "")), int(facts.get("pid", 0)))
        return out

    def ended(self) -> None:
        """The stall is over (or the tracer stops): delete this rank's record; the last out deletes the rest."""
        prefix, self._prefix, self._decide_at, self._last = self._prefix, "", 0.0, None
        self._step, self._since_ns, self._round = -1, 0, 0
        if not prefix or self._store is None:
            return
        try:
            store, rank = self._store, self._rank_of().rank
            store.delete_key(f"{prefix}r/{rank}")
            if int(store.add(f"{prefix}left", 1)) >= int(store.add(f"{prefix}count", 0)):
                for name in ("index", "count", "leader", "left", "said",
                             *(f"round/{n}" for n in range(1, MAX_ROUNDS + 1))):
                    store.delete_key(f"{prefix}{name}")
        except Exception as error:
            self._fail("deleting this rank's stall record", error)

    def stop(self) -> None:
        """The tracer stops: the stall's keys and this rank's alive key go."""
        self.ended()
        if self._store is not None:
            try:
                self._store.delete_key(f"{self._root}alive/{self._rank_of().rank}")
            except Exception as error:  # the store may be gone with the job
                _logger.debug("commdebug-otel: could not delete the alive key: %s", error)
        self._store = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
