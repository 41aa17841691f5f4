"""Which thread trains: the training thread's role, and its hand-back.

The tracer's starting thread holds the role; another thread may borrow it before the first
optimizer step, when no step and no module call is open (a script that trains on a thread other
than the tracer's), and keeps it once a backward pass of its own step ends (:meth:`ThreadRole.settle`).
Until then its finished steps are held, not exported: if the starting thread calls a module first,
it takes the role back and the borrower's steps are dropped (counted as ``other_thread``). So a side
thread (inference, EMA, evaluation) that happens to call first never takes the training thread's
steps; once the role is settled, other threads' calls are ignored.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from commdebug_otel import semconv
from commdebug_otel.capture._torch import graph_task_id
from commdebug_otel.core.failures import Failures
from commdebug_otel.core.record_pool import RecordPool
from commdebug_otel.core.records import Step

# Finished traced steps of a thread that borrows the training thread's role, kept until it trains.
MAX_HELD_STEPS = 64


class ThreadRoleHost(Protocol):
    """What the training thread's role (``thread_role.ThreadRole``) asks of the step lifecycle."""

    @property
    def idle(self) -> bool:
        """No optimizer step seen yet, no step and no module call open: another thread may borrow the role."""
        ...

    @property
    def counters(self) -> tuple[int, int]:
        """The next training and inference step numbers."""
        ...

    def export(self, step: Step) -> None: ...

    def drop_open(self, now: int) -> None:
        """Close the open step and segment (held by the role, not exported)."""
        ...

    def restore(self, counters: tuple[int, int] | None) -> None:
        """Give the step numbers back (the borrower's steps are dropped)."""
        ...


class ThreadRole:
    """The training thread of one recorder.

    Attributes:
        thread_id: the training thread: the tracer's starting thread, or another thread that trains.
        changes: how often the role changed hands (the tracker resets its call stack).
    """

    def __init__(self, steps: ThreadRoleHost, pool: RecordPool, failures: Failures) -> None:
        self._steps = steps
        self._pool = pool
        self._failures = failures
        self.reset()

    def reset(self) -> None:
        """The state a process starts with, and a forked child starts again with."""
        self.thread_id = self._home_thread = threading.get_ident()
        # (step counters when another thread borrowed the role, held steps)
        self._borrowed: tuple[int, int] | None = None
        self._held: list[Step] = []
        self.changes = 0
        # The training thread's optimizer stepped (or it ran NO_OPTIMIZER_CYCLES backward passes in a step):
        # the role never moves again, and one_role_holder's locks end.
        self.fixed = False
        self.lock = threading.RLock()  # one_role_holder's, until fixed (a fork may copy it held: made anew)

    def activate(self) -> None:
        """The tracer starts: this thread trains."""
        self.thread_id = self._home_thread = threading.get_ident()
        self._borrowed = None

    @property
    def borrowing(self) -> bool:
        """Whether another thread holds the role provisionally (it called a module first, untrained)."""
        return self._borrowed is not None

    def tracks_thread(self, claim: bool = True) -> bool:
        """Whether module calls on the calling thread are tracked: the training thread's, and autograd's.

        ``claim``: the calling thread may borrow the role (module docstring) when the steps are idle.
        """
        ident = threading.get_ident()
        if ident == self.thread_id or graph_task_id() != -1:
            return True
        if not claim:
            return False
        if ident == self._home_thread and self._borrowed is not None:
            self.take_back(time.time_ns())
            return True
        if self.fixed or not self._steps.idle:
            return False
        if ident != self._home_thread:
            self._borrowed = self._steps.counters
        self.thread_id = ident
        self.changes += 1
        return True

    def hold(self, step: Step) -> bool:
        """Keep a closed step of a borrowing thread until it trains (bounded: the oldest goes, counted).
        False when no thread borrows the role: export it."""
        if self._borrowed is None:
            return False
        self._held.append(step)
        if len(self._held) > MAX_HELD_STEPS:
            oldest = self._held.pop(0)
            self._failures.count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, len(oldest.records) + 1)
            self._pool.release(oldest, False)
        return True

    def settle(self) -> None:
        """The borrowing thread trains: it keeps the role, and the steps it finished so far are exported."""
        self._borrowed = None
        held, self._held = self._held, []
        for step in held:
            self._steps.export(step)
            self._pool.release(step, False)

    def take_back(self, now: int) -> None:
        """The starting thread calls a module while another thread borrows the role, untrained: the
        starting thread trains. The borrower's open and held steps are dropped, counted, and its
        step numbers given back."""
        self._steps.drop_open(now)  # held, not exported (the role is still borrowed)
        dropped = 0
        for step in self._held:
            dropped += len(step.records) + 1
            self._pool.release(step, False)
        self._held = []
        self._steps.restore(self._borrowed)
        self._borrowed = None
        self.thread_id = self._home_thread
        self.changes += 1
        if dropped:
            self._failures.count_dropped(semconv.DROPPED_KIND_OTHER_THREAD, dropped)


def one_role_holder(role_of: Callable[[Any], ThreadRole]) -> Callable[[Any], Any]:
    """Decorate a hook method that reads or changes which thread trains (:meth:`ThreadRole.tracks_thread`).

    ``role_of(self)``: the hook's :class:`ThreadRole`. Until the role is fixed (the training thread's first
    optimizer step, or ``NO_OPTIMIZER_CYCLES`` backward passes in a step), the hook runs whole under the
    role's lock: a thread that checked the role cannot see it move mid-hook (the starting thread taking it
    back while a side thread records). After that no lock: the role never moves again, and other threads'
    hooks only read it. Hooks that torch.compile may trace check that first, outside the decorated method
    (what it reads would become guards of the compiled graph).
    """
    def decorate(hook: Any) -> Any:
        @functools.wraps(hook)
        def guarded(self: Any, *args: Any) -> Any:  # positional only: no dict made per call
            role = role_of(self)
            if role.fixed:
                return hook(self, *args)
            with role.lock:
                return hook(self, *args)
        return guarded
    return decorate
