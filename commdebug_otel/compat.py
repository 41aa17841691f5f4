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
import re
from collections import defaultdict
from typing import Any

import torch

from . import semconv
from .config import Detail, Settings
from .instrumentation import CommTracer
from .mode import TRIVIAL_OPS, op_event_wanted
from .observer import RecorderObserver
from .ops import CollectiveSpec
from .records import Record, descends_from

GLOBAL = "Global"

_ANSI_ESCAPE = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")
_YELLOW, _RED, _RESET = "\033[1;33m", "\033[1;31m", "\033[0m"
# Report sections: (table title, pass key of the operation lists and collective counts).
_SECTIONS = (("FORWARD PASS", "forward"), ("BACKWARD PASS", "backward"),
             ("ACTIVATION CHECKPOINTING", "checkpointing"))


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
        return op_event_wanted(self._detail, func, is_dtensor)


def _noise(noise_level: int) -> tuple[bool, bool, bool, bool]:
    """torch's noise levels: (DTensor ops, module data, all ops, trivial ops)."""
    return noise_level > 0, noise_level > 0, noise_level > 1, noise_level > 2


def _shown_ops(operations: list[dict], noise_level: int) -> list[dict]:
    """The operations a report lists at ``noise_level`` (torch's filters)."""
    dtensor_ops, _, all_ops, trivial_ops = _noise(noise_level)
    if not dtensor_ops:
        return []
    return [op for op in operations if trivial_ops or (
        op["name"] not in TRIVIAL_OPS and (all_ops or len(op["input_shape"])))]


