"""Our background threads leave the process's signals to the script's own threads.

The kernel gives a process-directed signal (a launcher's SIGTERM, SIGINT, SIGQUIT, SIGUSR1) to any thread that
does not block it. Python runs its handlers on the main thread whichever thread took the signal, but a C-level
handler (``faulthandler.register``, an extension's) runs on the thread that took it: on one of ours while it runs
bytecode, faulthandler's dump of every thread reads frames that thread is changing, and can crash the process.
So every thread we start, and the SDK's export threads (started inside :func:`signals_blocked`), block those
signals: the script's threads take each of them, as they would without us. Threads the SDK starts again in a
forked child, or that gRPC starts later from the script's thread, keep that thread's mask.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["ASYNC_SIGNALS", "signals_blocked", "start_quiet"]

#: What our threads block: the signals a launcher, a scheduler or a user sends to the process (torchrun's SIGTERM,
#: Ctrl-C, a hangup, ``kill -QUIT`` for faulthandler's dump, SIGUSR1/2 for a script's own handler, an alarm).
#: Profilers' timers (SIGPROF, SIGVTALRM) go on sampling whichever thread runs, ours too; a signal a fault raises
#: (SIGSEGV, SIGBUS, ...) must never be blocked: the kernel would end the process without running its handler.
ASYNC_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1",
                                                             "SIGUSR2", "SIGALRM") if hasattr(signal, name)) \
    if hasattr(signal, "pthread_sigmask") else frozenset()


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Threads started inside (ours, the SDK's, gRPC's) block :data:`ASYNC_SIGNALS` for their whole life; the
    calling thread's own mask is restored on leaving (a signal that came meanwhile is delivered then). Also a
    decorator. A no-op where threads have no signal mask (Windows)."""
    if not ASYNC_SIGNALS:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_quiet(thread: threading.Thread) -> None:
    """``thread.start()``, the thread blocking :data:`ASYNC_SIGNALS`.

    Raises:
        RuntimeError: as ``Thread.start`` (started twice, or no thread can be started).
    """
    with signals_blocked():
        thread.start()
