"""``commdebug-otel diagnose``: which rank is stuck, which ranks disagree, which rank makes the others wait.

Reads the same OTLP-JSON trace files as ``summarize`` (ours, or a Collector's
``file`` exporter) and answers, in order of importance:

* **errors**: the exceptions ranks raised (``ERROR`` spans and their ``exception`` event):
  rank, step, module, type and message; a crashed rank comes first, and is not a desync;
* **stalls**: from the ``stalled`` snapshots a stalled rank exports while it is
  stuck, the rank the others wait for (the one behind on a process group's seq),
  its module and pass, how long, its stack, and what each waiting rank has in flight;
* **desyncs**: the first (process group, seq) where ranks issued different
  collectives (op, dtype, shape, reduce op), with each rank's side and module;
* **stragglers**: the (rank, module, pass) that held the others' collectives back consistently across
  steps and beyond the job's own noise, with how sure that is (:mod:`.stragglers`, the one model
  ``summarize`` and ``report`` use too); the raw lateness, noise included, under ``lateness``;
* **pipeline waits**: send/recv pairs, as :func:`.summary.pipeline_waits`.

Usage::

    from commdebug_otel.offline import diagnose, summary

    spans = summary.load_spans(["commdebug-otel-out/run-20261201-062712-66fd1e02"])
    found = diagnose.diagnose(spans)
    found["stragglers"]  # [] on a healthy job
    # [{"rank": 1, "module": "Transformer.layers.1.feed_forward", "pass": "forward", "lost_s": 0.42,
    #   "steps_late": 7, "steps_seen": 7, "late_min_s": 0.06, "late_max_s": 0.061, "p_value": 1e-14, ...}]
    print(diagnose.format_text(found))

or ``commdebug-otel diagnose PATH... [--format text|json] [--top N] [--noise-floor-ms MS]``, or with
``--jaeger URL`` / ``--tempo URL`` and ``--trace-id ID`` (repeatable) for traces from a backend
(:mod:`.backends`).

What it does not do: stragglers and desyncs come from traced steps only
(``OTEL_PYTHON_COMMDEBUG_TRACE_EVERY``; desyncs also from the stall snapshots' rings) and traced ranks; stalls need the
snapshots of a live job with stall detection on. Times are each host's wall
clock: across hosts, clock skew adds to or hides lateness.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from commdebug_otel import semconv
from commdebug_otel.core.fact import CollectiveFact, parse, ranges_text, stall_step_text
from commdebug_otel.offline import EXIT_DONE, EXIT_UNREADABLE, flight_recorder, hangs, stragglers, summary
from commdebug_otel.offline.backends import DEADLINE_S, MAX_RESPONSE_BYTES
from commdebug_otel.offline.load import load_for_command
from commdebug_otel.offline.model import (
    CollectiveEvent,
    SpanIndex,
    collective_events,
    counted_seqs,
    finished_spans,
    index_of,
    is_snapshot,
    once,
    own_step,
    reusing,
    warmup_step,
    warmup_steps,
)
from commdebug_otel.offline.rank_read import RankRead, rank_reads
from commdebug_otel.offline.stragglers import (
    BETWEEN_STEPS,
    NOISE_FLOOR_S,
    TRAIN_STEP,
    UNATTRIBUTED,
    span_label,
)

__all__ = ["BETWEEN_STEPS", "NOISE_FLOOR_S", "TRAIN_STEP", "UNATTRIBUTED", "RankRead", "Reads", "add_arguments",
           "desyncs", "diagnose", "errors", "format_text", "missing_ranks", "rank_reads", "run", "stalls",
           "unfinished_steps", "watchdog"]

#: Frames of a stuck rank's stack in the text report (the innermost; JSON has them all).
STACK_LINES = 8
_NO_OP = {"op": "none", "dtype": "", "shape": [], "reduce_op": "", "module": "", "pass": "", "seq": -1}


class _Issued(NamedTuple):
    """One collective a rank issued, as desyncs compare it (a tuple: a 1,024-rank job has half a million)."""

    op: str
    dtype: str
    shape: Sequence[int]
    reduce_op: str
    module: str
    pass_: str
    seq: int

    def plain(self) -> dict[str, Any]:
        """As the reports give it: ``{"op", "dtype", "shape" (a list), "reduce_op", "module", "pass", "seq"}``."""
        return {"op": self.op, "dtype": self.dtype, "shape": list(self.shape), "reduce_op": self.reduce_op,
                "module": self.module, "pass": self.pass_, "seq": self.seq}


def _checks(spans: list[dict]) -> dict[int, dict[str, Any]]:
    """What ``diagnose``'s checks keep of each rank in its :class:`.rank_read.RankRead`: ``prints`` (a 64-bit
    print of each record :func:`_issued_collectives` makes of what it issued: equal records, equal prints, so
    :func:`desyncs` compares the collectives only where ranks' prints differ), ``whole``, ``raised``
    (:func:`_raised`) and ``closed`` (:func:`_closed_at_exit`)."""
    finished = finished_spans(spans)
    firsts = _raised_in(spans)
    issued, whole = _issued_collectives(spans, {key: item["_time_ns"] for key, (_, item) in firsts.items()})
    out: dict[int, dict[str, Any]] = defaultdict(lambda: {"prints": {}, "whole": set(), "raised": [], "closed": {}})
    for (rank, _), found in firsts.items():
        out[rank]["raised"].append(found)
    for (rank, step), span in _closed_at_exit(finished, index_of(finished)).items():
        out[rank]["closed"][step] = span_label(span)
    for (rank, step), groups in issued.items():
        out[rank]["prints"][step] = {group: _print(records) for group, records in groups.items()}
    for rank, step in whole:
        out[rank]["whole"].add(step)
    return {rank: {**fields, "whole": frozenset(fields["whole"])} for rank, fields in out.items()}


def _print(records: dict[int, _Issued]) -> int:
    """A 64-bit print of one (rank, step, group)'s records as :func:`_first_difference` compares them (the same
    in every process)."""
    text = repr(sorted((seq, c.op, c.dtype, tuple(c.shape), c.reduce_op) for seq, c in records.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


_ROOTS = frozenset({semconv.SPAN_TRAIN_STEP, semconv.SPAN_TRAIN_STEP_TAIL})


class Reads:
    """What ``diagnose`` reads of the files, as :class:`.otlp_json.SpanReader`'s ``fold``: the ``train_step``
    and ``train_step_tail`` spans (a tail is a root to the views, :func:`_finished`: what is under it is in no step),
    stall snapshots, spans that raised, were left open at exit or dropped events, and spans with
    collective events; the module spans between are folded, and what the views need of a whole rank
    (:class:`RankRead`) is made first where the file is read (:meth:`digest`). Picklable: the reader's
    worker processes call it."""

    def __call__(self, span: dict) -> bool:
        attributes = span["attributes"]
        return (span["name"] in _ROOTS or is_snapshot(span)
                or span.get("status_code") == _STATUS_ERROR or attributes.get(semconv.SPAN_UNMATCHED) is True
                or semconv.SPAN_DROPPED_EVENTS in attributes or bool(span.get("dropped_events_count"))
                or any(event["name"] == semconv.EVENT_EXCEPTION or semconv.COLLECTIVE_OP in event["attributes"]
                       for event in span["events"]))

    def digest(self, spans: list[dict]) -> dict[int, RankRead]:
        """Each rank's :class:`.rank_read.RankRead` from one file's spans, with what the checks keep
        (:func:`_checks`)."""
        return rank_reads(spans, _checks)


# -------------------------------------------------------------------- stalls


def _collective(fact: CollectiveFact, attrs: dict) -> dict[str, Any]:
    """A ring or in-flight event of a ``stalled`` span (its ``fact`` and attributes) as plain data."""
    return {"op": fact.op, "group": fact.group.name, "seq": fact.seq, "dtype": fact.dtype, "shape": list(fact.shape),
            "bytes": fact.nbytes, "module": fact.fqn, "pass": fact.pass_,
            "age_s": float(attrs.get(semconv.STALL_AGE, 0.0))}


def _snapshot(span: dict) -> dict[str, Any]:
    """A ``stalled`` span as plain data, with ``"_record"``: the same snapshot as the live verdict's record."""
    attrs = span["attributes"]
    between = attrs.get(semconv.STALL_BETWEEN_STEPS) is True
    groups = [str(group) for group in attrs.get(semconv.STALL_GROUPS, [])]
    # Events that name no op (a damaged file's) are no collective.
    facts = [(event, fact) for event in span["events"]
             if (fact := parse(event["attributes"], event["name"])) is not None]
    in_flight = [(fact, event["attributes"]) for event, fact in facts
                 if event["attributes"].get(semconv.COLLECTIVE_STATE) == semconv.STATE_IN_FLIGHT]
    snap = {
        "rank": span["rank"], "step": attrs.get(semconv.STEP),
        "module": BETWEEN_STEPS if between else str(attrs.get(semconv.STALL_MODULE, "")) or TRAIN_STEP,
        "pass": "" if between else str(attrs.get(semconv.STALL_PASS, "")),
        "age_s": float(attrs.get(semconv.STALL_AGE, 0.0)),
        "threshold_s": float(attrs.get(semconv.STALL_THRESHOLD, 0.0)),
        "snapshot": int(attrs.get(semconv.STALL_SNAPSHOT, 1)), "between_steps": between,
        "stack": [str(line) for line in attrs.get(semconv.STALL_STACK, [])],
        "issued_seq": dict(zip(groups, map(int, attrs.get(semconv.STALL_ISSUED_SEQ, [])))),
        "completed_seq": dict(zip(groups, map(int, attrs.get(semconv.STALL_COMPLETED_SEQ, [])))),
        "in_flight": [_collective(fact, attrs) for fact, attrs in in_flight],
        "_sizes": {fact.group.name: fact.group.size for _, fact in facts if fact.group.size},
        "trace_id": span["trace_id"], "world_size": int(span["resource"].get(semconv.WORLD_SIZE, 0)),
        "_end_ns": span["end_ns"],
    }
    dims = {fact.group.name: fact.group.dim_name for _, fact in facts}
    return snap | {"_record": _stall_record(snap, str(attrs.get(semconv.STALL_MODULE, "")),
                                            [fact for fact, _ in in_flight], dims)}


