"""``CommDebugMode``: torch's counting API, plus the spans, events and metrics of :class:`CommTracer`.

Same constructor and counting results as
``torch.distributed.tensor.debug.CommDebugMode`` on the same workload
(``get_comm_counts``, ``get_total_counts``, ``comm_module_counts``,
``get_parameter_info``, ``get_sharding_info``), with these differences
(docs/comparison.md):

* a module that runs several times in one forward is counted correctly
  (torch 2.13's raises ``IndexError``);
* send/recv, barrier and the coalesced and in-place variants are counted too;
* FSDP2's post-backward reduce-scatter is booked to the FSDP unit, not to the
  block's first leaf.

It does not subclass torch's class or reuse its module tracker.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from . import semconv
from .config import Settings
from .instrumentation import CommTracer
from .ops import CollectiveSpec
from .recorder import Record

GLOBAL = "Global"


def _legacy_packets() -> dict[Any, Any]:
    """torch keys native functional collectives by their legacy packet (NATIVE_TO_PY_MAPPING)."""
    try:
        from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING

        return dict(NATIVE_TO_PY_MAPPING)
    except Exception:  # a torch without it: keep native packets
        return {}


def _module_chain(owner: Record | None) -> list[str]:
    """The owner's FQN, then the FQNs of the modules running around it in forward."""
    chain: list[str] = []
    record = owner
    while record is not None and record.fqn:
        if record.pass_ == semconv.PASS_BACKWARD:
            chain.append(record.fqn)
            record = record.fwd.parent if record.fwd is not None else None
            continue
        chain.append(record.fqn)
        record = record.parent
    return chain


class CommDebugMode:
    """Drop-in for torch's ``CommDebugMode`` that also streams OpenTelemetry.

    Args:
        settings: optional :class:`Settings` (default: from the environment).
        **tracer_kwargs: ``tracer_provider=`` / ``meter_provider=`` for :class:`CommTracer`.

    Attributes:
        comm_counts: ``{op packet: count}``; native functional ops are keyed by
            their legacy ``torch.ops.c10d_functional`` packet, as torch does.
        comm_module_counts: ``{fqn: {"forward": {packet: n}, "backward": {packet: n}}}``,
            counts including descendants, plus ``"Global"`` for everything.
    """

    def __init__(self, settings: Settings | None = None, **tracer_kwargs: Any) -> None:
        self._settings = settings
        self._tracer_kwargs = tracer_kwargs
        self._tracer: CommTracer | None = None
        self._legacy = _legacy_packets()
        self.comm_counts: dict[Any, int] = defaultdict(int)
        self.comm_module_counts: dict[str, dict[str, dict[Any, int]]] = {}
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._sharding: dict[str, Any] = {}

    @property
    def tracer(self) -> CommTracer | None:
        return self._tracer

    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self._parameters.clear()
        self._sharding.clear()
        self._module_counts(GLOBAL)
        self._tracer = CommTracer(self._settings, **self._tracer_kwargs)
        self._tracer.recorder.sinks.append(self._count)
        self._tracer.recorder.module_sinks.append(self._note_module)
        self._tracer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tracer is not None:
            self._tracer.stop()

    def _module_counts(self, fqn: str) -> dict[str, dict[Any, int]]:
        counts = self.comm_module_counts.get(fqn)
        if counts is None:
            counts = self.comm_module_counts[fqn] = {
                "forward": defaultdict(int), "backward": defaultdict(int)}
        return counts

    def _count(self, spec: CollectiveSpec, owner: Record | None, pass_: str) -> None:
        packet = getattr(getattr(torch.ops, spec.namespace), spec.packet_name)
        packet = self._legacy.get(packet, packet)
        self.comm_counts[packet] += 1
        key = "forward" if pass_ == semconv.PASS_FORWARD or pass_ == "none" else "backward"
        for fqn in (*_module_chain(owner), GLOBAL):
            self._module_counts(fqn)[key][packet] += 1

    def _note_module(self, module: torch.nn.Module, fqn: str) -> None:
        for name, param in module.named_parameters(recurse=False):
            self._parameters.setdefault(fqn, {})[name] = param.data
            if hasattr(param.data, "placements"):
                self._sharding[f"{fqn}.{name}"] = param.data.placements

    def get_total_counts(self) -> int:
        """Total collectives counted."""
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> dict[Any, int]:
        """``{op packet: count}``, as torch's ``CommDebugMode.get_comm_counts``."""
        return self.comm_counts

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """``{fqn: {param name: param.data}}`` for modules that ran in forward."""
        return self._parameters

    def get_sharding_info(self) -> dict[str, Any]:
        """``{"fqn.param": placements}`` for DTensor parameters."""
        return self._sharding

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"
