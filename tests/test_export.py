"""End to end as a user runs it: `commdebug-otel demo` exporting to a real OTLP receiver, or to files."""

import glob
import os
import subprocess
import sys

import pytest

from commdebug_otel import semconv
from commdebug_otel.testing.otlp_receiver import OtlpReceiver, spans_from_otlp_json


def run_demo(tmp_path, env_extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(env_extra)
    result = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "demo", "--steps", "2", *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


def check_demo_spans(spans):
    """Both ranks' nested module spans, with collective events carrying the contract's attributes."""
    by_id = {span["span_id"]: span for span in spans}
    ranks = {span["resource"][semconv.RANK] for span in spans}
    assert ranks == {0, 1}
    for rank in (0, 1):
        mine = [s for s in spans if s["resource"][semconv.RANK] == rank]
        steps = [s for s in mine if s["name"] == "train_step"]
        assert sorted(s["attributes"][semconv.STEP] for s in steps) == [0, 1]
        wo = [s for s in mine if s["name"] == "Transformer.layers.0.attention.wo forward"]
        assert len(wo) == 2
        parent = by_id[wo[0]["parent_span_id"]]
        assert parent["name"] == "Transformer.layers.0.attention forward"
        assert by_id[by_id[parent["parent_span_id"]]["parent_span_id"]]["name"] == "Transformer forward"
        [event] = wo[0]["events"]
        attributes = event["attributes"]
        assert event["name"] == "all_reduce"
        assert attributes[semconv.COLLECTIVE_OP] == "all_reduce"
        assert attributes[semconv.OP_NAME] == "_c10d_functional.all_reduce.default"
        assert attributes[semconv.COLLECTIVE_BYTES] == 4 * 32 * 64 * 4
        assert attributes[semconv.COLLECTIVE_SHAPE] == [4, 32, 64]
        assert attributes[semconv.COLLECTIVE_DTYPE] == "float32"
        assert attributes[semconv.COLLECTIVE_REDUCE_OP] == "sum"
        assert attributes[semconv.PROCESS_GROUP_SIZE] == 2
        assert attributes[semconv.MODULE_PASS] == "forward"
        backward = [s for s in mine if s["name"] == "Transformer.layers.0.attention.wq backward"]
        assert len(backward) == 2
        assert by_id[backward[0]["parent_span_id"]]["name"] == "Transformer.layers.0.attention backward"
        assert [e["name"] for e in backward[0]["events"]] == ["all_reduce"]
    # Step N of both ranks is one trace.
    trace_ids = {}
    for span in spans:
        if span["name"] == "train_step":
            trace_ids.setdefault(span["attributes"][semconv.STEP], set()).add(span["trace_id"])
    assert all(len(ids) == 1 for ids in trace_ids.values()) and len(trace_ids) == 2


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_demo_exports_to_a_live_otlp_receiver(tmp_path, receiver, protocol):
    receiver.clear()
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    out = run_demo(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                              "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
    assert f"OTLP ({protocol}) to {endpoint}" in out
    transport = "grpc" if protocol == "grpc" else "http"
    assert {request.transport for request in receiver.requests()} == {transport}
    check_demo_spans(receiver.spans())
    # Cumulative counters: the last export of each series holds the total.
    totals = {}
    for point in receiver.metrics():
        if point["name"] == semconv.METRIC_OPERATIONS:
            key = (point["resource"][semconv.RANK], tuple(sorted(point["attributes"].items())))
            totals[key] = max(totals.get(key, 0), point["value"])
    events = sum(1 for s in receiver.spans() for e in s["events"])
    assert sum(totals.values()) == events
    assert not os.path.exists(tmp_path / "commdebug-otel-out")


def test_demo_without_endpoint_writes_otlp_json_files(tmp_path):
    out = run_demo(tmp_path, {})
    [folder] = glob.glob(str(tmp_path / "commdebug-otel-out" / "run-*"))  # one folder per run
    assert f"writing traces and metrics as OTLP-JSON lines to {folder} (no OTLP endpoint" in out
    assert out.count("commdebug-otel: tracing is on (2 rank(s))") == 1  # once per job
    assert "  step 1/2: loss " in out and "  step 2/2: loss " in out  # the demo says each step
    assert f"next: read the run folder\n  commdebug-otel summarize {folder}   #" in out  # and what to run next
    assert sorted(os.listdir(folder)) == ["metrics-rank0.jsonl", "metrics-rank1.jsonl",
                                          "traces-rank0.jsonl", "traces-rank1.jsonl"]
    spans = []
    for rank in (0, 1):
        with open(os.path.join(folder, f"traces-rank{rank}.jsonl")) as handle:
            for line in handle:
                spans.extend(spans_from_otlp_json(line))
    check_demo_spans(spans)


def test_direct_spans_match_the_sdk_span_path_on_the_wire(monkeypatch, single_rank_group):
    """Our provider's spans skip the SDK's live Span; the wire must not show the difference."""
    import torch

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.otel import spans as spans_module
    from commdebug_otel.otel import telemetry as telemetry_module
    from commdebug_otel.testing import InMemoryTelemetry

    class Failing(torch.nn.Module):
        def forward(self, x):
            raise ValueError("an error recorded on the span: the SDK path")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.failing = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Failing()

        def forward(self, x):
            out = self.first(x)
            torch.distributed.all_reduce(out.detach())
            try:
                self.failing(out)
            except ValueError:
                pass
            return self.second(out)

    steps = []

    def capture(roots, children, trace_id):
        # The recorder empties its records' events after the step: keep them for the replays.
        records = roots + [child for kids in children.values() for child in kids]
        events = {id(record): list(record.events) for record in records}
        steps.append((roots, children, trace_id, records, events))

    def replay(sink):
        for roots, children, trace_id, records, events in steps:
            for record in records:
                record.events = [(name, dict(attributes), time_ns) for name, attributes, time_ns
                                 in events[id(record)]]
            sink.emit(roots, children, trace_id)

    memory = InMemoryTelemetry()
    monkeypatch.setattr(spans_module.SpanBuilder, "keeps_records", True)  # capture() keeps them: none reused
    tracer = CommTracer(Settings(), tracer_provider=memory.tracer_provider, meter_provider=memory.meter_provider)
    monkeypatch.setattr(tracer.telemetry.spans, "emit", capture)  # the recorder's span sink
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with tracer:
        for _ in range(2):
            net(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    assert len(steps) == 2

    monkeypatch.setattr(telemetry_module, "MAX_ATTRIBUTE_CHARS", 12)  # module types get cut
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    received = []
    for direct in (True, False):
        with OtlpReceiver() as receiver:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint)
            if not direct:
                monkeypatch.setattr(spans_module._DirectSpans, "for_provider", lambda *args: None)
            sink = telemetry_module.Telemetry(Settings(), tracer.recorder.rank)
            sink.spans.start()
            assert sink.spans.direct is direct
            if direct:  # trace flags are not on the wire: compare them with a span the SDK starts
                probe = sink.tracer_setup().provider.get_tracer("probe").start_span("probe")
                assert probe.get_span_context().trace_flags == sink.spans._direct._root_flags
            replay(sink.spans)
            sink.shutdown()
            received.append((receiver.spans(), [span.flags for request in receiver.requests("traces")
                                                for resource in request.request.resource_spans
                                                for scope in resource.scope_spans for span in scope.spans]))

    def normal(spans):
        names = {span["span_id"]: span["name"] for span in spans}
        traces = {}
        for span in spans:
            traces.setdefault(span["trace_id"], len(traces))
        return sorted((traces[span["trace_id"]], span["name"], names.get(span["parent_span_id"], ""),
                       repr(sorted({k: v for k, v in span.items()
                                    if k not in ("trace_id", "span_id", "parent_span_id")}.items())))
                      for span in spans)

    (direct_spans, direct_flags), (sdk_spans, sdk_flags) = received
    assert len(direct_spans) == len(sdk_spans) > 10
    assert normal(direct_spans) == normal(sdk_spans)
    assert sorted(direct_flags) == sorted(sdk_flags)
    assert [s["trace_id"] for s in direct_spans if s["name"] == "train_step"] == \
        [s["trace_id"] for s in sdk_spans if s["name"] == "train_step"]
    assert any(s["status_code"] == 2 and s["events"] for s in direct_spans)  # the error went the SDK way
    collective_events = [e for s in direct_spans for e in s["events"] if e["name"] == "all_reduce"]
    assert len(collective_events) == 2
    assert all(len(e["attributes"][semconv.OP_NAME]) == 12 for e in collective_events)  # event values cut
    assert any(len(value) == 12 for s in direct_spans for key, value in s["attributes"].items()
               if key == semconv.MODULE_TYPE)


def test_exporter_none_builds_no_records_and_keeps_metrics(monkeypatch, tmp_path):
    """OTEL_TRACES_EXPORTER=none: no record, tensor hook or span is made for spans; metrics go on."""
    import torch

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.otel import spans as spans_module
    from commdebug_otel.testing import InMemoryTelemetry

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    built = []
    monkeypatch.setattr(spans_module.SpanBuilder, "_start", lambda *args: built.append(args))
    memory = InMemoryTelemetry()  # its meter provider only: the tracer provider is our own, exporting nothing
    tracer = CommTracer(Settings(output_dir=str(tmp_path)), meter_provider=memory.meter_provider)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []
    with tracer:
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()
            sizes.append(tracer.recorder.state_sizes())
            loss.backward()
            optimizer.step()
        tracer.flush_metrics()
    assert tracer.telemetry.tracer_setup().discards
    assert built == []
    assert [(size["step records"], size["step hooks"]) for size in sizes] == [(0, 0)] * 3
    durations = memory.metric_points(semconv.METRIC_STEP_DURATION)
    assert sum(point.count for _, point in durations) == 3


def test_an_injected_provider_gets_spans_whatever_the_exporter_variable(monkeypatch):
    import torch

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    memory = InMemoryTelemetry()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer(Settings(), tracer_provider=memory.tracer_provider, meter_provider=memory.meter_provider):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert sorted(span.name for span in memory.spans()) == sorted([
        "train_step", "Sequential forward", "Sequential.0 forward", "Sequential.1 forward",
        "Sequential backward", "Sequential.0 backward", "Sequential.1 backward"])


def test_direct_path_keeps_attributes_as_bounded_attributes_does():
    """``_plain`` against the SDK's own ``BoundedAttributes`` on every kind of value it accepts."""
    from opentelemetry.attributes import BoundedAttributes

    from commdebug_otel.otel.spans import _plain

    values = {"short": "abc", "long": "x" * 20, "int": 3, "float": 0.5, "bool": True, "empty": [],
              "strings": ["ab", "y" * 15, "c"], "one long": ("z" * 30,), "kept": ("a", "b"), "ints": [1, 2, 3],
              "floats": (0.1, 0.2), "bools": [True, False]}
    ours = _plain(dict(values), 12, 128)
    assert ours == dict(BoundedAttributes(128, values, max_value_len=12))
    assert all(type(value) in (str, int, float, bool, tuple) for value in ours.values())
    assert _plain(dict(values), None, None) == dict(BoundedAttributes(None, values))
    for unplain in ([1, "a"], [1, True], [None], {"a": 1}, None, b"bytes", [[1]]):
        assert _plain({"key": unplain}, 12, 128) is None, unplain  # the SDK's path converts or drops it
    assert _plain({"a": 1, "b": 2}, 12, 1) is None  # over the count limit: the SDK's path drops and counts


def test_direct_module_spans_from_the_memo_are_the_records_own():
    """A module span's name and attributes come from a memo per module and pass: on every call they equal
    what ``_plain(span_attributes(record))`` gives that record, in the same order, whatever its module type,
    flags or call index, and within the limits (cut strings, surrogates made valid, the count limit)."""
    from types import SimpleNamespace

    from commdebug_otel.core.records import Record, SpanKind, span_attributes
    from commdebug_otel.otel.spans import _DirectSpans, _plain
    from commdebug_otel.otel.spans import valid_text as valid

    def direct(chars, count):
        spans = _DirectSpans.__new__(_DirectSpans)
        spans._span_chars, spans._span_attributes, spans._events, spans._modules = chars, count, 128, {}
        return spans

    def record(fqn, pass_, module_type, call_index, **flags):
        made = Record(SpanKind.MODULE, f"{fqn} {pass_}", 1)
        made.fqn, made.pass_, made.module_type, made.call_index = fqn, pass_, module_type, call_index
        for name, value in flags.items():
            setattr(made, name, value)
        return made

    def expected(made, chars, count):
        return valid(made.name), _plain(span_attributes(made), chars, count), ()

    records = [record("Net.blocks.0", "forward", "m.Block", 0), record("Net.blocks.0", "forward", "m.Block", 1),
               record("Net.blocks.0", "backward", "m.Block", 0), record("Net.blocks.0", "forward", "m.Other", 2),
               record("Net.blocks.0", "forward", "m.Block", 3, unmatched=True),
               record("Net.blocks.0", "forward", "m.Block", 4, compiled=True, params=["weight [8, 8]"]),
               record("Net.\udc80.layer_with_a_long_name", "forward", "m.Block", 0),
               record("Net.\udc80.layer_with_a_long_name", "forward", "m.Block", 1),
               record("Net.blocks.0", "forward", "m.Block", 5, dropped_events=2)]
    records[-1].attrs["user.key"] = "v"
    for chars, count in ((None, None), (12, 128), (None, 5), (None, 4)):
        spans = direct(chars, count)
        for made in records:
            got, want = spans.prepare(made), expected(made, chars, count)
            if want[1] is None:  # over the count limit: the SDK's path
                assert got is None
                continue
            assert got == want and list(got[1]) == list(want[1]), (chars, count, made.name, made.call_index)
    spans = direct(None, None)
    spans.prepare(records[0])
    assert spans.prepare(SimpleNamespace(**{**{name: getattr(records[0], name) for name in Record.__slots__},
                                            "error": ValueError()})) is None  # an error: the SDK's path
