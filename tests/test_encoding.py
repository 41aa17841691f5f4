"""commdebug_otel.otel.encoding gives the SDK's OTLP requests byte for byte (protobuf, and the OTLP-JSON file
exporter's lines), with a bounded memo."""

import importlib.util
import io
import json
import multiprocessing
import sys
import traceback

import pytest
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as sdk_encode_spans_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from commdebug_otel.otel import encoding
from commdebug_otel.otel.encoding import MEMO_ENTRIES, encode_spans, encode_spans_json

# Every attribute value type, and values Python finds equal (True == 1 == 1.0, 0.0 == -0.0,
# (1,) == (True,)) under one key across spans: each must keep its own encoding.
VALUES = ["fqn", "", "x" * 5000, True, False, 1, 0, -3, 2**63 - 1, 1.0, 0.0, -0.0, 2.5, float("nan"),
          b"\x00\x01", b"", None, ("a", "b"), (1, 2), (True, False), (1.0, 2.0), (-0.0,), (1,), (True,), (1.0,),
          ("a", None), (), ["list", "of", "str"], [1, 2]]


def _json_line(request):
    """The line the OTLP-JSON file exporter writes for an encoded request (a dict, or None: no line)."""
    return None if request is None else json.dumps(request, separators=(",", ":"))


def _sdk_json(spans):
    request = sdk_encode_spans_json(spans)
    return _json_line(request.to_dict() if request.resource_spans else None)


# (ours, the SDK's): each spans -> bytes or str, for both encodings.
CODECS = {
    "protobuf": (lambda spans: encode_spans(spans).SerializeToString(),
                 lambda spans: sdk_encode_spans(spans).SerializeToString()),
    "json": (encode_spans_json, _sdk_json),
}


@pytest.fixture(params=sorted(CODECS))
def codec(request):
    return CODECS[request.param]


def _context(trace_id, span_id, remote=False, state=None):
    return SpanContext(trace_id, span_id, is_remote=remote, trace_flags=TraceFlags(1), trace_state=state)


def _hand_made_spans():
    """Spans covering every field the encoder writes, over two resources (one of them as two
    equal objects) and three scopes (one None)."""
    resource = Resource({"service.name": "a", "rank": 0}, "https://schema/a")
    same_resource = Resource({"service.name": "a", "rank": 0}, "https://schema/a")  # equal, not identical
    other_resource = Resource({"service.name": "b", "bytes": b"\x01", "list": ("x", "y")})
    scope = InstrumentationScope("commdebug_otel", "1.0", "https://schema/s", {"scope.attr": "v"})
    other_scope = InstrumentationScope("other")
    dropped_attributes = BoundedAttributes(maxlen=2, attributes={"a": 1, "b": "two", "c": 3.0}, immutable=False)
    dropped_events = BoundedList(1)
    dropped_events.extend([Event("e1", {"k": "v"}, timestamp=5), Event("e2", timestamp=6)])
    dropped_links = BoundedList(1)
    dropped_links.extend([Link(_context(9, 9)), Link(_context(10, 10))])
    event_attributes = BoundedAttributes(maxlen=1, attributes={"a": 1, "b": 2})
    spans = [
        ReadableSpan("root", _context(1, 1), None, resource, {f"v{i}": value for i, value in enumerate(VALUES)},
                     start_time=10, end_time=20, instrumentation_scope=scope),
        ReadableSpan("child", _context(1, 2, state=TraceState([("vendor", "x"), ("other", "y")])),
                     _context(1, 1), same_resource, dropped_attributes,
                     events=[Event("collective", {"op": "all_reduce", "bytes": 1024, "shape": (4, 32)}, 11),
                             Event("bare", None, 12), Event("dropped", event_attributes, 13)],
                     links=[Link(_context(2, 7, remote=True), {"why": "stall", "n": 2}), Link(_context(3, 8))],
                     kind=SpanKind.CLIENT, status=Status(StatusCode.ERROR, "boom"), start_time=11, end_time=19,
                     instrumentation_scope=scope),
        ReadableSpan("remote child", _context(1, 3), _context(1, 9, remote=True), other_resource,
                     {"v0": 1, "v1": True, "v2": 1.0, "v3": -0.0}, events=dropped_events, links=dropped_links,
                     kind=SpanKind.SERVER, status=Status(StatusCode.OK), start_time=12, end_time=13,
                     instrumentation_scope=other_scope),
        ReadableSpan("no scope", _context(4, 4), None, resource, {"v0": True, "v1": 1, "v2": (True,), "v3": 0.0},
                     kind=SpanKind.PRODUCER, status=None, start_time=1, end_time=2),
        ReadableSpan("consumer", _context(5, 5), _context(4, 4), other_resource, None, kind=SpanKind.CONSUMER,
                     status=Status(StatusCode.UNSET, None), start_time=3, end_time=4, instrumentation_scope=scope),
        ReadableSpan("", _context(0, 0), _context(0, 0), resource, {"": "empty key", "long": "y" * 3000, "d": 0.5},
                     events=[Event("", {"": 2.5, "nan": float("nan"), "inf": float("-inf")}, 0),
                             Event("long", {"": "z" * 3000}, 1)],
                     start_time=0, end_time=None, instrumentation_scope=scope),
        ReadableSpan("same values again", _context(1, 6), _context(1, 1), same_resource,
                     {f"v{i}": value for i, value in enumerate(reversed(VALUES))}, start_time=14, end_time=15,
                     instrumentation_scope=scope),
    ]
    return spans


