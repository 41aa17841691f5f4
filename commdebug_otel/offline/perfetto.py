"""``commdebug-otel perfetto``: OTLP-JSON trace files -> Chrome trace-event JSON.

The output opens in https://ui.perfetto.dev and ``chrome://tracing``:

* one process per rank (``pid`` = rank + 1, because Perfetto treats pid 0 as
  the kernel's; named ``rank N`` by a ``process_name`` metadata event, sorted
  by rank), with one thread;
* every span (``train_step``, ``outside_step``, module passes) as a complete
  event (``ph: "X"``, ``ts``/``dur`` in microseconds since the earliest span of
  any rank), properly nested: a child lies within its parent and siblings do
  not overlap (a slice that had to be trimmed says by how much in
  ``args["commdebug.trimmed_ns"]``);
* every span event (collectives, DTensor ops) as a thread-scoped instant event
  (``ph: "i"``, ``s: "t"``) with its attributes in ``args``.

Usage::

    commdebug-otel perfetto commdebug-otel-out/demo-20260101-120000 -o trace.json

    from commdebug_otel.offline import perfetto, summary
    trace = perfetto.chrome_trace(summary.load_spans(paths))

Ranks share one time axis: on several hosts, clock skew shifts ranks against each other.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from commdebug_otel import semconv
from commdebug_otel.offline import EXIT_DONE, EXIT_NOT_THERE, EXIT_UNREADABLE
from commdebug_otel.offline.load import load_for_command
from commdebug_otel.offline.model import SpanIndex

__all__ = ["add_arguments", "chrome_trace", "run", "write_chrome_trace"]

TRIMMED = "commdebug.trimmed_ns"
_NS_PER_US = 1000


def _us(ns: int) -> float:
    """Nanoseconds -> microseconds (exact to the ns when read back: ``round(us * 1000)``)."""
    return ns / _NS_PER_US


def _jsonable(value: Any) -> str:
    """A ``bytesValue`` attribute (the only value JSON cannot hold) as base64, as OTLP-JSON writes it."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON")


def _category(span: dict) -> str:
    pass_ = span["attributes"].get(semconv.MODULE_PASS)
    return f"module.{pass_}" if pass_ else "step"


def chrome_trace(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON for spans from :func:`commdebug_otel.offline.summary.load_spans`.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"origin_unix_ns": int}}``;
        ``ts`` values are microseconds after ``origin_unix_ns`` (the earliest span start).
    """
    events: list[dict[str, Any]] = []
    origin = min((span["start_ns"] for span in spans), default=0)
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for span in spans:
        by_rank[span["rank"]].append(span)
    for rank in sorted(by_rank):
        pid = rank + 1
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": pid,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": pid,
                       "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": pid,
                       "args": {"name": "modules"}})
        _rank_events(by_rank[rank], pid, origin, events)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_ns": origin}}


def _rank_events(spans: list[dict], pid: int, origin: int, out: list[dict]) -> None:
    """Slices and instants of one rank; children are clamped into parents, siblings kept apart."""
    index = SpanIndex(spans)

    def by_start(siblings: list[dict]) -> Iterator[dict]:
        return iter(sorted(siblings, key=lambda s: (s["start_ns"], -s["end_ns"])))

    # A walk with its own stack (a chain of 20,000 spans is no recursion): each frame is
    # [siblings left, low (where the next may start), high (where they must end)].
    stack: list[list[Any]] = [[by_start(index.roots), origin, max((span["end_ns"] for span in spans), default=origin)]]
    while stack:
        frame = stack[-1]
        span = next(frame[0], None)
        if span is None:
            stack.pop()
            continue
        low, high = frame[1], frame[2]
        start = min(max(span["start_ns"], low), high)
        end = max(min(span["end_ns"], high), start)
        args = {"span_id": span["span_id"], **span["attributes"]}
        trimmed = (start - span["start_ns"]) + (span["end_ns"] - end)
        if trimmed:
            args[TRIMMED] = trimmed
        if span.get("status_code") == 2:  # STATUS_CODE_ERROR
            args["status"] = f"ERROR {span.get('status_message', '')}".strip()
        out.append({"ph": "X", "name": span["name"], "cat": _category(span), "pid": pid, "tid": pid,
                    "ts": _us(start - origin), "dur": _us(end - start), "args": args})
        for event in span["events"]:
            collective = semconv.COLLECTIVE_OP in event["attributes"]
            out.append({"ph": "i", "s": "t", "name": event["name"],
                        "cat": "collective" if collective else "op", "pid": pid, "tid": pid,
                        "ts": _us(event["time_ns"] - origin),
                        "args": {"span": span["name"], **event["attributes"]}})
        frame[1] = end  # the next sibling starts after this one
        stack.append([by_start(index.children(span)), start, end])


def write_chrome_trace(spans: list[dict[str, Any]], path: str) -> dict[str, int]:
    """Write :func:`chrome_trace` to ``path``. Returns ``{"slices": n, "instants": n, "ranks": n}``."""
    trace = chrome_trace(spans)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(trace, handle, default=_jsonable)
    kinds = [event["ph"] for event in trace["traceEvents"]]
    return {"slices": kinds.count("X"), "instants": kinds.count("i"),
            "ranks": len({span["rank"] for span in spans})}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``perfetto``'s arguments to ``parser``."""
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="OTLP-JSON trace files, or folders to search for *.jsonl / *.json")
    parser.add_argument("-o", "--output", default="trace.json",
                        help="Chrome trace-event JSON to write (default trace.json)")


def run(args: argparse.Namespace) -> int:
    """Convert ``args.paths`` to ``args.output``. Returns :data:`.EXIT_DONE`; :data:`.EXIT_UNREADABLE` when there
    is nothing to convert, :data:`.EXIT_NOT_THERE` when the output cannot be written (said on stderr)."""
    spans = load_for_command(args.paths, "perfetto")
    if spans is None:
        return EXIT_UNREADABLE
    try:
        counts = write_chrome_trace(spans, args.output)
    except OSError as error:
        print(f"commdebug-otel perfetto: cannot write {args.output}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_THERE
    print(f"wrote {args.output}: {counts['slices']} slices and {counts['instants']} instant events "
          f"on {counts['ranks']} rank(s); open it in https://ui.perfetto.dev")
    return EXIT_DONE