def _stall_record(snap: dict[str, Any], module: str, in_flight: list[CollectiveFact],
                  dims: dict[str, str]) -> hangs.StallRecord:
    """The snapshot ``snap`` as the record its rank published for the live verdict (:func:`.hangs.form_verdict`
    reads both): per group its issued and completed seqs, mesh dimension, size and collectives in flight.
    ``module``: the training thread's module as the span names it ("" outside every module)."""
    flying: dict[str, list[hangs.InFlight]] = defaultdict(list)
    for fact in in_flight:
        entry = hangs.InFlight(fact.seq, fact.op, fact.fqn, fact.pass_, hangs.cause_text(fact.why))
        flying[fact.group.name].append(entry)
    groups = {name: hangs.GroupProgress(issued, snap["completed_seq"].get(name, -1), dims.get(name, ""),
                                        snap["_sizes"].get(name, 0), tuple(flying[name]))
              for name, issued in snap["issued_seq"].items()}
    step = snap["step"] if isinstance(snap["step"], int) else -1
    return hangs.StallRecord(snap["rank"], step, snap["_end_ns"], snap["age_s"], snap["snapshot"],
                             snap["between_steps"], module, snap["pass"], tuple(snap["stack"]), groups)


def _episodes(snapshots: list[dict]) -> list[list[dict]]:
    """Snapshots whose stalls overlap in time (``[end - age, end]``), each episode with every snapshot of it."""
    intervals = sorted(((snap["_end_ns"] - round(snap["age_s"] * 1e9), snap["_end_ns"], snap) for snap in snapshots),
                       key=lambda item: (item[0], item[1]))
    episodes: list[list[dict]] = []
    reach = None
    for start, end, snap in intervals:
        if reach is None or start > reach:
            episodes.append([])
            reach = end
        episodes[-1].append(snap)
        reach = max(reach, end)
    return episodes


def _latest(snapshots: list[dict], number: int) -> list[dict]:
    """Each rank's latest of ``snapshots`` numbered at most ``number``, by rank."""
    latest: dict[int, dict] = {}
    for snap in snapshots:
        seen = latest.get(snap["rank"])
        if snap["snapshot"] <= number and (
                seen is None or (snap["_end_ns"], snap["snapshot"]) > (seen["_end_ns"], seen["snapshot"])):
            latest[snap["rank"]] = snap
    return [latest[rank] for rank in sorted(latest)]


def _verdict(snapshots: list[dict]) -> tuple[hangs.Verdict | None, list[dict]]:
    """The hang rule of the live verdict (:func:`.hangs.form_verdict`) over an episode's records, as the lowest
    rank that published would form it (the world: the resource's world size, at least the highest rank's), and
    the snapshots it read: each rank's latest; where those say nothing (a rank's latest was taken after the
    others' and disagrees with them), each rank's latest of the highest snapshot number that does, as the live
    rounds pair the n-th snapshots of a stall."""
    for number in sorted({snap["snapshot"] for snap in snapshots}, reverse=True):
        episode = _latest(snapshots, number)
        records = {snap["rank"]: snap["_record"] for snap in episode}
        world = max(max(snap["world_size"] for snap in episode), max(records) + 1)
        verdict = hangs.form_verdict(records, world, records[min(records)].step)
        if verdict is not None:
            return verdict, episode
    return None, _latest(snapshots, max(snap["snapshot"] for snap in snapshots))


def _ahead_of(snap: dict, episode: list[dict]) -> list[dict]:
    """Who is ahead of ``snap``'s rank: ``[{"rank", "group", "issued_seq", "behind_seq"}]`` on each group where
    others issued more (groups by name, then ranks)."""
    return [{"rank": other["rank"], "group": group, "issued_seq": other["issued_seq"][group], "behind_seq": seq}
            for group, seq in sorted(snap["issued_seq"].items()) for other in episode
            if other["issued_seq"].get(group, seq) > seq]


def _reason(verdict: hangs.Verdict, snap: dict | None, ahead: list[dict]) -> str:
    """Why the verdict blames this rank, in a few words (a desync: the verdict's sentence)."""
    if verdict.kind == hangs.KIND_DESYNC:
        return verdict.summary
    if snap is None:
        return "sent no snapshot while the others are stalled"
    if not ahead:
        return "in no collective while the others wait in one"
    groups: dict[str, list[dict]] = defaultdict(list)
    for item in ahead:
        groups[item["group"]].append(item)
    return "; ".join(f"behind on group {group}: issued seq {items[0]['behind_seq']}, "
                     + ", ".join(f"rank {item['rank']} {item['issued_seq']}" for item in items)
                     for group, items in groups.items())


