"""Damaged and hostile input for ``summarize``, ``diagnose`` and ``perfetto`` (issue 29, items 1 and 2).

Every case runs each command through the CLI entry (``commdebug_otel.cli.main``) and asserts the
good spans kept, the message about what was skipped, and the exit status (0: something to
show; 1: nothing readable, said on stderr). Cases that could hang (FIFOs, devices) run the
command in a child process with a timeout, so a hang fails the test instead of the suite.
"""

import base64
import gzip
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from commdebug_otel import semconv
from commdebug_otel.cli import main
from commdebug_otel.offline import backends, otlp_json, summary
from commdebug_otel.offline.model import SpanIndex

from otlp_files import checkout_env, write_otlp
from otlp_files import span as otlp_span

TRACE = "0af7651916cd43dd8448eb211c80319c"
COMMANDS = ("summarize", "diagnose", "perfetto")


def _id(n):
    return f"{n:016x}"


def _span(n, parent=0, name="m", start=1_000, end=2_000, trace=TRACE, attributes=(), events=()):
    span = {"traceId": trace, "spanId": _id(n), "name": name, "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end), "attributes": list(attributes), "events": list(events)}
    if parent:
        span["parentSpanId"] = _id(parent)
    return span


def _attr(key, **value):
    return {"key": key, "value": value}


def _request(spans, rank=0, resource_attrs=None):
    attrs = resource_attrs if resource_attrs is not None else [
        _attr(semconv.RANK, intValue=str(rank)), _attr(semconv.WORLD_SIZE, intValue="1")]
    return {"resourceSpans": [{"resource": {"attributes": attrs},
                               "scopeSpans": [{"scope": {"name": "commdebug"}, "spans": spans}]}]}


def _line(spans, **kwargs):
    return json.dumps(_request(spans, **kwargs))


def _good(step):
    """One good line: step ``step``'s train_step and a module span under it (2 spans)."""
    root, child = 100 + 2 * step, 101 + 2 * step
    return _line([_span(root, name="train_step", start=step * 10_000, end=step * 10_000 + 5_000,
                        attributes=[_attr(semconv.STEP, intValue=str(step))]),
                  _span(child, parent=root, name="M forward", start=step * 10_000 + 1_000,
                        end=step * 10_000 + 2_000, attributes=[_attr(semconv.MODULE_FQN, stringValue="M"),
                                                               _attr(semconv.MODULE_PASS, stringValue="forward")])])


def _run(argv, capsys, tmp_path):
    """``main(argv)`` for each command; ``{command: (status, stdout, stderr)}``."""
    out = {}
    for command in COMMANDS:
        extra = ["-o", str(tmp_path / "trace.json")] if command == "perfetto" else []
        status = main([command, *argv, *extra])
        captured = capsys.readouterr()
        out[command] = (status, captured.out, captured.err)
    return out


def _kept(results):
    """Good spans each command kept: summarize's header, perfetto's slices (diagnose reads the same)."""
    summarize = results["summarize"][1].split(" spans", 1)[0]
    slices = results["perfetto"][1].split(": ", 1)[1].split(" slices", 1)[0] if results["perfetto"][1] else "0"
    return int(summarize or 0), int(slices)


# --------------------------------------------------------------- bad lines


_BAD_LINES = {
    "a non-hex span id": (_line([_span(1) | {"spanId": "zz" * 8}]),
                          "spanId is not 16 hex digits ('zzzzzzzzzzzzzzzz')"),
    "a wrong attribute type": (_line([_span(2, attributes=[_attr(semconv.COLLECTIVE_SEQ, stringValue="seven")])]),
                               "attribute torch.collective.seq is not an integer ('seven')"),
    "a non-numeric rank": (_line([_span(3)], resource_attrs=[_attr(semconv.RANK, stringValue="zero")]),
                           "attribute torch.distributed.rank is not an integer ('zero')"),
    "resourceSpans not a list": (json.dumps({"resourceSpans": {"oops": 1}}),
                                 "resourceSpans is dict, expected a list"),
    "JSON nested 200,000 deep": ('{"resourceSpans": ' + "[" * 200_000 + "]" * 200_000 + "}", "JSON nested too deep"),
    "a huge int": (_line([_span(4, start=10**30)]),
                   "startTimeUnixNano 1000000000000000000000000000000 is out of range"),
    "a huge intValue": (_line([_span(5, attributes=[_attr("x", intValue=str(2**70))])]),
                        "an intValue 1180591620717411303424 is out of range"),
    "NaN": (_line([_span(6)]).replace('"attributes": []',
                                      '"attributes": [{"key": "x", "value": {"doubleValue": NaN}}]', 1),
            "a doubleValue is not a finite number"),
    "Infinity": (_line([_span(7, attributes=[_attr(semconv.COLLECTIVE_DURATION, doubleValue=1e400)])]),
                 "a doubleValue is not a finite number"),
    "a rank past any job": (_line([_span(8)], rank=10**9),
                            "attribute torch.distributed.rank 1000000000 is out of range"),
    "NUL bytes": ("\0" * 64, "not JSON (Expecting value)"),
    "a stall age past any job": (_line([_span(10, attributes=[_attr(semconv.STALL_AGE, doubleValue=1e300)])]),
                                 "attribute commdebug.stall.age_s 1e+300 is out of range"),
    "a span without a trace id": (_line([{k: v for k, v in _span(9).items() if k != "traceId"}]),
                                  "a span has no traceId"),
    # A JSON number, not a decimal string: orjson would make it a float (the message's number is json's, exact).
    "a huge int as a JSON number": (_line([_span(11) | {"endTimeUnixNano": 10**30}]),
                                    "endTimeUnixNano 1000000000000000000000000000000 is out of range"),
}


@pytest.mark.parametrize("case", sorted(_BAD_LINES))
def test_one_bad_line_among_good_ones_loses_only_that_line(case, tmp_path, capsys):
    bad, why = _BAD_LINES[case]
    path = tmp_path / "traces-rank0.jsonl"
    path.write_text("\n".join([_good(0), bad, _good(1)]) + "\n")
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (4, 4)
    for command, (status, _, err) in results.items():
        assert status == 0, err
        assert err == f"commdebug-otel {command}: skipped 1 line in {path}: line 2: {why}\n"


@pytest.mark.parametrize("case", ["a huge int as a JSON number", "NaN", "Infinity", "NUL bytes",
                                  "JSON nested 200,000 deep"])
def test_a_bad_line_reads_the_same_without_orjson(case, tmp_path, capsys, monkeypatch):
    # orjson decodes when installed (a dependency); the stdlib's json stands in for it, and reads what it refuses.
    assert otlp_json._orjson is not None
    monkeypatch.setattr(otlp_json, "_orjson", None)
    test_one_bad_line_among_good_ones_loses_only_that_line(case, tmp_path, capsys)


def test_every_bad_line_is_counted_in_one_message_per_file(tmp_path, capsys):
    path = tmp_path / "traces-rank0.jsonl"
    lines = [_good(0), *(bad for bad, _ in _BAD_LINES.values()), _good(1), "{cut"]
    path.write_text("\n".join(lines))  # the last line cut short, no newline
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (4, 4)
    status, _, err = results["summarize"]
    assert status == 0
    total = len(_BAD_LINES) + 1
    # The three most common reasons, each with its first line, in file order; the rest counted.
    assert err == (f"commdebug-otel summarize: skipped {total} lines in {path}: line 2: spanId is not 16 hex digits "
                   "('zzzzzzzzzzzzzzzz'); line 3: attribute torch.collective.seq is not an integer ('seven'); "
                   f"2 lines, the first 9: a doubleValue is not a finite number; {total - 4} more for other reasons\n")


def test_a_lone_surrogate_is_replaced_and_the_span_kept(tmp_path, capsys):
    bad = _line([_span(1, name="x")]).replace('"name": "x"', '"name": "x\\ud800y"')
    (tmp_path / "traces.jsonl").write_text("\n".join([_good(0), bad]) + "\n")
    results = _run([str(tmp_path), "--format", "report-json"][:1], capsys, tmp_path)
    assert _kept(results) == (3, 3)
    assert all(err == "" and status == 0 for status, _, err in results.values())
    names = {span["name"] for span in summary.load_spans([tmp_path])}
    assert "x\ufffdy" in names
    trace = json.loads((tmp_path / "trace.json").read_text())  # written as valid UTF-8
    assert "x\ufffdy" in {event["name"] for event in trace["traceEvents"] if event["ph"] == "X"}


def test_bom_duplicate_keys_and_proto_field_names(tmp_path, capsys):
    good = _good(0).replace('"name": "M forward"', '"name": "first", "name": "M forward"')
    proto_names = _line([_span(7)]).replace("resourceSpans", "resource_spans").replace("traceId", "trace_id")
    (tmp_path / "traces.jsonl").write_bytes(b"\xef\xbb\xbf" + f"{good}\n{proto_names}\n".encode())
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (3, 3)
    assert all(err == "" and status == 0 for status, _, err in results.values())
    assert sorted(span["name"] for span in summary.load_spans([tmp_path])) == ["M forward", "m", "train_step"]


def test_values_json_cannot_hold_or_hash_are_kept(tmp_path, capsys):
    # A bytesValue attribute (perfetto writes it as base64), a list where a host name is expected.
    resource = [_attr(semconv.RANK, intValue="0"), _attr("host.name", arrayValue={"values": [{"stringValue": "a"}]}),
                _attr("process.pid", kvlistValue={"values": [{"key": "k", "value": {"intValue": "1"}}]})]
    spans = [_span(1, attributes=[_attr("blob", bytesValue=base64.b64encode(b"\x00\xff").decode())])]
    (tmp_path / "traces.jsonl").write_text(_line(spans, resource_attrs=resource) + "\n")
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (1, 1)
    assert all(status == 0 and err == "" for status, _, err in results.values())
    (blob,) = [e["args"]["blob"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
               if e["ph"] == "X"]
    assert blob == "AP8="


# ------------------------------------------------------------- bad files


def test_files_that_cannot_be_read_are_skipped_each_with_one_message(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_text(_good(0) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress((_good(1) + "\n").encode()))
    (tmp_path / "folder.jsonl").mkdir()  # a folder named like a file: searched, holds nothing
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "dead.jsonl").symlink_to(tmp_path / "nowhere")
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (2, 2)
    for command, (status, _, err) in results.items():
        assert status == 0
        assert err.splitlines() == [
            f"commdebug-otel {command}: skipped {tmp_path / 'dead.jsonl'}: No such file or directory",
            f"commdebug-otel {command}: skipped {tmp_path / 'packed.jsonl'}: gzip-compressed (gunzip it first)",
            f"commdebug-otel {command}: skipped {tmp_path / 'zero.jsonl'}: a device, not a regular file (not opened)",
        ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_file_is_skipped(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_text(_good(0) + "\n")
    locked = tmp_path / "locked.jsonl"
    locked.write_text(_good(1) + "\n")
    locked.chmod(0)
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (2, 2)
    assert results["summarize"][2] == f"commdebug-otel summarize: skipped {locked}: Permission denied\n"


READERS = ("summarize", "diagnose", "perfetto", "report", "signature", "compare")


@pytest.mark.parametrize("command", READERS)
@pytest.mark.parametrize("case", ["missing", "empty folder", "garbage folder"])
def test_unreadable_input_exits_2_in_every_command(command, case, tmp_path, capsys):
    """As ``compare``'s help says (2 unreadable), for every command that reads files: docs/offline.md, "Exit
    status"."""
    path = tmp_path / "input"
    if case != "missing":
        path.mkdir()
    if case == "garbage folder":
        (path / "traces-rank0.jsonl").write_bytes(b"not json {\n\x00\xff\n")
        (path / "spans.json").write_text('{"resourceSpans": "no"}')
    argv = {"compare": [str(path), str(path)], "perfetto": [str(path), "-o", str(tmp_path / "t.json")],
            "report": [str(path), "-o", str(tmp_path / "r.html")]}.get(command, [str(path)])
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    why = "no such file or folder" if case == "missing" else "no spans found" if command != "compare" else "neither"
    assert err[-1].startswith(f"commdebug-otel {command}: ") and why in err[-1], err
    assert not list(tmp_path.glob("[tr].*"))  # no output written


@pytest.mark.parametrize("command", ["perfetto", "report", "signature"])
def test_an_output_that_cannot_be_written_exits_1_with_one_line(command, tmp_path, capsys):
    (tmp_path / "traces-rank0.jsonl").write_text(_good(0) + "\n")
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "under"
    assert main([command, str(tmp_path), "-o", str(output)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"commdebug-otel {command}: cannot write {output}: Not a directory")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_fifo_named_jsonl_is_not_opened(command, tmp_path):
    (tmp_path / "good.jsonl").write_text(_good(0) + "\n")
    os.mkfifo(tmp_path / "pipe.jsonl")  # nobody writes to it: opening it to read would block forever
    extra = ["-o", str(tmp_path / "trace.json")] if command == "perfetto" else []
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", command, str(tmp_path), *extra],
                         capture_output=True, text=True, env=checkout_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == (f"commdebug-otel {command}: skipped {tmp_path / 'pipe.jsonl'}: a FIFO, "
                          "not a regular file (not opened)\n")
    # Given by name, too.
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", command, str(tmp_path / "pipe.jsonl"), *extra],
                         capture_output=True, text=True, env=checkout_env(), timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == f"commdebug-otel {command}: no spans found (expected OTLP-JSON trace files)"


def test_a_line_over_the_limit_is_skipped_without_being_held(tmp_path):
    path = tmp_path / "traces.jsonl"
    long = _line([_span(1, name="x" * 5_000)])
    path.write_text("\n".join([_good(0), long, _good(1), long]))  # the last one without a newline
    reader = otlp_json.SpanReader([path], max_line_bytes=1_000)
    assert len(list(reader)) == 4
    assert reader.messages == [f"skipped 2 lines in {path}: 2 lines, the first 2: longer than 1000 bytes"]


def test_a_pretty_printed_file_is_one_object(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(json.loads(_good(0)), indent=2))
    reader = otlp_json.SpanReader([path])
    assert [span["name"] for span in reader] == ["train_step", "M forward"] and reader.messages == []


# ----------------------------------------------------- the same spans twice


def test_spans_read_twice_count_once(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "traces-rank0.jsonl").write_text("\n".join([_good(0), _good(1), _good(0)]) + "\n")  # a repeated line
    (run / "copy.jsonl").symlink_to(run / "traces-rank0.jsonl")  # a linked copy
    results = _run([str(run), str(run / "traces-rank0.jsonl")], capsys, tmp_path)  # and the file given again
    assert _kept(results) == (4, 4)
    for command, (status, _, err) in results.items():
        assert status == 0
        # 3 lines (6 spans) read 3 times: 4 spans kept, 14 read again.
        assert err == (f"commdebug-otel {command}: 14 spans read more than once (the same trace and span id: a file "
                       "given twice, a linked copy, repeated lines) are counted once\n")
    assert results["summarize"][1].startswith("4 spans from 1 rank(s) in 1 file(s)\n")


def test_files_read_by_worker_processes_give_the_same_spans_messages_and_counts(tmp_path):
    """Issue 29 item 3: files read one per worker process, a large job's way, are read as one after the other."""
    other = "1" * 32
    (tmp_path / "a.jsonl").write_text("\n".join([_good(0), "{cut", _good(1), _good(0)]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join([_line([_span(1, trace=other, name="train_step",
                                                             attributes=[_attr(semconv.STEP, intValue="0")])]),
                                                 _line([_span(2, parent=1, trace=other)], rank=1)]) + "\n")
    (tmp_path / "c.jsonl").write_text((tmp_path / "a.jsonl").read_text())  # a copy: every span read again
    (tmp_path / "d.jsonl").write_bytes(gzip.compress(b"{}\n"))
    os.mkfifo(tmp_path / "e.jsonl")
    (tmp_path / "f.jsonl").write_text(_good(2) + "\n")

    def read(**options):
        reader = otlp_json.SpanReader([tmp_path], **options)
        spans = list(reader)
        return spans, reader.messages, reader.duplicates, reader.skipped_lines, reader.files

    one_by_one = read(workers=1)
    assert len(one_by_one[0]) == 8 and one_by_one[2:4] == (8, 2)
    assert read(workers=2) == one_by_one
    assert read(workers=3, shared=True) == one_by_one


_READ_FILE = otlp_json._read_file
_PARENT = os.getpid()


def _dies_in_a_worker(path, *args):
    """``otlp_json._read_file``, but a worker process reading rank 2's file dies."""
    if os.getpid() != _PARENT and path.endswith("rank2.jsonl"):
        os._exit(9)
    return _READ_FILE(path, *args)


def test_a_worker_process_that_dies_leaves_its_files_to_the_reader(tmp_path, monkeypatch):
    """A worker killed (the OOM killer, a signal) does not lose its files: they are read in the command's process."""
    for step in range(4):
        (tmp_path / f"traces-rank{step}.jsonl").write_text(_good(step) + "\n")
    expected = list(otlp_json.SpanReader([tmp_path], workers=1))
    monkeypatch.setattr(otlp_json, "_read_file", _dies_in_a_worker)  # forked workers inherit it
    monkeypatch.setattr(sys.modules[__name__], "_PARENT", os.getpid())
    reader = otlp_json.SpanReader([tmp_path], workers=2)
    assert list(reader) == expected and reader.messages == [] and len(reader.files) == 4


def test_a_linked_run_folder_is_read_and_a_link_loop_ends(tmp_path, capsys):
    real = tmp_path / "elsewhere" / "run-1"
    real.mkdir(parents=True)
    (real / "traces-rank0.jsonl").write_text(_good(0) + "\n")
    top = tmp_path / "out"
    top.mkdir()
    (top / "run-1").symlink_to(real)
    (real / "up").symlink_to(top)  # a loop back up
    results = _run([str(top)], capsys, tmp_path)
    assert _kept(results) == (2, 2)
    assert all(status == 0 and err == "" for status, _, err in results.values())


# -------------------------------------------------------------- span trees


def test_parent_loops_and_self_parents_end(tmp_path, capsys):
    spans = [_span(1, parent=2, start=0, end=100), _span(2, parent=1, start=10, end=90),
             _span(3, parent=3, start=200, end=300),
             _span(4, parent=5, start=400, end=500), _span(5, parent=6, start=410, end=490),
             _span(6, parent=5, start=420, end=480)]
    (tmp_path / "traces.jsonl").write_text(_line(spans) + "\n")
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (6, 6)
    assert all(status == 0 and err == "" for status, _, err in results.values())
    loaded = summary.load_spans([tmp_path])
    index = SpanIndex(loaded)
    by_id = {int(span["span_id"], 16): span for span in loaded}
    assert sorted(int(span["span_id"], 16) for span in index.roots) == [1, 3, 5]
    assert [int(span["span_id"], 16) for span in index.ancestors(by_id[4])] == [5]


def test_a_chain_20000_deep(tmp_path, capsys):
    depth = 20_000

    def collective(n):  # one all_reduce on every span: each module counts those of its whole chain below
        return [{"name": "all_reduce", "timeUnixNano": str(n), "attributes": [
            _attr(semconv.COLLECTIVE_OP, stringValue="all_reduce"), _attr(semconv.COLLECTIVE_SEQ, intValue=str(n)),
            _attr(semconv.PROCESS_GROUP_NAME, stringValue="0"), _attr(semconv.PROCESS_GROUP_SIZE, intValue="1")]}]

    spans = [_span(1, name="train_step", start=0, end=10 * depth, attributes=[_attr(semconv.STEP, intValue="0")],
                   events=collective(1))]
    spans += [_span(n, parent=n - 1, name=f"M{n}", start=n, end=10 * depth - n, events=collective(n),
                    attributes=[_attr(semconv.MODULE_FQN, stringValue=f"M{n}")]) for n in range(2, depth + 1)]
    (tmp_path / "traces.jsonl").write_text(_line(spans) + "\n")
    # Module counts sum up the tree once: not one walk up 20,000 parents per collective (hours). In a child
    # process first, so that a walk per collective fails the test instead of stalling the suite.
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "summarize", str(tmp_path), "--format",
                          "report-json"], capture_output=True, text=True, env=checkout_env(), timeout=300)
    counts = json.loads(out.stdout)["module_counts"]
    assert list(counts)[:3] == ["Global", "M2", "M3"] and len(counts) == depth
    assert [counts[fqn]["forward"] for fqn in ("Global", "M2", f"M{depth}")] == [
        {"all_reduce": depth}, {"all_reduce": depth - 1}, {"all_reduce": 1}]
    results = _run([str(tmp_path)], capsys, tmp_path)
    assert _kept(results) == (depth, depth)
    assert all(status == 0 and err == "" for status, _, err in results.values())


# ------------------------------------------------------- Jaeger and Tempo

_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def bad_server():
    """A local HTTP server that misbehaves by path: drips, floods, redirects in a loop, checks credentials."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            try:
                if self.path.startswith("/drip/"):  # headers at once, then one byte every 0.5 s
                    self.send_response(200)
                    self.send_header("Content-Length", "40")
                    self.end_headers()
                    for _ in range(40):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                elif self.path.startswith("/flood/"):  # no length: 64 MiB until the client gives up
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(64):
                        self.wfile.write(b" " * (1 << 20))
                elif self.path.startswith("/big/"):  # says its length up front
                    self.send_response(200)
                    self.send_header("Content-Length", str(2 << 30))
                    self.end_headers()
                elif self.path.startswith("/loop/"):
                    self.send_response(302)
                    self.send_header("Location", self.path)
                    self.end_headers()
                elif self.path.startswith("/creds/"):
                    ok = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"me:s3cret").decode()
                    body = json.dumps({"result": _request([_span(1)])}).encode() if ok else b"{}"
                    self.send_response(200 if ok else 401, "Unauthorized" if not ok else None)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
            except OSError:  # the client hung up: that is the point
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def _diagnose(capsys, *argv):
    status = main(["diagnose", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_dripping_server_is_cut_off_at_the_deadline(bad_server, capsys):
    url, _ = bad_server
    status, _, err = _diagnose(capsys, "--jaeger", url + "/drip", "--trace-id", _TRACE_ID, "--backend-timeout", "1.5")
    assert (status, err) == (2, f"commdebug-otel diagnose: {url}/drip/api/v3/traces/{_TRACE_ID}: no whole answer "
                                "within 1.5 s (diagnose --backend-timeout raises it)\n")


def test_an_answer_over_the_limit_is_not_read(bad_server, capsys):
    url, _ = bad_server
    status, _, err = _diagnose(capsys, "--tempo", url + "/flood", "--trace-id", _TRACE_ID, "--backend-max-mib", "1")
    assert (status, err) == (2, f"commdebug-otel diagnose: {url}/flood/api/v2/traces/{_TRACE_ID}: the answer is over "
                                "the limit of 1048576 bytes (diagnose --backend-max-mib raises it)\n")
    status, _, err = _diagnose(capsys, "--tempo", url + "/big", "--trace-id", _TRACE_ID)
    assert (status, err) == (2, f"commdebug-otel diagnose: {url}/big/api/v2/traces/{_TRACE_ID}: the answer is "
                                f"{2 << 30} bytes, over the limit of {512 << 20} "
                                "(diagnose --backend-max-mib raises it)\n")


def test_a_redirect_loop_says_so(bad_server, capsys):
    url, _ = bad_server
    status, _, err = _diagnose(capsys, "--jaeger", url + "/loop?token=abc", "--trace-id", _TRACE_ID)
    target = f"{url}/loop/api/v3/traces/{_TRACE_ID}?token=***"
    assert status == 2
    assert err == f"commdebug-otel diagnose: {target}: HTTP 302: a redirect loop: {target} -> {target}\n"
    assert "abc" not in err


def test_credentials_are_sent_and_never_printed(bad_server, capsys):
    url, seen = bad_server
    host = url.removeprefix("http://")
    good = f"http://me:s3cret@{host}/creds/?token=hunter2"
    status, out, err = _diagnose(capsys, "--jaeger", good, "--trace-id", _TRACE_ID, "--format", "json")
    assert (status, err) == (0, "")
    assert json.loads(out)["ranks"] == [0]
    # The API path goes after the path, the query stays the query; the userinfo goes in a header.
    assert seen[-1] == (f"/creds/api/v3/traces/{_TRACE_ID}?token=hunter2",
                        "Basic " + base64.b64encode(b"me:s3cret").decode())
    spans = backends.fetch_trace("jaeger", good, _TRACE_ID)
    assert {span["file"] for span in spans} == {f"http://***@{host}/creds/api/v3/traces/{_TRACE_ID}?token=***"}
    status, out, err = _diagnose(capsys, "--jaeger", f"http://me:wrong@{host}/creds?token=hunter2", "--trace-id",
                                 _TRACE_ID)
    assert (status, err) == (2, f"commdebug-otel diagnose: http://***@{host}/creds/api/v3/traces/{_TRACE_ID}"
                                "?token=***: HTTP 401 Unauthorized\n")


def test_many_groups_each_on_its_own_step(tmp_path):
    # 6,000 steps, each with one collective on a group of its own: desyncs look at the (group, step) pairs
    # that hold records, not at every group in every step (36 million pairs: 135 s at 3,000 steps before). In a
    # child process with a timeout, so that the quadratic walk fails the test instead of stalling the suite.
    spans = []
    for step in range(6_000):
        for rank in (0, 1):
            event = (step * 10 + 1, {semconv.COLLECTIVE_OP: "all_reduce", semconv.COLLECTIVE_SEQ: 0,
                                     semconv.PROCESS_GROUP_NAME: f"g{step}", semconv.PROCESS_GROUP_SIZE: 2})
            spans.append(otlp_span(rank, "train_step", f"s{step}", start=step * 10, end=step * 10 + 5,
                                   events=[event], trace=f"t{step}-", world_size=2, **{semconv.STEP: step}))
    write_otlp(spans, tmp_path / "traces.jsonl")
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "diagnose", str(tmp_path), "--format", "json"],
                         capture_output=True, text=True, env=checkout_env(), timeout=240)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert (found["desyncs"], found["steps"], found["ranks"]) == ([], list(range(6_000)), [0, 1])


def test_an_in_flight_event_that_names_no_op_is_not_a_collective(tmp_path, capsys):
    """A damaged stall snapshot: its in-flight ring event has neither a name nor an op; diagnose reads the rest."""
    event = {"name": "", "timeUnixNano": "1500",
             "attributes": [_attr(semconv.COLLECTIVE_STATE, stringValue=semconv.STATE_IN_FLIGHT)]}
    stalled = _span(1, name=semconv.SPAN_STALLED, attributes=[_attr(semconv.STALL_AGE, doubleValue=5.0)],
                    events=[event])
    (tmp_path / "traces-rank0.jsonl").write_text(_line([stalled]) + "\n")
    assert main(["diagnose", "--format", "json", str(tmp_path)]) == 0
    [stall] = json.loads(capsys.readouterr().out)["stalls"]
    assert (stall["rank"], stall["age_s"], stall["in_flight"]) == (0, 5.0, [])