def _by_section(operations: list[dict]) -> dict[str, list[dict]]:
    return {
        "forward": [op for op in operations if not op["is_bw"]],
        "backward": [op for op in operations if op["is_bw"] and not op["is_activation_checkpointing"]],
        "checkpointing": [op for op in operations if op["is_activation_checkpointing"]],
    }


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
            counts including descendants, plus ``"Global"`` for everything.

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
        self.comm_module_counts: dict[str, dict[str, dict[Any, int]]] = {}
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._sharding: dict[str, Any] = {}
        # Per module, in first-forward order: module type, depth (Global 0, root 1), DTensor
        # parameters' placements (strings); its forward children; its operations in order.
        self._modules: dict[str, dict[str, Any]] = {}
        self._children: dict[str, list[str]] = {}
        self._operations: dict[str, list[dict[str, Any]]] = {}
        self._last_bw: Record | None = None  # torch's backward "current module" (see _op_owner)
        self._in_hook = False  # our own hooks' ops (param.data detaches) are not the model's

    @property
    def tracer(self) -> CommTracer | None:
        return self._tracer

    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self._parameters.clear()
        self._sharding.clear()
        self._modules.clear()
        self._modules[GLOBAL] = {"depth": 0}
        self._children.clear()
        self._operations.clear()
        self._last_bw = None
        self._module_counts(GLOBAL)
        settings = self._settings if self._settings is not None else Settings.from_env()
        # The reports need every op (as torch records them); span events keep settings.detail.
        self._tracer = CommTracer(dataclasses.replace(settings, detail=Detail.ALL),
                                  observer=_DropInObserver(self, settings.detail), **self._tracer_kwargs)
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
        self._add_op(spec.overload_name, [], [], None, owner)

    def _note_module(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        self._in_hook = True
        try:
            self._note_module_facts(module, fqn, callers)
        finally:
            self._in_hook = False

    def _note_module_facts(self, module: torch.nn.Module, fqn: str, callers: tuple[Record, ...]) -> None:
        for name, param in module.named_parameters(recurse=False):
            self._parameters.setdefault(fqn, {})[name] = param.data
            if hasattr(param.data, "placements"):
                self._sharding[f"{fqn}.{name}"] = param.data.placements
        if torch._C._current_graph_task_id() != -1 or self._tracer is None:
            return  # first seen in activation-checkpoint recompute: torch does not list it
        parent = callers[-1].fqn if callers else GLOBAL
        info: dict[str, Any] = {
            "module_type": str(type(module)).replace("<", "").replace(">", ""),
            "depth": len(callers) + 1,
        }
        placements = {name: str(param.data.placements)
                      for name, param in module.named_parameters(recurse=False)
                      if hasattr(param.data, "placements")}
        if placements:
            info["parameters"] = placements
        self._modules.setdefault(fqn, info)
        self._children.setdefault(parent, []).append(fqn)

    def _note_op(self, func: Any, args: tuple, is_dtensor: bool, owner: Record | None) -> None:
        if self._in_hook:
            return
        shapes: list[Any] = []
        placements: list[Any] = []
        mesh = None
        if is_dtensor:
            for arg in args:
                if hasattr(arg, "placements") and hasattr(arg, "device_mesh"):
                    shapes.append(arg.shape)
                    placements.append(arg.placements)
                    mesh = arg.device_mesh
        self._add_op(str(func), shapes, placements, mesh, owner)

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
        task = torch._C._current_graph_task_id()
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
        fqn = owner.fqn if owner is not None and owner.fqn else GLOBAL
        ops = self._operations.get(fqn)
        if ops is None:
            ops = self._operations[fqn] = []
        ops.append({
            "name": name,
            "input_shape": shapes,
            "input_sharding": placements,
            "device_mesh": mesh,  # made a string when reported
            "is_bw": torch._C._current_graph_task_id() != -1,
            "is_activation_checkpointing": owner is not None
            and owner.pass_ == semconv.PASS_RECOMPUTE,
        })

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
    def _sections(self, fqn: str, noise_level: int) -> list[tuple[str, dict[Any, int], list[dict], bool]]:
        """(title, collective counts, operations shown, any operation) per section.

        torch's table heads a section when the module ran any operation in it
        (noise >= 1), even if none of them is shown at that noise level.
        """
        counts = self.comm_module_counts.get(fqn, {})
        operations = self._operations.get(fqn, []) if _noise(noise_level)[0] else []
        shown = _by_section(_shown_ops(operations, noise_level))
        ran = _by_section(operations)
        return [(title, counts.get(key, {}) if key != "checkpointing" else {}, shown[key],
                 bool(ran[key])) for title, key in _SECTIONS]

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
        _, module_data, _, _ = _noise(noise_level)
        lines: list[str] = []
        for fqn, info in self._modules.items():
            indent = "  " * (2 * info["depth"])
            lines.append(f"{indent}{fqn}\n")
            if module_data:
                if "module_type" in info:
                    lines.append(f"{indent}*module type: {info['module_type']}\n")
                if "parameters" in info:
                    lines.append(f"{indent}*Parameter List\n")
                    lines.extend(f"{indent} *{name}: {placement}\n"
                                 for name, placement in info["parameters"].items())
            collective_indent = indent + "    "
            operation_indent = indent + "      "
            for title, collectives, ops, ran in self._sections(fqn, noise_level):
                if not collectives and not ran:
                    continue
                lines.append(f"{indent}  {title}\n")
                lines.extend(f"{_YELLOW}{collective_indent}*{collective}: {count}{_RESET}\n"
                             for collective, count in collectives.items())
                for op in ops:
                    lines.append(f"{_YELLOW}{collective_indent}**{op['name']}{_RESET}\n")
                    if op["input_shape"]:
                        lines.append(f"{_RED}{operation_indent}shape: {op['input_shape']}{_RESET}\n")
                        lines.append(
                            f"{_RED}{operation_indent}sharding: {op['input_sharding']}{_RESET}\n")
                        lines.append(f"{_RED}{operation_indent}device mesh: "
                                     f"{_mesh_text(op['device_mesh'])}{_RESET}\n")
        return "".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` to ``file_name`` without ANSI colours."""
        table = _ANSI_ESCAPE.sub("", self.generate_comm_debug_tracing_table(noise_level))
        with open(file_name, "w") as log_file:
            log_file.write(table)

    def comm_debug_json(self, noise_level: int = 3) -> dict[str, Any]:
        """The tree :meth:`generate_json_dump` writes, as a dict (tuples as lists, as JSON has them).

        Each node: ``fqn``, ``module_type`` (``"class 'pkg.Class'"``, noise >= 1),
        ``parameters`` (``[name, placements]`` per DTensor parameter, noise >= 1),
        ``children`` (nodes, first-forward order), ``collectives_forward`` /
        ``collectives_backward`` (``[packet, count]``, submodules included),
        ``operations_forward`` / ``operations_backward`` / ``operations_checkpointing``
        (``name``, ``input_shape``, ``input_sharding`` (strings), ``device_mesh``,
        ``is_bw``, ``is_activation_checkpointing``).
        """
        _, module_data, _, _ = _noise(noise_level)

        def node(fqn: str) -> dict[str, Any]:
            info = self._modules.get(fqn, {})
            out: dict[str, Any] = {
                "fqn": fqn,
                "module_type": info.get("module_type", "") if module_data else "",
                "parameters": [[name, placement] for name, placement
                               in info.get("parameters", {}).items()] if module_data else [],
                "children": [],
            }
            sections = self._sections(fqn, noise_level)
            for (_, collectives, _, _), key in zip(sections[:2], ("forward", "backward")):
                out[f"collectives_{key}"] = [[str(c), n] for c, n in collectives.items()]
            for (_, _, ops, _), key in zip(sections, ("forward", "backward", "checkpointing")):
                out[f"operations_{key}"] = [_op_json(op) for op in ops]
            out["children"] = [node(child) for child in self._children.get(fqn, [])]
            return out

        return node(GLOBAL)

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Write :meth:`comm_debug_json` to ``file_name`` (torch's browser-visual JSON, indent 4)."""
        with open(file_name, "w") as json_file:
            json.dump(self.comm_debug_json(noise_level), json_file, indent=4)

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"


def _mesh_text(mesh: Any) -> str:
    return "" if mesh is None else str(mesh)


def _op_json(op: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": op["name"],
        "input_shape": [str(shape) for shape in op["input_shape"]],
        "input_sharding": [str(placement) for placement in op["input_sharding"]],
        "device_mesh": _mesh_text(op["device_mesh"]),
        "is_bw": op["is_bw"],
        "is_activation_checkpointing": op["is_activation_checkpointing"],
    }
