"""The live fail-slow verdict: a rank that becomes persistently slow is named while the job runs.

What every step measures, traced or not (``core/progress.py``): each rank's *busy time* per training step, its
wall time less the time its training thread waited in collectives (``Work.wait()``, ``wait_tensor``, the
wait of a blocking c10d call). The ranks a straggler holds back wait for it, so their busy time stays flat
while its own grows: a clock-free measure (no cross-host clock is compared). Per step, the rank with the most
busy time is the last one, late by its busy time less the next highest (:func:`late_from_busy`): one
:class:`~commdebug_otel.offline.stragglers.Late` record per step, at the place
:data:`~commdebug_otel.offline.stragglers.TRAIN_STEP` (untraced steps know no module). The significance test is
the offline model's own, :func:`commdebug_otel.offline.stragglers.judge`, over the last :data:`WINDOW_STEPS`
steps every rank reported: a rank is a straggler when it was late beyond the other ranks' noise in at least
``MIN_STEPS_LATE`` steps, more often than the noise explains (binomial, Bonferroni, ``ALPHA``). Live, its
resolution floor is :data:`FLOOR_FRACTION` of the job's busy time (:func:`noise_floor_s`), and the verdict names
only a *persistent* straggler: one late in :data:`PERSISTENT_SHARE` of the steps since its episode began
(intermittent lateness is left to ``diagnose``), by a median of at least ``MIN_EFFECT`` noise cuts over those
steps (the offline effect size, judged over the episode). The episode starts at the earliest late step from which
both hold (:func:`_persistent_since`): a rank a little late now and then before the onset, sharing its core, would
otherwise stretch the episode back, hold its share and median down, and delay the verdict until the window forgets
those steps.

Where it is slow comes from traced steps: each rank keeps, per traced step, each (module, pass)'s self time
(``Progress.places``, only while the verdict is on) and publishes it with its busy times. On the steps every
rank traced, each late record is put at the (module, pass) where its rank spent most more time than the other
ranks' median (:func:`~commdebug_otel.offline.stragglers.blame`, the offline choice), and the same test names
the place (:meth:`StragglerJudge._place`). At the default 1-in-100 tracing such steps are rare, so while a
suspicion is open (a rank late in :data:`SUSPECT_STEPS` of the last steps, or named with no place yet) rank 0
asks every rank to trace the next :data:`TRACE_STEPS` steps (at most :data:`MAX_TRACE_REQUESTS` times in a row
while the suspicion stays open, so a rank whose spans go nowhere costs the others no endless tracing): it sets
the key ``trace`` to ``"first,last"``;
each rank reads it at a poll (at most every :data:`JUDGE_S` s) and its training thread traces those steps
as they open (one tuple read per step, nothing per module call). The place comes with the verdict, or in a
second ``straggler`` verdict once at least ``MIN_STEPS_LATE`` such steps are judged.

The exchange runs on the stall watchdog's thread (``stall/watchdog.py``), through the job's c10d store client
of the stall verdict (``StoreExchange.store``), never a collective. Keys, under the job's prefix
``commdebug_otel/verdict/<nonce>/straggler/``:

* ``r/<rank>``: each rank's record (:class:`BusyRecord`): the busy times of its steps ended since its last
  record and of the :data:`OVERLAP_STEPS` before (so a judge that read every other rewrite, or ranks polling
  out of phase, still share steps), at most :data:`MAX_KEPT_STEPS`; rewritten at a watchdog poll (every
  :data:`POLL_S` s) when a step ended since the last one. A step costs about 15 bytes, a rewrite about 160 of
  framing and overlap: at most about 175 bytes per step per rank (one step per poll), about 20 at fast steps
  (several per poll), and never more than one rewrite (about 1 KB) per rank per poll; a traced step's places
  add up to :data:`MAX_PLACES` x about 40 bytes to the records that still hold the step;
* ``trace``: rank 0's request ``"first,last"`` (above); every other rank reads it with one ``check`` (and a
  ``get`` when set) at most every :data:`JUDGE_S` s;
* rank 0 (the judge) reads every rank's record at a poll where its own record changed, at most every
  :data:`JUDGE_S` s: one ``check`` and one ``multi_get`` of ``world size`` keys, then the test (about
  0.3 ms of its watchdog thread at 2-4 ranks, 1 ms at 64).

Rank 0 exports a ``straggler_verdict`` span (in the trace of the newest step judged) and one stderr line each
time the answer changes: a rank named ``straggler``, or a named rank ``recovered`` (the same test over the
last :data:`RECOVER_STEPS` steps, all after it was named, finds it no more; the steps before are then no
evidence for or against anyone). Steps are matched by their index, so ranks that count steps
differently (pipeline stages) are never compared.

Busy time (``core/progress.py``) leaves out the waits the training thread makes in Python (``Work.wait()``,
``wait_tensor``, a blocking c10d call), the step's tail after a last collective no such wait followed (DDP's C++
reducer waits there), and the thread's wait for a CPU (host contention). Where the ranks a straggler holds back wait
elsewhere (on CUDA, hosts block at a synchronisation, ``.item()``, while collectives wait on the GPU stream) they
look as busy as it, and it is not told apart here; ``diagnose``, by arrival times over traced steps, names it.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.core.fact import versioned_record
from commdebug_otel.core.redact import describe
from commdebug_otel.offline import stragglers
from commdebug_otel.offline.stragglers import Late

_logger = logging.getLogger(__name__)

RECORD_FORMAT = 1
POLL_S = 0.05  # the watchdog wakes at least this often while the detector is on
OVERLAP_STEPS = 8  # steps published again in the next record: a judge that missed a rewrite still sees them
MAX_KEPT_STEPS = 64  # steps per published record at most (Progress.busy keeps as many)
WINDOW_STEPS = 32  # steps every rank reported, judged together: the noise's sample and the late steps'
RECOVER_STEPS = 12  # a named rank the test no longer finds over this many last steps has recovered
ONSET_GAP_STEPS = 6  # a late step this many steps before the next is not part of its episode
WARMUP_STEPS = 8  # the first steps (compilation, allocator warm-up, start-up skew) are not judged
MIN_STEPS_JUDGED = 16  # nobody is named before the window holds this many steps (a noise sample, not a few steps)
FLOOR_FRACTION = 0.5  # the least lateness that counts: this share of the median busy time (at least NOISE_FLOOR_S)
JUDGE_S = 0.1  # rank 0 reads the records and judges at most this often
PERSISTENT_SHARE = 0.75  # named only when late in this share of the steps judged since its episode began
TRACE_STEPS = 4  # steps traced per request while a suspicion is open (a rank late twice of late, or unplaced)
SUSPECT_STEPS = 2  # a rank busy-late in this many of the last ONSET_GAP_STEPS steps opens a suspicion
MAX_PLACES = 32  # (module, pass) self times published per traced step at most, the largest
MAX_TRACE_REQUESTS = 3  # requests in a row while one suspicion stays open (a rank never traced: TRACE_RANKS)
KIND_STRAGGLER = semconv.VERDICT_KIND_STRAGGLER
KIND_RECOVERED = semconv.VERDICT_KIND_RECOVERED


Places = tuple[tuple[str, str, int], ...]  # (module FQN or "(train_step)", pass, self ns) of one traced step


@dataclasses.dataclass(frozen=True)
class BusyRecord:
    """One rank's published busy times: ``steps`` as ``(step index, busy ns)``, oldest first; ``places``: its
    traced steps among them as ``(step index, ((module, pass, self ns), ...))`` (``Progress.places``)."""

    rank: int
    steps: tuple[tuple[int, int], ...]
    places: tuple[tuple[int, Places], ...] = ()

    def to_json(self) -> str:
        """Compact JSON, times in microseconds, with ``"format": RECORD_FORMAT`` (``"places"`` only when some)."""
        data: dict[str, Any] = {"format": RECORD_FORMAT, "rank": self.rank,
                                "steps": [[step, busy_ns // 1000] for step, busy_ns in self.steps]}
        if self.places:
            data["places"] = [[step, [[module, pass_, ns // 1000] for module, pass_, ns in labels]]
                              for step, labels in self.places]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> BusyRecord | None:
        """The record in ``text``; None when it is of another format.

        Raises:
            ValueError, KeyError, TypeError: ``text`` is not a record of this format.
        """
        data = versioned_record(text, RECORD_FORMAT)
        if data is None:
            return None
        places = tuple((int(step), tuple((str(module), str(pass_), int(us) * 1000) for module, pass_, us in labels))
                       for step, labels in data.get("places", ()))
        return cls(int(data["rank"]), tuple((int(step), int(busy_us) * 1000) for step, busy_us in data["steps"]),
                   places)


def top_places(times: Mapping[tuple[str, str], int]) -> Places:
    """The :data:`MAX_PLACES` largest of one traced step's ``{(module, pass): self ns}``, largest first."""
    ranked = sorted(times.items(), key=lambda item: (-item[1], item[0]))[:MAX_PLACES]
    return tuple((module, pass_, ns) for (module, pass_), ns in ranked)


