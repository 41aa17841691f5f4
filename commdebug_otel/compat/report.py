"""CommDebugMode's report model: one picture of a recording per module, one table and one JSON renderer.

torch's ``CommDebugMode`` reports a run as a tracing table
(``generate_comm_debug_tracing_table(noise_level)``) and a JSON tree
(``generate_json_dump``). Here both are rendered from a :class:`CommReport`,
whichever way it was filled:

* live, by :class:`commdebug_otel.compat.debug_mode.CommDebugMode` as modules, collectives and ops run;
* from OTLP-JSON files, by :func:`commdebug_otel.offline.summary.comm_report`
  (``commdebug-otel summarize``).

It also holds the rules both sides share: which ops a detail level (noise
level) lists (:func:`op_listed`), which arguments of an op are DTensors
(:func:`dtensor_inputs`), and the chain of modules a collective counts for
(:func:`module_chain`).

Usage::

    from commdebug_otel.compat.report import GLOBAL, CommReport, render_json, render_table

    report = CommReport()
    report.reset()                                       # lists Global (depth 0)
    report.add_module("Net", GLOBAL, depth=1, module_type="class 'pkg.Net'")
    report.count_collective("c10d_functional.all_reduce", "forward", ["Net"])
    print(render_table(report, noise_level=0, colour=False))
    tree = render_json(report, noise_level=1)

What it does not do: it records nothing by itself (the two builders feed it),
and it imports neither torch nor the OTel SDK, so the offline tools can use it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from commdebug_otel.detail import TRIVIAL_OPS, Detail, dtensor_inputs, op_listed
from commdebug_otel.semconv import PASS_BACKWARD, PASS_FORWARD, PASS_RECOMPUTE

__all__ = [
    "GLOBAL",
    "TRIVIAL_OPS",
    "CommReport",
    "ModuleInfo",
    "Operation",
    "dtensor_inputs",
    "module_chain",
    "op_listed",
    "render_json",
    "render_table",
]

GLOBAL = "Global"

_YELLOW, _RED, _RESET = "\033[1;33m", "\033[1;31m", "\033[0m"
# Report sections: (table title, collective-count pass key, JSON suffix of the operation list).
_SECTIONS = (("FORWARD PASS", PASS_FORWARD, "forward"),
             ("BACKWARD PASS", PASS_BACKWARD, "backward"),
             ("ACTIVATION CHECKPOINTING", PASS_RECOMPUTE, "checkpointing"))

_Node = TypeVar("_Node")


def module_chain(node: _Node | None, fqn_of: Callable[[_Node], str | None],
                 parent_of: Callable[[_Node], _Node | None]) -> list[str]:
    """The FQNs a collective on ``node`` counts for: its own, then its enclosing modules', innermost first.

    Args:
        node: where the collective ran (a live record, a span dict), or None.
        fqn_of: the node's module FQN; empty or None for a node that is not a
            module (a step), which ends the chain.
        parent_of: the node's enclosing node in forward terms (a backward
            record's is its forward call's parent), or None.

    ``"Global"`` is not in the chain: :meth:`CommReport.count_collective` adds it.
    """
    chain: list[str] = []
    while node is not None:
        fqn = fqn_of(node)
        if not fqn:
            break
        chain.append(fqn)
        node = parent_of(node)
    return chain


@dataclasses.dataclass
class ModuleInfo:
    """What the report says about one module, besides its counts and operations.

    ``depth``: 0 for ``Global``, 1 for a root module, one more per enclosing
    module (the table indents four spaces per level). ``module_type``:
    ``"class 'pkg.Class'"`` as torch writes it, ``""`` when unknown.
    ``parameters``: ``(name, placements text)`` of each direct DTensor
    parameter, e.g. ``("weight", "(Shard(dim=0),)")``.
    """

    depth: int
    module_type: str = ""
    parameters: list[tuple[str, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Operation:
    """One op in a module's operation list.

    ``input_shape`` / ``input_sharding``: each DTensor argument's shape and
    placements (live: ``torch.Size`` and placement tuples; from files: their
    text), empty for an op without DTensor arguments; ``device_mesh``: the last
    DTensor argument's mesh (or its text), None without one. ``is_bw``: ran
    inside autograd (backward or recompute); ``is_activation_checkpointing``:
    ran in activation-checkpoint recompute.
    """

    name: str
    input_shape: list[Any]
    input_sharding: list[Any]
    device_mesh: Any
    is_bw: bool
    is_activation_checkpointing: bool


class CommReport:
    """Per-module collective counts, module facts and operation lists of one recording (one rank).

    Args:
        recompute_apart: count activation-checkpoint recompute collectives
            under their own ``"recompute"`` key (the files' view) instead of
            as ``"backward"`` (torch's view: everything in autograd is
            backward; the live drop-in's, whose packet order must follow torch's).

    Attributes:
        modules: ``{fqn: ModuleInfo}`` in first-forward order, ``"Global"`` first.
        children: ``{fqn: [child fqn, ...]}``, the forward call tree, in call order.
        collectives: ``{fqn: {pass: {packet: count}}}`` in the order modules
            first counted one, ``"Global"`` first; passes ``"forward"`` and
            ``"backward"`` (and ``"recompute"`` when kept apart); counts include
            submodules and ``"Global"`` counts everything. Packets are whatever
            the builder keys by (torch op packets live, strings from files);
            reports print ``str(packet)``.
        operations: ``{fqn: [Operation, ...]}`` in the order they ran.
    """

    def __init__(self, recompute_apart: bool = False) -> None:
        self.recompute_apart = recompute_apart
        self._passes = (PASS_FORWARD, PASS_BACKWARD, PASS_RECOMPUTE) if recompute_apart \
            else (PASS_FORWARD, PASS_BACKWARD)
        self.modules: dict[str, ModuleInfo] = {}
        self.children: dict[str, list[str]] = {}
        self.collectives: dict[str, dict[str, dict[Any, int]]] = {}
        self.operations: dict[str, list[Operation]] = {}

    def reset(self) -> None:
        """Forget everything, then list ``"Global"`` (depth 0, no counts yet), as a recording starts.

        The containers are emptied in place: references to them stay valid.
        """
        self.modules.clear()
        self.children.clear()
        self.collectives.clear()
        self.operations.clear()
        self.modules[GLOBAL] = ModuleInfo(depth=0)
        self.counts_of(GLOBAL)

    def add_module(self, fqn: str, parent: str, depth: int, module_type: str = "",
                   parameters: Iterable[tuple[str, str]] = ()) -> None:
        """List ``fqn`` as a child of ``parent`` (see :class:`ModuleInfo` for the arguments).

        The first listing of an FQN keeps its facts and place in the order.
        """
        if fqn not in self.modules:
            self.modules[fqn] = ModuleInfo(depth, module_type, list(parameters))
        self.children.setdefault(parent, []).append(fqn)

    def counts_of(self, fqn: str) -> dict[str, dict[Any, int]]:
        """``{pass: {packet: count}}`` of ``fqn``, created empty on first use."""
        counts = self.collectives.get(fqn)
        if counts is None:
            counts = self.collectives[fqn] = {key: defaultdict(int) for key in self._passes}
        return counts

    def count_collective(self, packet: Any, pass_: str, chain: Iterable[str]) -> None:
        """Count one collective for every module in ``chain`` (see :func:`module_chain`) and ``"Global"``.

        Args:
            packet: the key to count under (e.g. ``"c10d_functional.all_reduce"``).
            pass_: the ``torch.module.pass`` it ran in: ``"backward"``,
                ``"recompute"`` (backward unless kept apart), anything else
                (``"forward"``, ``"none"`` for set-up) counts as forward, as
                CommDebugMode counts it.
        """
        if pass_ == PASS_RECOMPUTE:
            key = PASS_RECOMPUTE if self.recompute_apart else PASS_BACKWARD
        else:
            key = PASS_BACKWARD if pass_ == PASS_BACKWARD else PASS_FORWARD
        for fqn in (*chain, GLOBAL):
            self.counts_of(fqn)[key][packet] += 1

    def add_operation(self, fqn: str, operation: Operation) -> None:
        """Append ``operation`` to ``fqn``'s list (``"Global"`` for ops outside any module)."""
        ops = self.operations.get(fqn)
        if ops is None:
            ops = self.operations[fqn] = []
        ops.append(operation)


# ------------------------------------------------------------------ rendering


def _by_section(operations: list[Operation]) -> tuple[list[Operation], ...]:
    """(forward, backward, checkpointing) operations, as torch splits them."""
    return ([op for op in operations if not op.is_bw],
            [op for op in operations if op.is_bw and not op.is_activation_checkpointing],
            [op for op in operations if op.is_activation_checkpointing])


def _sections(report: CommReport, fqn: str, noise_level: int) -> list[tuple[str, dict, list[Operation], bool]]:
    """(title, collective counts, operations shown, any operation ran) per section of ``fqn``.

    torch's table heads a section when the module ran any operation in it
    (noise >= 1), even if none of them is shown at that noise level.
    """
    counts = report.collectives.get(fqn, {})
    operations = report.operations.get(fqn, []) if noise_level >= Detail.DTENSOR else []
    shown = _by_section([op for op in operations
                         if op_listed(noise_level, op.name, bool(op.input_shape))])
    ran = _by_section(operations)
    return [(title, counts.get(key, {}), shown[index], bool(ran[index]))
            for index, (title, key, _) in enumerate(_SECTIONS)]


def _mesh_text(mesh: Any) -> str:
    return "" if mesh is None else str(mesh)


def render_table(report: CommReport, noise_level: int = 3, *, colour: bool = True,
                 collective_modules_only: bool = False) -> str:
    """torch's tracing table (``generate_comm_debug_tracing_table``): one block per module, first-forward order.

    Args:
        report: what to render.
        noise_level: 0: collective counts per module (submodules included);
            1: + module type, DTensor parameter placements and DTensor ops
            other than trivial ones (with input shapes, placements and device
            mesh); 2: + all other non-trivial ops; 3: + trivial ops (see :func:`op_listed`).
        colour: torch's ANSI colours (yellow counts and op names, red op
            details); without them the text equals torch's log file.
        collective_modules_only: leave out modules that counted no collective
            (``summarize``'s table).

    Returns:
        The table, one ``\\n``-terminated line per row, ``""`` for an empty
        report; indentation is four spaces per module depth.
    """
    yellow, red, reset = (_YELLOW, _RED, _RESET) if colour else ("", "", "")
    module_data = noise_level >= Detail.DTENSOR
    lines: list[str] = []
    for fqn, info in report.modules.items():
        if collective_modules_only and not any(report.collectives.get(fqn, {}).values()):
            continue
        indent = "  " * (2 * info.depth)
        lines.append(f"{indent}{fqn}\n")
        if module_data:
            if info.module_type:
                lines.append(f"{indent}*module type: {info.module_type}\n")
            if info.parameters:
                lines.append(f"{indent}*Parameter List\n")
                lines.extend(f"{indent} *{name}: {placement}\n" for name, placement in info.parameters)
        collective_indent = indent + "    "
        operation_indent = indent + "      "
        for title, collectives, ops, ran in _sections(report, fqn, noise_level):
            if not collectives and not ran:
                continue
            lines.append(f"{indent}  {title}\n")
            lines.extend(f"{yellow}{collective_indent}*{collective}: {count}{reset}\n"
                         for collective, count in collectives.items())
            for op in ops:
                lines.append(f"{yellow}{collective_indent}**{op.name}{reset}\n")
                if op.input_shape:
                    lines.append(f"{red}{operation_indent}shape: {op.input_shape}{reset}\n")
                    lines.append(f"{red}{operation_indent}sharding: {op.input_sharding}{reset}\n")
                    lines.append(f"{red}{operation_indent}device mesh: {_mesh_text(op.device_mesh)}{reset}\n")
    return "".join(lines)


def _op_json(op: Operation) -> dict[str, Any]:
    return {
        "name": op.name,
        "input_shape": [str(shape) for shape in op.input_shape],
        "input_sharding": [str(placement) for placement in op.input_sharding],
        "device_mesh": _mesh_text(op.device_mesh),
        "is_bw": op.is_bw,
        "is_activation_checkpointing": op.is_activation_checkpointing,
    }


def _counts_json(counts: dict[Any, int], *more: dict[Any, int]) -> list[list[Any]]:
    """``[[str(packet), count]]``, adding the counts of ``more`` (recompute kept apart is backward here)."""
    merged = {str(packet): n for packet, n in counts.items()}
    for extra in more:
        for packet, n in extra.items():
            merged[str(packet)] = merged.get(str(packet), 0) + n
    return [[packet, n] for packet, n in merged.items()]


def render_json(report: CommReport, noise_level: int = 3) -> dict[str, Any]:
    """torch's ``generate_json_dump`` tree, as a dict (tuples as lists, as JSON has them).

    Each node: ``fqn``, ``module_type`` (``"class 'pkg.Class'"``, noise >= 1),
    ``parameters`` (``[name, placements]`` per DTensor parameter, noise >= 1),
    ``children`` (nodes, first-forward order), ``collectives_forward`` /
    ``collectives_backward`` (``[packet, count]``, submodules included;
    recompute counts as backward, as torch's JSON has no checkpointing counts),
    ``operations_forward`` / ``operations_backward`` / ``operations_checkpointing``
    (``name``, ``input_shape``, ``input_sharding`` (strings), ``device_mesh``,
    ``is_bw``, ``is_activation_checkpointing``), filtered as :func:`render_table` does.
    The root is ``"Global"``.
    """
    module_data = noise_level >= Detail.DTENSOR

    def node(fqn: str) -> dict[str, Any]:
        info = report.modules.get(fqn)
        out: dict[str, Any] = {
            "fqn": fqn,
            "module_type": info.module_type if module_data and info is not None else "",
            "parameters": [[name, placement] for name, placement in info.parameters]
            if module_data and info is not None else [],
            "children": [node(child) for child in report.children.get(fqn, [])],
        }
        counts = report.collectives.get(fqn, {})
        out["collectives_forward"] = _counts_json(counts.get(PASS_FORWARD, {}))
        out["collectives_backward"] = _counts_json(counts.get(PASS_BACKWARD, {}),
                                                   counts.get(PASS_RECOMPUTE, {}))
        for (_, _, ops, _), (_, _, suffix) in zip(_sections(report, fqn, noise_level), _SECTIONS, strict=True):
            out[f"operations_{suffix}"] = [_op_json(op) for op in ops]
        return out

    return node(GLOBAL)