def test_hand_made_spans_encode_as_the_sdk(codec):
    ours, sdk = codec
    spans = _hand_made_spans()
    expected = sdk(spans)
    assert ours(spans) == expected
    assert ours(spans) == expected  # now from the memo
    for i in range(len(spans)):  # and one span at a time, each value type on its own
        assert ours(spans[i:i + 1]) == sdk(spans[i:i + 1])
    assert ours([]) == sdk([])


def test_equal_resources_share_one_group():
    spans = _hand_made_spans()
    assert [len(resource.scope_spans) for resource in encode_spans(spans).resource_spans] == [2, 2]
    assert [len(resource["scopeSpans"]) for resource in json.loads(encode_spans_json(spans))["resourceSpans"]] == [2, 2]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_each_value_after_each_other_value(value, codec):
    """A value encoded right after another that Python finds equal is not given that one's message."""
    ours, sdk = codec
    for earlier in VALUES:
        spans = [ReadableSpan("s", _context(1, 1), None, Resource({}), {"k": earlier}, start_time=1, end_time=2),
                 ReadableSpan("s", _context(1, 2), None, Resource({}), {"k": value}, start_time=1, end_time=2)]
        ours(spans[:1])
        assert ours(spans) == sdk(spans)


def test_keys_and_statuses_python_finds_equal_keep_their_own_encoding(codec):
    """Non-string keys (1, True, 1.0 are one dict key) and a falsy unhashable status description, which the SDK
    keeps as given: the SDK's output, in one batch and across batches."""
    ours, sdk = codec
    spans = [ReadableSpan("s", _context(1, i + 1), None, Resource({}), {key: "x"}, start_time=1, end_time=2)
             for i, key in enumerate([1, True, 1.0, "1"])]
    spans.append(ReadableSpan("s", _context(1, 9), None, Resource({}), {"k": 1},
                              status=Status(StatusCode.ERROR, []), start_time=1, end_time=2))
    for batch in [spans, *([span] for span in spans)]:
        try:
            expected = sdk(batch)
        except TypeError:  # protobuf's Status takes no list: the SDK's encoder raises, and so does ours
            with pytest.raises(TypeError):
                ours(batch)
            continue
        assert ours(batch) == expected