def _issued_by_all(episode: list[dict]) -> None:
    """Move each snapshot's in-flight collectives that every rank of their group has issued to
    ``"issued_by_all"``: they are not what blocks (on an untimed step a c10d collective that did
    complete may still say in flight).

    A group counts when as many ranks as its size sent a snapshot with it. Left out: seqs at or
    below the lowest seq issued on the group, but when every rank issued the same seq, the
    collective at that seq stays (they all wait in it).
    """
    issued: dict[str, dict[int, int]] = defaultdict(dict)
    sizes: dict[str, int] = {}
    for snap in episode:
        for group, seq in snap["issued_seq"].items():
            issued[group][snap["rank"]] = seq
        sizes |= snap["_sizes"]
    below: dict[str, int] = {}
    for group, seqs in issued.items():
        if group in sizes and len(seqs) >= sizes[group]:
            low = min(seqs.values())
            below[group] = low + 1 if max(seqs.values()) > low else low
    for snap in episode:
        pending = [c for c in snap["in_flight"] if c["seq"] >= below.get(c["group"], c["seq"])]
        snap["issued_by_all"] = [c for c in snap["in_flight"] if c not in pending]
        snap["in_flight"] = pending


def _ends(spans: list[dict]) -> tuple[dict[tuple[int, int], int], dict[int, list[tuple[int, int]]]]:
    """The finished exports of steps: ``{(rank, step): end_ns}`` of those that stalled
    (``commdebug.step.stalled``), and ``{rank: [(step, start_ns)]}`` of every ``train_step``."""
    stalled: dict[tuple[int, int], int] = {}
    starts: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for span in finished_spans(spans):
        attrs = span["attributes"]
        if span["name"] != semconv.SPAN_TRAIN_STEP or not isinstance(attrs.get(semconv.STEP), int):
            continue
        key = (span["rank"], attrs[semconv.STEP])
        starts[span["rank"]].append((attrs[semconv.STEP], span["start_ns"]))
        if semconv.STEP_STALLED in attrs:
            stalled[key] = max(stalled.get(key, span["end_ns"]), span["end_ns"])
    return stalled, starts


def _ended(snap: dict, stalled: dict[tuple[int, int], int], starts: dict[int, list[tuple[int, int]]]
           ) -> dict[str, Any]:
    """Whether the stall of ``snap`` ended: ``{"ended", "ended_after_s" (after the snapshot),
    "duration_s" (from when the stall began)}``, times None when not known."""
    rank, step, end = snap["rank"], snap["step"], snap["_end_ns"]
    began = end - round(snap["age_s"] * 1e9)
    done: int | None = None
    if step is not None and not snap["between_steps"] and (rank, step) in stalled:
        done = stalled[(rank, step)]
    elif step is not None and snap["between_steps"]:
        done = min((start for number, start in starts.get(rank, []) if number == step and start >= began),
                   default=None)
    later = step is not None and any(number > step for number, _ in starts.get(rank, []))
    if done is None:
        return {"ended": later, "ended_after_s": None, "duration_s": None}
    return {"ended": True, "ended_after_s": max(done - end, 0) / 1e9, "duration_s": (done - began) / 1e9}


def stalls(spans: list[dict]) -> list[dict[str, Any]]:
    """The stuck rank of each stall episode, what it was doing, and who waits for it.

    Reads the ``stalled`` spans (the live side's stall snapshots). Snapshots whose stalls
    overlap in time form one episode; each rank's latest snapshot in it is used (where those
    name nobody, each rank's latest of the highest snapshot number that does), as the
    record that rank published for the live verdict (:class:`.hangs.StallRecord`), and the
    live verdict's rule names the ranks (:func:`.hangs.form_verdict`, the one hang rule):
    a desync (ranks with different collectives in flight at one (group, seq): the smaller
    side), else the ranks behind (on a process group where others issued a higher seq,
    the lowest, and not ahead on any group), else the ranks in no collective while the
    others wait in one, else the ranks of the world that sent no snapshot. The waiting
    ranks are those the rule finds waiting in the collective the blamed ranks never
    entered. In-flight collectives that every rank of their group has issued are listed
    apart (``issued_by_all``).

    A stall has ended when the files hold the step's final export on that rank (its
    ``train_step`` with ``commdebug.step.stalled``; for a stall between steps, the next
    step's ``train_step``), or a later step of that rank.

    Returns:
        one entry per stuck rank, the latest episode first: ``{"rank", "step" (between steps:
        the next step), "module", "pass" (:data:`BETWEEN_STEPS` and "" when it stalled between
        steps; :data:`TRAIN_STEP` and "" when in a step outside every module), "age_s",
        "threshold_s", "snapshot", "between_steps", "stack" (innermost last), "issued_seq" /
        "completed_seq" ({group: seq}, -1 none), "in_flight" ([{"op", "group", "seq", "dtype",
        "shape", "bytes", "module", "pass", "age_s"}]), "issued_by_all" (as "in_flight"),
        "trace_id", "ended" (bool), "ended_after_s" (seconds after the snapshot the step or gap
        ended, or None), "duration_s" (the whole stall, or None), "reason", "ahead" ([{"rank",
        "group", "issued_seq", "behind_seq"}]: the ranks that issued more on a group),
        "waiting_ranks" ([{"rank", "step", "module", "pass", "age_s", "in_flight",
        "issued_by_all"}]), "verdict" ({"kind" (hang, desync or missing), "summary" (the live
        verdict's sentence)})}``. "reason": "behind on group G: issued seq N, rank R M", "in no
        collective while the others wait in one", "sent no snapshot while the others are
        stalled" (a rank with no snapshot: "step" None, empty fields), or for a desync the
        verdict's sentence. When the rule blames nobody (every rank waits in the same
        collective, or a behind rank's snapshot is older than what a waiting rank knows
        complete), every rank of the episode is listed with the reason "undetermined", no
        waiting ranks and "verdict" None.
    """
    snapshots = [_snapshot(span) for span in spans if span["name"] == semconv.SPAN_STALLED]
    stalled, starts = _ends(spans)
    out = []
    for episode in sorted(_episodes(snapshots), key=lambda ep: -max(snap["_end_ns"] for snap in ep)):
        verdict, episode = _verdict(episode)
        _issued_by_all(episode)
        by_rank = {snap["rank"]: snap for snap in episode}
        ranks = sorted(by_rank) if verdict is None else list(verdict.behind)
        waiting = [] if verdict is None else [
            {key: by_rank[rank][key] for key in ("rank", "step", "module", "pass", "age_s", "in_flight",
                                                 "issued_by_all")} for rank in verdict.waiting if rank in by_rank]
        said = None if verdict is None else {"kind": verdict.kind, "summary": verdict.summary}
        for rank in ranks:
            snap = by_rank.get(rank)
            ahead = [] if snap is None else _ahead_of(snap, episode)
            reason = "undetermined" if verdict is None else _reason(verdict, snap, ahead)
            snap = snap or {
                "rank": rank, "step": None, "module": "", "pass": "", "age_s": 0.0, "threshold_s": 0.0,
                "snapshot": 0, "between_steps": False, "stack": [], "issued_seq": {}, "completed_seq": {},
                "in_flight": [], "issued_by_all": [], "trace_id": "", "_end_ns": 0}
            entry = {key: value for key, value in snap.items() if not key.startswith("_") and key != "world_size"}
            out.append(entry | _ended(snap, stalled, starts) | {
                "reason": reason, "ahead": ahead, "waiting_ranks": waiting, "verdict": said})
    return out


