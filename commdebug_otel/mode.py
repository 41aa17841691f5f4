"""The dispatch mode: collectives and (by detail level) ops, reported to the recorder.

A ``TorchDispatchMode`` sees every aten op, c10d op and functional collective.
Ops on DTensors reach the mode before DTensor itself; as in torch's
CommDebugMode we note the op and return ``NotImplemented``, so DTensor runs,
redistributes (issuing functional collectives that come back through this
mode on plain tensors) and computes locally.

The hot path for an op that is neither a collective nor recorded is one dict
lookup and one ``in`` test before redispatch. The mode is on only where it is
needed (traced steps; see ``CommTracer``): collectives are counted by the
dispatcher kernels of :mod:`commdebug_otel.intercept`, which cost nothing per op.
"""

from __future__ import annotations

import time
from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from .config import Detail
from .ops import build_registry
from .recorder import Recorder

# CommDebugMode's trivial ops (torch/distributed/tensor/debug/_comm_mode.py), left out below detail "all".
TRIVIAL_OPS = frozenset({
    "aten.detach.default", "aten.t.default", "aten.view.default",
    "aten._to_copy.default", "aten.as_strided.default", "aten.transpose.int",
})

COLLECTIVES = build_registry()


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch without distributed
        return None
    return DTensor


class CollectiveDispatchMode(TorchDispatchMode):
    """Notes DTensor ops (the "why" of collectives) and ops (``detail >= dtensor``) for a :class:`Recorder`.

    ``collectives``: also report collectives; only needed where the dispatcher
    kernels of :mod:`commdebug_otel.intercept` could not be registered, which
    otherwise report every collective, mode or not.
    """

    supports_higher_order_operators = True

    def __init__(self, recorder: Recorder, detail: Detail, collectives: bool = False) -> None:
        super().__init__()
        self._recorder = recorder
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
                    recorder.why_func, recorder.why_args = func, args  # the "why" of collectives to come
                    return NotImplemented  # DTensor desugars into local ops and collectives, through here
                # DTensor's own dispatch runs here with this mode off: its local ops never come back
                # to Python, and its collectives reach the dispatcher kernels with this "why".
                previous = recorder.why_func, recorder.why_args
                recorder.why_func, recorder.why_args = func, args
                try:
                    return func(*args, **kwargs) if kwargs else func(*args)
                finally:
                    recorder.why_func, recorder.why_args = previous
            if recorder.why_func is func:
                recorder.why_func = None  # DTensor runs its local op: redistribution is over
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
            if self._detail >= Detail.ALL or str(func) not in TRIVIAL_OPS:
                self._recorder.op_event(func, args, is_dtensor=is_dtensor)
        except Exception as error:
            self._recorder.hook_failed("op event", error)


def _user_modes_above_infra() -> int:
    """How many modes on this thread's stack are user modes (infra modes, e.g. FakeTensorMode, sit below them)."""
    return sum(1 for mode in _get_current_dispatch_mode_stack() if getattr(mode, "_mode_key", None) is None)


def enter_below_user_modes(mode: TorchDispatchMode) -> None:
    """Push ``mode`` under the user modes already on this thread's dispatch mode stack.

    The tracer pushes its mode when a traced step opens (inside the first
    forward pre-hook) and removes it when the step closes. A user mode entered
    before that and exited earlier (``with FlopCounterMode(): loss = model(x)``)
    pops whatever is on top (``TorchDispatchMode.__exit__``): ours must not be there.
    """
    above = [_pop_mode() for _ in range(_user_modes_above_infra())]
    mode.__enter__()
    for other in reversed(above):
        _push_mode(other)


def exit_from_stack(mode: TorchDispatchMode) -> bool:
    """Remove ``mode`` from wherever it is on this thread's stack, leaving the others in order.

    Returns False (and changes nothing) if ``mode`` is not on this thread's stack.
    """
    if not any(other is mode for other in _get_current_dispatch_mode_stack()):
        return False
    above = []
    while True:
        stack = _get_current_dispatch_mode_stack()
        if stack[-1] is mode:
            break
        above.append(_pop_mode())
    mode.__exit__(None, None, None)
    for other in reversed(above):
        _push_mode(other)
    return True