def test_unencodable_attributes_are_left_out_and_logged_as_by_the_sdk(caplog, codec):
    ours_encode, sdk = codec
    attributes = {"ok": "yes", "object": object(), "huge": 2**70, "mapping": {"a": 1}, "mixed": (1, "a")}
    spans = [ReadableSpan("s", _context(1, 1), None, Resource({}), attributes, start_time=1, end_time=2)]
    caplog.clear()
    ours = ours_encode(spans)
    logged = [record.getMessage() for record in caplog.records]
    caplog.clear()
    assert ours == sdk(spans)
    assert logged == [record.getMessage() for record in caplog.records]
    # object (and, in protobuf, the int beyond 64 bits); the mapping is a kvlist, the mixed tuple an array
    assert len(logged) == (2 if ours_encode is CODECS["protobuf"][0] else 1)


def test_encoded_requests_share_nothing_with_the_memo():
    """Changing an encoded request does not change the memo (it keeps bytes): the next request is the SDK's again."""
    spans = _hand_made_spans()
    expected = sdk_encode_spans(spans).SerializeToString()
    first = encode_spans(spans)
    memo = dict(encoding._memo)
    assert memo and all(type(entry) is bytes for entry in memo.values())
    for resource in first.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                for attribute in span.attributes:
                    attribute.key = "changed"
                    attribute.value.string_value = "changed"
                for event in span.events:
                    del event.attributes[:]
    assert encode_spans(spans).SerializeToString() == expected
    assert encoding._memo == memo


@pytest.mark.parametrize("memo", ["_memo", "_json_memo"])
def test_memo_stays_within_its_cap(memo):
    """Many distinct values: the memo is emptied when full, never over MEMO_ENTRIES; values that
    rarely repeat (floats, long strings, long tuples) are not kept at all."""
    ours, sdk = CODECS["protobuf" if memo == "_memo" else "json"]
    memo = getattr(encoding, memo)
    resource = Resource({})
    memo.clear()
    sizes = []
    for batch in range(5):
        spans = [ReadableSpan("s", _context(1, i + 1), None, resource,
                              {"seq": batch * 1000 + i, "name": f"n{batch}-{i}", "duration_s": i / 7,
                               "long": "x" * 300 + str(i), "tuple": tuple(range(i % 40))},
                              start_time=1, end_time=2) for i in range(1000)]
        assert ours(spans) == sdk(spans)
        sizes.append(len(memo))
    assert max(sizes) <= MEMO_ENTRIES
    assert sizes[0] == 1000 + 1000 + 17  # seq, name, and tuples of up to 16 items
    assert not {key for key in memo if key[0] in ("duration_s", "long")}


def test_file_exporter_writes_the_sdks_lines_with_our_encoder():
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter

    from commdebug_otel.otel.exporters import exporter_class as _exporter_class

    exporter_class = _exporter_class("traces", "file")
    assert issubclass(exporter_class, FileSpanExporter) and exporter_class is _exporter_class("traces", "file")
    ours, theirs = io.StringIO(), io.StringIO()
    exporter, sdk_exporter = exporter_class(stream=ours), FileSpanExporter(stream=theirs)
    assert exporter._exporter._encode.__qualname__.endswith("write_line")
    spans = _hand_made_spans()
    for batch in (spans, spans[:2], [], spans):
        assert exporter.export(batch) == sdk_exporter.export(batch)
    assert ours.getvalue() == theirs.getvalue() and ours.getvalue().count("\n") == 3


def test_grpc_exporter_translates_with_our_encoder():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from commdebug_otel.otel.exporters import exporter_class as _exporter_class

    exporter_class = _exporter_class("traces", "grpc")
    assert issubclass(exporter_class, OTLPSpanExporter) and exporter_class is _exporter_class("traces", "grpc")
    exporter = exporter_class(endpoint="127.0.0.1:1", insecure=True)
    try:
        spans = _hand_made_spans()
        assert exporter._translate_data(spans).SerializeToString() == sdk_encode_spans(spans).SerializeToString()
    finally:
        exporter.shutdown(timeout_millis=100)
    assert _exporter_class("traces", "http").__module__.startswith("opentelemetry.")


