#!/usr/bin/env python
"""Span encoding cost: the SDK's encoders against ``commdebug_otel.otel.encoding``'s (protobuf and OTLP-JSON).

Run from the repository root (about 30 seconds)::

    python benchmarks/encoding.py [--steps 20]

One process traces ``3 + --steps`` steps of ``bench.Job("demo")`` (the demo transformer,
tensor parallel, as rank 0 of 2 on torch's fake process group), twice: with
``build_resource``'s resource and with an SDK ``Resource`` of the same attributes. The first three steps'
spans are encoded once (our memo warms up as in a running job); then each later step's
spans are encoded into one request and serialized, each step once, best of five runs, in
microseconds per span (span events included). Before each run our memo is put back as the
warm-up left it, so values unique to a step (sequence numbers, durations) are misses, as
in a job. The same for the OTLP-JSON file exporter's line (the SDK's: the request as a dict,
then ``json.dumps``; ours: the line's text, written directly), with the young garbage
collections the encoding set off per 1,000 spans (each is 700 more objects that the
collector tracks, alive at once). It first checks that every step's requests serialize to
the same bytes and lines and exits with status 1 if not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import timeit

ROOT = pathlib.Path(__file__).resolve().parent.parent


def traced_steps(steps: int, plain_resource: bool = False) -> list[list]:
    """The spans of ``steps`` traced demo steps, one list per step, on rank 0 of a fake 2-rank group.

    Their resource is ``build_resource``'s, or with ``plain_resource`` an SDK ``Resource``
    with the same attributes (its hash is not cached).
    """
    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.resources import Resource
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    import bench

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.core.job_identity import rank_info
    from commdebug_otel.otel.telemetry import build_resource
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    resource = build_resource(rank_info())
    if plain_resource:
        resource = Resource(dict(resource.attributes), resource.schema_url)
    telemetry = InMemoryTelemetry(resource=resource)
    job = bench.Job("demo")
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        for _ in range(steps):
            job.step()
    by_trace: dict[int, list] = {}
    for span in telemetry.spans():
        by_trace.setdefault(span.context.trace_id, []).append(span)
    return list(by_trace.values())


def serialized(request) -> bytes:
    return request.SerializeToString()


def json_line(request) -> str:
    """The file exporter's line (no newline) for an encoder's result: our text as it is, the SDK's request dumped."""
    if isinstance(request, str):
        return request
    return json.dumps(request.to_dict(), separators=(",", ":"))


def per_span_us(encode, steps: list[list], before_run=lambda: None, serialize=serialized) -> float:
    """Best of five runs: microseconds per span to encode each step in one request and serialize it."""
    def run() -> None:
        for spans in steps:
            serialize(encode(spans))

    best = min(timeit.repeat(run, setup=before_run, number=1, repeat=5))
    return best / sum(map(len, steps)) * 1e6


def young_collections(encode, steps: list[list], serialize) -> float:
    """Generation-0 collections per 1,000 spans while encoding and serializing every step once."""
    gc.collect()
    before = gc.get_stats()[0]["collections"]
    for spans in steps:
        serialize(encode(spans))
    return (gc.get_stats()[0]["collections"] - before) / sum(map(len, steps)) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after three warm-up steps")
    args = parser.parse_args()

    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as sdk_json
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode

    from commdebug_otel.otel import encoding
    from commdebug_otel.otel.encoding import encode_spans as our_encode
    from commdebug_otel.otel.encoding import encode_spans_json as our_json

    steps = traced_steps(3 + args.steps)
    for spans in steps[:3]:
        our_encode(spans)
        our_json(spans)
    memos = ("_memo", "_json_memo")  # absent where the SDK's encoders are used
    warm = {name: dict(getattr(encoding, name, {})) for name in memos}

    def rewarm() -> None:
        for name in memos:
            if hasattr(encoding, name):
                getattr(encoding, name).clear()
                getattr(encoding, name).update(warm[name])

    timed = steps[3:]
    for spans in timed:
        if (our_encode(spans).SerializeToString() != sdk_encode(spans).SerializeToString()
                or json_line(our_json(spans)) != json_line(sdk_json(spans))):
            print("FAIL: the requests differ")
            return 1
    spans = sum(map(len, timed))
    events = sum(len(span.events) for step in timed for span in step)
    print(f"{len(timed)} steps, {spans / len(timed):.0f} spans and {events / len(timed):.0f} events per step: "
          f"requests identical")
    plain = per_span_us(sdk_encode, traced_steps(3 + args.steps, plain_resource=True)[3:])
    sdk = per_span_us(sdk_encode, timed)
    ours = per_span_us(our_encode, timed, rewarm)
    print("encode_spans + SerializeToString, us per span:")
    print(f"  SDK's, plain Resource (its hash per span):           {plain:5.1f}")
    print(f"  SDK's, build_resource's Resource (OTLP/HTTP's now):  {sdk:5.1f} ({sdk / plain:.0%})")
    print(f"  commdebug_otel.otel.encoding's (OTLP/gRPC's now):         {ours:5.1f} ({ours / plain:.0%})")
    sdk = per_span_us(sdk_json, timed, serialize=json_line)
    ours = per_span_us(our_json, timed, rewarm, serialize=json_line)  # the line is the text itself
    rewarm()
    sdk_gc, ours_gc = young_collections(sdk_json, timed, json_line), young_collections(our_json, timed, json_line)
    print("OTLP-JSON file exporter's line (the SDK's: encode, json.dumps; ours: the text), us per span; young "
          "collections per 1,000 spans:")
    print(f"  SDK's (opentelemetry-exporter-otlp-json-common):     {sdk:5.1f}  {sdk_gc:5.1f}")
    print(f"  commdebug_otel.otel.encoding's (the file exporter's now): {ours:5.1f}  {ours_gc:5.1f} "
          f"({ours / sdk:.0%} of the time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
