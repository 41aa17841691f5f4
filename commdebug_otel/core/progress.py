"""One rank's progress, :class:`Progress`, is what the recorder keeps on every step, traced or not, at
about Flight Recorder's cost (one tuple per collective in a bounded ring):

* the recent collectives (op, process group, seq, dtype, shape, issuing module, issue time);
* per process group, the last seq issued and the last known completed: a
  collective is known complete when the training thread's wait on it returned
  (``Work.wait``, ``wait_tensor``), when its c10d ``Work`` future completed (the
  steps timed to completion), or when its step ended;
* when the current step began (or, between steps, when the last one ended),
  the time the training thread spent waiting in collectives, the recent step times.

Under ``auto``, time between steps with no collective in flight (data loading,
checkpoints, evaluation) is held to a much larger floor than a step
(:data:`AUTO_BETWEEN_STEPS_S`): a hang shows as a collective in flight on the
ranks that wait, and those report it at the step threshold.

The watchdog (``stall/watchdog.py``) reads it from its own thread; the metric reader reads its seqs.
"""

from __future__ import annotations

import collections
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commdebug_otel.config import (  # the auto rule's numbers live in config: diagnose repeats the rule without torch
    AUTO_BETWEEN_STEPS_S,
    AUTO_FACTOR,
    AUTO_FIRST_S,
    AUTO_FLOOR_S,
    AUTO_MIN_STEPS,
    RECENT_STEPS,
    STALL_AUTO,
)
from commdebug_otel.core.fact import CollectiveFact, ring_event_attributes

RING_SIZE = 64  # recent collectives kept per rank, exported with each snapshot
SLOW_STEP_FACTOR = 2.0  # commdebug.step.slow: longer than this times the recent median...
SLOW_AFTER_STEPS = 8  # ...once this many steps have ended
MAX_PENDING_WAITS = 4096  # issued collectives whose wait has not been seen (cleared at each step end)
BUSY_KEPT = 64  # recent training steps' busy times kept for the live straggler verdict (stall/straggler.py)
PLACES_KEPT = 8  # recent traced steps' module self times kept for the live straggler verdict


