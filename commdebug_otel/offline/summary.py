"""``commdebug-otel summarize``: offline views of OTLP-JSON trace files.

Reads the files that the embedded default writes (``traces-rank*.jsonl``) or
that an OpenTelemetry Collector's ``file`` exporter writes (one
``ExportTraceServiceRequest`` JSON object per line), from any mix of files and
folders, and answers four questions without torch or a live job:

* which module issued which collectives (torch ``CommDebugMode``'s per-module
  counts, from span parents alone);
* did every rank issue the same collectives, with how many bytes;
* which rank reaches collectives last (lateness), and which (rank, module, pass) holds the others back
  beyond the job's noise (stragglers: :mod:`.stragglers`, the answer ``diagnose`` gives);
* how long pipeline stages wait for their peers (send/recv pairs, apart from stragglers);
* which collectives move the most bytes.

Usage::

    from commdebug_otel.offline import summary

    spans = summary.load_spans(["commdebug-otel-out/demo-20260101-120000"])
    counts = summary.module_counts(spans, rank=0)
    # {"Global": {"forward": {"c10d.scatter_": 16, ...}, "backward": {...}}, ...}
    print(summary.format_report(spans, rank=0))

or ``commdebug-otel summarize PATH... [--rank N] [--step N] [--top N] [--format text|json|report-json]``.

What it does not do: it sees only traced steps (``OTEL_PYTHON_COMMDEBUG_TRACE_EVERY``)
and traced ranks, and events beyond the per-span cap are counted on the span
(``commdebug.span.dropped_events``), not listed, so they are missing here too
(the report says so). Metrics files are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.compat.report import GLOBAL, CommReport, Operation, render_json, render_table
from commdebug_otel.offline import EXIT_DONE, EXIT_NOT_THERE, EXIT_UNREADABLE
from commdebug_otel.offline.load import load_for_command, load_spans, ranked_spans
from commdebug_otel.offline.model import P2P as _P2P
from commdebug_otel.offline.model import (
    CollectiveEvent,
    SpanIndex,
    arrival_matches,
    collective_events,
    index_of,
    is_snapshot,
    own_step,
    process_of,
    reusing,
    warmup_step,
    warmup_steps,
)
from commdebug_otel.offline.otlp_json import trace_files
from commdebug_otel.offline.rank_read import ALL, RankRead, rank_reads
from commdebug_otel.offline.stragglers import ALPHA, NOISE_FLOOR_S, find, format_lines

__all__ = [
    "GLOBAL",
    "add_arguments",
    "collective_events",
    "columns",
    "comm_debug_json",
    "comm_report",
    "format_report",
    "format_table",
    "human_bytes",
    "is_snapshot",
    "lateness",
    "load_spans",
    "module_counts",
    "module_pass_counts",
    "packet_name",
    "pipeline_waits",
    "rank_totals",
    "ranked_spans",
    "report_dict",
    "run",
    "span_warnings",
    "step_spans",
    "steps_present",
    "straggler_answer",
    "top_collectives",
    "trace_files",
]

_FORWARD, _BACKWARD, _RECOMPUTE = semconv.PASS_FORWARD, semconv.PASS_BACKWARD, semconv.PASS_RECOMPUTE
_LEGACY_FUNCTIONAL = semconv.LEGACY_FUNCTIONAL_PACKETS


def packet_name(op_name: str) -> str:
    """CommDebugMode's key for an op: the overload packet, native functional mapped to legacy.

    >>> packet_name("_c10d_functional.all_reduce.default")
    'c10d_functional.all_reduce'
    >>> packet_name("c10d._allgather_base_.default")
    'c10d._allgather_base_'
    """
    parts = op_name.split(".")
    if len(parts) >= 3:
        parts = parts[:2]
    if len(parts) == 2 and parts[1] in _LEGACY_FUNCTIONAL.get(parts[0], ()):
        return f"c10d_functional.{parts[1]}"
    return ".".join(parts)


def _ranks(spans: list[dict]) -> list[int]:
    return sorted({span["rank"] for span in spans})


def _fqn(span: dict) -> str | None:
    return span["attributes"].get(semconv.MODULE_FQN)


def steps_present(spans: list[dict]) -> list[int]:
    """The ``torch.step`` values of the ``train_step`` spans in ``spans``, ascending."""
    return sorted({step for step in map(own_step, spans) if step is not None})


def step_spans(spans: list[dict], step: int) -> list[dict]:
    """The spans of training step ``step`` on every rank: its ``train_step`` span(s) and their descendants.

    A step exported in parts (``commdebug.step.part``) has several ``train_step``
    spans with the same ``torch.step``: all are kept. ``outside_step`` spans and
    inference roots belong to no step. Order is kept; ``[]`` when no rank has that step.
    """
    index = index_of(spans)
    return [span for span in spans if index.step(span) == step]


# -------------------------------------------------------------- module counts


def _event_pass(event: CollectiveEvent) -> str:
    """The ``torch.module.pass`` of a collective: the event's own, else its span's (forward if neither)."""
    return event.pass_ or event.span["attributes"].get(semconv.MODULE_PASS, _FORWARD)


def _count_collectives(report: CommReport, spans: list[dict], rank: int, index: SpanIndex) -> None:
    """Count ``rank``'s collectives into ``report`` for their span's module and its enclosing module spans.

    As ``report.count_collective(packet, pass, module_chain(span))`` for each event, with the same
    counts and the same order of modules and packets, but in time linear in the spans: counts are
    summed up the tree once instead of walking each event's chain (a chain 20,000 modules deep).
    """
    first: dict[int, dict[tuple[str, str], list[int]]] = defaultdict(dict)  # id(span) -> (key, packet) -> [n, order]
    seen: set[int] = set()
    for order, event in enumerate(collective_events(spans, rank)):
        packet = packet_name(event.overload)
        pass_ = _event_pass(event)
        span = event.span
        node: dict | None = span
        while node is not None and id(node) not in seen and (fqn := _fqn(node)):  # as the chains meet them
            seen.add(id(node))
            report.counts_of(fqn)
            node = index.parent(node)
        report.count_collective(packet, pass_, ())  # "Global"
        if _fqn(span):
            key = _pass_key(report, pass_)
            first[id(span)].setdefault((key, packet), [0, order])[0] += 1
    # Children before parents: a module span's counts are its own and those of its module children.
    spans_down = list(index.roots)
    for span in spans_down:
        spans_down.extend(index.children(span))
    by_fqn: dict[str, dict[tuple[str, str], list[int]]] = defaultdict(dict)
    for span in reversed(spans_down):
        fqn = _fqn(span)
        if not fqn or id(span) not in first:
            continue
        counts = first.pop(id(span))
        for (key, packet), (n, order) in counts.items():
            total = by_fqn[fqn].setdefault((key, packet), [0, order])
            total[0] += n
            total[1] = min(total[1], order)
        parent = index.parent(span)
        if parent is not None and _fqn(parent):
            into = first[id(parent)]
            for item, (n, order) in counts.items():
                total = into.setdefault(item, [0, order])
                total[0] += n
                total[1] = min(total[1], order)
    for fqn, counts in by_fqn.items():
        table = report.counts_of(fqn)
        for (key, packet), (n, _) in sorted(counts.items(), key=lambda item: item[1][1]):
            table[key][packet] += n


def _pass_key(report: CommReport, pass_: str) -> str:
    """The pass a collective of ``pass_`` counts under, as :meth:`CommReport.count_collective` files it."""
    if pass_ == _RECOMPUTE:
        return _RECOMPUTE if report.recompute_apart else _BACKWARD
    return _BACKWARD if pass_ == _BACKWARD else _FORWARD


def _plain(counts: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, dict[str, int]]]:
    return {fqn: {key: dict(packets) for key, packets in by_pass.items()} for fqn, by_pass in counts.items()}


def module_pass_counts(spans: list[dict], rank: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    """Per-module collective counts on ``rank``, with recompute apart.

    Returns:
        ``{fqn: {"forward": {packet: n}, "backward": {packet: n}, "recompute": {packet: n}}}``;
        a collective on a module span counts for that module and every ancestor
        module span, and always for ``"Global"``; ones on ``train_step`` /
        ``outside_step`` count for ``"Global"`` only. Set-up collectives (pass
        ``none``) count as forward, as CommDebugMode does. Keys are in the order
        modules first issued a collective (``"Global"`` first).
    """
    report = CommReport(recompute_apart=True)
    report.reset()
    _count_collectives(report, spans, rank, SpanIndex([span for span in spans if span["rank"] == rank]))
    return _plain(report.collectives)


def module_counts(spans: list[dict], rank: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    """``CommDebugMode.comm_module_counts`` for ``rank``, from spans alone, with string keys.

    ``{fqn: {"forward": {packet: n}, "backward": {packet: n}}}``; recompute
    (activation checkpointing) counts as backward, as torch counts everything
    that runs during autograd. Packets are torch's, e.g.
    ``"c10d_functional.all_reduce"`` (see :func:`packet_name`).
    """
    out = {}
    for fqn, by_pass in module_pass_counts(spans, rank).items():
        backward = dict(by_pass[_BACKWARD])
        for packet, n in by_pass[_RECOMPUTE].items():
            backward[packet] = backward.get(packet, 0) + n
        out[fqn] = {_FORWARD: dict(by_pass[_FORWARD]), _BACKWARD: backward}
    return out


def _module_order(spans: list[dict], index: SpanIndex) -> tuple[list[str], dict[str, int], dict[str, str]]:
    """FQNs in first-forward order, their call depth (Global = 0, root module = 1), their forward parent.

    ``spans``: one rank's.
    """
    order: dict[str, int] = {GLOBAL: 0}
    parents: dict[str, str] = {}
    module_spans = sorted((span for span in spans if _fqn(span)),
                          key=lambda span: (span["attributes"].get(semconv.MODULE_PASS) != _FORWARD,
                                            span["start_ns"]))
    for span in module_spans:  # forward spans first: a parent comes before its children
        fqn = _fqn(span) or ""  # (never empty: module_spans have one)
        if span["attributes"].get(semconv.MODULE_PASS) == _FORWARD and fqn not in parents:
            parent = index.parent(span)
            parents[fqn] = (_fqn(parent) if parent is not None else None) or GLOBAL
        if fqn not in order:  # depth in the call tree, as torch's ModTracker counts it
            order[fqn] = order.get(parents.get(fqn, GLOBAL), 0) + 1
    return list(order), order, parents


def comm_report(spans: list[dict], rank: int = 0) -> CommReport:
    """CommDebugMode's report model (:class:`commdebug_otel.compat.report.CommReport`) for ``rank``, from spans alone.

    Modules in first-forward order with their call depth, forward parent,
    type and DTensor parameters (span attributes); collective counts with
    recompute apart; each module span's op events (detail ``dtensor`` and
    above) as its operations, those of ``train_step`` / ``outside_step``
    under ``"Global"``. A module called several times is listed once.
    """
    rank_spans = [span for span in spans if span["rank"] == rank]
    index = SpanIndex(rank_spans)
    report = CommReport(recompute_apart=True)
    report.reset()
    _count_collectives(report, rank_spans, rank, index)
    module_type: dict[str, str] = {}
    parameters: dict[str, list[tuple[str, str]]] = {}
    for span in rank_spans:
        fqn = _fqn(span) or GLOBAL
        attrs = span["attributes"]
        if semconv.MODULE_TYPE in attrs:
            module_type.setdefault(fqn, f"class '{attrs[semconv.MODULE_TYPE]}'")  # as torch writes it
        if semconv.MODULE_PARAMETERS in attrs and fqn not in parameters:
            parameters[fqn] = [p for p in map(_parameter_placement, attrs[semconv.MODULE_PARAMETERS]) if p]
        for event in span["events"]:
            if semconv.COLLECTIVE_OP not in event["attributes"]:
                report.add_operation(fqn, _operation(event, attrs.get(semconv.MODULE_PASS)))
    fqns, depth, parents = _module_order(rank_spans, index)
    for fqn in fqns[1:]:
        report.add_module(fqn, parents.get(fqn, GLOBAL), depth[fqn], module_type.get(fqn, ""),
                          parameters.get(fqn, ()))
    return report


def format_table(spans: list[dict], rank: int = 0) -> str:
    """CommDebugMode's tracing table (``generate_comm_debug_tracing_table(0)``) for ``rank``.

    Same layout and counts (including submodules), without colours or a final
    newline, listing only modules that issued collectives, and with recompute
    collectives under ``ACTIVATION CHECKPOINTING`` instead of inside ``BACKWARD PASS``.
    """
    table = render_table(comm_report(spans, rank), noise_level=0, colour=False,
                         collective_modules_only=True)
    return table.removesuffix("\n")


def comm_debug_json(spans: list[dict], rank: int = 0) -> dict[str, Any]:
    """CommDebugMode's ``generate_json_dump`` tree for ``rank``, as a dict.

    As :func:`commdebug_otel.compat.report.render_json` at noise level 3 (the files
    hold the ops their detail level let through): ``fqn``, ``module_type``,
    ``parameters`` (``[name, placements]`` for DTensor parameters),
    ``children`` (nodes, in forward order; a module called several times is
    listed once, unlike torch), ``collectives_forward`` /
    ``collectives_backward`` (``[packet, count]``, including submodules;
    recompute counts as backward), ``operations_forward`` /
    ``operations_backward`` / ``operations_checkpointing`` (op events of that
    module only, present at detail ``dtensor`` and above: ``name``,
    ``input_shape``, ``input_sharding``, ``device_mesh``, ``is_bw``,
    ``is_activation_checkpointing``).
    """
    return render_json(comm_report(spans, rank), noise_level=3)


def _parameter_placement(text: str) -> tuple[str, str] | None:
    """``"weight [64, 64] (Shard(dim=0),)"`` -> ``("weight", "(Shard(dim=0),)")``; None if not a DTensor."""
    name, _, rest = text.partition(" ")
    _, _, placements = rest.partition("] ")
    return (name, placements) if placements else None


def _operation(event: dict, span_pass: str | None) -> Operation:
    attrs = event["attributes"]
    pass_ = attrs.get(semconv.MODULE_PASS, span_pass)
    return Operation(
        name=attrs.get(semconv.OP_NAME, event["name"]),
        input_shape=list(attrs.get(semconv.DTENSOR_INPUT_SHAPES, [])),
        input_sharding=list(attrs.get(semconv.DTENSOR_INPUT_PLACEMENTS, [])),
        device_mesh=attrs.get(semconv.DEVICE_MESH),
        is_bw=pass_ in (_BACKWARD, _RECOMPUTE),
        is_activation_checkpointing=pass_ == _RECOMPUTE,
    )


# ---------------------------------------------------------------- across ranks


def rank_totals(spans: list[dict], reads: dict[int, RankRead] | None = None,
                step: Any = ALL) -> dict[int, dict[str, Any]]:
    """Per rank: ``{"events": n, "bytes": total payload bytes, "by_op": {op: n}, "odd": bool}``.

    ``odd`` marks a rank whose per-op counts differ from the most common ones,
    point-to-point ops aside (pipeline stages send and receive different amounts).
    ``reads``: each rank's :class:`RankRead` (``summarize``'s reading: the same answer), counting ``step``
    (:data:`ALL`, or the step ``spans`` were chosen for with :func:`step_spans`); None: counted from ``spans``.
    """
    totals: dict[int, dict[str, Any]] = {
        rank: {"events": 0, "bytes": 0, "by_op": Counter()} for rank in _ranks(spans)}
    if reads is None:
        for event in collective_events(spans):
            total = totals[event.rank]
            total["events"] += 1
            total["bytes"] += event.nbytes
            total["by_op"][event.name] += 1
    else:
        for rank, total in totals.items():
            found = reads[rank].totals.get(step) if rank in reads else None
            if found is not None:
                total["events"], total["bytes"], total["by_op"] = found[0], found[1], Counter(found[2])
    def shape(total: dict) -> tuple:
        return tuple(sorted((op, n) for op, n in total["by_op"].items() if op not in _P2P))

    shapes = Counter(map(shape, totals.values()))
    usual = shapes.most_common(1)[0][0] if shapes else ()
    for total in totals.values():
        total["odd"] = len(shapes) > 1 and shape(total) != usual
        total["by_op"] = dict(total["by_op"])
    return totals


def lateness(spans: list[dict], step: int | None = None, include_warmup: bool = False,
             reads: dict[int, RankRead] | None = None) -> dict[str, Any]:
    """Each rank's lateness at the collectives matched across ranks: a table, not a verdict (the straggler
    answer is :func:`.stragglers.find`'s).

    Matching is :func:`.model.arrival_matches`'s: by (process group name, seq counted without send/recv);
    point-to-point ops are no collectives (see :func:`pipeline_waits`). A rank's lateness in a match is its
    arrival (when its CPU began issuing the collective, :attr:`.model.CollectiveEvent.issued_ns`) minus the
    earliest rank's (ns): the time the others waited for it. A match is complete when as many ranks as the
    group's size took part. ``step``: only collectives of that training step (matched over all of ``spans``);
    without it, every collective but those of the warm-up steps (:func:`.model.warmup_step`: start-up skew and
    warm-up), unless ``include_warmup``. Collectives outside every step count (a pipeline schedule's loss
    all_reduce can be one).

    Returns:
        ``{"warmup_step": the last step left out (with every one before it) or None, "matched": complete matches,
        "incomplete": other matches, "per_rank": {rank: {"matched": complete matches it took part in,
        "mean_late_ms", "max_late_ms", "last": matches where it was the latest (ties count for all)}},
        "most_often_last": rank or None}``.
        Matches of one-rank groups are complete but have no latest rank.

    The times are each host's wall clock when the CPU issued the collective,
    not when the device ran it; across hosts, clock skew adds to lateness.
    ``reads``: each rank's :class:`RankRead` (``summarize``'s reading: the same answer); None: made from ``spans``.
    """
    warmup = None if include_warmup or step is not None else warmup_step(spans)
    reads = rank_reads(spans) if reads is None else reads
    tables = {rank: read.times.arrivals for rank, read in reads.items()}
    # A train_step_tail's collectives count in their step here, as step_spans takes them.
    matches = arrival_matches(
        tables, lambda number: number != step if step is not None else (
            warmup is not None and number is not None and number <= warmup),
        {rank: read.steps for rank, read in reads.items()})
    late: dict[int, list[int]] = {rank: [] for rank in _ranks(spans)}
    last: Counter = Counter()
    complete = 0
    for events in sorted(sorted(events) for events in matches):  # ties among the latest count in event order
        _, rank, i = events[0]
        if len(events) != tables[rank].sizes[i]:
            continue
        complete += 1
        arrivals = {rank: tables[rank].issued[i] for _, rank, i in events}
        first, latest = min(arrivals.values()), max(arrivals.values())
        for rank, time_ns in arrivals.items():
            late[rank].append(time_ns - first)
            if len(arrivals) > 1 and time_ns == latest:
                last[rank] += 1
    per_rank = {rank: {
        "matched": len(values),
        "mean_late_ms": statistics.fmean(values) / 1e6 if values else 0.0,
        "max_late_ms": max(values) / 1e6 if values else 0.0,
        "last": last[rank],
    } for rank, values in late.items()}
    return {"warmup_step": warmup, "matched": complete, "incomplete": len(matches) - complete,
            "per_rank": per_rank, "most_often_last": last.most_common(1)[0][0] if last else None}


def straggler_answer(spans: list[dict], include_warmup: bool = False,
                     reads: dict[int, RankRead] | None = None, noise_floor_s: float = NOISE_FLOOR_S) -> dict[str, Any]:
    """:func:`.stragglers.find` of ``spans`` over every counted step, from ``reads`` where the files were read
    folded: the answer ``diagnose`` gives."""
    times = None if reads is None else {rank: read.times for rank, read in reads.items()}
    return find(spans, noise_floor_s, include_warmup, times)


def _group_members(events: list[CollectiveEvent]) -> dict[str, Sequence[int] | None]:
    """Process group name -> its global ranks in group-rank order, or None where the files cannot tell.

    torch orders a group's ranks ascending (``new_group`` sorts them), so a group whose
    every member left an event maps in sorted order; one as large as the world is the identity.
    """
    seen: dict[str, set[int]] = defaultdict(set)
    sizes: dict[str, int] = {}
    worlds: dict[str, int] = {}
    for event in events:
        group = event.group
        seen[group].add(event.rank)
        sizes[group] = event.group_size
        worlds[group] = int(event.span["resource"].get(semconv.WORLD_SIZE, 0))
    return _members(seen, sizes, worlds)


def _members_read(reads: dict[int, RankRead]) -> dict[str, Sequence[int] | None]:
    """:func:`_group_members` from each rank's :class:`RankRead`: the size and world of a group's last event."""
    seen: dict[str, set[int]] = defaultdict(set)
    last: dict[str, tuple[int, int, int, int, int]] = {}  # group -> (time, rank, index, size, world)
    for rank, read in reads.items():
        for group, (i, size, world) in read.groups.items():
            seen[group].add(rank)
            found = (read.times.arrivals.returned[i], rank, i, size, world)
            if group not in last or found[:3] > last[group][:3]:
                last[group] = found
    return _members(seen, {group: found[3] for group, found in last.items()},
                    {group: found[4] for group, found in last.items()})


def _members(seen: dict[str, set[int]], sizes: dict[str, int], worlds: dict[str, int]
             ) -> dict[str, Sequence[int] | None]:
    members: dict[str, Sequence[int] | None] = {}
    for group, ranks in seen.items():
        if len(ranks) == sizes[group]:
            members[group] = sorted(ranks)
        else:
            members[group] = range(sizes[group]) if sizes[group] == worlds[group] else None  # not a list per group
    return members


def pipeline_waits(spans: list[dict], step: int | None = None,
                   reads: dict[int, RankRead] | None = None) -> dict[str, Any]:
    """Pair each ``send`` with its ``recv`` and measure how long the receiver waited for the sender.

    A pair is the n-th ``send`` from rank A to rank B on a process group and the
    n-th ``recv`` on B from A on that group (``torch.collective.peer`` is a group
    rank; see :func:`_group_members` for how it becomes a global rank). The
    receiver's wait is how long its ``recv`` was posted before the matching
    ``send`` began (0 when the data was sent first): in a pipeline, the bubble
    where a stage waits for the stage before (forward) or after (backward).
    ``step``: only pairs of that training step (paired over all of ``spans``): a pair's step is its
    ``recv``'s, or its ``send``'s when the ``recv`` is in no step or in a step's tail (a later stage
    posts the first ``recv`` of a step before its first forward, so that ``recv`` is an ``outside_step``
    event, or one of the step before's ``train_step_tail``).
    ``batch_p2p`` (coalesced, no peer) is not paired.

    Returns:
        ``{"pairs": n, "wait_ms": total wait over all pairs, "unmatched": {"send": n, "recv": n}
        (no partner in the files, or a group whose ranks the files cannot tell),
        "per_stage": [{"rank", "group", "group_rank" (the receiver's rank in the group),
        "recvs": pairs received, "wait_ms", "max_wait_ms", "mean_wait_ms"}]}``,
        one row per receiving (rank, group), sorted by rank then group. Times in ms,
        from each host's wall clock (clock skew across hosts adds to or hides waits).
    ``reads``: each rank's :class:`RankRead` (``summarize``'s reading, where ``spans`` hold, of the other
    ranks, only spans with a send or recv): the group's ranks are told from them.
    """
    events = collective_events(spans)
    members = _group_members(events) if reads is None else _members_read(reads)
    index = index_of(spans) if step is not None else None

    def in_step(event: CollectiveEvent, partner: CollectiveEvent | None = None) -> bool:
        if index is None:
            return True
        # A recv posted before the next step's forward lies in the step before's tail: the next step's data.
        own = None if event.span["name"] == semconv.SPAN_TRAIN_STEP_TAIL else index.step(event.span)
        return (own if own is not None or partner is None else index.step(partner.span)) == step

    queues: dict[tuple, dict[str, list[CollectiveEvent]]] = defaultdict(lambda: {semconv.SEND: [], semconv.RECV: []})
    unmatched = {semconv.SEND: 0, semconv.RECV: 0}
    for event in events:
        peer = event.peer
        if event.name not in unmatched or peer is None:
            continue
        group = event.group
        ranks = members.get(group)
        if ranks is None or not 0 <= peer < len(ranks):
            unmatched[event.name] += in_step(event)
            continue
        ends = (event.rank, ranks[peer]) if event.name == semconv.SEND else (ranks[peer], event.rank)
        queues[(group, *ends)][event.name].append(event)
    rows: dict[tuple[int, str], list[int]] = defaultdict(list)
    for (group, _, _), queue in queues.items():
        sends, recvs = queue[semconv.SEND], queue[semconv.RECV]
        for send, recv in zip(sends, recvs, strict=False):
            if in_step(recv, send):
                rows[(recv.rank, group)].append(max(0, send.issued_ns - recv.issued_ns))
        for name, left in ((semconv.SEND, sends[len(recvs):]), (semconv.RECV, recvs[len(sends):])):
            unmatched[name] += sum(map(in_step, left))
    per_stage = [{
        "rank": rank, "group": group, "group_rank": (members[group] or ()).index(rank), "recvs": len(waits),
        "wait_ms": sum(waits) / 1e6, "max_wait_ms": max(waits) / 1e6, "mean_wait_ms": sum(waits) / len(waits) / 1e6,
    } for (rank, group), waits in sorted(rows.items())]
    return {"pairs": sum(len(waits) for waits in rows.values()),
            "wait_ms": sum(sum(waits) for waits in rows.values()) / 1e6,
            "unmatched": unmatched, "per_stage": per_stage}


def top_collectives(spans: list[dict], rank: int = 0, limit: int = 10) -> list[dict[str, Any]]:
    """The ``limit`` (op, owning span) pairs on ``rank`` that moved the most payload bytes.

    Returns:
        ``[{"op", "module" (the owning span's name, e.g. "Transformer.output backward"),
        "bytes" (sum of ``torch.collective.bytes``), "count"}]``, largest first.
    """
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for event in collective_events(spans, rank):
        total = totals[(event.name, event.span["name"])]
        total[0] += event.nbytes
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], -item[1][1], item[0]))
    return [{"op": op, "module": module, "bytes": nbytes, "count": count}
            for (op, module), (nbytes, count) in ranked[:limit]]


# ------------------------------------------------------------------ report


def columns(rows: list[tuple]) -> list[str]:
    """Rows (the first a header) as left-aligned text columns two spaces apart, one string per row."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]


def human_bytes(n: float) -> str:
    """``n`` bytes as ``640 B``, ``256.0 KiB``, ``1.5 MiB`` (powers of 1,024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def span_warnings(spans: list[dict]) -> list[str]:
    """Warnings about the spans themselves: several processes for one rank (runs mixed), events dropped."""
    notes = []
    processes: dict[int, set] = defaultdict(set)
    dropped: Counter = Counter()
    resources: dict[tuple[int, int], dict] = {}  # each (rank, resource) once: a file's spans share a few
    for span in spans:
        resources[(span["rank"], id(span["resource"]))] = span["resource"]
        lost = int(span["attributes"].get(semconv.SPAN_DROPPED_EVENTS, 0)) + span.get("dropped_events_count", 0)
        if lost:
            dropped[span["rank"]] += lost
    for (rank, _), resource in resources.items():
        processes[rank].add(process_of(resource))
    for rank, seen in sorted(processes.items()):
        if len(seen) > 1:
            notes.append(f"warning: rank {rank} has spans from {len(seen)} processes: "
                         "several runs are mixed; pass one run's folder")
    for rank, n in sorted(dropped.items()):
        if n:
            notes.append(f"warning: rank {rank} dropped {n} events over the per-span cap "
                         "(OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN); counts here miss them")
    return notes


def report_dict(spans: list[dict], rank: int = 0, top: int = 10, step: int | None = None,
                include_warmup: bool = False, reads: dict[int, RankRead] | None = None) -> dict[str, Any]:
    """Everything ``summarize``'s text report says, as plain data (``--format report-json``).

    ``step``: training step ``step`` only (:func:`step_spans`); lateness and
    pipeline pairs are matched over all of ``spans`` first; the stragglers are every counted step's.
    ``reads``: each rank's :class:`RankRead`, as
    ``summarize`` reads the files (the same answer; the other ranks' spans then need no collective but
    send and recv).

    Returns:
        ``{"spans": n, "step": step or None, "ranks": [rank...], "files": n,
        "warnings": [str], "rank": rank, "module_counts": module_counts(...),
        "rank_totals": rank_totals(...), "lateness": lateness(...), "stragglers": the (rank, module, pass)
        rows found significant over every counted step (:func:`.stragglers.find`, as ``diagnose`` gives them;
        ``[]`` on a healthy job), "contended": the rows of host contention, "alpha": their false-blame rate,
        "pipeline_waits": pipeline_waits(...), "top_collectives": top_collectives(...)}``.
    """
    chosen = spans if step is None else step_spans(spans, step)
    answer = straggler_answer(spans, include_warmup, reads)
    return {
        "spans": sum(1 + span.get("folded", 0) for span in chosen),
        "step": step,
        "ranks": _ranks(chosen),
        "files": len({span["file"] for span in chosen if "file" in span}),
        "warnings": span_warnings(chosen),
        "rank": rank,
        "module_counts": module_counts(chosen, rank),
        "rank_totals": rank_totals(chosen, reads, ALL if step is None else step),
        "lateness": lateness(spans, step, include_warmup, reads),
        "stragglers": answer["stragglers"],
        "contended": answer["contended"],
        "alpha": ALPHA,
        "pipeline_waits": pipeline_waits(spans, step, reads),
        "top_collectives": top_collectives(chosen, rank, top),
    }


def format_report(spans: list[dict], rank: int = 0, top: int = 10, step: int | None = None,
                  include_warmup: bool = False, reads: dict[int, RankRead] | None = None) -> str:
    """``commdebug-otel summarize``'s text: module table, per-rank totals, stragglers, pipeline waits, top bytes.

    ``step``, ``include_warmup``, ``reads``: as :func:`report_dict`.
    """
    report = report_dict(spans, rank, top, step, include_warmup, reads)
    where = "" if step is None else f" in step {step}"
    out = [f"{report['spans']} spans{where} from {len(report['ranks'])} rank(s) in {report['files']} file(s)",
           *report["warnings"], ""]
    out.append(f"Collectives per module on rank {rank} (CommDebugMode's tracing table; "
               "counts include submodules; Global = all):")
    out.append(format_table(spans if step is None else step_spans(spans, step), rank) or "(no collectives)")

    totals = report["rank_totals"]
    ops = sorted({op for total in totals.values() for op in total["by_op"]})
    out += ["", "Collectives per rank:"]
    rows = [("rank", "events", "bytes", *ops, "")]
    for r, total in totals.items():
        rows.append((r, total["events"], human_bytes(total["bytes"]),
                     *(total["by_op"].get(op, 0) for op in ops),
                     "<- differs from the other ranks" if total["odd"] else ""))
    out += columns(rows)

    lag = report["lateness"]
    out += ["", (f"Lateness: {lag['matched']} collectives matched across ranks by "
                 f"(process group, seq); {lag['incomplete']} seen on fewer ranks than the group size. "
                 "Send/recv are not collectives: see pipeline waits.")]
    rows = [("rank", "matched", "mean late ms", "max late ms", "last")]
    for r, stats in lag["per_rank"].items():
        rows.append((r, stats["matched"], f"{stats['mean_late_ms']:.3f}", f"{stats['max_late_ms']:.3f}",
                     stats["last"]))
    out += columns(rows)
    out.append("Lateness = when a rank's CPU issued the collective minus the earliest rank, by each "
               "host's wall clock: across hosts, clock skew adds to it.")
    out += format_lines({"stragglers": report["stragglers"], "contended": report["contended"],
                         "alpha": report["alpha"], "warmup_steps": [] if include_warmup else warmup_steps(spans)})
    if report["stragglers"]:
        out.append("(`commdebug-otel diagnose` adds the raw lateness of every rank and place.)")

    waits = report["pipeline_waits"]
    if waits["pairs"] or any(waits["unmatched"].values()):
        out += ["", (f"Pipeline waits: {waits['pairs']} send/recv pairs matched by (process group, sender, "
                     f"receiver) in order; {waits['unmatched']['send']} sends and {waits['unmatched']['recv']} "
                     f"recvs without a partner. Total wait {waits['wait_ms']:.3f} ms.")]
        rows = [("rank", "group", "group rank", "recvs", "wait ms", "mean wait ms", "max wait ms")]
        rows += [(row["rank"], row["group"], row["group_rank"], row["recvs"], f"{row['wait_ms']:.3f}",
                  f"{row['mean_wait_ms']:.3f}", f"{row['max_wait_ms']:.3f}") for row in waits["per_stage"]]
        out += columns(rows)
        out.append("Wait = how long a rank's recv was posted before its peer began the send "
                   "(the pipeline bubble), by each host's wall clock.")

    out += ["", f"Top collectives by bytes on rank {rank}:"]
    biggest = report["top_collectives"]
    rows = [("op", "module", "bytes", "count")]
    rows += [(c["op"], c["module"], human_bytes(c["bytes"]), c["count"]) for c in biggest]
    out += columns(rows) if biggest else ["(none)"]
    return "\n".join(out)


# --------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``summarize``'s arguments to ``parser``."""
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="OTLP-JSON trace files, or folders to search for *.jsonl / *.json")
    parser.add_argument("--rank", type=int, default=0,
                        help="rank for the module table, the JSON tree and top bytes (default 0)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="only training step N (its train_step spans and everything under them, "
                             "on every rank); default all spans")
    parser.add_argument("--top", type=int, default=10, help="rows of top collectives by bytes (default 10)")
    parser.add_argument("--format", choices=("text", "json", "report-json"), default="text",
                        help="text report, CommDebugMode's generate_json_dump tree (json), or the text "
                             "report's content as JSON (report-json) (default text)")
    parser.add_argument("--include-warmup", action="store_true",
                        help="count the first traced step in the stragglers (left out by default: ranks start it "
                             "at different times and run it cold)")


class _Needs:
    """What ``summarize`` reads of a span, as :class:`.otlp_json.SpanReader`'s ``fold``: every span of
    ``rank`` (the module table, top collectives), spans with a send or recv (pipeline waits), ``train_step``
    spans, stall snapshots (counted as left out) and spans that dropped events (warned about); the others are
    counted, each rank's totals and collectives (stragglers) made first where the file is read
    (:meth:`digest`). Picklable: the reader's worker processes call it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, span: dict) -> bool:
        attributes = span["attributes"]
        return (span["rank"] == self.rank or span["name"] == semconv.SPAN_TRAIN_STEP or is_snapshot(span)
                or semconv.SPAN_DROPPED_EVENTS in attributes or bool(span.get("dropped_events_count"))
                or any(event["name"] in _P2P and semconv.COLLECTIVE_OP in event["attributes"]
                       for event in span["events"]))

    def digest(self, spans: list[dict]) -> dict[int, RankRead]:
        """Each rank's :class:`.rank_read.RankRead` from one file's spans (:func:`.rank_read.rank_reads`: stall
        snapshots aside, as ``summarize`` leaves them out)."""
        return rank_reads(spans)


def run(args: argparse.Namespace) -> int:
    """Print the report (or JSON) for ``args.paths``. Returns :data:`.EXIT_DONE`; :data:`.EXIT_UNREADABLE` when
    there are no spans to read, :data:`.EXIT_NOT_THERE` when none is of ``--rank`` or no ``train_step`` is
    ``--step`` (each said on stderr)."""
    with reusing():  # the views share one span index, one list of collectives
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    reads: dict[int, RankRead] = {}
    spans = load_for_command(args.paths, "summarize", fold=_Needs(args.rank), digests=reads)
    if spans is None:
        return EXIT_UNREADABLE
    ranks = _ranks(spans)
    if args.rank not in ranks:
        print(f"commdebug-otel summarize: no spans for rank {args.rank}; ranks present: "
              f"{', '.join(map(str, ranks))}", file=sys.stderr)
        return EXIT_NOT_THERE
    if args.step is not None and args.step not in steps_present(spans):
        print(f"commdebug-otel summarize: no train_step {args.step} in the files; steps present: "
              f"{', '.join(map(str, steps_present(spans))) or 'none'}", file=sys.stderr)
        return EXIT_NOT_THERE
    if args.format == "json":
        chosen = spans if args.step is None else step_spans(spans, args.step)
        print(json.dumps(comm_debug_json(chosen, args.rank), indent=4))
    elif args.format == "report-json":
        print(json.dumps(report_dict(spans, args.rank, args.top, args.step, args.include_warmup, reads or None),
                         indent=4))
    else:
        print(format_report(spans, args.rank, args.top, args.step, args.include_warmup, reads or None))
    return EXIT_DONE