def watchdog(spans: list[dict]) -> dict[str, Any] | None:
    """When the stall watchdog would take its first snapshot under ``OTEL_PYTHON_COMMDEBUG_STALL_AFTER=auto``
    (the default), for a rank stuck right after its last finished step in the files.

    The setting itself is not exported (a ``stalled`` span carries the threshold only once the watchdog
    fired), so this repeats the auto rule of :mod:`commdebug_otel.stall.watchdog` (its numbers from
    :mod:`commdebug_otel.config`) on each rank's finished ``train_step`` durations in the files
    (traced steps only: the live rank also counts untraced ones):
    300 s while fewer than 3 steps ended, else 10 x the median of the last 32, at least 30 s.

    Returns:
        None without finished steps, else ``{"threshold_s": the largest rank's threshold (seconds),
        "last_step_end_ns": the latest end of a rank's last step, "due_ns": the earliest time a rank's
        first snapshot is due (its last step's end plus its threshold; a stall between steps with no
        collective in flight waits at least 600 s)}``.
    """
    from commdebug_otel.config import AUTO_FACTOR, AUTO_FIRST_S, AUTO_FLOOR_S, AUTO_MIN_STEPS, RECENT_STEPS

    by_rank: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for span in finished_spans(spans):
        if own_step(span) is not None and span["end_ns"] >= span["start_ns"]:
            by_rank[span["rank"]].append((span["end_ns"], span["end_ns"] - span["start_ns"]))
    if not by_rank:
        return None
    thresholds, ends = {}, {}
    for rank, steps in by_rank.items():
        steps.sort()
        recent = [duration / 1e9 for _, duration in steps[-RECENT_STEPS:]]
        thresholds[rank] = AUTO_FIRST_S if len(recent) < AUTO_MIN_STEPS \
            else max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(recent))
        ends[rank] = steps[-1][0]
    return {"threshold_s": max(thresholds.values()), "last_step_end_ns": max(ends.values()),
            "due_ns": min(ends[rank] + round(thresholds[rank] * 1e9) for rank in ends)}


