"""``CommDebugMode``: torch's counting API, plus the spans, events and metrics of :class:`CommTracer`.

Same constructor and counting results as
``torch.distributed.tensor.debug.CommDebugMode`` on the same workload
(``get_comm_counts``, ``get_total_counts``, ``comm_module_counts``,
``get_parameter_info``, ``get_sharding_info``) and the same reports
(``generate_comm_debug_tracing_table``, ``generate_json_dump``,
``log_comm_debug_tracing_table_to_file``), built live from the recorder's own
data, with these differences (docs/comparison.md):

* a module that runs several times in one forward is counted correctly
  (torch 2.13's raises ``IndexError``);
* send/recv, barrier and the coalesced and in-place variants are counted too;
* FSDP2's post-backward reduce-scatter is booked to the FSDP unit, not to the
  block's first leaf;
* the FQNs here are torch's (``FSDPNet.blocks.0`` under ``fully_shard``), while
  the spans and metrics name the user's class (``Net.blocks.0``);
* at noise level 3 torch's lists also hold its own tracker's ops (the
  ``aten.detach.default`` of reading ``param.data`` in its pre-hook, the
  ``aten.view.default`` of its global full backward hooks); ours do not;
* at noise levels 2-3 the order of ops within one module's backward list can
  differ: torch's backward hooks add nodes to the autograd graph, which
  changes the order in which the engine runs independent nodes;
* at noise levels >= 1 torch heads an empty ``FORWARD PASS`` for a container
  (``nn.Sequential``) where only its tracker's own ops ran; ours does not;
* operations are listed under torch's backward owner (see ``_op_owner``), but
  ops outside forward and backward go to ``Global``, as our collectives do.

The dispatch mode always reports every op here (the reports need them, as
torch records them all); span events still follow ``settings.detail``.

It does not subclass torch's class or reuse its module tracker.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any

import torch

from commdebug_otel import semconv
from commdebug_otel.capture._torch import graph_task_id, in_backward
from commdebug_otel.capture.ops import CollectiveSpec
from commdebug_otel.capture.sinks import RecorderObserver
from commdebug_otel.compat.report import (
    GLOBAL,
    CommReport,
    Operation,
    dtensor_inputs,
    module_chain,
    op_listed,
    render_json,
    render_table,
)
from commdebug_otel.config import Detail, Settings
from commdebug_otel.core.records import Record, descends_from
from commdebug_otel.tracer import CommTracer, exporting_tracer


def _legacy_packets() -> dict[Any, Any]:
    """torch keys native functional collectives by their legacy packet (NATIVE_TO_PY_MAPPING).

    Built from names, so that torch.distributed.tensor.debug (which imports numpy) is not imported.
    """
    mapping = {}
    for namespace, names in semconv.LEGACY_FUNCTIONAL_PACKETS.items():
        for name in names:
            try:
                mapping[getattr(getattr(torch.ops, namespace), name)] = getattr(
                    torch.ops.c10d_functional, name)
            except (AttributeError, RuntimeError):  # an op this torch does not have
                continue
    return mapping


# id(OpOverload) -> (it, str(it)): asked twice per op; OpOverload's __str__ and __hash__ run in Python.
_OP_NAMES: dict[int, tuple[Any, str]] = {}


def _record_parent(record: Record) -> Record | None:
    """The record around ``record`` in forward terms: a backward record's is its forward call's parent."""
    if record.pass_ == semconv.PASS_BACKWARD:
        return record.fwd.parent if record.fwd is not None else None
    return record.parent


class _DropInObserver(RecorderObserver):
    """Feeds a :class:`CommDebugMode` every collective, first module call and op; span events keep ``detail``."""

    wants_every_event = True  # torch's counts cover every step, traced or not

    def __init__(self, mode: CommDebugMode, detail: Detail) -> None:
        self._mode, self._detail = mode, detail

    def on_collective(self, spec: CollectiveSpec, owner: Record | None, pass_: str) -> None:
        self._mode._count(spec, owner, pass_)

    def on_first_call(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        self._mode._note_module(module, fqn, callers)

    def on_op(self, func: Any, args: tuple, is_dtensor: bool, owner: Record | None) -> None:
        self._mode._note_op(func, args, is_dtensor, owner)

    def op_event_wanted(self, func: Any, is_dtensor: bool) -> bool:
        return op_listed(self._detail, self._mode._op_name(func), is_dtensor)


class CommDebugMode:
    """Drop-in for torch's ``CommDebugMode`` that also streams OpenTelemetry.

    Args:
        settings: optional :class:`Settings` (default: ``Settings.from_env()``).
            ``settings.detail`` chooses which ops become span events; the
            reports' operation lists (noise levels 1-3) hold every op whatever
            the detail, so the dispatch mode sees every op (as torch's does):
            the tracer's own settings say ``Detail.ALL``.
        **tracer_kwargs: ``tracer_provider=`` / ``meter_provider=`` for :class:`CommTracer`.

    Attributes:
        comm_counts: ``{op packet: count}``; native functional ops are keyed by
            their legacy ``torch.ops.c10d_functional`` packet, as torch does.
        comm_module_counts: ``{fqn: {"forward": {packet: n}, "backward": {packet: n}}}``,
            counts including descendants, plus ``"Global"`` for everything
            (the :attr:`report`'s ``collectives``).
        report: the :class:`~commdebug_otel.compat.report.CommReport` behind the
            reports; ``commdebug-otel summarize`` renders the same model from files.

    Example::

        comm_mode = CommDebugMode()
        with comm_mode:
            model(tokens).sum().backward()
        print(comm_mode.generate_comm_debug_tracing_table(noise_level=1))

    Known limits: a module is listed once, under the module that called it
    first (torch lists it again under each caller, and raises ``IndexError``
    when one forward calls it twice); modules are only seen in traced steps
    (``OTEL_PYTHON_COMMDEBUG_TRACE_EVERY`` / ``_RANKS``).
    """

    def __init__(self, settings: Settings | None = None, **tracer_kwargs: Any) -> None:
        self._settings = settings
        self._tracer_kwargs = tracer_kwargs
        self._tracer: CommTracer | None = None
        self._legacy = _legacy_packets()
        self.comm_counts: dict[Any, int] = defaultdict(int)
        # The reports' model; recompute counts as backward, in torch's packet order.
        self._report = CommReport()
        self.comm_module_counts: dict[str, dict[str, dict[Any, int]]] = self._report.collectives
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._sharding: dict[str, Any] = {}
        self._last_bw: Record | None = None  # torch's backward "current module" (see _op_owner)
        self._in_hook = False  # our own hooks' ops (param.data detaches) are not the model's

    @property
    def tracer(self) -> CommTracer | None:
        return self._tracer

    @property
    def report(self) -> CommReport:
        """The :class:`~commdebug_otel.compat.report.CommReport` the reports are rendered from.

        Modules in first-forward order, collective counts, operation lists;
        filled while the mode is entered, emptied on the next ``__enter__``.
        """
        return self._report

    @property
    def _modules(self) -> dict[str, Any]:
        # demo.py orders its rows by this until it reads report.modules (same keys, same order).
        return self._report.modules

    def _reset(self) -> None:
        """Forget the last recording (containers emptied in place: references stay valid)."""
        self.comm_counts.clear()
        self._report.reset()
        self._parameters.clear()
        self._sharding.clear()
        self._last_bw = None

    def __enter__(self) -> CommDebugMode:
        self._reset()
        settings = self._settings if self._settings is not None else Settings.from_env()
        # The reports need every op (as torch records them); span events keep settings.detail.
        # Inside a running tracer this one only counts: the running one exports, once.
        exports = exporting_tracer() is None
        self._tracer = CommTracer(dataclasses.replace(settings, detail=Detail.ALL),
                                  observer=_DropInObserver(self, settings.detail), exports=exports,
                                  **(self._tracer_kwargs if exports else {}))
        self._tracer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tracer is not None:
            self._tracer.stop()

    def _count(self, spec: CollectiveSpec, owner: Record | None, pass_: str) -> None:
        packet = getattr(getattr(torch.ops, spec.namespace), spec.packet_name)
        packet = self._legacy.get(packet, packet)
        self.comm_counts[packet] += 1
        self._report.count_collective(packet, pass_, module_chain(owner, self._record_fqn, _record_parent))
        self._add_op(spec.overload_name, [], [], None, owner)

    def _record_fqn(self, record: Record) -> str:
        """The record's FQN as torch's ModTracker writes it (the drop-in's keys are torch's)."""
        return self._tracer.torch_fqn(record.fqn) if self._tracer is not None else record.fqn

    def _note_module(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        self._in_hook = True
        try:
            self._note_module_facts(module, fqn, callers)
        finally:
            self._in_hook = False

    def _note_module_facts(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        if self._tracer is not None:
            fqn = self._tracer.torch_fqn(fqn)
        for name, param in module.named_parameters(recurse=False):
            self._parameters.setdefault(fqn, {})[name] = param.data
            if hasattr(param.data, "placements"):
                self._sharding[f"{fqn}.{name}"] = param.data.placements
        if in_backward() or self._tracer is None:
            return  # first seen in activation-checkpoint recompute: torch does not list it
        parent = self._record_fqn(callers[-1]) if callers else GLOBAL
        self._report.add_module(
            fqn, parent, depth=len(callers) + 1,
            module_type=str(type(module)).replace("<", "").replace(">", ""),  # "class 'pkg.Class'"
            parameters=[(name, str(param.data.placements))
                        for name, param in module.named_parameters(recurse=False)
                        if hasattr(param.data, "placements")])

    @staticmethod
    def _op_name(func: Any) -> str:
        """``str(func)``, kept per op for every drop-in (an overload lives as long as the process; each is held)."""
        known = _OP_NAMES.get(id(func))
        if known is None:
            known = _OP_NAMES[id(func)] = (func, str(func))
        return known[1]

    def _note_op(self, func: Any, args: tuple, is_dtensor: bool, owner: Record | None) -> None:
        if self._in_hook:
            return
        if is_dtensor:
            self._add_op(self._op_name(func), *dtensor_inputs(args), owner)
        else:
            self._add_op(self._op_name(func), [], [], None, owner)

    def _op_owner(self, owner: Record | None) -> Record | None:
        """The record an op is listed under: torch's rule, which differs from ours in backward.

        torch's current module in backward is the module whose backward began
        last, even after that backward ended (then the caller owns the ops, in
        our spans: e.g. the attention math between ``wo`` and ``wq``). So a
        backward record takes over only if its backward began after the last
        one's: after it ended, or before that but not as its ancestor (an
        ancestor's hook on a shared output fires after the child's, yet torch's
        fires first).
        """
        task = graph_task_id()
        last = self._last_bw
        if task == -1 or owner is None or owner.pass_ == semconv.PASS_RECOMPUTE:
            return owner
        if last is not None and last.graph_task != task:
            last = self._last_bw = None
        if owner.pass_ == semconv.PASS_BACKWARD and owner is not last and (
                last is None or (last.end_ns and owner.start_ns >= last.end_ns)
                or (owner.start_ns >= last.start_ns and not descends_from(last, owner.fwd))):
            last = self._last_bw = owner
        return last if last is not None else owner

    def _add_op(self, name: str, shapes: list, placements: list, mesh: Any,
                owner: Record | None) -> None:
        owner = self._op_owner(owner)
        fqn = self._record_fqn(owner) if owner is not None and owner.fqn else GLOBAL
        self._report.add_operation(fqn, Operation(
            name, shapes, placements, mesh,  # the mesh is made a string when reported
            is_bw=in_backward(),
            is_activation_checkpointing=owner is not None and owner.pass_ == semconv.PASS_RECOMPUTE))

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

    # ------------------------------------------------------------- reports
    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """torch's tracing table, ANSI colours included: one block per module, first-forward order.

        Args:
            noise_level: 0: collective counts per module (submodules included);
                1: + module type, DTensor parameter placements and DTensor ops
                other than trivial ones (with input shapes, placements and
                device mesh); 2: + all other non-trivial ops (collectives
                included); 3: + trivial ops (``aten.view.default``, ...).

        Returns:
            The table, one ``\\n``-terminated line per row; indentation is
            four spaces per module depth (``Global`` 0, the root module 1).
        """
        return render_table(self._report, noise_level)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` to ``file_name`` without ANSI colours."""
        with open(file_name, "w") as log_file:
            log_file.write(render_table(self._report, noise_level, colour=False))

    def comm_debug_json(self, noise_level: int = 3) -> dict[str, Any]:
        """The tree :meth:`generate_json_dump` writes, as a dict (:func:`commdebug_otel.compat.report.render_json`)."""
        return render_json(self._report, noise_level)

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Write :meth:`comm_debug_json` to ``file_name`` (torch's browser-visual JSON, indent 4)."""
        with open(file_name, "w") as json_file:
            json.dump(self.comm_debug_json(noise_level), json_file, indent=4)

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

