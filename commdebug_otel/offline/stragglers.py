"""The one straggler model of ``summarize``, ``diagnose`` and ``report``: which (rank, module, pass) makes the
others wait, found only where that lateness is consistent across steps and beyond the job's own noise.

Two layers, so that a live detector can use the second without spans:

* **lateness records** (:class:`Late`), from spans: each collective of a counted step, matched across ranks by
  (process group, seq counted without send/recv, :func:`.model.arrival_matches`), is held back by its last rank
  L. A record gives L, the step, the (module, pass) where L spent its extra time since its previous
  collective (:func:`late_records`), and ``lost_ns``: the delay L added since then (a delay that leaves
  several asynchronous collectives late counts once).
* **the test** (:func:`judge`), over records alone: per (rank, module, pass) and step, the lost time summed
  (a *cell*). A cell is *beyond the noise* when it exceeds the row's noise cut: the median plus
  :data:`NOISE_MADS` x 1.4826 x MAD of every *other* row's cells (every rank and place but this one: the
  job's noise, which a slow row does not raise for itself), at least the resolution floor. Under the null
  hypothesis (no straggler: ranks are exchangeable) a given cell is beyond the cut at the rate the other
  rows' cells are: ``q`` is the higher of their rate in the whole job, ``(exceeding + 1) / (cells possible
  + 1)`` (cells possible: the counted steps of every rank x the places seen, this row's aside), and the
  other ranks' rate at the row's place (per counted step: a place where every rank is often late, such as
  the optimizer step on a busy machine, is noise there). A row late beyond the noise in ``k`` of its
  ``n`` steps gets the one-sided binomial ``p = P(Binomial(n, q) >= k)``; it is a straggler when
  ``k >= MIN_STEPS_LATE`` (3), ``p x m <= alpha`` (Bonferroni over the ``m`` rows with a step beyond the
  noise) and its median late cell is at least :data:`MIN_EFFECT` (1.5) cuts (an effect size: a rank starved
  just past the cut for a stretch is the noise's tail). Rows found are left out of the noise and the test is
  run again, until no new row is found. A rank late with no place where it spent more time than the others
  (:data:`UNATTRIBUTED`) is never blamed: that lateness is not its own work (a pipeline stage's place in the
  schedule, a wait for its peer on another group); its cells stay in the others' noise and in the lateness
  table. A rank whose extra time lay in several places, none above the floor, is its own work: :data:`SPREAD`.
  Pipeline stages (send/recv pairs) run different layers: a stage late to its send is placed where its step
  spent more than the receiving stage's in modules of the same kind (``layers.5.attention`` against
  ``layers.1.attention``: :func:`stage_place`), by at least the floor; else it is late by the model's split
  (the last stage's output layer and loss, a stage with more layers): :data:`STAGE`, never blamed, like
  ``UNATTRIBUTED``. A stage slow in a module no other stage has, or uniformly slower (a throttled device), is
  therefore not told apart from a heavier stage over send/recv alone; with data-parallel replicas of each stage,
  their collectives compare like with like and find it.

Assumptions: steps are independent trials; the other ranks' lateness is the job's noise (wrong when most
ranks are slow in the same place, then nobody stands out); one or two slow steps are events, not a straggler.
The first traced step, and the slow ones right after it, are left out (:func:`.model.warmup_step`), as are
collectives outside steps.

Usage::

    from commdebug_otel.offline import stragglers, summary

    answer = stragglers.find(summary.load_spans(["commdebug-otel-out/run-20261201-062712-66fd1e02"]))
    answer["stragglers"]  # [] on a healthy job
    print("\\n".join(stragglers.format_lines(answer)))

Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from array import array
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from commdebug_otel import semconv
from commdebug_otel.core.fact import BETWEEN_STEPS
from commdebug_otel.offline.model import (
    WARMUP_SLOWER,
    Arrivals,
    CollectiveEvent,
    SpanIndex,
    arrival_matches,
    collective_events,
    column,
    finished_spans,
    index_of,
    p2p_pairs,
    reusing,
    warmup_step,
    warmup_steps,
)

__all__ = ["ALPHA", "BETWEEN_STEPS", "CONTENDED_SHARE", "MIN_EFFECT", "MIN_EFFECT_SPARSE", "MIN_STEPS_LATE",
           "NOISE_FLOOR_S", "NOISE_MADS", "SPREAD", "STAGE", "TRAIN_STEP", "UNATTRIBUTED", "Late", "RankTimes",
           "Tested", "Timeline", "binomial_sf", "blame", "find", "format_lines", "judge", "late_records",
           "lateness_rows", "module_kinds", "rank_times", "row_text", "span_label", "stage_place", "tested_rows",
           "warmup_text"]

#: Resolution: a collective held back less than this (seconds) is not recorded, nor a place with less extra time.
NOISE_FLOOR_S = 0.001
#: The noise cut: the other ranks' median lateness plus this many robust standard deviations (1.4826 x MAD).
NOISE_MADS = 3.0
#: Family-wise false-blame rate per job (Bonferroni over the rows tested).
ALPHA = 0.05
#: A row late beyond the noise in fewer steps than this is events, not a straggler.
MIN_STEPS_LATE = 3
#: A row whose typical late step (the median of its late cells) is under this many noise cuts is the noise's tail,
#: not a straggler: on a starved host one rank's steps run just past the cut for a stretch.
MIN_EFFECT = 1.5
#: A row late in under half its steps from its first late one (intermittent; a fail-slow from mid-run is late in
#: most of them) needs a median late cell of this many noise cuts: a rare
#: excursion must stand far out to be told from the noise's tail, whose rate ``q`` is estimated from the other
#: rows (on 2 ranks, one rank's steps), which a rank with more to do between collectives (rank 0, hosting the
#: store) does not share. Healthy 2-rank jobs had rank 0 late in 3-5 of 35 steps by 1.5-2.8 cuts.
MIN_EFFECT_SPARSE = 3.0
#: Where L's extra time lay outside every module span: in ``train_step`` itself (loss, optimizer, backward
#: outside modules), or between one step's end and the next's first module (``BETWEEN_STEPS``, core.fact).
TRAIN_STEP = f"({semconv.SPAN_TRAIN_STEP})"
#: A late rank that spent no more time anywhere than the others since their previous collectives.
UNATTRIBUTED = "(unattributed)"
#: A late rank whose extra time since its previous collective lay in several places, none above the floor.
SPREAD = "(several places)"
#: A pipeline stage late to its send by work the receiving stage has not (its share of the model spread over its
#: modules, or the schedule's own code, the loss of the last stage): the model's split, no place to blame.
STAGE = "(pipeline stage)"
STATISTIC = "binomial"
#: A row whose rank waited for a CPU (over the others) for at least this share of its lost time is host contention.
CONTENDED_SHARE = 0.5

Label = tuple[str, str]  # (module FQN or a parenthesised place, pass)


class Late(NamedTuple):
    """One collective held back by its last rank: the lateness record the test reads (ns, ints).

    ``rank``: the last rank L; ``step``; ``module``, ``pass_``: where L spent its extra time (``pass_`` ""
    for the parenthesised places); ``lost_ns``: the delay L added since its previous collective;
    ``waited_ns``: rank-ns the others waited for it; ``excess_ns``: L's time there over the others' median.
    """

    rank: int
    step: int
    module: str
    pass_: str
    lost_ns: int
    waited_ns: int
    excess_ns: int


# ------------------------------------------------------------------ from spans


def span_label(span: dict) -> Label:
    """``(module FQN, pass)`` of a module span; ``("(name)", "")`` of any other."""
    attrs = span["attributes"]
    if semconv.MODULE_FQN in attrs:
        return str(attrs[semconv.MODULE_FQN]), str(attrs.get(semconv.MODULE_PASS, ""))
    return f"({span['name']})", ""


class Timeline:
    """One rank's time cut into disjoint pieces, each owned by its innermost span.

    ``spans``: one rank's finished spans. Children are clipped to their parent; of
    overlapping siblings, the later one starts where the earlier ended.
    """

    def __init__(self, spans: list[dict]) -> None:
        index = SpanIndex(spans)
        pieces: list[tuple[int, int, Label]] = []
        for root in index.roots:
            # A walk with its own stack (a chain of 20,000 spans is no recursion): each frame is
            # [span, end, cursor (where the next child may start), its children by start].
            stack = [[root, root["end_ns"], root["start_ns"],
                      iter(sorted(index.children(root), key=lambda child: child["start_ns"]))]]
            while stack:
                frame = stack[-1]
                span, end, cursor, children = frame
                for child in children:
                    child_start, child_end = max(child["start_ns"], cursor), min(child["end_ns"], end)
                    if child_end <= child_start:
                        continue
                    if child_start > cursor:
                        pieces.append((cursor, child_start, span_label(span)))
                    frame[2] = child_end
                    stack.append([child, child_end, child_start,
                                  iter(sorted(index.children(child), key=lambda kid: kid["start_ns"]))])
                    break
                else:
                    if end > cursor:
                        pieces.append((cursor, end, span_label(span)))
                    stack.pop()
        pieces.sort()
        # Columns, each label once: a 1,024-rank job cuts into millions of pieces.
        labels: dict[Label, Label] = {}
        self._starts = array("Q", [piece[0] for piece in pieces])
        self._ends = array("Q", [piece[1] for piece in pieces])
        self._labels = [labels.setdefault(piece[2], piece[2]) for piece in pieces]

    def self_times(self, start: int, end: int) -> dict[Label, int]:
        """ns of ``[start, end)`` owned by each span label; time under no span is :data:`BETWEEN_STEPS`."""
        out: dict[Label, int] = defaultdict(int)
        covered = 0
        starts, ends = self._starts, self._ends
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(starts) and starts[i] < end:
            overlap = min(ends[i], end) - max(starts[i], start)
            if overlap > 0:
                out[self._labels[i]] += overlap
                covered += overlap
            i += 1
        if end - start > covered:
            out[(BETWEEN_STEPS, "")] += end - start - covered
        return out


class RankTimes(NamedTuple):
    """What the model reads of one rank: its :class:`Timeline`, its collectives (:class:`.model.Arrivals`,
    a ``train_step_tail``'s between steps, :func:`.model.finished_spans`), each step's wait for a CPU
    (``{step: ns}``, ``commdebug.step.cpu_wait_s``; absent where not exported), and each step's
    ``train_step`` span (``{step: (start ns, end ns)}``)."""

    timeline: Timeline
    arrivals: Arrivals
    cpu_wait: dict[int, int] = {}
    steps: dict[int, tuple[int, int]] = {}


def rank_times(spans: list[dict]) -> dict[int, RankTimes]:
    """:class:`RankTimes` of each rank, from ``spans`` holding every span of each of their ranks (stall
    snapshots are left out here). Within :func:`.model.reusing`, the span index of
    :func:`.model.finished_spans` is shared with the caller's."""
    finished = finished_spans(spans)
    steps = index_of(finished)
    by_rank: dict[int, list[dict]] = defaultdict(list)
    step_starts: dict[int, dict[int, int]] = defaultdict(dict)
    step_spans: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    cpu_wait: dict[int, dict[int, int]] = defaultdict(dict)
    for span in finished:
        by_rank[span["rank"]].append(span)
        step = steps.step(span)
        if span["name"] == semconv.SPAN_TRAIN_STEP and step is not None:
            starts = step_starts[span["rank"]]
            starts[step] = min(starts.get(step, span["start_ns"]), span["start_ns"])
            start, end = step_spans[span["rank"]].get(step, (span["start_ns"], span["end_ns"]))
            step_spans[span["rank"]][step] = (min(start, span["start_ns"]), max(end, span["end_ns"]))
            waited = span["attributes"].get(semconv.STEP_CPU_WAIT)
            if waited is not None:
                cpu_wait[span["rank"]][step] = cpu_wait[span["rank"]].get(step, 0) + round(float(waited) * 1e9)
    events: dict[int, list[CollectiveEvent]] = defaultdict(list)
    for event in collective_events(finished):
        events[event.rank].append(event)
    return {rank: RankTimes(Timeline(by_rank[rank]), Arrivals(events.get(rank, []), steps, step_starts.get(rank, {})),
                            cpu_wait.get(rank, {}), step_spans.get(rank, {}))
            for rank in sorted(by_rank)}


class _Carried:
    """How late each rank still was when it left each collective, to count a delay once.

    ``complete``: the complete matches, ``{rank: index in its table}`` each. A rank's lateness at a collective
    is ``a_r - max(a_o, o != r)``; what it carries away is that lateness, but no more than how much
    later than the others it returned from the call (the event's time): a blocking collective
    returns on every rank when the last arrives (nothing carried), an asynchronous one (DDP's
    buckets, FSDP's prefetch, functional collectives) returns at once (all of it carried).
    """

    def __init__(self, complete: list[dict[int, int]], tables: dict[int, Arrivals]) -> None:
        carried: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> {index in its table: ns carried}
        for members in complete:
            issued = _Latest({rank: tables[rank].issued[i] for rank, i in members.items()})
            returned = _Latest({rank: tables[rank].returned[i] for rank, i in members.items()})
            for rank, i in members.items():
                late = issued[rank] - _latest_other(issued, rank)
                later = returned[rank] - _latest_other(returned, rank)
                carried[rank][i] = max(0, min(late, later))
        # Per rank, by arrival (a column each: half a million of them at 1,024 ranks).
        self._times: dict[int, Sequence[int]] = {}
        self._carried: dict[int, Sequence[int]] = {}
        self._steps: dict[int, list[int | None]] = {}
        for rank, found in carried.items():
            table = tables[rank]
            order = sorted(found, key=table.issued.__getitem__)
            self._times[rank] = column([table.issued[i] for i in order])
            self._carried[rank] = column([found[i] for i in order])
            self._steps[rank] = [table.steps[i] for i in order]

    def before(self, rank: int, arrival: int, step: int | None) -> int:
        """ns of lateness ``rank`` carried from its previous collective (in this step or the one before)."""
        times = self._times.get(rank)
        if times is None:  # in no complete match (a pipeline stage that only sends and receives)
            return 0
        i = bisect.bisect_left(times, arrival)
        if i == 0:
            return 0
        return self._carried[rank][i - 1] if step is not None and self._steps[rank][i - 1] in (step, step - 1) else 0


class _Latest(dict):
    """``{rank: ns}`` that knows its two latest ranks: the latest other than a rank in O(1), not O(ranks)."""

    def __init__(self, times: dict[int, int]) -> None:
        super().__init__(times)
        top = sorted(times, key=lambda rank: times[rank], reverse=True)[:2]
        self.top = [(rank, times[rank]) for rank in top]


def _latest_other(times: _Latest, rank: int) -> int:
    """The latest time of a rank other than ``rank`` (a match has at least two ranks)."""
    (first, first_time), (_, second_time) = times.top[0], times.top[1]
    return second_time if first == rank else first_time


def blame(late: Mapping[Label, int], others: Sequence[Mapping[Label, int]]) -> tuple[Label, int, int]:
    """The label where ``late`` spent most more time than the others' median, that excess, and the
    excesses summed over every label where it spent more (ns)."""
    labels = set(late).union(*others)
    excess = {label: late.get(label, 0) - statistics.median(other.get(label, 0) for other in others)
              for label in labels}
    label = max(sorted(excess), key=lambda label: excess[label])
    extra = round(sum(value for value in excess.values() if value > 0))
    if excess[label] <= 0:  # e.g. it was late only because the others left the previous collective early
        return (UNATTRIBUTED, ""), 0, extra
    return label, round(excess[label]), extra


def _placed(label: Label, excess: int, extra: int, floor_ns: float) -> tuple[Label, int]:
    """Where a late rank's delay goes, and its excess there: ``label`` when that excess reaches the floor;
    :data:`SPREAD` when only its extra time summed over every place does (its own work, in small pieces);
    else :data:`UNATTRIBUTED` (it spent no more time anywhere: the lateness is not its own work)."""
    if excess >= floor_ns:
        return label, excess
    return ((SPREAD, "") if extra >= floor_ns else (UNATTRIBUTED, "")), 0


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def module_kinds(times: Mapping[Label, int]) -> dict[Label, dict[str, int]]:
    """A step's module self times (``{(FQN, pass): ns}``) by kind: each FQN with its layer indices replaced by
    ``*`` (``Model.layers.5.attention`` -> ``Model.layers.*.attention``), as ``{(kind, pass): {FQN: ns}}``. Two
    pipeline stages hold different layers of the same kind; the parenthesised places are left out."""
    kinds: dict[Label, dict[str, int]] = defaultdict(dict)
    for (module, pass_), ns in times.items():
        if not module.startswith("("):
            kinds[(_LAYER_INDEX.sub(".*", module), pass_)][module] = ns
    return kinds


def stage_place(late: Mapping[Label, dict[str, int]], other: Mapping[Label, dict[str, int]], floor_ns: float
                ) -> tuple[Label, int]:
    """Where a pipeline stage late to its send spent more than the receiving stage, from each one's step
    (:func:`module_kinds`): of the kinds both run, the one whose time per module is most above the other
    stage's, at its slowest module, with that excess (ns), when it reaches ``floor_ns``; else :data:`STAGE` and
    0 (its extra time is work the other stage has not: the model's split)."""
    best: tuple[float, Label] | None = None
    for kind, mine in late.items():
        theirs = other.get(kind)
        if theirs:
            excess = sum(mine.values()) / len(mine) - sum(theirs.values()) / len(theirs)
            if best is None or excess > best[0]:
                best = excess, kind
    if best is None or best[0] < floor_ns:
        return (STAGE, ""), 0
    mine = late[best[1]]
    return (max(sorted(mine), key=lambda module: mine[module]), best[1][1]), round(best[0])


def late_records(times: dict[int, RankTimes], warmup: int | None, noise_floor_s: float = NOISE_FLOOR_S
                 ) -> tuple[list[Late], dict[int, set[int]]]:
    """The lateness records of ``times`` (:func:`rank_times`), and each rank's counted steps.

    Each complete match (as many ranks as the group's size, at least two) of a step other than ``warmup`` counts. A
    rank's arrival ``a_r`` is when its CPU began issuing the op (:attr:`.model.CollectiveEvent.issued_ns`); the last
    rank L is late by ``late = a_L - max(a_r, r != L)``. Its record's ``lost = min(late, max(late - carried,
    extra))``: ``carried`` is the lateness it left its previous collective (this step or the one before) with (at
    most how much later than the others that call returned: 0 after a blocking collective, all of it after an
    asynchronous one), ``extra`` the time it spent over the others since then. Where: the window on each rank from
    its previous arrival (or its ``train_step``'s start) up to this one is cut by innermost span, and the (module,
    pass) where L spent most over the other ranks' median is named (:data:`TRAIN_STEP`, :data:`BETWEEN_STEPS`;
    :data:`SPREAD` when no place but its summed extra time reaches ``noise_floor_s``, :data:`UNATTRIBUTED` when not
    even that). A ``late`` or ``lost`` under ``noise_floor_s`` is no record.

    Returns:
        ``(records, {rank: steps where it took part in a complete match})``.
    """
    tables = {rank: read.arrivals for rank, read in times.items()}
    complete = []
    for events in arrival_matches(tables, lambda step: step is None or (warmup is not None and step <= warmup)):
        if len(events) >= 2:  # as many ranks as the group's size, as the earliest event says
            _, rank, i = min(events)
            if len(events) == tables[rank].sizes[i]:
                complete.append({rank: i for _, rank, i in events})

    def self_times(rank: int, i: int, step: int) -> dict[Label, int]:
        arrival = tables[rank].issued[i]
        return times[rank].timeline.self_times(tables[rank].window_start(arrival, step), arrival)

    carried = _Carried(complete, tables)
    seen: dict[int, set[int]] = defaultdict(set)
    records = []
    floor_ns = noise_floor_s * 1e9
    for members in complete:
        issued = {rank: tables[rank].issued[i] for rank, i in members.items()}
        last = max(sorted(issued), key=lambda rank: issued[rank])
        step = tables[last].steps[members[last]]
        assert step is not None  # arrival_matches leaves out events outside steps
        for rank in members:
            seen[rank].add(step)
        others = [time for rank, time in issued.items() if rank != last]
        late = issued[last] - max(others)
        if late < floor_ns:
            continue
        (module, pass_), excess, extra = blame(
            self_times(last, members[last], step),
            [self_times(rank, i, step) for rank, i in members.items() if rank != last])
        # Lateness it carried from its previous collective was counted there; unless it spent more time
        # than the others since then (the others waited out its lateness in between, e.g. in wait_tensor).
        lost = min(late, max(late - carried.before(last, issued[last], step), extra))
        if lost < floor_ns:
            continue
        (module, pass_), excess = _placed((module, pass_), excess, extra, floor_ns)
        records.append(Late(last, step, module, pass_, lost, sum(min(issued[last] - time, lost) for time in others),
                            excess))
    # Point-to-point: a receiver that posted its recv before the send began waits for the sender (a pipeline
    # stage for the stage before it in forward, after it in backward): that wait is the sender's lateness.
    # A recv posted in another step (a later stage's first recv, in the step before's tail) waits out the
    # pipeline's fill, everything the earlier stage does between steps: no step's lateness.
    # Stages run different layers: the place is where the sender's step spent more than the receiver's in
    # modules of the same kind (stage_place), not what it ran while the receiver waited.
    kinds: dict[tuple[int, int], dict[Label, dict[str, int]]] = {}

    def step_kinds(rank: int, step: int) -> dict[Label, dict[str, int]]:
        if (rank, step) not in kinds:
            window = times[rank].steps.get(step)
            kinds[(rank, step)] = module_kinds(times[rank].timeline.self_times(*window)) if window else {}
        return kinds[(rank, step)]

    for (sender, send), (receiver, recv) in p2p_pairs(tables):
        step = tables[sender].steps[send]
        if step is None or (warmup is not None and step <= warmup) or tables[receiver].steps[recv] != step:
            continue
        seen[sender].add(step)
        seen[receiver].add(step)
        late = tables[sender].issued[send] - tables[receiver].issued[recv]
        if late < floor_ns:
            continue
        _, _, extra = blame(self_times(sender, send, step), [self_times(receiver, recv, step)])
        lost = min(late, max(late - carried.before(sender, tables[sender].issued[send], step), extra))
        if lost < floor_ns:
            continue
        (module, pass_), excess = stage_place(step_kinds(sender, step), step_kinds(receiver, step), floor_ns)
        records.append(Late(sender, step, module, pass_, lost, lost, excess))
    return records, dict(seen)


# --------------------------------------------------------------------- the test


def _kth(values: Sequence[float], without: Sequence[float], k: int) -> float:
    """The ``k``-th smallest (from 0) of sorted ``values`` less the sorted sub-multiset ``without``."""
    lo, hi = 0, len(values) - 1
    while lo < hi:  # the first index whose value has more than k of the rest at or below it
        mid = (lo + hi) // 2
        if bisect.bisect_right(values, values[mid]) - bisect.bisect_right(without, values[mid]) > k:
            hi = mid
        else:
            lo = mid + 1
    return values[lo]


def _within(values: Sequence[float], low: float, high: float) -> int:
    return bisect.bisect_right(values, high) - bisect.bisect_left(values, low)


def _median_mad(values: Sequence[float], without: Sequence[float]) -> tuple[float, float]:
    """Median and MAD of sorted ``values`` less the sorted ``without`` (a subset), in O(log^2) each."""
    n = len(values) - len(without)
    median = (_kth(values, without, (n - 1) // 2) + _kth(values, without, n // 2)) / 2
    widest = max(values[-1] - median, median - values[0])

    def least_within(count: int) -> float:
        """The least d with ``count`` of the rest within [median - d, median + d]: the count-th deviation."""
        lo, hi = 0.0, widest
        for _ in range(64):
            mid = (lo + hi) / 2
            if _within(values, median - mid, median + mid) - _within(without, median - mid, median + mid) >= count:
                hi = mid
            else:
                lo = mid
        return hi

    return median, (least_within((n - 1) // 2 + 1) + least_within(n // 2 + 1)) / 2


def binomial_sf(k: int, n: int, p: float) -> float:
    """``P(Binomial(n, p) >= k)``."""
    if k <= 0:
        return 1.0
    if p >= 1.0:
        return 1.0
    total = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for i in range(k, n + 1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                        + (n - i) * log_q)
        total += term
        if i > n * p and term < total * 1e-17:
            break
    return min(1.0, total)


def judge(records: Iterable[Late], steps_seen: dict[int, set[int]], noise_floor_s: float = NOISE_FLOOR_S,
          alpha: float = ALPHA, min_effect: float = MIN_EFFECT, sparse_effect: float = MIN_EFFECT_SPARSE
          ) -> list[dict[str, Any]]:
    """The (rank, module, pass) rows whose lateness is consistent and beyond the job's noise (module docstring).

    ``records``: :class:`Late` of counted steps; ``steps_seen``: each rank's counted steps (each a possible
    cell at every place, late or not: the null rate's denominator). ``noise_floor_s``: the least noise cut.
    ``min_effect``: the least median late cell, in noise cuts (1.0: none beyond the cut; the live verdict judges
    the effect over an episode's steps only); ``sparse_effect``: the same for a row late in under half its steps
    from its first late one (:data:`MIN_EFFECT_SPARSE`; the higher of the two counts).

    Returns:
        the straggler rows, most ``lost_s`` first: ``{"rank", "module", "pass", "lost_s" (in its late steps),
        "steps_late", "steps_seen", "late_steps" (sorted), "late_min_s", "late_max_s" (a late step's lost
        time), "noise_cut_s", "null_rate" (q), "p_value" (before the correction), "tested" (m), "statistic"
        (:data:`STATISTIC`)}``; a healthy job gives ``[]``.
    """
    cells: dict[tuple[int, str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        cells[(record.rank, record.module, record.pass_)][record.step] += record.lost_ns
    found: dict[tuple[int, str, str], dict[str, Any]] = {}
    for _ in range(8):  # rows found are no noise: test again without them until no new row is found
        again = _test(cells, steps_seen, set(found), noise_floor_s * 1e9, alpha, min_effect, sparse_effect)
        if set(again) <= set(found):
            break
        found |= again
    rows = sorted(again.values(), key=lambda row: (-row["lost_s"], row["rank"], row["module"], row["pass"]))
    return rows


class Tested(NamedTuple):
    """A (rank, module, pass) row with a cell beyond its noise cut: ``late`` ``{step: lost ns}`` of those cells,
    ``cut_ns`` its noise cut, ``rate`` the null rate ``q`` of a cell beyond it."""

    key: tuple[int, str, str]
    late: dict[int, int]
    cut_ns: float
    rate: float


def tested_rows(records: Iterable[Late], steps_seen: dict[int, set[int]],
                noise_floor_s: float = NOISE_FLOOR_S) -> list[Tested]:
    """The rows :func:`judge` tests in its first pass (each row's cells beyond its cut, the cut and the null rate),
    for a test of another shape over the same noise (the live verdict's scan over an episode)."""
    cells: dict[tuple[int, str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        cells[(record.rank, record.module, record.pass_)][record.step] += record.lost_ns
    return _tested(cells, steps_seen, set(), noise_floor_s * 1e9)


def _test(cells: dict[tuple[int, str, str], dict[int, int]], steps_seen: dict[int, set[int]],
          apart: set[tuple[int, str, str]], floor_ns: float, alpha: float, min_effect: float, sparse_effect: float
          ) -> dict[tuple[int, str, str], dict]:
    """One pass of :func:`judge`'s test, the cells of the rows ``apart`` (found before) left out of the noise."""
    tested = _tested(cells, steps_seen, apart, floor_ns)
    found = {}
    for (rank, module, pass_), late, cut, rate in tested:
        n = len(steps_seen.get(rank, ())) or len(late)
        p = binomial_sf(len(late), n, rate)
        if len(late) < MIN_STEPS_LATE or p * len(tested) > alpha:
            continue
        first = min(late)  # from its first late step: a fail-slow from mid-run is late in most steps since
        since = sum(1 for step in steps_seen.get(rank, ()) if step >= first) or len(late)
        effect = min_effect if 2 * len(late) >= since else max(min_effect, sparse_effect)
        if statistics.median(late.values()) < effect * cut:
            continue
        found[(rank, module, pass_)] = found_row(Tested((rank, module, pass_), late, cut, rate), late, n, p,
                                                 len(tested), STATISTIC)
    return found


def found_row(row: Tested, late: Mapping[int, int], seen: int, p: float, tested: int, statistic: str
              ) -> dict[str, Any]:
    """:func:`judge`'s row of a found (rank, module, pass) ``row``: its late cells ``late`` (``{step: lost ns}``, the
    ones counted) of ``seen`` steps, ``p`` before the correction over ``tested`` rows, by ``statistic``."""
    rank, module, pass_ = row.key
    return {"rank": rank, "module": module, "pass": pass_, "lost_s": sum(late.values()) / 1e9,
            "steps_late": len(late), "steps_seen": seen, "late_steps": sorted(row.late),
            "late_min_s": min(late.values()) / 1e9, "late_max_s": max(late.values()) / 1e9,
            "noise_cut_s": row.cut_ns / 1e9, "null_rate": row.rate, "p_value": p, "tested": tested,
            "statistic": statistic}


def _tested(cells: dict[tuple[int, str, str], dict[int, int]], steps_seen: dict[int, set[int]],
            apart: set[tuple[int, str, str]], floor_ns: float) -> list[Tested]:
    """Each row of ``cells`` with a cell beyond its noise cut, but ``UNATTRIBUTED`` and ``STAGE`` ones, the cells
    of the rows ``apart`` left out of the noise."""
    places = len({(module, pass_) for _, module, pass_ in cells}) or 1
    everything = sorted(value for key, row in cells.items() if key not in apart for value in row.values())
    at_place: dict[tuple[str, str], list[int]] = defaultdict(list)  # the noise's cells at each place
    for key, row in cells.items():
        if key not in apart:
            at_place[key[1:]].extend(row.values())
    for values in at_place.values():
        values.sort()
    seen_all = sum(len(steps) for steps in steps_seen.values())
    possible = seen_all * places - sum(len(steps_seen.get(rank, ())) for rank, _, _ in apart)

    def over(values: list[int], mine: list[int], cut: float) -> int:
        return (len(values) - bisect.bisect_right(values, cut)) - (len(mine) - bisect.bisect_right(mine, cut))

    pooled = _median_mad(everything, []) if len(everything) >= 3 else None
    tested: list[Tested] = []
    for key, row in cells.items():
        if key[1] in (UNATTRIBUTED, STAGE):  # not the rank's own fault: noise for the others, no blame
            continue
        rank = key[0]
        mine = sorted(row.values()) if key not in apart else []
        cut = floor_ns
        if len(everything) - len(mine) >= 3:
            # A row of under 1 % of the cells moves the median and MAD by under half a percentile: the pooled
            # ones stand for the rest (at 1,024 ranks, 30,000 rows would each take a few hundred bisections).
            median, mad = pooled if pooled and len(mine) * 100 < len(everything) else _median_mad(everything, mine)
            cut = max(floor_ns, median + NOISE_MADS * 1.4826 * mad)
        late = {step: ns for step, ns in row.items() if ns > cut}
        if not late:
            continue
        own_steps = len(steps_seen.get(rank, ()))
        rate = (over(everything, mine, cut) + 1) / (max(possible - (0 if key in apart else own_steps), 0) + 1)
        others_at_place = seen_all - own_steps  # the other ranks' counted steps, each a cell there
        if others_at_place > 0:
            rate = max(rate, over(at_place.get(key[1:], []), mine, cut) / others_at_place)
        tested.append(Tested(key, late, cut, min(1.0, rate)))
    return tested


def lateness_rows(records: Iterable[Late]) -> list[dict[str, Any]]:
    """The raw lateness per (rank, module, pass), every record summed, most ``lost_s`` first:
    ``{"rank", "module", "pass", "lost_s", "waited_s", "collectives", "steps" (sorted), "excess_s"}``."""
    rows: dict[tuple[int, str, str], dict[str, Any]] = {}
    for record in records:
        row = rows.setdefault((record.rank, record.module, record.pass_), {
            "rank": record.rank, "module": record.module, "pass": record.pass_, "lost_s": 0, "waited_s": 0,
            "collectives": 0, "steps": set(), "excess_s": 0})
        row["lost_s"] += record.lost_ns
        row["waited_s"] += record.waited_ns
        row["excess_s"] += record.excess_ns
        row["collectives"] += 1
        row["steps"].add(record.step)
    out = [row | {"lost_s": row["lost_s"] / 1e9, "waited_s": row["waited_s"] / 1e9,
                  "excess_s": row["excess_s"] / 1e9, "steps": sorted(row["steps"])} for row in rows.values()]
    out.sort(key=lambda row: (-row["lost_s"], row["rank"], row["module"], row["pass"]))
    return out


def find(spans: list[dict], noise_floor_s: float = NOISE_FLOOR_S, include_warmup: bool = False,
         times: dict[int, RankTimes] | None = None, alpha: float = ALPHA) -> dict[str, Any]:
    """The straggler answer of ``spans``: what ``summarize``, ``diagnose`` and ``report`` say.

    ``times``: each rank's :class:`RankTimes` where the files were read folded (:func:`rank_times` of each
    file's spans); None: made from ``spans``. The warm-up steps are left out unless ``include_warmup``.

    Returns:
        ``{"stragglers": judge(...)'s rows but those of host contention (``[]``: no straggler above the noise),
        "contended": those rows, each with ``"cpu_wait_s"`` (:func:`_contended`), "lateness": lateness_rows(...),
        "warmup_step": the last step left out (with every one before it) or None, "warmup_steps": the traced steps
        left out (:func:`.model.warmup_steps`), "steps": the counted steps (sorted), "noise_floor_s",
        "alpha"}``.
    """
    finished = finished_spans(spans)
    warmup = None if include_warmup else warmup_step(finished)
    if times is None:
        ordered = sorted(spans, key=lambda span: (span["rank"], span["start_ns"]))
        with reusing(own=True):
            times = rank_times(ordered)
    records, seen = late_records(times, warmup, noise_floor_s)
    rows = judge(records, seen, noise_floor_s, alpha)
    contended = [row for row in rows if _contended(row, times)]
    return {"stragglers": [row for row in rows if row not in contended], "contended": contended,
            "lateness": lateness_rows(records), "warmup_step": warmup,
            "warmup_steps": [] if include_warmup else warmup_steps(finished),
            "steps": sorted(set().union(*seen.values())) if seen else [], "noise_floor_s": noise_floor_s,
            "alpha": alpha}


def _contended(row: dict[str, Any], times: dict[int, RankTimes]) -> bool:
    """Whether ``row``'s rank waited for a CPU, in its late steps, more than the other ranks' median by at least
    :data:`CONTENDED_SHARE` of the time it lost there: another process on its host took its CPU, and its code is
    not what is slow. Adds ``"cpu_wait_s"`` (that extra wait, summed) to the row."""
    mine = times[row["rank"]].cpu_wait
    others = [read.cpu_wait for rank, read in times.items() if rank != row["rank"]]
    if not mine or not others:
        return False
    extra = sum(max(0.0, mine.get(step, 0) - statistics.median(other.get(step, 0) for other in others))
                for step in row["late_steps"])
    row["cpu_wait_s"] = extra / 1e9
    return extra / 1e9 >= CONTENDED_SHARE * row["lost_s"]


def _where(module: str, pass_: str) -> str:
    return f"{module or TRAIN_STEP} {pass_}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def row_text(row: dict[str, Any]) -> str:
    """One straggler row as a sentence: ``rank 1 in M forward: late in 7 of 7 steps, 60-62 ms (noise cut
    4.1 ms), p=2e-11``."""
    spread = _ms(row["late_min_s"]) if row["late_min_s"] == row["late_max_s"] else \
        f"{_ms(row['late_min_s'])}-{_ms(row['late_max_s'])}"
    return (f"rank {row['rank']} in {_where(row['module'], row['pass'])}: late in {row['steps_late']} of "
            f"{row['steps_seen']} steps, {spread} ms (noise cut {_ms(row['noise_cut_s'])} ms), "
            f"p={row['p_value']:.0e}")


def warmup_text(steps: Sequence[int]) -> str:
    """The words saying which warm-up steps (:func:`.model.warmup_steps`) the answer left out ("" when none)."""
    if not steps:
        return ""
    if len(steps) == 1:
        return (f" (step {steps[0]} left out: the first traced step, start-up skew and warm-up; "
                "--include-warmup counts it)")
    return (f" (steps {steps[0]}-{steps[-1]} left out: the first traced step and the {len(steps) - 1} after it that "
            f"took over {WARMUP_SLOWER:g} times the median step, start-up skew and warm-up; --include-warmup counts "
            "them)")


def format_lines(answer: dict[str, Any]) -> list[str]:
    """The answer as both commands print it: the verdict, then each straggler row (:func:`row_text`), then each
    row of host contention (``"contended"``, when given).

    ``answer``: a dict with :func:`find`'s ``"stragglers"``, ``"warmup_step"`` and ``"alpha"``."""
    rows = answer["stragglers"]
    left_out = warmup_text(answer.get("warmup_steps") or (
        [answer["warmup_step"]] if answer.get("warmup_step") is not None else []))
    if not rows:
        out = [f"No straggler above the noise{left_out}."]
    else:
        out = [f"Stragglers: {len(rows)} (rank, module, pass) late consistently and beyond the other ranks' noise "
               f"(Bonferroni over {rows[0]['tested']} rows, alpha {answer['alpha']:g}){left_out}:"]
        out += [f"  {row_text(row)}" for row in rows]
    contended = answer.get("contended") or []
    if contended:
        out.append("Host contention, not a straggler in the code: late as consistently, but waiting for a CPU that "
                   "another process on its host had:")
        out += [f"  {row_text(row)}; waited {_ms(row['cpu_wait_s'])} ms more than the others for a CPU"
                for row in contended]
    return out