def _clock(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _no_stall_text(due: dict | None) -> str:
    text = ("no stall snapshot: the watchdog (OTEL_PYTHON_COMMDEBUG_STALL_AFTER) had not fired or is off; "
            "a hang shows here only once it has")
    if due is None:
        return text
    return (f"{text}. Under auto (the default) its threshold from the steps here is {due['threshold_s']:g} s: "
            f"for a rank stuck after its last step in the files (the last ended {_clock(due['last_step_end_ns'])}), "
            f"the first snapshot is due from {_clock(due['due_ns'])} (600 s when stuck between steps with no "
            "collective in flight)")


# -------------------------------------------------------------------- errors

_STATUS_ERROR = 2  # OTLP's STATUS_CODE_ERROR


def _raised(spans: list[dict], reads: dict[int, RankRead] | None = None) -> list[dict[str, Any]]:
    """Each (rank, step)'s first exception, from its innermost span that raised, with ``_time_ns``; from
    ``reads`` where given (the same)."""
    return once("raised", spans, lambda: _in_order(_raised_in(spans).values() if reads is None else [
        found for rank in sorted(reads) for found in reads[rank].raised]))


def _in_order(firsts: Iterable[tuple[tuple[int, int], dict]]) -> list[dict[str, Any]]:
    return [item for _, item in sorted(firsts, key=lambda found: found[0])]


def _raised_in(spans: list[dict]) -> dict[tuple[int, int | None], tuple[tuple[int, int], dict]]:
    """``{(rank, step): (order, first exception)}``, in the order of the spans (:func:`_raised`)."""
    finished = finished_spans(spans)
    steps = index_of(finished)
    first: dict[tuple[int, int | None], tuple[tuple[int, int], dict]] = {}
    for span in finished:
        event = next((event for event in span["events"] if event["name"] == semconv.EVENT_EXCEPTION), None)
        if span.get("status_code") != _STATUS_ERROR and event is None:
            continue
        attrs = event["attributes"] if event is not None else {}
        time_ns = event["time_ns"] if event is not None else span["end_ns"]
        module, pass_ = span_label(span)
        key = (span["rank"], steps.step(span))
        order = (time_ns, -span["start_ns"])  # the first to raise; of those, the innermost
        if key not in first or order < first[key][0]:
            first[key] = (order, {
                "rank": span["rank"], "step": steps.step(span), "module": module, "pass": pass_,
                "type": str(attrs.get(semconv.EXCEPTION_TYPE, span.get("status_message", ""))),
                "message": str(attrs.get(semconv.EXCEPTION_MESSAGE, "")),
                "stacktrace": str(attrs.get(semconv.EXCEPTION_STACKTRACE, "")), "_time_ns": time_ns})
    return first


def _raised_at(spans: list[dict], reads: dict[int, RankRead] | None = None) -> dict[tuple[int, int | None], int]:
    """``{(rank, step): ns}`` of each (rank, step) whose step raised: when it first did."""
    return {(item["rank"], item["step"]): item["_time_ns"] for item in _raised(spans, reads)}


def errors(spans: list[dict], reads: dict[int, RankRead] | None = None) -> list[dict[str, Any]]:
    """The exceptions the ranks raised: per rank and step, the first, from the innermost span that raised.

    Reads the finished spans with status ``ERROR`` and their ``exception`` event (the live side
    records it on module spans whose forward raised). The message is as exported: redacted
    unless ``OTEL_PYTHON_COMMDEBUG_EXCEPTION_MESSAGES`` said otherwise.

    Returns:
        ``[{"rank", "step" (None outside a step), "module", "pass" (:data:`TRAIN_STEP` and "" for
        ``train_step`` itself), "type", "message" ("" when not exported), "stacktrace"}]``, earliest first.
    """
    return [{key: value for key, value in item.items() if key != "_time_ns"} for item in _raised(spans, reads)]


def missing_ranks(spans: list[dict]) -> list[int]:
    """Ranks below the world size (``torch.distributed.world_size``) that sent no span."""
    world = max((int(span["resource"].get(semconv.WORLD_SIZE, 0)) for span in spans), default=0)
    return sorted(set(range(world)) - {span["rank"] for span in spans})


def _closed_at_exit(finished: list[dict], steps: SpanIndex) -> dict[tuple[int, int], dict]:
    """``{(rank, step): innermost open span}`` of steps a rank ended at exit, not by finishing them.

    At exit (a signal such as torchrun's SIGTERM, or the script ending) the tracer closes the open
    step and exports it like a finished one; what was still open (the module the rank was stuck in,
    a collective it waited in) is marked ``commdebug.span.unmatched``. Such a step is the rank's
    last in the files and holds an unmatched span: killed while inside it, e.g. a hang killed before
    the watchdog fired.
    """
    return once("closed_at_exit", finished, lambda: _closed_in(finished, steps))


def _closed_in(finished: list[dict], steps: SpanIndex) -> dict[tuple[int, int], dict]:
    last: dict[int, int] = {}
    for span in finished:
        if (step := own_step(span)) is not None:
            last[span["rank"]] = max(last.get(span["rank"], step), step)
    out: dict[tuple[int, int], dict] = {}
    for span in finished:
        step = steps.step(span)
        if step is None or last.get(span["rank"]) != step or span["attributes"].get(semconv.SPAN_UNMATCHED) is not True:
            continue
        key = (span["rank"], step)
        if key not in out or any(item is out[key] for item in steps.ancestors(span)):  # the innermost
            out[key] = span
    return out


def unfinished_steps(spans: list[dict], reads: dict[int, RankRead] | None = None) -> list[dict[str, Any]]:
    """Steps that did not finish on every rank: a hang (or a crash) cut short, not a desync.

    A step is unfinished when some rank ended it at exit (:func:`_closed_at_exit`: killed while
    inside it) or some rank's finished steps in the files all come before it (it never got there,
    or was killed without the exit flush). Ranks there issued collectives the others never did:
    the first such (group, seq) is where the job stopped, not ranks out of step (:func:`desyncs`
    does not report it).

    Returns:
        ``[{"step", "closed_at_exit": {rank: {"module", "pass"}} (where it was: the innermost span
        still open), "missing": [ranks without the step], "not_issued": [{"group", "seq" (counted
        without send/recv), "op", "issued_by": [ranks], "not_by": [ranks]}] (the first per group)}]``,
        by step.
    """
    return once("unfinished_steps", spans, lambda: _unfinished_in(spans, reads))


def _unfinished_in(spans: list[dict], reads: dict[int, RankRead] | None) -> list[dict[str, Any]]:
    finished = finished_spans(spans)
    if reads is None:
        cut = {key: span_label(span) for key, span in _closed_at_exit(finished, index_of(finished)).items()}
    else:
        cut = {(rank, step): label for rank, read in reads.items() for step, label in read.closed.items()}
    by_rank: dict[int, set[int]] = defaultdict(set)
    for span in finished:
        if (step := own_step(span)) is not None:
            by_rank[span["rank"]].add(step)
    lasts = {rank: max(numbers) for rank, numbers in by_rank.items()}
    unfinished = {step for step in set().union(*by_rank.values()) if step > min(lasts.values())}
    unfinished |= {step for _, step in cut}
    issued = _issued_collectives(spans)[0] if unfinished else {}
    out = []
    for step in sorted(unfinished):
        missing = sorted(rank for rank, last in lasts.items() if last < step)
        closed = {rank: label for (rank, number), label in cut.items() if number == step}
        records = {rank: groups for (rank, number), groups in issued.items() if number == step}
        not_issued = []
        for group in sorted({group for groups in records.values() for group in groups}):
            seqs = {rank: groups.get(group, {}) for rank, groups in records.items()}
            for seq in sorted(set().union(*seqs.values())):
                issued_by = sorted(rank for rank, found in seqs.items() if seq in found)
                if len(issued_by) < len(seqs):
                    not_issued.append({"group": group, "seq": seq, "op": seqs[issued_by[0]][seq].op,
                                       "issued_by": issued_by,
                                       "not_by": sorted(rank for rank in seqs if rank not in issued_by)})
                    break
        out.append({"step": step, "missing": missing, "not_issued": not_issued,
                    "closed_at_exit": {rank: dict(zip(("module", "pass"), label, strict=True))
                                       for rank, label in sorted(closed.items())}})
    return out


def _traced_steps(spans: list[dict], reads: dict[int, RankRead] | None = None) -> list[int]:
    """Steps every rank finished and traced, without those where a rank raised or that some rank did
    not finish (:func:`unfinished_steps`).

    An untraced step that stalled is exported as its ``train_step`` alone (no child, no event): not traced.
    """
    finished = finished_spans(spans)
    crashed = {item["step"] for item in _raised(spans, reads)} | {item["step"] for item in
                                                                 unfinished_steps(spans, reads)}
    steps = [(step, span) for span in finished if (step := own_step(span)) is not None and step not in crashed]
    alone = [span for _, span in steps if semconv.STEP_STALLED in span["attributes"] and not span["events"]
             and not span.get("folded")]  # no event and nothing folded into it: a child, if any, is in the files
    if alone:
        parents = {(span["trace_id"], span["parent_span_id"]) for span in finished if span["parent_span_id"]}
        alone = [span for span in alone if (span["trace_id"], span["span_id"]) not in parents]
    untraced = {id(span) for span in alone}
    return sorted({step for step, span in steps if id(span) not in untraced})


# ------------------------------------------------------------------- desyncs


def _issued_collectives(spans: list[dict], raised: dict[tuple[int, int | None], int] | None = None
                        ) -> tuple[dict[tuple[int, int], dict[str, dict[int, _Issued]]], set[tuple[int, int]]]:
    """What each rank issued in each step, and which of those records are whole.

    ``raised``: ``{(rank, step): ns}`` when the rank's step raised; its record of that step stops
    there and is not whole.

    Returns:
        ``({(rank, step): {group: {seq: collective}}}, {(rank, step) whose record is whole}})``.
        Records come from finished steps and, for steps a rank never finished, its stall
        snapshots (copies of the step's spans and the ring of recent collectives); a record is
        whole when the step finished (not ended at exit: :func:`_closed_at_exit`) and none of its
        spans dropped events. Each (rank, group,
        seq) is taken once, a finished step's event first; seqs are counted without
        point-to-point ops (:func:`.model.counted_seqs`). Each collective: an
        :class:`_Issued` (``.plain()``: ``{"op", "dtype", "shape", "reduce_op", "module", "pass", "seq"}``, seq the
        rank's own torch.collective.seq).
    """
    finished = finished_spans(spans)
    snapshots = [span for span in spans if is_snapshot(span)]
    steps = index_of(finished)
    snapshot_steps = SpanIndex(snapshots)
    finished_steps = {(span["rank"], step) for span in finished if (step := steps.step(span)) is not None}
    raised = raised or {}
    cut = {(span["rank"], steps.step(span)) for span in finished if span.get("dropped_events_count", 0)
           or span["attributes"].get(semconv.SPAN_DROPPED_EVENTS, 0)} | set(raised) \
        | set(_closed_at_exit(finished, steps))  # a step cut short at exit cannot say what it never issued
    seen: set[tuple[int, str, int]] = set()
    taken: list[tuple[CollectiveEvent, int | None]] = []
    for source, step_of in ((finished, steps), (snapshots, snapshot_steps)):
        for event in collective_events(source):
            span, seq = event.span, event.seq
            step = step_of.step(span) if span["name"] != semconv.SPAN_STALLED else span["attributes"].get(semconv.STEP)
            if seq is None or (source is snapshots and (event.rank, step) in finished_steps):
                continue
            if event.time_ns > raised.get((event.rank, step), event.time_ns):
                continue
            key = (event.rank, event.group, seq)
            if key not in seen:
                seen.add(key)
                taken.append((event, step))
    taken.sort(key=lambda item: item[0].time_ns)
    out: dict[tuple[int, int], dict[str, dict[int, _Issued]]] = defaultdict(lambda: defaultdict(dict))
    step_of_event = {id(event): step for event, step in taken}
    # Send/recv are counted wherever they are (a pipeline's first recv is outside the step).
    for event, group, counted in counted_seqs(event for event, _ in taken):
        step, own = step_of_event[id(event)], event.seq
        if counted is None or step is None or own is None:
            continue
        module, pass_ = (event.module, event.pass_ or "") if event.module is not None else span_label(event.span)
        out[(event.rank, step)][group][counted] = _Issued(
            event.op, event.dtype, event.shape, event.reduce_op, module,
            event.pass_ if event.pass_ is not None else pass_, own)
    return out, finished_steps - cut


def _fingerprints(spans: list[dict]) -> dict[tuple[int, int], dict[str, tuple[str, int]]]:
    """``(rank, step) -> group -> (fingerprint, count)`` from finished ``train_step`` spans that carry them."""
    out: dict[tuple[int, int], dict[str, tuple[str, int]]] = {}
    for span in finished_spans(spans):
        attrs = span["attributes"]
        fingerprints = attrs.get(semconv.STEP_COLLECTIVE_FINGERPRINTS)
        if span["name"] != semconv.SPAN_TRAIN_STEP or fingerprints is None or semconv.STEP not in attrs:
            continue
        groups, counts = attrs.get(semconv.STEP_COLLECTIVE_GROUPS, []), attrs.get(semconv.STEP_COLLECTIVE_COUNTS, [])
        out[(span["rank"], attrs[semconv.STEP])] = {
            str(group): (str(fingerprint), int(count))
            for group, fingerprint, count in zip(groups, fingerprints, counts)}
    return out


def _same(collectives: Iterable[_Issued | None], reduce_op_only: bool = False) -> bool:
    """Whether the collectives agree: (op, dtype, shape), and the reduce op where each records one
    (a stall ring's events do not); ``reduce_op_only``: the reduce op alone."""
    collectives = list(collectives)
    kinds = {None if c is None else (c.op, c.dtype, tuple(c.shape)) for c in collectives}
    reduce_ops = {c.reduce_op for c in collectives if c is not None and c.reduce_op}
    return len(reduce_ops) <= 1 and (reduce_op_only or len(kinds) == 1)


def desyncs(spans: list[dict], reads: dict[int, RankRead] | None = None) -> list[dict[str, Any]]:
    """The first collective, per process group, where ranks disagree on (op, dtype, shape, reduce op).

    Per training step (ascending) and process group, each rank's collectives in seq order
    are compared; the reduce op (``torch.collective.reduce_op``) only where both sides
    record one (a stall ring's events do not). A step whose ``train_step`` fingerprints
    (``torch.step.collective_fingerprints``, when the live side records them) are equal on
    every rank is compared on its events' reduce ops only (a fingerprint may not cover them).
    Ranks are those with collectives on
    the group in the files; a rank that skipped a collective shows, at that seq, the next one
    it issued, or op ``"none"`` when it issued none in the step. Steps a rank never finished
    are read from its stall snapshots; there, and where a span dropped events, a seq the rank
    has no record of is not compared; so too after a rank's step raised (:func:`errors`: a crashed
    rank is not out of step). Only the first difference per group is reported:
    everything after it on that group is shifted by it.

    ``reads``: each rank's :class:`RankRead` (spans read with :class:`Reads`): the collectives of a step and
    group are read from ``spans`` only where the ranks' prints differ.

    Returns:
        ``[{"group", "seq" (counted without send/recv, as stragglers match), "step",
        "ranks": {rank: {"op", "dtype", "shape", "reduce_op" ("" when not recorded), "module",
        "pass", "seq" (its own torch.collective.seq)}}}]``, by step then group.
    """
    issued: dict[tuple[int, int], dict[str, dict[int, _Issued]]] | None = None
    if reads is None:
        issued, whole = _issued_collectives(spans, _raised_at(spans, reads))
        records: dict[tuple[int, int], dict[str, Any]] = issued
    else:
        records = {(rank, step): groups for rank, read in reads.items() for step, groups in read.prints.items()}
        whole = {(rank, step) for rank, read in reads.items() for step in read.whole}
    fingerprints = _fingerprints(spans)
    members: dict[str, set[int]] = defaultdict(set)
    steps: dict[int, set[int]] = defaultdict(set)
    recorded: dict[str, set[int]] = defaultdict(set)  # group -> steps where some rank issued on it
    for (rank, step), groups in records.items():
        steps[step].add(rank)
        for group in groups:
            members[group].add(rank)
            recorded[group].add(step)
    for rank, step in [*fingerprints, *whole]:
        steps[step].add(rank)
    out = []
    for group in sorted(members):
        for step in sorted(recorded[group]):  # not every (group, step): no record there, no difference
            ranks = sorted(members[group] & steps[step])
            if len(ranks) < 2:
                continue
            if issued is None:
                if len({records.get((rank, step), {}).get(group) for rank in ranks}) == 1:
                    continue  # the same records on every rank: no difference
                issued = _issued_collectives(spans, _raised_at(spans, reads))[0]
            prints = [fingerprints.get((rank, step), {}).get(group) for rank in ranks]
            by_rank = {rank: issued.get((rank, step), {}).get(group, {}) for rank in ranks}
            found = _first_difference(group, step, by_rank, {rank for rank in ranks if (rank, step) in whole},
                                      reduce_op_only=None not in prints and len(set(prints)) == 1)
            if found is not None:
                out.append(found)
                break
    out.sort(key=lambda found: (found["step"], found["group"]))
    return out


def _first_difference(group: str, step: int, by_rank: dict[int, dict[int, _Issued]],
                      whole: set[int], reduce_op_only: bool = False) -> dict[str, Any] | None:
    """The first seq of ``step`` where the ranks' collectives on ``group`` differ, or None.

    ``whole``: the ranks whose record of the step is whole; only they can say that they
    issued nothing at a seq. ``reduce_op_only``: compare reduce ops only (the fingerprints agree).
    """
    for seq in sorted(set().union(*by_rank.values())):
        known = {rank: seqs.get(seq) for rank, seqs in by_rank.items() if seq in seqs or rank in whole}
        if reduce_op_only:
            known = {rank: c for rank, c in known.items() if c is not None}
        if len(known) < 2 or _same(known.values(), reduce_op_only):
            continue
        return {"group": group, "seq": seq, "step": step,
                "ranks": {rank: c.plain() if c else dict(_NO_OP) for rank, c in sorted(known.items())}}
    return None


# ------------------------------------------------------------------ together


def diagnose(spans: list[dict], noise_floor_s: float = NOISE_FLOOR_S, include_warmup: bool = False,
             flight_dumps: list[dict] | None = None, reads: dict[int, RankRead] | None = None) -> dict[str, Any]:
    """Everything ``diagnose`` reports, as plain data (``--format json``).

    ``flight_dumps``: torch's Flight Recorder dumps (:func:`.flight_recorder.read_dumps`); when given,
    ``"flight_recorder"`` holds them joined with the spans (:func:`.flight_recorder.join`).
    ``reads``: each rank's :class:`RankRead`, for spans read with :class:`Reads` (:func:`desyncs`, the
    stragglers).

    Returns:
        ``{"errors": errors(spans), "stalls": stalls(spans), "unfinished_steps": unfinished_steps(spans),
        "desyncs": desyncs(spans), "stragglers": the (rank, module, pass) rows found significant
        (:func:`.stragglers.find`; ``[]`` on a healthy job), "contended": rows of ranks whose lateness is their
        wait for a CPU (another process on the host), "lateness": the raw lateness per (rank, module,
        pass) (:func:`.stragglers.lateness_rows`), "pipeline_waits": summary.pipeline_waits(finished spans),
        "ranks": [rank...], "missing_ranks": missing_ranks(spans), "steps": [finished traced step...]
        (untraced steps exported because they stalled, steps where a rank raised and unfinished steps left out),
        "noise_floor_s": noise_floor_s, "alpha": the family-wise false-blame rate, "warmup_step": the last step left
        out of stragglers, with every one before it (:func:`.model.warmup_step`; None when ``include_warmup`` or
        none), "warmup_steps": the traced steps left out (:func:`.model.warmup_steps`), "watchdog": :func:`watchdog`
        (when the first stall snapshot is due), "warnings": [str]}``, and "flight_recorder" with ``flight_dumps``.
    """
    finished = finished_spans(spans)
    missing = missing_ranks(spans)
    warnings = summary.span_warnings(finished)
    if missing:
        world = max(int(span["resource"].get(semconv.WORLD_SIZE, 0)) for span in spans)
        warnings.append(f"warning: world size {world}, but no spans from rank(s) {_ranges(missing)}: not traced "
                        "(OTEL_PYTHON_COMMDEBUG_RANKS), their files not given, or they exported nothing")
    found = {
        "errors": errors(spans, reads),
        "stalls": stalls(spans),
        "unfinished_steps": unfinished_steps(spans, reads),
        "desyncs": desyncs(spans, reads),
        **_straggler_answer(spans, noise_floor_s, include_warmup, reads),
        # Without a send or recv the waits need no collective event (as reads tell, where spans were read).
        "pipeline_waits": summary.pipeline_waits(
            finished if reads is None or any(read.times.arrivals.p2p for read in reads.values()) else []),
        "ranks": sorted({span["rank"] for span in spans}),
        "missing_ranks": missing,
        "steps": _traced_steps(spans, reads),
        "noise_floor_s": noise_floor_s,
        "alpha": stragglers.ALPHA,
        "warmup_step": None if include_warmup else warmup_step(finished),
        "warmup_steps": [] if include_warmup else warmup_steps(finished),
        "watchdog": watchdog(spans),
        "warnings": warnings,
    }
    if flight_dumps:
        found["flight_recorder"] = flight_recorder.join(spans, flight_dumps)
    return found


def _straggler_answer(spans: list[dict], noise_floor_s: float, include_warmup: bool,
                      reads: dict[int, RankRead] | None) -> dict[str, Any]:
    """``{"stragglers", "contended", "lateness"}`` of :func:`.stragglers.find`, from ``reads`` where the files
    were read folded."""
    answer = summary.straggler_answer(spans, include_warmup, reads, noise_floor_s)
    return {key: answer[key] for key in ("stragglers", "contended", "lateness")}


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``; ``"none"`` when empty."""
    return ranges_text(numbers, ", ") or "none"


def _where(module: str, pass_: str) -> str:
    return f"{module or TRAIN_STEP} {pass_}".rstrip()


def _in_flight(collectives: list[dict]) -> str:
    """In-flight collectives, each from its module where the ring recorded it (traced steps)."""
    return "; ".join(f"{c['op']} (group {c['group']}, seq {c['seq']})"
                     + (f" from {_where(c['module'], c['pass'])}" if c["module"] else "")
                     + f", {c['age_s']:.1f} s" for c in collectives) or "nothing"


def _stall_where(stall: dict) -> str:
    """``in step 3 at M forward``, or ``between step 6 and step 7`` (``before step 0``)."""
    place = stall_step_text(stall["between_steps"], stall["step"])
    return place if stall["between_steps"] else f"{place} at {_where(stall['module'], stall['pass'])}"


def _stall_end(stall: dict) -> str:
    if not stall["ended"]:
        return ""
    what = "the gap" if stall["between_steps"] else "the step"
    if stall["ended_after_s"] is None:
        return f" ({what} ended: a later step finished)"
    return f" ({what} ended {stall['ended_after_s']:.1f} s later, {stall['duration_s']:.1f} s in all)"


def _collective_text(c: dict, reduce_op: bool = False) -> str:
    """One rank's side of a desync; ``reduce_op``: with its reduce op (when the ranks' differ)."""
    if c["op"] == "none":
        return "none (no collective at this seq in the step)"
    op = f" {c['reduce_op'] or '(reduce op not recorded)'}" if reduce_op else ""
    return f"{c['op']} {c['dtype']} {c['shape']}{op} in {_where(c['module'], c['pass'])}"


def format_text(found: dict[str, Any], top: int = 10) -> str:
    """``commdebug-otel diagnose``'s text: errors, stalls, desyncs, stragglers, pipeline waits, in that order.

    ``found``: :func:`diagnose`'s result. ``top``: lateness rows shown (the rest summed in one line).
    """
    out = [f"{len(found['ranks'])} rank(s), finished traced steps: {_ranges(found['steps'])}", *found["warnings"], ""]
    out.append(f"Errors: {len(found['errors'])}")
    for error in found["errors"]:
        where = "outside a step" if error["step"] is None else f"step {error['step']}"
        message = f": {error['message']}" if error["message"] else ""
        at = ("outside any module call" if error["module"] == TRAIN_STEP
              else f"at {_where(error['module'], error['pass'])}")
        out.append(f"  rank {error['rank']} raised in {where} {at}: {error['type']}{message}")
    out.append("")
    out.append(f"Stalls: {len(found['stalls'])}"
               + ("" if found["stalls"] else f" ({_no_stall_text(found.get('watchdog'))})"))
    for stall in found["stalls"]:
        if stall["snapshot"]:
            out.append(f"  rank {stall['rank']} {'was' if stall['ended'] else 'is'} stuck {_stall_where(stall)} "
                       f"for {stall['age_s']:.1f} s (snapshot {stall['snapshot']}; {stall['reason']})"
                       + _stall_end(stall))
            out.append(f"    in flight on rank {stall['rank']}: {_in_flight(stall['in_flight'])}")
        else:
            out.append(f"  rank {stall['rank']} is stuck: it {stall['reason']} "
                       "(hung in native code holding the GIL, or gone: look at its process)")
        out += [f"    waiting for it: rank {waiting['rank']} in {_in_flight(waiting['in_flight'])}"
                for waiting in stall["waiting_ranks"]]
        out += [f"    ahead of it: rank {item['rank']} on group {item['group']} "
                f"(issued seq {item['issued_seq']}; rank {stall['rank']}: {item['behind_seq']})"
                for item in stall["ahead"]]
        stack = stall["stack"]
        if stack:
            outer = max(0, len(stack) - STACK_LINES)
            out.append("    stack (innermost last" + (f"; {outer} outer frames in --format json):" if outer else "):"))
            out += [f"      {line}" for line in stack[outer:]]
    unfinished = found.get("unfinished_steps", [])
    if unfinished:
        out += ["", f"Unfinished steps: {len(unfinished)} (not finished on every rank: the job stopped there; "
                    "ranks that issued collectives the others never did are not out of step)"]
    for item in unfinished:
        parts = [f"rank {rank} ended it at exit in {_where(*where.values())} (killed while inside the step)"
                 for rank, where in item["closed_at_exit"].items()]
        parts += [f"rank {rank} never finished it" for rank in item["missing"]]
        out.append(f"  step {item['step']}: " + "; ".join(parts))
        out += [f"    rank(s) {_ranges(c['issued_by'])} issued {c['op']} (group {c['group']}, seq {c['seq']}); "
                f"rank(s) {_ranges(c['not_by'])} never did: look at what they were doing"
                for c in item["not_issued"]]
    out += ["", f"Desyncs: {len(found['desyncs'])}"]
    for desync in found["desyncs"]:
        out.append(f"  group {desync['group']}, step {desync['step']}, seq {desync['seq']}: ranks disagree")
        reduce_ops = len({c["reduce_op"] for c in desync["ranks"].values() if c["op"] != "none"}) > 1
        out += [f"    rank {rank}: {_collective_text(c, reduce_ops)}" for rank, c in desync["ranks"].items()]
    out += ["", *stragglers.format_lines(found)]
    rows = found["lateness"]
    if rows:
        out.append(f"  Lateness, noise included: lost = wall time a collective was held back by the last rank to "
                   f"arrive, counting only the delay it added since its previous collective (under "
                   f"{found['noise_floor_s'] * 1e3:g} ms ignored), waited = rank-seconds the others waited, "
                   "excess = the time it spent in that module over the other ranks.")
        table: list[tuple[Any, ...]] = [("rank", "module", "pass", "lost s", "waited s", "excess s", "collectives",
                                         "steps")]
        table += [(row["rank"], row["module"], row["pass"] or "-", f"{row['lost_s']:.3f}", f"{row['waited_s']:.3f}",
                   f"{row['excess_s']:.3f}", row["collectives"], len(row["steps"])) for row in rows[:top]]
        out += ["    " + line for line in summary.columns(table)]
        if len(rows) > top:
            out.append(f"    ... {len(rows) - top} more rows, {sum(row['lost_s'] for row in rows[top:]):.3f} s lost "
                       "in all (--top, or --format json for every row)")
    waits = found["pipeline_waits"]
    out += ["", f"Pipeline waits: {waits['pairs']} send/recv pairs, total wait {waits['wait_ms']:.3f} ms"]
    out += [f"  rank {row['rank']} (group {row['group']}): {row['recvs']} recvs, waited {row['wait_ms']:.3f} ms, "
            f"max {row['max_wait_ms']:.3f} ms" for row in waits["per_stage"]]
    if "flight_recorder" in found:
        out += ["", *flight_recorder.format_text(found["flight_recorder"])]
    return "\n".join(out)


# --------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``diagnose``'s arguments to ``parser``."""
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="OTLP-JSON trace files, or folders to search for *.jsonl / *.json")
    backend = parser.add_mutually_exclusive_group()
    backend.add_argument("--jaeger", metavar="URL",
                         help="also read traces from Jaeger's HTTP API at URL (e.g. http://localhost:16686)")
    backend.add_argument("--tempo", metavar="URL",
                         help="also read traces from Tempo's HTTP API at URL (e.g. http://localhost:3200)")
    parser.add_argument("--trace-id", action="append", default=[], metavar="ID",
                        help="a trace (32 hex digits) to read from --jaeger or --tempo; repeat for more steps")
    parser.add_argument("--backend-timeout", type=float, default=DEADLINE_S, metavar="S",
                        help=f"seconds one trace's fetch may take in all (default {DEADLINE_S:g})")
    parser.add_argument("--backend-max-mib", type=float, default=MAX_RESPONSE_BYTES / (1 << 20), metavar="MIB",
                        help=f"the largest answer read per trace (default {MAX_RESPONSE_BYTES >> 20})")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="text report, or everything as one JSON object (default text)")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="lateness rows in the text report (default 10; JSON has them all)")
    parser.add_argument("--noise-floor-ms", type=float, default=NOISE_FLOOR_S * 1e3, metavar="MS",
                        help="the resolution: a delay below this is not recorded, nor a place where it spent "
                             "less extra time than this, and no noise cut is lower "
                             f"(default {NOISE_FLOOR_S * 1e3:g})")
    parser.add_argument("--flight-recorder", action="append", default=[], metavar="PATH",
                        help="torch's Flight Recorder dumps (JSON; a file, or every file in a folder) to join with "
                             "the spans; the stall snapshots' own (commdebug-flight-recorder-rank<N>.json) are "
                             "found in the PATHs without it")
    parser.add_argument("--flight-recorder-pickle", action="store_true",
                        help="also read pickled dumps (torch's own files), without loading any class or function")
    parser.add_argument("--include-warmup", action="store_true",
                        help="count the first traced step in the stragglers (left out by default: ranks start it "
                             "at different times and run it cold)")


