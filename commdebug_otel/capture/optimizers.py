"""Whether an optimizer is alive in this process, so that a step ends at its ``step()`` alone.

A training step ends at ``optimizer.step()`` however many backward passes come first (gradient
accumulation of 64 micro-batches, a chunked loss that runs the head's forward and backward many
times per micro-batch). Only where no optimizer exists is a step cut after ``NO_OPTIMIZER_CYCLES``
backward passes (``core/ownership.py``), so that scripts without one still get bounded traces; an
optimizer made but not yet stepped must not let that cut split its first step (the ranks of a
pipeline would then number the same optimizer step differently).

:data:`OPTIMIZERS` knows the optimizers alive: each one made while a tracer watches
(``Optimizer.__init__`` wrapped), and those made before, found once by one pass over the collector's
objects that refer to an optimizer class torch has marked used (:func:`~._torch.optimizer_classes_made`),
at the first question after the watch began. Frameworks that wrap an optimizer (DeepSpeed, Lightning)
make a torch optimizer underneath, which is the one seen. Optimizers are held weakly.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Any

import torch

from commdebug_otel.capture._torch import optimizer_classes_made
from commdebug_otel.capture.intercept import registering_init
from commdebug_otel.core.redact import describe

_logger = logging.getLogger(__name__)


class LiveOptimizers:
    """The ``torch.optim.Optimizer`` instances alive, weakly held (the process's one is :data:`OPTIMIZERS`)."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._watchers = 0
        self._lock = threading.Lock()
        self._original: Any = None  # Optimizer.__init__ as it was before our wrapper
        self._wrapper: Any = None
        self._scan_pending = True  # optimizers may have been made while nobody watched

    def watch(self, on: bool) -> None:
        """A tracer starts (``on``) or stops watching: while at least one watches, ``Optimizer.__init__`` is
        wrapped to remember each optimizer made. Each ``watch(True)`` needs its ``watch(False)``. Never raises."""
        with self._lock:
            try:
                if on:
                    self._watchers += 1
                    if self._watchers == 1:
                        self._scan_pending = True  # made since the last watch ended: found at the next question
                        self._wrap()
                else:
                    self._watchers = max(0, self._watchers - 1)
                    if self._watchers == 0:
                        self._unwrap()
            except Exception as error:  # another torch: optimizers made later are not known before they step
                _logger.debug("commdebug-otel: optimizers not watched: %s", describe(error))

    def _wrap(self) -> None:
        optimizer = torch.optim.Optimizer
        original = optimizer.__dict__["__init__"]
        if self._wrapper is None or self._original is not original:
            self._original, self._wrapper = original, registering_init(original, self.add, "an optimizer")
        optimizer.__init__ = self._wrapper  # type: ignore[method-assign]

    def _unwrap(self) -> None:
        optimizer = torch.optim.Optimizer
        if self._wrapper is not None and optimizer.__dict__.get("__init__") is self._wrapper:
            optimizer.__init__ = self._original  # type: ignore[method-assign]  # (wrapped again by someone since: ours stays, harmless)

    def add(self, optimizer: Any) -> None:
        """Remember ``optimizer`` (weakly; ``Optimizer`` has no ``__slots__``, so every subclass can be); again
        is a no-op."""
        self._live.add(optimizer)

    def any_alive(self) -> bool:
        """Whether an optimizer is alive. The first question after a watch began may walk the collector's
        objects once (only where some optimizer class was ever used): ``gc.get_referrers``, 0.26 s over 3.3
        million objects on a busy 2-core machine; asked only before the first ``optimizer.step()``, at a step's
        top-level forward after ``NO_OPTIMIZER_CYCLES`` backward passes."""
        if self._live:
            return True
        if self._scan_pending:
            self._scan_pending = False
            try:
                classes = optimizer_classes_made()
                if classes:
                    kind = torch.optim.Optimizer
                    for found in gc.get_referrers(*classes):
                        if isinstance(found, kind):
                            self.add(found)
            except Exception as error:  # optimizers made before the tracer are not known before they step
                _logger.debug("commdebug-otel: optimizers made before the tracer not found: %s", describe(error))
        return bool(self._live)


#: The process's optimizers (the tracers start and stop its watch).
OPTIMIZERS = LiveOptimizers()