class Progress:
    """One rank's progress: written by the training thread, read by the watchdog and the metric reader.

    Attributes:
        next_seq: per process group name, the seq the next collective gets (the recorder's counter).
        completed: per process group name, the last seq known complete (absent: none known).
        ring: the last :data:`RING_SIZE` collectives, as their :class:`~commdebug_otel.core.fact.CollectiveFact`.
        since_ns: ``time.time_ns()`` when the current step began, or the last one ended.
        in_step: whether a step is open.
        wait_ns: nanoseconds the training thread waited in collectives since the step began.
        busy: the last :data:`BUSY_KEPT` training steps as ``(step index, busy ns)``: the step's wall time less
            the time the training thread waited in collectives, less the step's tail after a last collective
            no Python wait followed (DDP's reducer waits in C++: :meth:`_tail_ns`), and less its wait for a CPU
            (``cpu_wait_ns``; read by the watchdog thread).
        cpu_wait_ns: the last training step's time runnable but not running (:class:`CpuWait`; 0 when not
            measured, ``step_began``).
        places: the last :data:`PLACES_KEPT` traced training steps as ``(step index, {(module FQN or
            "(train_step)", pass): self ns})``, kept only while the live straggler verdict is on.
        trace_steps: ``(first, last)`` step indexes traced whatever ``trace_every`` says (the live straggler
            verdict's request, set by the watchdog thread; ``(0, -1)``: none).
    """

    def __init__(self, dim_name: Callable[[str], str] = lambda group: "", cpu_wait: CpuWait | None = None) -> None:
        """``dim_name(group name)``: the mesh dimensions the group serves (``GroupResolver.dim_name``);
        ``cpu_wait``: the training thread's wait for a CPU (default :class:`CpuWait`)."""
        self._dim_name = dim_name
        self.next_seq: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.ring: collections.deque = collections.deque(maxlen=RING_SIZE)
        self.since_ns = time.time_ns()
        self.in_step = False
        self.step_index = 0
        self.wait_ns = 0
        self.durations: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self.busy: collections.deque = collections.deque(maxlen=BUSY_KEPT)
        self.places: collections.deque = collections.deque(maxlen=PLACES_KEPT)
        self.trace_steps: tuple[int, int] = (0, -1)
        self._pending: dict[int, tuple[str, int]] = {}  # id(functional output) -> (group, seq)
        # perf_counter_ns when the last collective's issue returned, while no Python wait has come since (0: one
        # has). DDP's reducer waits for its buckets in C++: its wait is in the step's tail after that collective.
        self._unwaited_at = 0
        self.cpu_wait_ns = 0  # the last training step's wait for a CPU (CpuWait)
        self._cpu_wait = cpu_wait or CpuWait()
        self._cpu_wait_at = 0

    def remember(self, fact: CollectiveFact, out: Any, issued_at: int = 0) -> None:
        """A collective was issued on the training thread (every step: kept cheap); ``out``: what the op returned;
        ``issued_at``: ``time.perf_counter_ns()`` when its issue returned (0: not known)."""
        self.ring.append(fact)
        self._unwaited_at = issued_at
        if type(out) is torch.Tensor:  # a functional collective's output: wait_tensor takes this object
            pending = self._pending
            if len(pending) >= MAX_PENDING_WAITS:
                pending.clear()  # never waited on (compiled code waits on its own buffers): forget them
            pending[id(out)] = (fact.group.name, fact.seq)

    def waited(self, handle: Any, duration_ns: int) -> None:
        """The training thread waited ``duration_ns`` on ``handle``: a ``Work`` (whose collective is not
        known here: c10d ones are known complete from their future, on timed steps) or a functional
        collective's output (``wait_tensor``: that collective is complete)."""
        self.wait_ns += duration_ns
        self._unwaited_at = 0
        found = self._pending.pop(id(handle), None)
        if found is not None:
            self.complete(*found)

    def complete(self, group: str, seq: int) -> None:
        """Collective ``seq`` of ``group`` is known complete (and so, in order, every earlier one)."""
        if seq > self.completed.get(group, -1):
            self.completed[group] = seq

    def step_began(self, now: int, index: int, cpu_wait: bool = True) -> None:
        """A step opens; ``cpu_wait``: whether its wait for a CPU is wanted (a traced step exports it, the live
        straggler verdict reads it): two reads of the kernel's count, left off the other steps."""
        self.since_ns, self.in_step, self.step_index, self.wait_ns, self._unwaited_at = now, True, index, 0, 0
        self._cpu_wait_at = self._cpu_wait.ns() if cpu_wait else -1

    def step_ended(self, now: int, training: bool) -> tuple[float, bool]:
        """The step ended: its collectives are complete. Returns its duration in seconds, and whether
        it was slow for this rank (``commdebug.step.slow``, training steps)."""
        duration_s = (now - self.since_ns) / 1e9
        slow = False
        if training:
            slow = self.slow(duration_s)
            self.durations.append(duration_s)
            # Waiting for a CPU is not the rank's work either: a process sharing its core is not its code.
            self.cpu_wait_ns = self._cpu_wait.since(self._cpu_wait_at) if self._cpu_wait_at >= 0 else 0
            self.busy.append((self.step_index, max(0, now - self.since_ns - self.wait_ns - self._tail_ns()
                                                   - self.cpu_wait_ns)))
        for group, following in self.next_seq.items():
            self.complete(group, following - 1)
        self._pending.clear()
        self.since_ns, self.in_step = now, False
        return duration_s, slow

    def close(self) -> None:
        """Tracing stops: the file the CPU wait is read from is closed (reopened if a step begins again)."""
        self._cpu_wait.close()

    def _tail_ns(self) -> int:
        """ns from the step's last collective to its end when no wait in Python followed it: where DDP waits for
        its gradient buckets (in its C++ reducer, at the end of backward). The optimizer step and host work after
        it count too, alike on every rank; 0 when a Python wait came after (FSDP2, DTensor, ``dist.*`` calls)."""
        return max(0, time.perf_counter_ns() - self._unwaited_at) if self._unwaited_at else 0

    def slow(self, duration_s: float) -> bool:
        """Whether a step of ``duration_s`` is slow for this rank (``commdebug.step.slow``)."""
        recent = self.durations
        return len(recent) > SLOW_AFTER_STEPS and duration_s > SLOW_STEP_FACTOR * statistics.median(recent)

    def threshold_s(self, setting: float | str) -> float:
        """The stall threshold in seconds: ``setting``, or the auto rule (see the config option).

        Under auto, time between steps (or before the first) with no collective in flight counts
        against at least :data:`AUTO_BETWEEN_STEPS_S`: a planned pause is not a stall.
        """
        if setting != STALL_AUTO:
            return float(setting)
        recent = list(self.durations)
        if len(recent) < AUTO_MIN_STEPS:
            threshold = AUTO_FIRST_S
        else:
            threshold = max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(recent))
        if not self.in_step and not self.in_flight():
            return max(threshold, AUTO_BETWEEN_STEPS_S)
        return threshold

    def in_flight(self) -> bool:
        """Whether a collective this rank issued is not known complete (a peer may be what it waits for)."""
        completed = self.completed
        return any(following - 1 > completed.get(group, -1) for group, following in list(self.next_seq.items()))

    def age_s(self, now: int | None = None) -> float:
        return ((now or time.time_ns()) - self.since_ns) / 1e9

    def seqs(self) -> list[tuple[str, int, int, str]]:
        """``(group, last issued seq, last completed seq, mesh dimension name or "")`` per process group; -1: none."""
        return [(group, following - 1, self.completed.get(group, -1), self._dim_name(group))
                for group, following in list(self.next_seq.items())]

    def ring_events(self, now: int) -> list[tuple[str, dict[str, Any], int]]:
        """The ring as it stood at ``now`` (``time.time_ns()``), as span events ``(name, attributes, time)``, each
        in flight or completed: a collective issued after ``now`` (the training thread went on while a snapshot
        was taken) is not in it, so no event falls after the snapshot and no age is negative."""
        completed = dict(self.completed)
        return [(fact.op, ring_event_attributes(fact, fact.seq <= completed.get(fact.group.name, -1), now),
                 fact.time_ns) for fact in list(self.ring) if fact.time_ns <= now]