def placed_records(records: Iterable[Late], places: Mapping[int, Mapping[int, Mapping[tuple[str, str], int]]]
                   ) -> list[Late]:
    """``records`` (:func:`late_from_busy`) of steps in ``places`` (``{step: {rank: {(module, pass): self
    ns}}}``, every rank's), each at the (module, pass) where its late rank spent most more time than the
    other ranks' median: the offline model's choice (:func:`~commdebug_otel.offline.stragglers.blame`)."""
    out = []
    for record in records:
        times = places.get(record.step)
        if times is None:
            continue
        (module, pass_), excess, _ = stragglers.blame(
            times[record.rank], [times[rank] for rank in sorted(times) if rank != record.rank])
        out.append(record._replace(module=module, pass_=pass_, excess_ns=excess))
    return out


def late_from_busy(busy: Mapping[int, Mapping[int, int]], world_size: int,
                   noise_floor_s: float = stragglers.NOISE_FLOOR_S) -> tuple[list[Late], dict[int, set[int]]]:
    """The lateness records of steps every rank reported, from busy times.

    Args:
        busy: ``{step: {rank: busy ns}}``; a step missing a rank of ``0 .. world_size - 1`` is left out.
        world_size: ranks in the job (at least 2).
        noise_floor_s: a lateness under this is no record (as offline).

    Returns:
        ``(records, {rank: steps seen})`` for :func:`~commdebug_otel.offline.stragglers.judge`: per step, the
        rank with the most busy time, late by that less the next highest, at the place ``TRAIN_STEP``.
    """
    records: list[Late] = []
    seen: dict[int, set[int]] = {rank: set() for rank in range(world_size)}
    floor_ns = noise_floor_s * 1e9
    for step in sorted(busy):
        times = busy[step]
        if len(times) < world_size or any(rank not in times for rank in range(world_size)):
            continue
        for rank in range(world_size):
            seen[rank].add(step)
        last = max(range(world_size), key=lambda rank: (times[rank], -rank))
        others = [times[rank] for rank in range(world_size) if rank != last]
        late = times[last] - max(others)
        if late < floor_ns:
            continue
        records.append(Late(last, step, stragglers.TRAIN_STEP, "", late,
                            sum(min(times[last] - other, late) for other in others), late))
    return records, seen


