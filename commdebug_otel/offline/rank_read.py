"""What every command keeps of one rank's spans where its file is read: :class:`RankRead`, made by :func:`rank_reads`.

A folding reader (:class:`.otlp_json.SpanReader` with a ``fold``) calls its fold's ``digest`` on one file's
spans; ``summarize`` and ``diagnose`` both digest into a :class:`RankRead`, so a rank's collectives, its timeline
and its per-step totals mean the same in both. ``diagnose`` adds what its checks need of the rank (``prints``,
``whole``, ``raised``, ``closed``) through the ``checks`` callback; ``summarize`` leaves them empty.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from commdebug_otel import semconv
from commdebug_otel.offline.model import (
    Arrivals,
    collective_events,
    finished_spans,
    index_of,
    is_snapshot,
    reusing,
)
from commdebug_otel.offline.stragglers import Label, RankTimes, Timeline, rank_times

__all__ = ["ALL", "RankRead", "rank_reads"]

#: The key of :attr:`RankRead.totals` that counts every collective event of the rank.
ALL = "all"

class RankRead(NamedTuple):
    """One rank's spans as the offline commands keep them where its file is read.

    ``times``: what the straggler model reads of it (:class:`.stragglers.RankTimes`: its module timeline and its
    collectives, :class:`.model.Arrivals`, a ``train_step_tail``'s between steps); ``totals``:
    ``{step: [events, bytes, {op: n}]}`` of its collective events by the step :func:`.summary.step_spans`
    gives their span (a ``train_step_tail``'s in its step; None: outside steps), and under the key :data:`ALL`
    all of them, each ``{op: n}`` in the order the ops first came; ``groups``: ``{group: (index in
    ``times.arrivals`` of its last event there, the group's size, the world size)}`` (pipeline waits place peers
    by them); ``steps``: the step of each of ``times.arrivals``' collectives as ``totals`` counts them (a tail's
    in its step: ``summarize``'s lateness leaves the warm-up step's tail out with the step).

    Filled by ``checks`` (``diagnose``; empty otherwise): ``prints``: ``{step: {group: print}}``, a 64-bit print
    of what it issued there; ``whole``: the steps whose record is whole; ``raised``: ``[(order, first
    exception)]`` per step that raised; ``closed``: ``{step: label of the innermost span left open}`` of a step
    ended at exit.
    """

    times: RankTimes
    totals: Mapping[Any, list]
    groups: Mapping[str, tuple[int, int, int]]
    steps: Sequence[int | None]
    prints: dict[int, dict[str, int]]
    whole: frozenset[int]
    raised: list[tuple[tuple[int, int], dict]]
    closed: dict[int, Label]


#: ``checks(spans)`` -> ``{rank: {field of RankRead: value}}`` for the fields it fills (run within
#: :func:`.model.reusing`, on the spans sorted by rank and start).
Checks = Callable[[list[dict]], Mapping[int, Mapping[str, Any]]]


def rank_reads(spans: list[dict], checks: Checks | None = None) -> dict[int, RankRead]:
    """:class:`RankRead` of each rank, from ``spans`` holding every span of each of their ranks (stall snapshots
    are left out of ``times``, ``totals`` and ``groups``; ``checks`` sees them)."""
    spans = sorted(spans, key=lambda span: (span["rank"], span["start_ns"]))  # the order load_spans gives
    with reusing(own=True):  # its own results: one file's, dropped when done
        finished = finished_spans(spans)
        times = rank_times(spans)
        totals, groups, steps = _totals(spans, finished)
        extra = checks(spans) if checks is not None else {}
        empty = RankTimes(Timeline([]), Arrivals([], index_of(finished), {}))
    return {rank: RankRead(times.get(rank, empty), totals.get(rank, {}), groups.get(rank, {}), steps.get(rank, []),
                           {}, frozenset(), [], {})._replace(**extra.get(rank, {}))
            for rank in sorted({*times, *extra})}


def _totals(spans: list[dict], finished: list[dict]
            ) -> tuple[dict[int, dict[Any, list]], dict[int, dict[str, tuple[int, int, int]]],
                       dict[int, list[int | None]]]:
    """Each rank's :attr:`RankRead.totals`, :attr:`RankRead.groups` and :attr:`RankRead.steps`, over the
    finished spans' collective events (in the order of ``times.arrivals``)."""
    tails = any(span["name"] == semconv.SPAN_TRAIN_STEP_TAIL for span in finished)
    # A tail's events count in its step, as step_spans takes them: the index of the spans as exported
    # (finished_spans keeps their order, a tail copied).
    kept = [span for span in spans if not is_snapshot(span)] if tails else finished
    steps = index_of(kept)
    original = {id(copy): span for copy, span in zip(finished, kept, strict=True)} if tails else {}
    totals: dict[int, dict[Any, list]] = defaultdict(dict)
    groups: dict[int, dict[str, tuple[int, int, int]]] = defaultdict(dict)
    in_steps: dict[int, list[int | None]] = defaultdict(list)
    for event in collective_events(finished):
        rank, span = event.rank, event.span
        if tails:
            span = original[id(span)]
        world = int(span["resource"].get(semconv.WORLD_SIZE, 0))
        groups[rank][event.group] = (len(in_steps[rank]), event.group_size, world)
        step = steps.step(span)
        in_steps[rank].append(step)
        nbytes = event.nbytes
        for key in (ALL, step):
            total = totals[rank].setdefault(key, [0, 0, Counter()])
            total[0] += 1
            total[1] += nbytes
            total[2][event.name] += 1
    return totals, groups, in_steps