def _libc_pread() -> Any:
    try:
        function = ctypes.PyDLL(None).pread
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]
    return function


_pread = _libc_pread()


class CpuWait:
    """The training thread's time runnable but not running: waiting on the run queue while another process (or
    thread) had its CPU, from Linux's per-thread schedstat (the second number, ns). 0 where there is none.

    The file is opened on the thread that reads it first and kept (a 64-byte ``pread`` per read, about 4 us);
    another thread's read (the training thread changed) opens its own.
    """

    PATH = "/proc/thread-self/schedstat"

    def __init__(self) -> None:
        self._fd = -1
        self._thread = 0
        self._off = _pread is None or not os.path.exists(self.PATH)
        self._buffer = ctypes.create_string_buffer(64)

    def ns(self) -> int:
        """ns the calling thread has waited for a CPU since it started (0: not known here)."""
        if self._off:
            return 0
        try:
            thread = threading.get_ident()
            if thread != self._thread:
                self.close()
                self._fd, self._thread = os.open(self.PATH, os.O_RDONLY), thread
            # libc's pread holding the GIL (PyDLL): a read of ours on the training thread's hook path lets no other
            # thread run in the middle of a step's bookkeeping.
            read = _pread(self._fd, self._buffer, 64, 0)
            return int(self._buffer.raw[:max(read, 0)].split()[1])
        except (OSError, ValueError, IndexError):
            self._off = True  # no schedstat here (a kernel without it): no wait is known, none is taken off
            self.close()
            return 0

    def since(self, before: int) -> int:
        """ns the calling thread waited for a CPU since its read of ``before`` (:meth:`ns`); 0 on another thread
        (a step closed from elsewhere: its wait is not known)."""
        if self._off or threading.get_ident() != self._thread:
            return 0
        return max(0, self.ns() - before)

    def close(self) -> None:
        """Close the file (the next read opens it again, on its thread)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._thread = -1, 0