def test_built_resource_hashes_once_and_compares_as_the_sdks():
    from commdebug_otel.core.job_identity import RankInfo
    from commdebug_otel.otel.telemetry import build_resource

    resource = build_resource(RankInfo(0, 2, 0, 0, "run", "gloo", True))
    plain = Resource(dict(resource.attributes), resource.schema_url)
    assert resource == plain and plain == resource and hash(resource) == hash(plain)
    assert {plain: 1}[resource] == 1
    merged = resource.merge(Resource({"extra": 1}))
    assert type(merged) is Resource and merged.attributes == {**resource.attributes, "extra": 1}
    assert resource.merge(Resource({})) == resource
    assert resource != Resource({**resource.attributes, "rank": 1})


def test_falls_back_to_the_sdks_encoder_without_its_private_helpers(monkeypatch):
    """Another exporter version without ``_internal``'s helpers: encode_spans is the SDK's public one."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.common._internal", None)
    spec = importlib.util.spec_from_file_location("_encoding_fallback", encoding.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.encode_spans is sdk_encode_spans
    assert not hasattr(module, "_memo")


def test_json_falls_back_to_the_sdks_encoder_without_its_private_helpers(monkeypatch):
    """Another JSON exporter version without ``_internal``'s helpers: the SDK's own dict, unmemoized."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.json.common._internal", None)
    spec = importlib.util.spec_from_file_location("_encoding_json_fallback", encoding.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not hasattr(module, "_json_memo")
    spans = _hand_made_spans()
    assert module.encode_spans_json(spans) == _sdk_json(spans)
    assert module.encode_spans_json([]) is None


def _traced_demo_steps(result):
    """Rank 0 of 2 on torch's fake process group: three traced demo steps; puts, per trace, whether
    our request (twice) equals the SDK's, and the span and event counts; or the traceback."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commdebug_otel import CommTracer, Settings, _demo_model
    from commdebug_otel.core.job_identity import rank_info
    from commdebug_otel.otel.telemetry import build_resource
    from commdebug_otel.testing import InMemoryTelemetry

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        telemetry = InMemoryTelemetry(resource=build_resource(rank_info()))
        with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            args = _demo_model.ModelArgs(n_layers=2)
            model = _demo_model.parallelize(_demo_model.Transformer(args, seed=0), mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            for step in range(3):
                _demo_model.train_step(model, optimizer, *_demo_model.make_batch(args, 2, step))
        by_trace = {}
        for span in telemetry.spans():
            by_trace.setdefault(span.context.trace_id, []).append(span)
        found = []
        for spans in [*by_trace.values(), telemetry.spans()]:
            for ours, sdk in CODECS.values():
                expected = sdk(spans)
                found.append((ours(spans) == expected, ours(spans) == expected,
                              len(spans), sum(len(span.events) for span in spans)))
        result.put(found)
    except BaseException:
        result.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def test_traced_demo_steps_encode_as_the_sdk():
    """Real spans (set-up and three tensor-parallel steps of the demo model): the same bytes and JSON
    lines, per trace and all together, encoded once and again from the memo. In a child: the fake process group
    cannot join a test session's own."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    process = context.Process(target=_traced_demo_steps, args=(result,))
    process.start()
    found = result.get(timeout=240)
    process.join(60)
    assert isinstance(found, list), found
    assert all(first and again for first, again, _, _ in found), found
    assert len(found) >= 8 and sum(events for _, _, _, events in found[:-2]) > 0


def test_nesting_at_protobufs_depth_limit_encodes_as_the_sdk(codec):
    """Protobuf counts its nesting limit from the request: an attribute nested deep enough for it alone
    still encodes (or fails) as the SDK's encoder does, not only as a part of our whole request."""
    ours, sdk = codec
    for depth in (30, 32, 40, 48, 200):
        for make in (lambda inner: {"k": inner}, lambda inner: [inner]):
            value = 1
            for _ in range(depth):
                value = make(value)
            spans = [ReadableSpan("s", _context(1, 1), None, Resource({}), {"deep": value, "ok": "x"},
                                  start_time=1, end_time=2)]
            try:
                expected = sdk(spans)
            except Exception as error:  # past the limit for the SDK too: the same failure
                with pytest.raises(type(error)):
                    ours(spans)
                continue
            assert ours(spans) == expected, depth


class _Counted(ReadableSpan):
    """A span whose dropped counts are whatever it is given (an SDK span's are never below 0 or past 2**32)."""

    def __init__(self, *args, dropped=(0, 0, 0), **kwargs):
        super().__init__(*args, **kwargs)
        self._dropped = dropped

    dropped_attributes = property(lambda self: self._dropped[0])
    dropped_events = property(lambda self: self._dropped[1])
    dropped_links = property(lambda self: self._dropped[2])


class _CountedEvent(Event):
    def __init__(self, *args, dropped=0, **kwargs):
        super().__init__(*args, **kwargs)
        self._dropped = dropped

    dropped_attributes = property(lambda self: self._dropped)


@pytest.mark.parametrize("odd", [-1, 2**32, 2**64, True, 1.5, 2.0])
def test_odd_times_and_counts_encode_or_fail_as_the_sdk(odd, codec):
    """Times and dropped counts that protobuf would reject or convert, and JSON would write as given:
    the SDK's output or its exception."""
    ours, sdk = codec
    batches = [
        [_Counted("s", _context(1, 1), None, Resource({}), {"a": 1}, start_time=odd, end_time=2)],
        [_Counted("s", _context(1, 1), None, Resource({}), {"a": 1}, start_time=1, end_time=odd)],
        [_Counted("s", _context(1, 1), None, Resource({}), {"a": 1}, start_time=1, end_time=2, dropped=(odd, 0, 0))],
        [_Counted("s", _context(1, 1), None, Resource({}), {}, start_time=1, end_time=2, dropped=(0, odd, odd))],
        [ReadableSpan("s", _context(1, 1), None, Resource({}), {}, events=[_CountedEvent("e", {"k": 1}, odd)],
                      start_time=1, end_time=2)],
        [ReadableSpan("s", _context(1, 1), None, Resource({}), {}, events=[
            _CountedEvent("e", {"k": 1}, 5, dropped=odd)], start_time=1, end_time=2)],
    ]
    for spans in batches:
        try:
            expected = sdk(spans)
        except Exception as error:
            with pytest.raises(type(error)):
                ours(spans)
            continue
        assert ours(spans) == expected


def test_a_huge_string_is_not_kept_in_the_long_text_memo():
    name = "n" * (encoding._LONG_TEXT_CHARS // 8)
    spans = [ReadableSpan(name, _context(1, 1), None, Resource({}), {"fqn": "f" * 1000}, start_time=1, end_time=2)]
    encoding._long_texts.clear()
    assert encode_spans_json(spans) == _sdk_json(spans)
    assert list(encoding._long_texts) == ["f" * 1000]  # the attribute kept, the huge name not


def test_the_file_exporter_writes_nothing_to_a_closed_stream():
    import tempfile

    from commdebug_otel.otel.export_guard import WholeLineFile
    from commdebug_otel.otel.exporters import exporter_class as _exporter_class

    with tempfile.TemporaryDirectory() as directory:
        stream = WholeLineFile(f"{directory}/traces.jsonl")
        exporter = _exporter_class("traces", "file")(stream=stream)
        spans = _hand_made_spans()
        assert exporter.export(spans).name == "SUCCESS"
        stream.close()
        for _ in range(3):
            assert exporter.export(spans).name == "FAILURE"  # as the SDK's: the stream is closed
        assert not stream._pending  # and nothing waits to be written


# ----------------------------------------------------------------- what we write is valid UTF-8
def _surrogate_job(tracer):
    """Module names, a class's qualified name and an exception message, each with a lone surrogate."""
    import torch
    from torch import nn

    from models import AllReduceLinear

    class Boom(nn.Module):
        fail = False

        def forward(self, x):
            if self.fail:
                raise ValueError("bad \udc80 value")
            return x

    Odd = type("Odd", (nn.Module,), {"forward": lambda self, x: x * 2})
    Odd.__module__, Odd.__qualname__ = "mod\udc82", "Odd\udc81"  # a class name itself cannot hold one
    model = nn.Sequential()
    model.add_module("lin\udc80", AllReduceLinear())
    model.add_module("odd", Odd())
    model.add_module("boom", Boom())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer:
        for _ in range(2):
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
        model.boom.fail = True
        with pytest.raises(ValueError):
            model(torch.ones(1, 4))
        tracer.flush_metrics()


def _strict_lines(path):
    """Every line decoded strictly as UTF-8 and parsed, with no string a UTF-8 encoder refuses."""
    lines = []
    for raw in path.read_bytes().splitlines():
        obj = json.loads(raw.decode("utf-8", "strict"))
        json.dumps(obj, ensure_ascii=False).encode("utf-8", "strict")
        lines.append(obj)
    return lines


def test_surrogates_in_names_and_messages_leave_valid_utf8_json(tmp_path, single_rank_group, capsys):
    import argparse

    from commdebug_otel import CommTracer, Settings, semconv
    from commdebug_otel.offline import summary
    from commdebug_otel.offline.otlp_json import spans_from_otlp_json

    _surrogate_job(CommTracer(Settings(output_dir=str(tmp_path), metric_module_depth=3)))
    [run] = tmp_path.glob("run-*")
    traces, metrics = _strict_lines(run / "traces-rank0.jsonl"), _strict_lines(run / "metrics-rank0.jsonl")
    spans = [span for line in traces for span in spans_from_otlp_json(line)]
    names = {span["name"] for span in spans}
    assert {"Sequential.lin\ufffd forward", "Sequential.odd forward", "Sequential.boom forward"} <= names
    odd = next(span for span in spans if span["name"] == "Sequential.odd forward")
    assert odd["attributes"][semconv.MODULE_TYPE] == "mod\ufffd.Odd\ufffd"
    messages = {event["attributes"]["exception.message"] for span in spans for event in span["events"]
                if event["name"] == "exception"}  # the module that raised and its parent
    assert messages == {"bad \ufffd value"}
    assert "Sequential.lin\ufffd" in json.dumps(metrics, ensure_ascii=False)  # the module label
    parser = argparse.ArgumentParser()
    summary.add_arguments(parser)
    assert summary.run(parser.parse_args([str(run)])) == 0
    assert "Sequential.lin\ufffd" in capsys.readouterr().out


def test_surrogates_reach_the_protobuf_encoders_as_valid_strings(telemetry, tracer_factory, single_rank_group):
    """gRPC (our encoder) and HTTP (the SDK's): protobuf refuses an invalid string, and the batch with it."""
    _surrogate_job(tracer_factory(metric_module_depth=3))
    spans = telemetry.spans()
    assert "Sequential.lin\ufffd forward" in {span.name for span in spans}
    assert encode_spans(spans).SerializeToString() == sdk_encode_spans(spans).SerializeToString()
    labels = [point.attributes for rm in telemetry.metric_reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for metric in sm.metrics for point in metric.data.data_points]
    assert {"Sequential.lin\ufffd"} <= {label.get("torch.module.fqn") for label in labels}


def test_file_lines_are_valid_utf8_whatever_reaches_them(tmp_path):
    """The files' last guard (a resource attribute from the environment, a metric the SDK encodes): a lone
    surrogate, escaped by json.dumps or raw, becomes U+FFFD; pairs and escaped backslashes stay."""
    from commdebug_otel.otel.export_guard import WholeLineFile, valid_json

    values = ["a\udc80", "\ud83d\ude00", "x\\udc80", "é\ud800", "\ud83d"]
    written = WholeLineFile(str(tmp_path / "out.jsonl"))
    written.write(json.dumps(values) + "\n")
    written.write(json.dumps(values, ensure_ascii=False) + "\n")
    written.flush()
    written.close()
    expected = ["a\ufffd", "\U0001f600", "x\\udc80", "é\ufffd", "\ufffd"]
    assert [json.loads(line) for line in _strict_raw(tmp_path / "out.jsonl")] == [expected, expected]
    assert valid_json('{"k":"plain"}') == '{"k":"plain"}'


def _strict_raw(path):
    return [raw.decode("utf-8", "strict") for raw in path.read_bytes().splitlines()]