def _load(args: argparse.Namespace, reads: dict[int, RankRead]) -> list[dict] | None:
    """The spans of ``args.paths`` and of each ``--trace-id`` from the backend; None after saying why not.

    Files alone are read reduced (:class:`Reads`), each rank's :class:`RankRead` put in ``reads``; with a
    backend too, whole (a rank's spans may be in both)."""
    from commdebug_otel.offline.backends import BackendError, fetch_trace

    backend = "jaeger" if args.jaeger else "tempo" if args.tempo else None
    if backend is None and (args.trace_id or not args.paths):
        print("commdebug-otel diagnose: give PATH..., or --jaeger URL / --tempo URL with --trace-id ID",
              file=sys.stderr)
        return None
    if backend is not None and not args.trace_id:
        print(f"commdebug-otel diagnose: --{backend} needs --trace-id ID", file=sys.stderr)
        return None
    spans: list[dict] = []
    # A trace id without a backend was refused above.
    for trace_id in args.trace_id:
        assert backend is not None
        try:
            spans += fetch_trace(backend, args.jaeger or args.tempo, trace_id, args.backend_timeout,
                                 round(args.backend_max_mib * (1 << 20)))
        except (ValueError, BackendError) as error:
            print(f"commdebug-otel diagnose: {error}", file=sys.stderr)
            return None
    if args.paths:
        alone = not args.trace_id
        from_files = load_for_command(args.paths, "diagnose", snapshots=True,
                                              fold=Reads() if alone else None,
                                              digests=reads if alone else None)
        if from_files is None:
            return None
        spans += from_files
    if not spans:
        print("commdebug-otel diagnose: no spans in the traces", file=sys.stderr)
        return None
    if args.trace_id and args.paths:  # a span both in the files and in the backend counts once
        unique = {(span["rank"], span["trace_id"], span["span_id"]): span for span in reversed(spans)}
        spans = list(unique.values())
    spans.sort(key=lambda span: (span["rank"], span["start_ns"]))
    return spans


def run(args: argparse.Namespace) -> int:
    """Print the diagnosis of ``args.paths`` and of ``--trace-id`` from ``--jaeger``/``--tempo``.

    Returns :data:`.EXIT_DONE`, or :data:`.EXIT_UNREADABLE` when there are no spans, a trace cannot be
    fetched or no input is named (said on stderr).
    """
    with reusing():  # the views share one span index, one list of collectives...
        reads: dict[int, RankRead] = {}
        spans = _load(args, reads)
        if spans is None:
            return EXIT_UNREADABLE
        try:
            files = flight_recorder.dump_files(args.paths, args.flight_recorder)
        except OSError as error:
            print(f"commdebug-otel diagnose: {error}", file=sys.stderr)
            files = []
        dumps, messages = flight_recorder.read_dumps(files, args.flight_recorder_pickle)
        for message in messages:
            print(f"commdebug-otel diagnose: {message}", file=sys.stderr)
        found = diagnose(spans, args.noise_floor_ms / 1e3, args.include_warmup, dumps or None, reads or None)
    print(json.dumps(found, indent=4) if args.format == "json" else format_text(found, args.top))
    sys.stdout.flush()
    return EXIT_DONE