@dataclasses.dataclass(frozen=True)
class StragglerVerdict:
    """A change of the live answer; field names follow the ``commdebug.verdict.*`` attributes.

    ``step``: the newest step judged (``torch.step``); ``lost_s``: seconds per late step the other ranks
    waited on the behind rank (the mean over its late steps since the onset); ``since_step``: the first late
    step of the episode; ``steps_late`` of ``steps_seen``: the behind rank's late steps, of its steps judged.
    """

    kind: str
    step: int
    behind: tuple[int, ...]
    module: str
    pass_: str
    lost_s: float
    since_step: int
    steps_late: int
    steps_seen: int
    summary: str

    def attributes(self) -> dict[str, Any]:
        """The ``straggler_verdict`` span's attributes."""
        return {
            semconv.STEP: self.step,
            semconv.VERDICT_KIND: self.kind,
            semconv.VERDICT_BEHIND_RANKS: list(self.behind),
            semconv.VERDICT_MODULE: self.module,
            semconv.VERDICT_PASS: self.pass_,
            semconv.VERDICT_LOST: self.lost_s,
            semconv.VERDICT_SINCE_STEP: self.since_step,
            semconv.VERDICT_STEPS_LATE: self.steps_late,
            semconv.VERDICT_STEPS_SEEN: self.steps_seen,
            semconv.VERDICT_SUMMARY: self.summary,
        }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def _onset(late_steps: list[int]) -> int:
    """The first late step of the last run of ``late_steps`` (sorted) with no gap of :data:`ONSET_GAP_STEPS`
    steps or more: where the episode began (an earlier late step beyond that gap was noise, or a past episode)."""
    since = late_steps[-1]
    for step in reversed(late_steps[:-1]):
        if since - step >= ONSET_GAP_STEPS:
            break
        since = step
    return since


