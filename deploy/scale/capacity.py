"""What a job sends into the gateway tier: spans/s and bytes/s per 1,000 ranks, from one rank's measured steps.

Usage::

    commdebug-otel demo --ranks 4 --steps 6          # or your own job, writing OTLP-JSON files (the default)
    python deploy/scale/capacity.py commdebug-otel-out/run-*/traces-rank0.jsonl \\
        --metrics commdebug-otel-out/run-*/metrics-rank0.jsonl --step-time-s 1 --metric-interval-s 10

It reads one rank's OTLP-JSON lines (the file exporter's format), groups the spans of each traced step
(the trace that holds a ``train_step``), and encodes each step as the OTLP protobuf export request it
would be on the wire, and that request gzipped (what an agent with ``compression: gzip`` sends). It
prints the per-rank-step median (the first step, which carries the parameter attributes, is left out when
there are more) and a Markdown table of the rates into the gateways per 1,000 ranks at
``OTEL_PYTHON_COMMDEBUG_TRACE_EVERY`` 1, 10 and 100. Metric exports, if given, are added at one export
per rank per ``--metric-interval-s``, whatever the trace setting.

Not measured: the agents' batching (a request holds several steps' spans, which gzip compresses a little
better) and gRPC framing (a few bytes a message). Rates scale with 1 / step time and with the ranks that
trace (``OTEL_PYTHON_COMMDEBUG_RANKS``).
"""

from __future__ import annotations

import argparse
import gzip
import pathlib
import statistics
from collections import defaultdict
from typing import Any, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from commdebug_otel import semconv
from commdebug_otel.offline.otlp_json import parse_otlp_json

TRACE_EVERY = (1, 10, 100)
RANKS = 1000


class StepSize(NamedTuple):
    """One rank's traced step: spans, events, and its size as an OTLP protobuf request, plain and gzipped."""

    spans: int
    events: int
    protobuf_bytes: int
    gzip_bytes: int


def step_sizes(path: pathlib.Path) -> list[StepSize]:
    """Every traced step in one rank's OTLP-JSON trace file, in file order."""
    requests: dict[bytes, ExportTraceServiceRequest] = defaultdict(ExportTraceServiceRequest)
    steps: list[bytes] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        request = parse_otlp_json(line, "traces")
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    out = requests[span.trace_id].resource_spans.add()
                    out.resource.CopyFrom(resource_spans.resource)
                    out.scope_spans.add(scope=scope_spans.scope).spans.append(span)
                    if span.name == semconv.SPAN_TRAIN_STEP and span.trace_id not in steps:
                        steps.append(span.trace_id)
    sizes = []
    for trace_id in steps:
        merged = _merge(requests[trace_id])
        wire = merged.SerializeToString()
        spans = [span for rs in merged.resource_spans for ss in rs.scope_spans for span in ss.spans]
        sizes.append(StepSize(len(spans), sum(len(span.events) for span in spans), len(wire),
                              len(gzip.compress(wire))))
    return sizes


def _merge(request: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """One resource and one scope per distinct (resource, scope), as one export request would carry them."""
    merged = ExportTraceServiceRequest()
    groups: dict[tuple[bytes, bytes], Any] = {}
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            key = (resource_spans.resource.SerializeToString(), scope_spans.scope.SerializeToString())
            if key not in groups:
                out = merged.resource_spans.add()
                out.resource.CopyFrom(resource_spans.resource)
                groups[key] = out.scope_spans.add(scope=scope_spans.scope)
            groups[key].spans.extend(scope_spans.spans)
    return merged


def metric_export_bytes(path: pathlib.Path) -> list[tuple[int, int]]:
    """``(protobuf, gzip)`` bytes of every metric export in one rank's OTLP-JSON metric file."""
    sizes = []
    for line in path.read_text().splitlines():
        if line.strip():
            wire = parse_otlp_json(line, "metrics").SerializeToString()
            sizes.append((len(wire), len(gzip.compress(wire))))
    return sizes


def typical(sizes: list[StepSize]) -> StepSize:
    """The median step, leaving out the first (parameter attributes) when there are others."""
    if not sizes:
        raise ValueError("no traced step (no train_step span) in the file")
    later = sizes[1:] or sizes
    return StepSize(*(int(statistics.median(column)) for column in zip(*later)))


def table(step: StepSize, step_time_s: float, metric_bytes: tuple[int, int] | None = None,
          metric_interval_s: float = 10.0, ranks: int = RANKS) -> str:
    """Markdown rows: spans/s and bytes/s into the gateways for ``ranks`` ranks at each TRACE_EVERY."""
    rows = ["| TRACE_EVERY | spans/s | protobuf MB/s | gzip MB/s |", "|---|---|---|---|"]
    for every in TRACE_EVERY:
        per_s = ranks / step_time_s / every
        rows.append(f"| {every} | {step.spans * per_s:,.0f} | {step.protobuf_bytes * per_s / 1e6:,.2f} "
                    f"| {step.gzip_bytes * per_s / 1e6:,.3f} |")
    if metric_bytes is not None:
        per_s = ranks / metric_interval_s
        rows.append(f"| metrics, every {metric_interval_s:g} s | - | {metric_bytes[0] * per_s / 1e6:,.2f} "
                    f"| {metric_bytes[1] * per_s / 1e6:,.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=pathlib.Path, help="one rank's traces-rank<N>.jsonl")
    parser.add_argument("--metrics", type=pathlib.Path, help="the same rank's metrics-rank<N>.jsonl")
    parser.add_argument("--step-time-s", type=float, default=1.0, help="seconds per training step (default 1)")
    parser.add_argument("--metric-interval-s", type=float, default=10.0,
                        help="OTEL_METRIC_EXPORT_INTERVAL in seconds (default 10)")
    args = parser.parse_args(argv)
    sizes = step_sizes(args.traces)
    for index, size in enumerate(sizes):
        print(f"step {index}: {size.spans} spans, {size.events} events, "
              f"{size.protobuf_bytes} B protobuf, {size.gzip_bytes} B gzip")
    step = typical(sizes)
    print(f"per rank per traced step (median): {step.spans} spans, {step.events} events, "
          f"{step.protobuf_bytes} B protobuf, {step.gzip_bytes} B gzip")
    metric = None
    if args.metrics:
        exports = metric_export_bytes(args.metrics)
        metric = (int(statistics.median(p for p, _ in exports)), int(statistics.median(g for _, g in exports)))
        print(f"per rank per metric export (median of {len(exports)}): {metric[0]} B protobuf, {metric[1]} B gzip")
    print(f"\ninto the gateways per {RANKS:,} ranks, {args.step_time_s:g} s a step:\n")
    print(table(step, args.step_time_s, metric, args.metric_interval_s))


if __name__ == "__main__":
    main()
