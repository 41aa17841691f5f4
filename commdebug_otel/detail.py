"""What becomes an op event, as CommDebugMode decides it: the detail levels and the rule that lists an op.

Read by the dispatch mode (``capture/mode.py``), the span records (``core/records.py``), the settings
(``config.py``: ``Detail`` is an option's type) and the report model (``compat/report.py``, which the
offline tools use too): no torch, no OpenTelemetry, no settings.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any


class Detail(enum.IntEnum):
    """What becomes a span event, mirroring CommDebugMode's ``noise_level`` 0-3."""

    COLLECTIVES = 0  # collectives only
    DTENSOR = 1  # + DTensor ops other than trivial ones
    OPS = 2  # + all non-trivial ops
    ALL = 3  # + trivial ops

    @property
    def label(self) -> str:
        return self.name.lower()


# CommDebugMode's trivial ops (torch/distributed/tensor/debug/_comm_mode.py), listed only at detail "all".
TRIVIAL_OPS = frozenset({
    "aten.detach.default", "aten.t.default", "aten.view.default",
    "aten._to_copy.default", "aten.as_strided.default", "aten.transpose.int",
})


def op_listed(detail: int, op_name: str, is_dtensor: bool) -> bool:
    """Whether an op is listed at ``detail``: the one detail -> ops rule.

    Args:
        detail: a :class:`~commdebug_otel.config.Detail`, or CommDebugMode's
            ``noise_level`` (the same integers): 0 lists no op (collectives
            are counted apart); 1 ops on DTensors except :data:`TRIVIAL_OPS`;
            2 every op except :data:`TRIVIAL_OPS`; 3 every op.
        op_name: the overload's name, ``str(func)``, e.g. ``"aten.mm.default"``.
        is_dtensor: the op ran on DTensors. The reports decide it as torch's
            do: an op with DTensor input shapes recorded.

    The dispatch mode's rule for op events and the reports' rule for
    operation lists alike.
    """
    if detail >= Detail.ALL:
        return True
    if detail < Detail.DTENSOR or (detail < Detail.OPS and not is_dtensor):
        return False
    return op_name not in TRIVIAL_OPS


def dtensor_inputs(args: Iterable[Any]) -> tuple[list[Any], list[Any], Any]:
    """The DTensor arguments of an op: ``(shapes, placements, device mesh)``.

    A DTensor is an argument with ``placements`` and ``device_mesh`` (duck
    typed, so torch is not imported); only top-level positional arguments are
    looked at, as torch's CommDebugMode does. ``shapes`` holds each one's
    ``.shape`` (``torch.Size``), ``placements`` its ``.placements`` tuple, in
    argument order; the mesh is the last one's, None when there is none.
    """
    shapes: list[Any] = []
    placements: list[Any] = []
    mesh = None
    for arg in args:
        if hasattr(arg, "placements") and hasattr(arg, "device_mesh"):
            shapes.append(arg.shape)
            placements.append(arg.placements)
            mesh = arg.device_mesh
    return shapes, placements, mesh
