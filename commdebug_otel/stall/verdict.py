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
  late and takes over does not say it again), ``ended`` (when a rank's stall
  last ended) and ``left`` (cleanup).

One rank leads the whole job's stall (a subgroup's stuck rank and a world
barrier's waiters get one verdict). It forms the verdict with the hang rule
that ``commdebug-otel diagnose`` applies to the files too
(:func:`commdebug_otel.offline.hangs.form_verdict`, torch-free, over the same
:class:`~commdebug_otel.offline.hangs.StallRecord`)
once every rank published or :data:`VERDICT_WAIT_S` after its own record,
whichever comes first, and again at each of its later snapshots once every rank
that published has published that round too, or :data:`VERDICT_WAIT_S` after
its own (so records of one round are read together); it exports a
``stall_verdict`` span and one stderr line only when the verdict changed, and
none from records all taken before a rank's stall ended (``ended``: the job
may have moved on since). The
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
instead when a rank's record went since it was indexed) and a check of
``ended``; a rank whose stall ends makes a set, a delete and an add. Nothing
happens on healthy steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from commdebug_otel.core.fact import CollectiveFact
from commdebug_otel.offline.hangs import (
    RECORD_FORMAT,
    GroupProgress,
    InFlight,
    StallRecord,
    Verdict,
    cause_text,
    form_verdict,
)

_logger = logging.getLogger(__name__)

KEY_ROOT = "commdebug_otel/verdict"
STORE_TIMEOUT_S = 5.0  # each store call of the watchdog thread, at most
VERDICT_WAIT_S = 4.0  # the leader waits this long after its own record for the other ranks' records
IN_FLIGHT_KEPT = 8  # per process group: the first and the last this many collectives in flight
STACK_KEPT = 8  # the training thread's innermost code locations in a record
MAX_ROUNDS = 12  # snapshots per stall (stall.MAX_SNAPSHOTS): a round key each


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
            if records and store.check([f"{prefix}ended"]) and \
                    int(_text(store.get(f"{prefix}ended"))) >= max(record.time_ns for record in records.values()):
                # A rank's stall ended after every record still up was taken (one published by a rank that held
                # the GIL until now, say): they describe a stall its progress may have ended, and would call it
                # silent. The ranks still stuck publish again at their next snapshot.
                return
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
            store.set(f"{prefix}ended", str(time.time_ns()))
            store.delete_key(f"{prefix}r/{rank}")
            if int(store.add(f"{prefix}left", 1)) >= int(store.add(f"{prefix}count", 0)):
                for name in ("index", "count", "leader", "left", "said", "ended",
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
