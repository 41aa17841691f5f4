"""Our flush on SIGTERM, SIGHUP and SIGQUIT: the process lifecycle's signals, apart from the providers.

``process_exit.ProcessExit`` holds one :class:`SignalFlush` and arms it once its own providers exist
(nothing of ours to flush before); ``tracer.CommTracer`` gives the handlers back when a tracer
stops or the default group is destroyed. The rescue thread (:class:`_SignalRescue`) ends a process whose
main thread is stuck in a native wait, as the default action would have.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stub: the C module under signal)
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from commdebug_otel.core.frames import without_frames_of
from commdebug_otel.core.redact import describe
from commdebug_otel.core.thread_signals import start_quiet

_logger = logging.getLogger(__name__)


class SignalFlush:
    """Flush-then-die handlers chained over the signals' own.

    Args:
        exit: ``exit()``: tracers end their open spans, one bounded flush and shutdown (the atexit path).
        flush: ``flush()``: a bounded flush, training going on.
        armed: ``armed()``: whether our own providers exist (nothing to flush before).
    """

    def __init__(self, exit: Callable[[], None], flush: Callable[[], None], armed: Callable[[], bool]) -> None:
        self._exit = exit
        self._flush = flush
        self._armed = armed
        self._signal_rescue: _SignalRescue | None = None
        self._signals_held = False  # hold() ran and release() has not
        self._chained: dict[int, tuple[Any, Any]] = {}  # signum -> (our handler, the one it calls)

    def hold(self) -> None:
        """Flush on SIGTERM, SIGHUP and SIGQUIT, then hand the signal to the handler that was there.

        torchrun sends SIGTERM to every worker when a peer fails or the job is
        restarted, and forwards SIGHUP and SIGQUIT it receives
        (``torch.distributed.elastic``'s termination handler); their default
        action kills the process without atexit, and every finished step and
        metric point still buffered would be lost (SIGINT's KeyboardInterrupt
        exits through atexit). Only the main thread can set
        handlers: elsewhere this does nothing. An ignored signal stays ignored.
        Does nothing before our own providers exist (nothing of ours to flush).
        A signal with a handler installed by ``sigaction`` outside Python's
        signal module (``faulthandler.register``, a C extension), which
        ``signal.getsignal`` reports as ``SIG_DFL``, is left alone too: it runs
        at once on any thread, where ours would wait for the main thread.
        A handler the script (or a library) installs later replaces ours and
        runs alone: :meth:`keep` never wraps it, and the rescue thread
        leaves that signal alone. Undone by :meth:`release`.
        """
        if not self._armed() or threading.current_thread() is not threading.main_thread():
            return
        self._signals_held = True
        for signum in _FLUSH_SIGNALS:
            try:
                previous = _getsignal(signum)
                if previous is None or previous is signal.SIG_IGN or self._ours(signum, previous):
                    continue  # set outside Python, ignored (leave it), or ours already
                if isinstance(previous, _Chained) and not previous.held():
                    previous = previous.previous  # ours, left behind by a release: what it stood for
                if _c_level_handler(signum):
                    # faulthandler's or an extension's (Python's view says SIG_DFL): it runs at once on any
                    # thread, also while the main thread waits in native code; ours would delay it until
                    # the main thread runs Python again. Left alone, with no flush of ours on it.
                    continue
                self._chain(signum, previous)
            except (ValueError, OSError) as error:  # an embedded interpreter, a restricted platform
                _logger.debug("commdebug-otel: no flush on signal %s: %s", signum, describe(error))
        self._take_wakeup_fd()

    def keep(self) -> None:
        """At a step boundary on the main thread: chain our flush again where a signal's handler was reset
        to the default (asyncio's ``remove_signal_handler`` sets ``SIG_DFL`` and clears the wakeup fd).

        A handler of the script's is left as it is. Cheap (a few ``signal.getsignal`` calls); never raises.
        """
        if not self._signals_held or threading.current_thread() is not threading.main_thread():
            return
        try:
            reset = False
            for signum in self._chained:
                current = _getsignal(signum)
                if current is signal.SIG_DFL and not _c_level_handler(signum):
                    self._chain(signum, current)
                    reset = True
            if reset:
                self._take_wakeup_fd()
        except (ValueError, OSError) as error:
            _logger.debug("commdebug-otel: signal handlers not kept: %s", describe(error))

    def release(self) -> None:
        """Undo :meth:`hold`: each signal whose handler is still ours gets back the one we found, and
        the wakeup fd, if still ours, is given back. Main thread only (elsewhere does nothing); never raises.

        A C-level handler installed since (``faulthandler.register`` after tracing started) is left in
        force: Python still names ours, which stays for that handler to chain to and acts as the one we
        found would have (the default action ends the process by the signal).
        """
        if not self._signals_held or threading.current_thread() is not threading.main_thread():
            return
        self._signals_held = False
        for signum, (handler, previous) in list(self._chained.items()):
            try:
                if _getsignal(signum) is handler and not _c_level_handler(signum):
                    signal.signal(signum, previous)
            except (ValueError, OSError) as error:
                _logger.debug("commdebug-otel: signal %s not restored: %s", signum, describe(error))
        self._chained.clear()
        rescue, self._signal_rescue = self._signal_rescue, None
        if rescue is not None:
            rescue.uninstall()

    def _chain(self, signum: int, previous: Any) -> None:
        found = _disposition(signum) if _python_handler is None and callable(previous) else None
        handler = _Chained(self, signum, previous)
        signal.signal(signum, handler)
        _learn_python_handler(signum)
        if found is not None and _handler_address(signum, found) != _python_handler:
            # A C-level handler over the script's Python one, found out only now: exactly as it was.
            signal.signal(signum, previous)
            _set_disposition(signum, found)
            return
        self._chained[signum] = (handler, previous)

    def _ours(self, signum: int, handler: Any) -> bool:
        chained = self._chained.get(signum)
        return chained is not None and chained[0] is handler

    def _take_wakeup_fd(self) -> None:
        """Start the rescue thread (or give it the wakeup fd again) when a deadly signal's handler is ours."""
        if not any(self.rescues(signum) for signum in self._chained):
            return
        if self._signal_rescue is None:
            self._signal_rescue = _SignalRescue(self).install()
        else:
            self._signal_rescue.retake()

    def handlers_lost(self) -> bool:
        """Whether a signal we hold has its default action again (asyncio's ``remove_signal_handler`` or
        ``loop.close()``, ``signal.signal(SIGTERM, SIG_DFL)``) and is not chained yet (:meth:`keep`, at the
        next optimizer step on the main thread). Read from any thread; never raises."""
        try:
            return any(_getsignal(signum) is signal.SIG_DFL and not _c_level_handler(signum)
                       for signum in list(self._chained))
        except (ValueError, OSError):
            return False

    def rescues(self, signum: int) -> bool:
        """Whether the rescue thread may end the process for ``signum`` now: the handler in force (read from
        any thread) is still ours, over the default action. A handler installed since is the script's to run."""
        chained = self._chained.get(signum)
        if chained is None or chained[1] is not signal.SIG_DFL:
            return False
        try:
            return _getsignal(signum) is chained[0]
        except (ValueError, OSError):
            return False

    def _on_signal(self, handler: _Chained, signum: int, frame: Any) -> None:
        """Export what is finished within the budget, then do what ``handler.previous`` would have done.

        Called by a handler installed since (one that calls the handler it found, as Lightning's
        does), ours is no longer the handler in force: it flushes and calls ``previous`` if that is a
        function, and never ends the process (without us that handler would have found the default
        action, and called nothing). Once released (a C-level handler installed since kept it in
        Python's table, and chains to it) it only does what ``previous`` would have.
        """
        previous = handler.previous
        in_force = _getsignal(signum) is handler
        if not self._ours(signum, handler):  # released: no flush of ours, the process acts as without us
            if previous is signal.SIG_DFL and in_force:
                _die_by(signum)
            elif callable(previous):
                previous(signum, frame)
            return
        dying = previous is signal.SIG_DFL and in_force
        if dying and self._signal_rescue is not None and not self._signal_rescue.claim():
            return  # the rescue thread is flushing and will end the process by the signal
        try:
            if dying:
                self._exit()  # tracers end their open spans; one bounded flush and shutdown
            else:
                self._flush()  # the previous handler decides; training may go on
        except Exception as error:  # the signal must still be delivered
            _logger.debug("commdebug-otel: flush on signal %s failed: %s", signum, describe(error))
        if dying:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the process ends as it would have, by the signal
        elif callable(previous):
            previous(signum, frame)


class _Chained:
    """Our handler for one signal: flushes (:meth:`SignalFlush._on_signal`), then does what ``previous`` would.

    It compares and hashes as ``previous``, so the script reads what it would untraced: ``signal.getsignal``
    (and ``signal.signal``'s return) give the ``SIG_DFL`` member itself where ours stands for the default
    action (the module maps a value equal to a member to that member), and ``getsignal(s) == handler``
    holds where ours stands for the script's ``handler``: code that decides by them (Lightning's
    ``SignalConnector``, ``getsignal(s) is SIG_DFL``) decides as untraced. Our own code reads Python's table
    itself (:func:`_getsignal`) and compares with ``is``.
    """

    __slots__ = ("owner", "previous", "signum")

    def __init__(self, owner: SignalFlush, signum: int, previous: Any) -> None:
        self.owner = owner
        self.signum = signum
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            self.owner._on_signal(self, signum, frame)
        except BaseException as error:  # the script's handler raised: its traceback, without our frames
            error.__traceback__ = without_frames_of(error.__traceback__, __file__)
            raise

    def __eq__(self, other: object) -> bool:
        return other is self or self.previous == other

    def __hash__(self) -> int:
        try:
            return hash(self.previous)
        except TypeError:  # an unhashable callable object as the handler we found
            return object.__hash__(self)

    def held(self) -> bool:
        """Whether its owner still holds the signal with it (not released)."""
        return self.owner._ours(self.signum, self)


class _SignalRescue:
    """Ends the process by a deadly signal when the main thread cannot run its Python handler.

    Python runs signal handlers on the main thread, between bytecodes: a rank blocked in
    a native wait (a collective waiting for a stuck peer, gloo or NCCL) would run our
    flush-then-die handler only when the wait returns, at the process group's timeout,
    where without us the default action kills it at once. Python's C-level handler also
    writes the signal's number to the wakeup fd: this thread reads it and, if the main
    thread has not begun the handler within ``GRACE_S``, flushes (within the shutdown
    budget) and ends the process by the signal itself, but only while the handler in
    force is still ours over the default action (:meth:`SignalFlush.rescues`): a handler
    the script installed since runs alone, and the process lives if it says so. Not
    installed when the wakeup fd is someone else's (asyncio); a forked child drops it
    (its signals are its own). Every ``WATCH_S`` it also looks for a handler reset to the
    default action (:meth:`_flush_if_lost`).
    """

    GRACE_S = 0.5
    JOIN_S = 1.0  # how long uninstall waits for the thread to end
    WATCH_S = 1.0  # how often it looks for a handler reset to the default action (_flush_if_lost)

    def __init__(self, signals: SignalFlush) -> None:
        self._signals = signals
        self._claimed = threading.Lock()
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> _SignalRescue | None:
        """Take the wakeup fd and start the thread; None where the fd is taken or cannot be set."""
        try:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._writer = writer
            if not self.retake():
                reader.close()
                writer.close()
                return None
        except (ValueError, OSError) as error:
            _logger.debug("commdebug-otel: no signal rescue thread: %s", describe(error))
            return None
        self._reader = reader
        _RESCUES.add(self)
        _forget_rescues_in_children()
        self._thread = threading.Thread(target=self._run, args=(reader,), name="commdebug-otel-signals", daemon=True)
        start_quiet(self._thread)
        return self

    def retake(self) -> bool:
        """Make our socket the wakeup fd if nobody's is (asyncio gives it back as -1); False if it is someone
        else's (left to them)."""
        try:
            writer = self._writer
            if writer is None:  # uninstalled
                return False
            previous = _set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            if previous not in (-1, writer.fileno()):  # someone else's (an event loop): theirs again
                _set_wakeup_fd(previous)
                return False
        except (ValueError, OSError) as error:
            _logger.debug("commdebug-otel: wakeup fd not taken: %s", describe(error))
            return False
        _hide_wakeup_fd(True)
        return True

    def uninstall(self) -> None:
        """Give the wakeup fd back (if still ours) and end the thread (main thread only): it is gone when
        this returns, unless it is flushing for a signal (waited for ``JOIN_S`` at most)."""
        _RESCUES.discard(self)
        self._forget()
        if not _RESCUES:
            _hide_wakeup_fd(False)
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # the reader sees the end and the thread returns
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.JOIN_S)  # a script that lists or joins threads after the tracer stops sees none

    def claim(self) -> bool:
        """Whoever claims first flushes and ends the process: the main thread's handler or this thread."""
        return self._claimed.acquire(blocking=False)

    def _forget(self) -> None:
        try:
            current = _set_wakeup_fd(-1)
            if self._writer is None or current != self._writer.fileno():
                _set_wakeup_fd(current)  # someone else's by now: theirs again
        except (ValueError, OSError):
            pass

    def _run(self, reader: socket.socket) -> None:
        reader.settimeout(self.WATCH_S)
        flushed = False  # since the handler in force was found back to the default action
        with reader:
            while True:
                try:
                    data = reader.recv(64)
                except TimeoutError:
                    flushed = self._flush_if_lost(flushed)
                    continue
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    if self._signals.rescues(signum):
                        self._rescue(signum)

    def _flush_if_lost(self, flushed: bool) -> bool:
        """A signal's handler went back to the default action after the last step (an event loop removed
        its handler, also at ``loop.close()``): the signal now ends the process at once, with no Python of
        ours, and nothing on the main thread chains our flush until its next step. What is finished is
        exported now, once per such reset. Returns whether the handlers are still lost and flushed."""
        if not self._signals.handlers_lost():
            return False
        if not flushed:
            try:
                self._signals._flush()
            except Exception as error:
                _logger.debug("commdebug-otel: flush after a signal handler reset failed: %s", describe(error))
        return True

    def _rescue(self, signum: int) -> None:
        time.sleep(self.GRACE_S)  # a main thread that is running Python takes it itself
        # A handler installed meanwhile (or the one the main thread ran) is the script's: it decides.
        if not self._signals.rescues(signum) or not self.claim():
            return
        try:
            self._signals._exit()
        except Exception as error:
            _logger.debug("commdebug-otel: flush on signal %s failed: %s", signum, describe(error))
        _die_by(signum)


_RESCUES: weakref.WeakSet = weakref.WeakSet()  # installed rescue threads' owners


def _getsignal(signum: int) -> Any:
    """The handler in Python's table for ``signum``: ours as itself (``signal.getsignal`` gives the member
    ours compares equal to), ``SIG_DFL``/``SIG_IGN`` as the members, None for one set outside Python."""
    handler = _signal.getsignal(signum)
    return signal.Handlers(handler) if type(handler) is int else handler
_set_wakeup_fd = signal.set_wakeup_fd  # Python's own (ours stands in for it while a rescue holds the fd)


@functools.wraps(_set_wakeup_fd)
def _script_set_wakeup_fd(fd: int, /, **kwargs: Any) -> int:
    """``signal.set_wakeup_fd`` as the script calls it while our socket is the wakeup fd: what it returns is
    what it would untraced, -1 where the fd it replaced is ours (taken only where there was none). A library
    that warns when it finds another's fd (trio) or hands the old one back stays as it is without us."""
    previous = _set_wakeup_fd(fd, **kwargs)
    for rescue in list(_RESCUES):
        writer = rescue._writer
        if writer is not None and previous == writer.fileno():
            return -1
    return previous


def _hide_wakeup_fd(hide: bool) -> None:
    """Put :func:`_script_set_wakeup_fd` in ``signal.set_wakeup_fd`` (``hide``), or Python's own back where
    ours is still there."""
    if hide and signal.set_wakeup_fd is _set_wakeup_fd:
        signal.set_wakeup_fd = _script_set_wakeup_fd
    elif not hide and signal.set_wakeup_fd is _script_set_wakeup_fd:
        signal.set_wakeup_fd = _set_wakeup_fd


def _forget_in_child() -> None:
    for rescue in list(_RESCUES):
        rescue._forget()
    _hide_wakeup_fd(False)  # the child's wakeup fd is its own


@functools.cache
def _forget_rescues_in_children() -> None:
    """One at-fork hook per process (hooks cannot be unregistered): a forked child's signals are its own."""
    os.register_at_fork(after_in_child=_forget_in_child)


def _die_by(signum: int) -> None:
    """End the process by ``signum``'s default action, from any thread (Python's signal.signal is main-only)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # delivery is asynchronous
    os._exit(128 + signum)


# The C-level handler's address that Python installs for a Python function (its signal module's
# signal_handler), read back after our first signal.signal; None until then.
_python_handler: int | None = None
_SIGACTION_BYTES = 512  # more than any libc's struct sigaction (glibc: 152 on x86-64); read as opaque bytes


@functools.cache
def _sigaction() -> Any:
    """libc's ``sigaction`` through ctypes (Linux only), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sigaction
        function.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        function.restype = ctypes.c_int
        return function
    except (OSError, AttributeError):
        return None


def _disposition(signum: int) -> bytes | None:
    """``signum``'s ``struct sigaction`` as the kernel has it (opaque bytes, the handler first); None where it
    cannot be read. Any thread."""
    sigaction = _sigaction()
    if sigaction is None:
        return None
    import ctypes

    found = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if sigaction(signum, None, found) != 0:
        return None
    return found.raw


def _set_disposition(signum: int, disposition: bytes) -> None:
    """Put back a ``struct sigaction`` that :func:`_disposition` read: handler, mask and flags exactly."""
    import ctypes

    if _sigaction()(signum, ctypes.create_string_buffer(disposition, len(disposition)), None) != 0:
        raise OSError(ctypes.get_errno(), f"sigaction({signum}) failed")


def _handler_address(signum: int, disposition: bytes | None = None) -> int | None:
    """The address of the handler the kernel runs for ``signum``: 0 for the default action, 1 for ignored;
    None where it cannot be read. Any thread."""
    import ctypes

    disposition = _disposition(signum) if disposition is None else disposition
    if disposition is None:
        return None
    return int.from_bytes(disposition[:ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)


def _learn_python_handler(signum: int) -> None:
    """Remember Python's own C-level handler, just installed on ``signum`` by ``signal.signal``."""
    global _python_handler
    if _python_handler is None:
        address = _handler_address(signum)
        if address not in (None, 0, 1):
            _python_handler = address


def _c_level_handler(signum: int) -> bool:
    """Whether ``signum`` has a handler installed by ``sigaction`` outside Python's signal module
    (``faulthandler.register``, a C extension), which ``signal.getsignal`` does not see: it names the
    default action or the Python function it last set. False where it cannot be told."""
    address = _handler_address(signum)
    if address is None:
        return False
    current = _getsignal(signum)
    if current is signal.SIG_DFL:
        return address != 0
    if current is signal.SIG_IGN:
        return address != 1
    return _python_handler is not None and address != _python_handler


# SIGHUP and SIGQUIT do not exist on Windows. SIGINT is left alone: its default handler raises
# KeyboardInterrupt, the interpreter's exit then runs our atexit flush, and libraries that look for
# that handler (asyncio.run installs its own only over it) must find it.
_FLUSH_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))