def _persistent_since(late_steps: list[int], window: Iterable[int], records: list[Late], rank: int,
                      cut_s: float) -> int | None:
    """The first step of the longest run of the last episode (:func:`_onset`) in which ``rank`` is a fail-slow:
    late in at least :data:`PERSISTENT_SHARE` of the steps of ``window`` from there (and ``MIN_STEPS_LATE``), by
    a median of ``MIN_EFFECT`` cuts (:func:`_sized`); None when no such run. Each late step of the episode is
    tried as its start, earliest first: a rank already a little late now and then before the onset (sharing its
    core with another process) would otherwise stretch the episode back over those steps and dilute its share of
    late steps until the window forgets them."""
    steps = sorted(window)
    first = _onset(late_steps)
    for since in (step for step in late_steps if step >= first):
        late = sum(1 for step in late_steps if step >= since)
        seen = sum(1 for step in steps if step >= since)
        if late >= max(stragglers.MIN_STEPS_LATE, PERSISTENT_SHARE * seen) and _sized(records, rank, since, cut_s):
            return since
    return None


def noise_floor_s(busy: Mapping[int, Mapping[int, int]]) -> float:
    """The least lateness (seconds) that counts in ``busy`` (``{step: {rank: busy ns}}``): :data:`FLOOR_FRACTION` of
    the median over steps of the fastest rank's busy time (the job's own work, which one slow rank does not
    raise), at least the offline model's resolution (``NOISE_FLOOR_S``). A rank a few percent slower than the
    others (the one that shares its core with another process, or hosts the store) is consistent, but no
    straggler worth naming while the job runs."""
    values = sorted(min(times.values()) for times in busy.values() if times)
    median_s = values[len(values) // 2] / 1e9 if values else 0.0
    return max(stragglers.NOISE_FLOOR_S, FLOOR_FRACTION * median_s)


def _episode(records: Iterable[Late], rank: int, since: int, cut_s: float) -> list[int]:
    """The ns ``rank`` cost the others in each of its late steps (beyond ``cut_s``) since step ``since`` (one
    record per rank and step: :func:`late_from_busy`)."""
    return [record.lost_ns for record in records if record.rank == rank and record.step >= since
            and record.lost_ns > cut_s * 1e9]


def _sized(records: Iterable[Late], rank: int, since: int, cut_s: float) -> bool:
    """Whether ``rank``'s late steps since ``since`` (beyond ``cut_s``) have a median of at least
    ``stragglers.MIN_EFFECT`` cuts: the offline model's effect size, over the episode."""
    lost = _episode(records, rank, since, cut_s)
    return bool(lost) and statistics.median(lost) >= stragglers.MIN_EFFECT * cut_s * 1e9


def _changed(records: list[Late], rank: int, since: int, steps: Iterable[int], cut_s: float, tested: int,
             alpha: float) -> bool:
    """Whether ``rank``'s episode from ``since`` is a change of its own, not more of its past: its ``k`` late
    steps of the ``s`` from there are unlikely under its own rate ``q`` of steps as late (half the episode's
    upper quartile or more) before ``since`` in the window: ``p = (n - s + 1) x P(Binomial(s, q) >= k)`` (the scan's
    union bound), ``p x tested <= alpha``, ``q = (a + 1) / (b + 2)`` for ``a`` such steps of the ``b`` before.
    The other ranks are the offline test's noise; a rank that shares its core, or hosts the store, is late
    more often than they are, and a co-tenant's burst of a few steps would otherwise be named a fail-slow
    (then recovered). A rank a little late now and then (under half the episode's lateness, and the episode may
    begin with such steps) is not alike."""
    episode = _episode(records, rank, since, cut_s)
    if not episode:
        return False
    half = sorted(episode)[3 * len(episode) // 4] / 2
    steps = sorted(steps)
    before = sum(1 for step in steps if step < since)
    alike = sum(1 for record in records if record.rank == rank and record.step < since and record.lost_ns >= half)
    run = len(steps) - before
    p = (len(steps) - run + 1) * stragglers.binomial_sf(len(episode), run, (alike + 1) / (before + 2))
    return p * tested <= alpha


def _judged(records: list[Late], seen: dict[int, set[int]], floor_s: float, alpha: float) -> list[dict[str, Any]]:
    """The offline test (:func:`~commdebug_otel.offline.stragglers.judge`) with no effect size: the live verdict
    asks its own, over an episode (:func:`_sized`)."""
    return stragglers.judge(records, seen, floor_s, alpha, min_effect=1.0, sparse_effect=1.0)


def _scan_rows(records: list[Late], seen: dict[int, set[int]], window: Mapping[int, Any], floor_s: float,
               alpha: float) -> list[dict[str, Any]]:
    """The ranks found by a scan over the window's steps: one whose persistent run (:func:`_persistent_since`),
    ``k`` late steps of its ``s``, is unlikely anywhere in the window's ``n`` steps under the null rate ``q`` of
    the offline test (:func:`~commdebug_otel.offline.stragglers.tested_rows`): ``p = (n - s + 1) x P(Binomial(s,
    q) >= k)`` (a union bound over the run's start), ``p x m <= alpha``. A fail-slow is a change: its late steps
    come in a run, which the window's binomial (blind to their order) weighs no more than as many scattered ones
    until many steps after the onset; rows as :func:`~commdebug_otel.offline.stragglers.judge`'s,
    ``"statistic": "scan"``, and ``"since"``: the run's first step."""
    tested = stragglers.tested_rows(records, seen, floor_s)
    steps = sorted(window)
    out = []
    for row in tested:
        rank = row.key[0]
        late_steps = sorted(row.late)
        since = _persistent_since(late_steps, steps, records, rank, row.cut_ns / 1e9)
        if since is None:
            continue
        late = {step: row.late[step] for step in late_steps if step >= since}
        run = sum(1 for step in steps if step >= since)
        p = min(1.0, (len(steps) - run + 1) * stragglers.binomial_sf(len(late), run, row.rate))
        if p * len(tested) <= alpha:
            out.append(stragglers.found_row(row, late, run, p, len(tested), "scan") | {"since": since})
    return out


def _episode_lost_s(records: Iterable[Late], rank: int, since: int, cut_s: float) -> float:
    """Seconds per late step ``rank`` cost the others since step ``since``: the mean of its records there beyond
    ``cut_s`` (0.0 when none)."""
    lost = _episode(records, rank, since, cut_s)
    return sum(lost) / len(lost) / 1e9 if lost else 0.0


class StragglerJudge:
    """The judging rank's state: busy times of recent steps, and the ranks named. Torch-free, no I/O.

    Args:
        world_size: ranks in the job.
        alpha: the family-wise false-blame rate of each judgement (:data:`stragglers.ALPHA`).
    """

    def __init__(self, world_size: int, alpha: float = stragglers.ALPHA) -> None:
        self.world_size = world_size
        self.alpha = alpha
        self._busy: dict[int, dict[int, int]] = {}  # step -> rank -> busy ns
        self._named: dict[int, dict[str, Any]] = {}  # rank -> its judge row when named
        self._lost: dict[int, float] = {}  # rank -> s per late step (0.0 once recovered): the metric
        self._judged = -1  # the newest complete step judged
        self._onsets: dict[int, int] = {}  # rank -> the first late step of its episode, when named
        self._named_at: dict[int, int] = {}  # rank -> the step judged when it was named
        self._since = -1  # steps up to this one are not judged again (a recovery ends the evidence before it)
        self._places: dict[int, dict[int, dict[tuple[str, str], int]]] = {}  # step -> rank -> self ns by place
        self._placed: dict[int, tuple[str, str]] = {}  # rank -> (module, pass) named, while named
        # Whether the last judgement left a suspicion open that traced steps could settle: a rank late in
        # SUSPECT_STEPS of the last steps and not named, or named without a module.
        self.trace_wanted = False

    def add(self, record: BusyRecord) -> None:
        """A rank's record: its steps past the warm-up, kept while within the window."""
        for step, busy_ns in record.steps:
            if step >= WARMUP_STEPS and step > max(self._since, self._judged - WINDOW_STEPS):
                self._busy.setdefault(step, {})[record.rank] = busy_ns
        for step, labels in record.places:
            if step >= WARMUP_STEPS and step > max(self._since, self._judged - WINDOW_STEPS):
                self._places.setdefault(step, {})[record.rank] = {(module, pass_): ns for module, pass_, ns in labels}

    def lost_by_rank(self) -> dict[int, float]:
        """Seconds per late step the others waited on each named rank (the metric's values)."""
        return dict(self._lost)

    def judge(self) -> list[StragglerVerdict]:
        """The changes since the last call, if a step every rank reported is new: each newly slow rank's
        ``straggler`` verdict, then each named rank's ``recovered`` one."""
        complete = sorted(step for step, times in self._busy.items() if len(times) >= self.world_size)
        if not complete or complete[-1] <= self._judged:
            return []
        newest = complete[-1]
        self._judged = newest
        cut = max(self._since, newest - WINDOW_STEPS)
        for step in [step for step in self._busy if step <= cut]:
            del self._busy[step]
        for step in [step for step in self._places if step <= cut]:
            del self._places[step]
        window = {step: self._busy[step] for step in complete if step in self._busy}
        floor_s = noise_floor_s(window)
        records, seen = late_from_busy(window, self.world_size, floor_s)
        # The effect size is judged over the episode (below), not the window: a rank already a little late before
        # the onset (sharing its core) would hold a fail-slow's median down until the window forgets it.
        rows = {}
        if len(window) >= MIN_STEPS_JUDGED:
            rows = {row["rank"]: row for row in _judged(records, seen, floor_s, self.alpha)}
            for row in _scan_rows(records, seen, window, floor_s, self.alpha):
                rows.setdefault(row["rank"], row)
        out = []
        for rank, row in sorted(rows.items()):
            if rank not in self._named and row["late_steps"][-1] > newest - ONSET_GAP_STEPS:
                since = row["since"] if "since" in row else _persistent_since(row["late_steps"], window, records,
                                                                              rank, row["noise_cut_s"])
                if since is not None and _changed(records, rank, since, window, row["noise_cut_s"], row["tested"],
                                                  self.alpha):  # persistent, large, and new: a fail-slow
                    self._named[rank] = row
                    row["episode_lost_s"] = _episode_lost_s(records, rank, since, row["noise_cut_s"])
                    place = self._place(rank, since, window, records, floor_s)
                    if place is not None:
                        self._placed[rank] = place
                    out.append(self._verdict(KIND_STRAGGLER, newest, rank, row, since))
            elif rank in self._named:  # its numbers, updated
                self._named[rank] = row | {"episode_lost_s": _episode_lost_s(
                    records, rank, self._onsets[rank], row["noise_cut_s"]) or self._named[rank]["episode_lost_s"]}
            if rank in self._named:
                self._lost[rank] = self._named[rank]["episode_lost_s"]
        for rank in sorted(self._named):  # traced steps came since it was named: where it is slow is a change
            if rank not in self._placed:
                place = self._place(rank, self._onsets[rank], window, records, floor_s)
                if place is not None:
                    self._placed[rank] = place
                    out.append(self._verdict(KIND_STRAGGLER, newest, rank, self._named[rank], self._onsets[rank]))
        recent_late: dict[int, int] = {}
        for record in records:
            if record.step > newest - ONSET_GAP_STEPS:
                recent_late[record.rank] = recent_late.get(record.rank, 0) + 1
        self.trace_wanted = any(rank not in self._placed for rank in self._named) or any(
            count >= SUSPECT_STEPS and rank not in self._named for rank, count in recent_late.items())
        recent = sorted(window)[-RECOVER_STEPS:]
        if not self._named or len(recent) < RECOVER_STEPS:
            return out
        records, seen = late_from_busy({step: window[step] for step in recent}, self.world_size, floor_s)
        still = {row["rank"] for row in _judged(records, seen, floor_s, self.alpha)}
        recovered = False
        for rank in sorted(self._named):
            row = self._named[rank]
            if rank not in still and recent[0] > self._named_at[rank]:
                del self._named[rank]
                self._lost[rank] = 0.0
                out.append(self._verdict(KIND_RECOVERED, newest, rank, row, self._onsets.pop(rank)))
                self._placed.pop(rank, None)
                recovered = True
        if recovered:  # its late steps are no evidence any more, nor the noise they hid: judged afresh from here
            self._since = newest
            self._busy = {step: times for step, times in self._busy.items() if step > newest}
            self._places = {step: times for step, times in self._places.items() if step > newest}
        return out

    def _place(self, rank: int, since: int, window: Mapping[int, Mapping[int, int]], records: list[Late],
               floor_s: float) -> tuple[str, str] | None:
        """Where ``rank`` is slow: the offline test (:func:`~commdebug_otel.offline.stragglers.judge`) over the
        steps of ``window`` from its episode's first late step ``since`` that every rank traced, each late
        record at its place (:func:`placed_records`); its first row of ``rank``, else None (too few such
        steps, or no place beyond the noise). Steps before the episode are left out: the busy test found the
        rank slow since then, the question here is where, and a noisy past would only hide the answer."""
        traced = {step: times for step, times in self._places.items()
                  if step >= since and step in window and len(times) >= self.world_size}
        if len(traced) < stragglers.MIN_STEPS_LATE:
            return None
        placed = placed_records([record for record in records if record.step in traced], traced)
        seen = {other: set(traced) for other in range(self.world_size)}
        for row in _judged(placed, seen, floor_s, self.alpha):
            if row["rank"] == rank and row["module"] != stragglers.SPREAD:  # a module, or no place named
                return row["module"], row["pass"]
        return None

    def _verdict(self, kind: str, step: int, rank: int, row: dict[str, Any], since: int) -> StragglerVerdict:
        if kind == KIND_STRAGGLER:
            self._onsets[rank], self._named_at[rank] = since, step
        lost_s = row["episode_lost_s"]
        spread = _ms(row["late_min_s"]) if row["late_min_s"] == row["late_max_s"] else \
            f"{_ms(row['late_min_s'])}-{_ms(row['late_max_s'])}"
        how = (f"late beyond the noise in {row['steps_late']} of {row['steps_seen']} steps judged, {spread} ms "
               f"(noise cut {_ms(row['noise_cut_s'])} ms, p={row['p_value']:.0e}, {row['statistic']})")
        module, pass_ = self._placed.get(rank, ("", ""))
        where = f" in {module} {pass_}".rstrip() if module else ""
        if kind == KIND_STRAGGLER:
            summary = (f"rank {rank} is slow{where} since step {since}: the other ranks wait {_ms(lost_s)} ms per "
                       f"step for it, {how}; step {step}")
        else:
            summary = (f"rank {rank} is no longer slow{where}: the test finds it no more over the last "
                       f"{RECOVER_STEPS} steps (it was since step {since}, {_ms(lost_s)} ms per step); step {step}")
        return StragglerVerdict(kind, step, (rank,), module, pass_, round(lost_s, 6), since, row["steps_late"],
                                row["steps_seen"], summary)


class StragglerExchange:
    """One rank's side of the live straggler verdict. Used by the watchdog thread only; no method raises.

    Args:
        rank_of: ``() -> RankInfo`` (rank, world size, whether distributed).
        busy: ``() -> iterable of (step, busy ns)``: the rank's recent steps (``Progress.busy``).
        store: ``() -> (store client, key root) or None``: the stall exchange's connection
            (``StoreExchange.store``), None until it is connected.
        export: ``export(verdict)``: the span and the flush (the watchdog's), on rank 0 only.
        alpha: each judgement's false-blame rate.
        places: ``() -> iterable of (step, {(module, pass): self ns})``: the rank's recent traced steps
            (``Progress.places``).
        trace: ``trace((first, last))``: have this rank trace steps ``first`` to ``last`` (``Progress.trace_steps``).
    """

    def __init__(self, rank_of: Callable[[], Any], busy: Callable[[], Iterable[tuple[int, int]]],
                 store: Callable[[], tuple[Any, str] | None], export: Callable[[StragglerVerdict], Any],
                 alpha: float = stragglers.ALPHA,
                 places: Callable[[], Iterable[tuple[int, Mapping[tuple[str, str], int]]]] = tuple,
                 trace: Callable[[tuple[int, int]], Any] = lambda steps: None) -> None:
        self._rank_of = rank_of
        self._busy = busy
        self._store = store
        self._export = export
        self._alpha = alpha
        self._places = places
        self._trace = trace
        self._published = -1  # the newest step published
        self._judged_at = -JUDGE_S  # monotonic time of rank 0's last judgement
        self._read_at = -JUDGE_S  # monotonic time this rank last read the trace request
        self._request = ""  # the trace request last read or made
        self._requested = (0, -1)  # rank 0: the steps it last asked to be traced
        self._requests = 0  # rank 0: requests made since the judge last wanted none
        self._judge: StragglerJudge | None = None
        self._off = False
        # Verdicts exported, each with the newest step this rank had ended then (tests, the benchmark).
        self.said: list[tuple[StragglerVerdict, int]] = []

    def lost_by_rank(self) -> dict[int, float]:
        """The metric's values: seconds per step the others wait on each rank named slow (rank 0 only)."""
        judge = self._judge
        return judge.lost_by_rank() if judge is not None else {}

    def poll(self) -> None:
        """Publish this rank's new steps; on rank 0, judge. Cheap when no step ended since the last poll."""
        if self._off:
            return
        try:
            steps = list(self._busy())
            if not steps or steps[-1][0] <= self._published:
                return
            connected = self._store()
            if connected is None:
                return
            store, root = connected
            info = self._rank_of()
            if info.world_size <= 1:
                return
            prefix = f"{root}straggler/"
            new = sum(1 for step, _ in steps if step > self._published)
            kept = tuple(steps[-min(MAX_KEPT_STEPS, new + OVERLAP_STEPS):])
            places = tuple((step, top_places(times)) for step, times in list(self._places()) if step >= kept[0][0])
            record = BusyRecord(info.rank, kept, places)
            store.set(f"{prefix}r/{info.rank}", record.to_json())
            self._published = steps[-1][0]
            now = time.monotonic()
            if info.rank != 0:
                if now >= self._read_at + JUDGE_S:  # rank 0's request to trace the next steps (a suspicion)
                    self._read_at = now
                    self._read_request(store, f"{prefix}trace")
                return
            if now < self._judged_at + JUDGE_S:
                return
            self._judged_at = now
            if self._judge is None:
                self._judge = StragglerJudge(info.world_size, self._alpha)
            keys = [f"{prefix}r/{rank}" for rank in range(info.world_size)]
            if not store.check(keys):  # multi_get would wait for a rank that has not published yet
                return
            for value in store.multi_get(keys):
                found = BusyRecord.from_json(value.decode() if isinstance(value, bytes) else str(value))
                if found is not None:
                    self._judge.add(found)
            verdicts = self._judge.judge()
            if not self._judge.trace_wanted:
                self._requests = 0
            elif self._published >= self._requested[1] and self._requests < MAX_TRACE_REQUESTS:
                # The next steps traced on every rank: each reads this at its next poll, before they begin.
                self._requests += 1
                self._requested = (self._published + 2, self._published + 1 + TRACE_STEPS)
                self._request = f"{self._requested[0]},{self._requested[1]}"
                store.set(f"{prefix}trace", self._request)
                self._trace(self._requested)
        except Exception as error:
            self._off = True
            _logger.warning("commdebug-otel: the live straggler verdict is off for this rank (%s)", describe(error))
            return
        for verdict in verdicts:
            _logger.warning("commdebug-otel: straggler verdict: %s", verdict.summary)
            self.said.append((verdict, self._published))
            self._export(verdict)

    def _read_request(self, store: Any, key: str) -> None:
        """Trace the steps rank 0 last asked for, if that request is new (one ``check``, a ``get`` if set)."""
        if not store.check([key]):
            return
        value = store.get(key)
        text = value.decode() if isinstance(value, bytes) else str(value)
        if text != self._request:
            self._request = text
            first, last = (int(part) for part in text.split(","))
            self._trace((first, last))
