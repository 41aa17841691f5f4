"""The dispatch mode: op events (detail ``dtensor`` and up), and the fallbacks.

A ``TorchDispatchMode`` sees every aten op, so every op pays for it; the
tracer pushes one only where op events need it, and only while a traced step
is open (``CommTracer``). Collectives are counted by the dispatcher kernels of
:mod:`commdebug_otel.capture.intercept`, mode or not.

Ops on DTensors reach the mode before DTensor itself. At detail ``dtensor``
the mode notes the op and runs DTensor's dispatch itself, with the mode off:
DTensor's local ops never come back to Python. At ``ops`` and up (and in the
fallback where the kernels could not be registered, when the mode counts
collectives itself), it notes the op and returns ``NotImplemented``, as
torch's CommDebugMode does, so DTensor desugars into local ops and functional
collectives that come back through the mode on plain tensors.
"""

from __future__ import annotations

import time
from typing import Any

from commdebug_otel.capture._torch import (
    HigherOrderOperator,
    TorchDispatchMode,
    dispatch_mode_stack,
    is_user_mode,
    pop_mode,
    push_mode,
    sync_dispatch_mode_flags,
)
from commdebug_otel.capture.ops import build_registry
from commdebug_otel.config import Detail
from commdebug_otel.core.protocols import OpSubscriber
from commdebug_otel.detail import op_listed

COLLECTIVES = build_registry()


def op_event_wanted(detail: Detail, func: Any, is_dtensor: bool) -> bool:
    """Whether an op is a span event at ``detail``: :func:`~commdebug_otel.detail.op_listed` of ``func``."""
    return detail >= Detail.ALL or op_listed(detail, str(func), is_dtensor)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch without distributed
        return None
    return DTensor


class CollectiveDispatchMode(TorchDispatchMode):
    """Notes DTensor ops (the "why" of collectives) and ops (``detail >= dtensor``) for a :class:`Recorder`.

    ``collectives``: also report collectives; only needed where the dispatcher
    kernels of :mod:`commdebug_otel.capture.intercept` could not be registered, which
    otherwise report every collective, mode or not.
    """

    supports_higher_order_operators = True

    def __init__(self, recorder: OpSubscriber, detail: Detail, collectives: bool = False) -> None:
        super().__init__()
        self._recorder = recorder
        self._why = recorder.why  # the recorder's one "why", cleared in place, never replaced
        self._collectives = collectives
        self._detail = detail
        self._dtensor = _dtensor_type()
        self._record_dtensor_ops = detail >= Detail.DTENSOR
        self._record_plain_ops = detail >= Detail.OPS
        # Must DTensor desugar through this mode (its local ops and collectives seen here)?
        self._desugar = self._record_plain_ops or collectives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Hot path: most ops are neither collectives nor recorded.
        spec = COLLECTIVES.get(func)
        recorder = self._recorder
        if spec is None:
            if types and self._dtensor in types and not isinstance(func, HigherOrderOperator):
                if not recorder.active:
                    return func(*args, **kwargs) if kwargs else func(*args)
                if self._record_dtensor_ops:
                    self._note(func, args, is_dtensor=True)
                if self._desugar:
                    self._why.until_local_op(func, args)  # the "why" of collectives to come
                    return NotImplemented  # DTensor desugars into local ops and collectives, through here
                # DTensor's own dispatch runs here with this mode off: its local ops never come back
                # to Python, and its collectives reach the dispatcher kernels with this "why".
                with self._why(func, args):
                    return func(*args, **kwargs) if kwargs else func(*args)
            if self._why.op is func:
                self._why.local_op_ran(func)  # DTensor runs its local op: redistribution is over
            if self._record_plain_ops and recorder.active:
                self._note(func, args, is_dtensor=False)
            return func(*args, **kwargs) if kwargs else func(*args)
        if not self._collectives:
            return func(*args, **kwargs) if kwargs else func(*args)
        start = time.perf_counter_ns()
        out = func(*args, **kwargs) if kwargs else func(*args)
        if recorder.active:
            try:
                recorder.collective(spec, args, time.perf_counter_ns() - start, out, start)
            except Exception as error:
                recorder.hook_failed("collective event", error)
        return out

    def _note(self, func: Any, args: tuple, is_dtensor: bool) -> None:
        """An op event (detail ``dtensor`` and up); trivial ops only at ``all``."""
        try:
            if op_event_wanted(self._detail, func, is_dtensor):
                self._recorder.op_event(func, args, is_dtensor=is_dtensor)
        except Exception as error:
            self._recorder.hook_failed("op event", error)


def _user_modes_above_infra() -> int:
    """How many modes on this thread's stack are user modes (infra modes, e.g. FakeTensorMode, sit below them)."""
    return sum(1 for mode in dispatch_mode_stack() if is_user_mode(mode))


def on_stack(mode: TorchDispatchMode) -> bool:
    """Whether ``mode`` is on this thread's dispatch mode stack."""
    return any(other is mode for other in dispatch_mode_stack())


def enter_below_user_modes(mode: TorchDispatchMode) -> None:
    """Push ``mode`` under the user modes already on this thread's dispatch mode stack.

    The tracer pushes its mode when a traced step opens (inside the first
    forward pre-hook) and removes it when the step closes. A user mode entered
    before that and exited earlier (``with FlopCounterMode(): loss = model(x)``)
    pops whatever is on top (``TorchDispatchMode.__exit__``): ours must not be there.
    """
    above = [pop_mode() for _ in range(_user_modes_above_infra())]
    push_mode(mode)
    for other in reversed(above):
        push_mode(other)
    sync_dispatch_mode_flags()


def exit_from_stack(mode: TorchDispatchMode) -> bool:
    """Remove ``mode`` from wherever it is on this thread's stack, leaving the others in order.

    Returns False (and changes nothing) if ``mode`` is not on this thread's stack.
    """
    if not on_stack(mode):
        return False
    above = []
    while dispatch_mode_stack()[-1] is not mode:
        above.append(pop_mode())
    pop_mode()
    for other in reversed(above):
        push_mode(other)
    sync_dispatch_mode_flags()
    return True
