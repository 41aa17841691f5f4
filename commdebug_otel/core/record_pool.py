"""The record pool: module records of closed steps, reused by the next step.

A record made anew for each call lives through the step's garbage collections and is promoted
to the oldest generation, whose full collections then come sooner (docs/performance.md, History
19). So, where nothing outside keeps them (a span sink that says so, no observer handed records),
a closed step's records are unlinked and handed out again.
"""

from __future__ import annotations

import threading

from commdebug_otel.core.records import Record, SpanKind, Step


class RecordPool:
    """Spare module records, and the lock a stall snapshot holds while it copies a step's records.

    Args:
        reuse: whether records may be reused at all (False: every record is made anew).
    """

    def __init__(self, reuse: bool) -> None:
        self._spare: list[Record] | None = [] if reuse else None
        self.copying = threading.RLock()  # a stall snapshot copying the step's records

    @property
    def reuses(self) -> bool:
        return self._spare is not None

    def __len__(self) -> int:
        return len(self._spare or ())

    def reset_after_fork(self) -> None:
        self.copying = threading.RLock()  # a fork may have copied it held

    def module_record(self, name: str, now: int) -> Record:
        """A fresh module record: a closed step's, reset, when one is spare."""
        spare = self._spare
        if not spare:
            return Record(SpanKind.MODULE, name, now)
        record = spare.pop()
        record.reset(SpanKind.MODULE, name, now)
        return record

    def release(self, step: Step, reuse: bool) -> None:
        """Unlink a closed step's records (its spans are built or dropped); reuse them where ``reuse``."""
        # Not while a stall snapshot copies them (the watchdog's thread): then they are not reused.
        # Never waited for: the training thread goes on.
        reuse = reuse and self._spare is not None and self.copying.acquire(blocking=False)
        try:
            for record in step.records:  # nothing outlives the step through these links
                record.parent = record.fwd = record.open_bw = record.handling = record.last_bw = None
                record.prev_bw = None
                record.events = ()
                if reuse:  # nothing of the step kept alive by a spare record (an error's traceback, its frames)
                    record.error = None  # (its children list is emptied when it is reused: Record.reset)
                else:  # the sink may keep the children lists it was given; the hook refers to the record
                    record.kids = record.end_hook = None
            step.root.kids = None
            spare = self._spare
            if reuse and spare is not None:  # at most as many spare as this step used (reuse: there is a list)
                spare.extend(step.records)
                del spare[len(step.records):]
        finally:
            if reuse:
                self.copying.release()
        step.records.clear()
