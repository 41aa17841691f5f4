"""What a closing step says of itself, beside its spans: duration, collective wait, slow, stalled; and the
hooks it holds, removed when it closes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.capture._torch import tensor_hook_key
from commdebug_otel.core.fact import MetricsSink
from commdebug_otel.core.progress import Progress
from commdebug_otel.core.records import Record, SpanKind, Step


def step_signals(step: Step, now: int, progress: Progress, metrics: MetricsSink | None,
                 exemplar_span: Callable[[Record, Step], tuple[int, int]],
                 hook_failed: Callable[[str, BaseException], None]) -> None:
    """Every step: its duration and collective wait (metrics, ``metrics.step``); traced steps: the same on
    ``train_step``, with its fingerprint. ``now``: ``time.time_ns()`` at its close."""
    training = step.kind is SpanKind.STEP
    wait_s = progress.wait_ns / 1e9
    duration_s, slow = progress.step_ended(now, training)
    if not training:
        return
    if metrics is not None:
        try:
            # Traced: the points' exemplars name this step's train_step span.
            span_ref = exemplar_span(step.root, step) if step.traced and step.trace_id else None
            metrics.step(duration_s, wait_s, span_ref)
        except Exception as error:
            hook_failed("metrics", error)
    attrs = step.root.attrs
    if step.traced:
        attrs[semconv.STEP_COLLECTIVE_WAIT] = round(wait_s, 6)
        attrs[semconv.STEP_CPU_WAIT] = round(progress.cpu_wait_ns / 1e9, 6)
        attrs.update(step.fingerprint_attributes())
    if slow:
        attrs[semconv.STEP_SLOW] = True
    if step.stalled:
        attrs[semconv.STEP_STALLED] = step.stalled


def keep_hook(step: Step | None, handle: Any) -> None:
    """Remember a tensor or multi-grad hook handle on the open ``step`` (None: none open, nothing kept): it is
    removed when the step closes. A hook left on a tensor that outlives the step (a cached activation, a
    tensor kept by the user) would keep the step's records alive. ``handle`` may be the ``(hooks dict, key)``
    of a tensor hook added without a handle (``_torch.add_tensor_hook``)."""
    if step is not None:
        key = handle if type(handle) is tuple else tensor_hook_key(handle)
        if key is None:
            step.hooks.append(handle)
        else:  # the handle (and its weak reference) goes now: fewer objects alive through the step
            step.tensor_hooks += key


def remove_hooks(step: Step) -> None:
    """Remove the hooks ``step`` kept (:func:`keep_hook`)."""
    hooks = step.tensor_hooks
    for index in range(0, len(hooks), 2):
        hooks[index].pop(hooks[index + 1], None)  # what RemovableHandle.remove() does
    hooks.clear()
    for handle in step.hooks:
        handle.remove()
    step.hooks.clear()
