"""Offline views (``summarize``, ``perfetto``) on files written by real multi-rank jobs."""

import argparse
import functools
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.compat.report import (
    GLOBAL,
    CommReport,
    Operation,
    module_chain,
    op_listed,
    render_json,
    render_table,
)
from commdebug_otel.config import Detail
from commdebug_otel.demo import format_counts
from commdebug_otel.offline import diagnose, model, otlp_json, perfetto, summary

from distributed import run_ranks
from otlp_files import span as otlp_span

_STEPS = 2


def _clean_env():
    return {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}


def _normalize(counts):
    return {fqn: {key: {str(op): n for op, n in ops.items() if n} for key, ops in by_pass.items()}
            for fqn, by_pass in counts.items()}


@pytest.fixture(scope="module")
def demo_started(tmp_path_factory):
    """``commdebug-otel demo --steps 2`` (2-rank tensor parallel) started in a fresh folder."""
    cwd = tmp_path_factory.mktemp("demo")
    process = subprocess.Popen([sys.executable, "-m", "commdebug_otel.cli", "demo", "--steps", str(_STEPS)],
                               cwd=cwd, env=_clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    yield cwd, process
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def demo_run(demo_started):
    """The finished demo: (its trace folder, its stdout)."""
    cwd, process = demo_started
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    (folder,) = glob.glob(str(cwd / "commdebug-otel-out" / "run-*"))
    return folder, stdout


@pytest.fixture(scope="module")
def demo_spans(demo_run):
    return summary.load_spans([demo_run[0]])


def _traced_job(rank, world_size, out_dir):
    """Tensor parallel demo model, layer 1 activation-checkpointed, under our CommDebugMode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    from commdebug_otel import CommDebugMode, Settings
    from commdebug_otel import _demo_model as demo

    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        del os.environ[name]  # the file exporter is the default only without OTEL_* settings
    torch.set_num_threads(1)
    args = demo.ModelArgs()
    with CommDebugMode(Settings(output_dir=out_dir)) as comm_mode:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        model = demo.parallelize(demo.Transformer(args, seed=0), mesh)
        block = model.layers[1]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        for step in range(_STEPS):
            tokens, targets = demo.make_batch(args, 2, step)
            demo.train_step(model, optimizer, tokens, targets)
    comm_mode.tracer.telemetry.shutdown()
    return _normalize(comm_mode.comm_module_counts)


@pytest.fixture(scope="module")
def traced_job(tmp_path_factory, demo_started):
    """Live ``comm_module_counts`` of each rank, and the folder its files went to.

    Runs while the demo runs (``demo_started``): both are mostly process start-up.
    """
    out_dir = str(tmp_path_factory.mktemp("traced"))
    return run_ranks(_traced_job, 2, out_dir), out_dir


def _events(spans, rank):
    return [e for s in spans if s["rank"] == rank for e in s["events"]
            if semconv.COLLECTIVE_OP in e["attributes"]]


# ------------------------------------------------------------------ summarize


def test_module_counts_from_files_equal_live_comm_module_counts(traced_job):
    live, out_dir = traced_job
    spans = summary.load_spans([out_dir])
    # Recompute re-issues attention.wo's all_reduce; torch stops recomputing (early stop)
    # before feed_forward.w2's output hook.
    recompute = summary.module_pass_counts(spans, 0)["Transformer.layers.1"]["recompute"]
    assert recompute == {"c10d_functional.all_reduce": _STEPS}
    for rank, counts in enumerate(live):
        assert summary.module_counts(spans, rank) == counts


def test_module_counts_match_the_demo_table(demo_run, demo_spans):
    counts = {fqn: {key: ops for key, ops in by_pass.items() if ops}
              for fqn, by_pass in summary.module_counts(demo_spans, 0).items()}
    table = format_counts(counts).splitlines()
    printed = demo_run[1].splitlines()
    start = printed.index(table[0])
    # Same rows (the demo prints them in module-tree order).
    assert sorted(printed[start:start + len(table)]) == sorted(table)


def test_rank_totals_agree_and_stragglers_match_every_collective(demo_spans):
    totals = summary.rank_totals(demo_spans)
    assert sorted(totals) == [0, 1]
    assert totals[0]["by_op"] == totals[1]["by_op"] and not totals[0]["odd"] and not totals[1]["odd"]
    assert totals[0]["events"] == len(_events(demo_spans, 0))
    lag = summary.lateness(demo_spans, include_warmup=True)  # every collective, the first step too
    assert lag["incomplete"] == 0
    assert lag["matched"] == len(_events(demo_spans, 0))
    for rank in (0, 1):
        stats = lag["per_rank"][rank]
        assert stats["matched"] == len(_events(demo_spans, rank))
        assert 0 <= stats["mean_late_ms"] <= stats["max_late_ms"]
    assert sum(stats["last"] for stats in lag["per_rank"].values()) >= lag["matched"]
    assert lag["most_often_last"] in (0, 1)


def test_rank_totals_flag_a_rank_with_other_counts(demo_spans):
    fewer = [s for s in demo_spans if not (s["rank"] == 1 and s["name"] == "outside_step")]
    totals = summary.rank_totals(fewer)
    assert totals[1]["odd"] and not totals[0]["odd"]
    assert summary.lateness(fewer)["incomplete"] > 0


def test_top_collectives_are_sorted_by_bytes(demo_spans):
    top = summary.top_collectives(demo_spans, rank=0, limit=3)
    assert len(top) == 3 and [t["bytes"] for t in top] == sorted((t["bytes"] for t in top), reverse=True)
    scatter = next(t for t in summary.top_collectives(demo_spans, 0, 100) if t["op"] == "scatter")
    assert scatter["module"] == "outside_step"
    assert scatter["bytes"] == sum(e["attributes"][semconv.COLLECTIVE_BYTES]
                                   for e in _events(demo_spans, 0) if e["name"] == "scatter")


def _cli(module, argv, capsys):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    code = module.run(parser.parse_args(argv))
    return code, capsys.readouterr()


def test_summarize_cli_prints_the_report(demo_run, demo_spans, capsys):
    code, out = _cli(summary, [demo_run[0]], capsys)
    assert code == 0
    assert out.out.startswith(f"{len(demo_spans)} spans from 2 rank(s) in 2 file(s)\n")
    assert summary.format_table(demo_spans, 0) in out.out
    assert "Global\n  FORWARD PASS\n    *c10d.scatter_: 16\n" in out.out
    assert "        Transformer.output\n          FORWARD PASS\n" \
           "            *c10d_functional.all_gather_into_tensor: 2\n" in out.out
    for section in ("Collectives per rank:", "Lateness:", "clock skew", "Top collectives by bytes on rank 0:"):
        assert section in out.out
    assert ("\nStragglers: " in out.out) != ("\nNo straggler above the noise" in out.out)  # one or the other
    code, out = _cli(summary, [demo_run[0], "--rank", "7"], capsys)
    assert code == 1 and "ranks present: 0, 1" in out.err


def test_summarize_json_has_comm_debug_mode_shape(demo_run, demo_spans, capsys):
    code, out = _cli(summary, [demo_run[0], "--format", "json", "--rank", "1"], capsys)
    assert code == 0
    tree = json.loads(out.out)
    keys = {"fqn", "module_type", "parameters", "children", "collectives_forward", "collectives_backward",
            "operations_forward", "operations_backward", "operations_checkpointing"}
    counts = summary.module_counts(demo_spans, 1)
    nodes = []

    def check(node):
        assert set(node) == keys
        nodes.append(node)
        by_pass = counts.get(node["fqn"], {"forward": {}, "backward": {}})
        assert dict(map(tuple, node["collectives_forward"])) == by_pass["forward"]
        assert dict(map(tuple, node["collectives_backward"])) == by_pass["backward"]
        for child in node["children"]:
            assert child["fqn"].startswith(node["fqn"] if node["fqn"] != "Global" else "")
            check(child)

    check(tree)
    fqns = [node["fqn"] for node in nodes]
    assert fqns[:2] == ["Global", "Transformer"] and len(fqns) == len(set(fqns))
    assert set(counts) <= set(fqns)
    wq = nodes[fqns.index("Transformer.layers.0.attention.wq")]
    assert wq["module_type"] == "class 'torch.nn.modules.linear.Linear'"
    assert wq["parameters"] == [["weight", "(Shard(dim=0),)"]]


def test_collector_file_exporter_output_and_folders(demo_run, demo_spans, tmp_path):
    """One file with traces and metrics lines, nested in folders, as a Collector ``file`` exporter writes."""
    nested = tmp_path / "collector" / "2026"
    nested.mkdir(parents=True)
    lines = []
    for signal in ("traces", "metrics"):
        for path in sorted(glob.glob(os.path.join(demo_run[0], f"{signal}-rank*.jsonl"))):
            with open(path) as handle:
                lines += [line for line in handle if line.strip()]
    (nested / "otel-export.json").write_text("".join(lines))
    (nested / "notes.txt").write_text("not telemetry")
    loaded = summary.load_spans([tmp_path / "collector"])
    assert [(s["rank"], s["span_id"]) for s in loaded] == [(s["rank"], s["span_id"]) for s in demo_spans]
    # A single pretty-printed request is read too.
    first = json.loads(lines[0])
    (tmp_path / "one.json").write_text(json.dumps(first, indent=2))
    assert len(summary.load_spans([tmp_path / "one.json"])) == sum(
        len(ss["spans"]) for rs in first["resourceSpans"] for ss in rs["scopeSpans"])
    with pytest.raises(FileNotFoundError):
        summary.load_spans([tmp_path / "missing"])


def test_views_read_apart_and_computed_once_equal_those_read_and_computed_afresh(demo_run, demo_spans):
    """Issue 29 item 3: a large job's files are read by one process per CPU, and within a command's run
    (``model.reusing``) the views share one span index and list of collectives: the same answers."""
    reader = otlp_json.SpanReader([demo_run[0]], workers=2, shared=True)
    apart = sorted(reader, key=lambda span: (span["rank"], span["start_ns"]))
    assert apart == demo_spans and reader.messages == [] and reader.duplicates == 0

    def views(spans):
        return json.loads(json.dumps([summary.report_dict(spans, 0), summary.report_dict(spans, 1, step=1),
                                      summary.step_spans(spans, 0), diagnose.diagnose(spans),
                                      diagnose.diagnose(spans, include_warmup=True)]))

    fresh = views(demo_spans)
    with model.reusing():
        assert views(apart) == fresh
        assert views(apart) == fresh  # the second time from what the first computed


def test_span_warnings_name_mixed_runs_and_dropped_events_per_rank():
    """Each (rank, resource) is looked at once (issue 29 item 3): the warnings are still per rank, exact."""
    def one(rank, span_id, pid, **attributes):
        found = otlp_span(rank, "m", span_id, **attributes)
        found["resource"] = {**found["resource"], "host.name": "h", "process.pid": pid}
        return found

    spans = [one(0, "a", 1), one(0, "b", 1), one(0, "c", 2), one(1, "d", 3, **{semconv.SPAN_DROPPED_EVENTS: 2}),
             one(1, "e", 3) | {"dropped_events_count": 3}, one(2, "f", 4), one(2, "g", 4)]
    spans[1]["resource"] = dict(spans[0]["resource"])  # the same process in another line
    assert summary.span_warnings(spans) == [
        "warning: rank 0 has spans from 2 processes: several runs are mixed; pass one run's folder",
        "warning: rank 1 dropped 5 events over the per-span cap (OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN); "
        "counts here miss them"]


def test_packet_names_follow_comm_debug_mode():
    assert summary.packet_name("_c10d_functional.all_reduce.default") == "c10d_functional.all_reduce"
    assert summary.packet_name("_c10d_functional.all_reduce_.default") == "_c10d_functional.all_reduce_"
    assert summary.packet_name("_c10d_functional_autograd.all_to_all_single.default") == \
        "c10d_functional.all_to_all_single"
    assert summary.packet_name("_c10d_functional_autograd.all_gather_into_tensor.default") == \
        "_c10d_functional_autograd.all_gather_into_tensor"
    assert summary.packet_name("c10d._allgather_base_.default") == "c10d._allgather_base_"
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING

    for native, legacy in NATIVE_TO_PY_MAPPING.items():
        assert summary.packet_name(f"{native}.default") == str(legacy)


# ------------------------------------------------------------------- perfetto


def _ns(us):
    return round(us * 1000)


def test_perfetto_trace_is_valid_and_nested(demo_run, demo_spans, tmp_path, capsys):
    output = tmp_path / "trace.json"
    code, out = _cli(perfetto, [demo_run[0], "-o", str(output)], capsys)
    assert code == 0 and "wrote" in out.out
    trace = json.loads(output.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {1: "rank 0", 2: "rank 1"}
    slices = [e for e in events if e["ph"] == "X"]
    instants = [e for e in events if e["ph"] == "i"]
    assert len(slices) == len(demo_spans)
    assert len(instants) == sum(len(s["events"]) for s in demo_spans)
    assert all(e["s"] == "t" and e["pid"] in names for e in instants)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in names for e in slices)
    # Nesting: on each thread, slices form a proper stack.
    for pid in names:
        stack = []
        for e in sorted((e for e in slices if e["pid"] == pid), key=lambda e: (_ns(e["ts"]), -_ns(e["dur"]))):
            start, end = _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])
            while stack and start >= stack[-1]:
                stack.pop()
            assert not stack or end <= stack[-1], e["name"]
            stack.append(end)
    # Every span lies within its parent span's slice.
    where = {(e["pid"], e["args"]["span_id"]): (_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in slices}
    for span in demo_spans:
        parent = where.get((span["rank"] + 1, span["parent_span_id"]))
        if parent is not None:
            start, end = where[(span["rank"] + 1, span["span_id"])]
            assert parent[0] <= start <= end <= parent[1], span["name"]
    wo = next(e for e in instants if e["args"]["span"] == "Transformer.layers.0.attention.wo forward")
    assert wo["name"] == "all_reduce" and wo["cat"] == "collective"
    assert wo["args"][semconv.OP_NAME] == "_c10d_functional.all_reduce.default"


def test_perfetto_keeps_overlapping_siblings_apart():
    def span(span_id, parent, start, end):
        return {"rank": 0, "trace_id": "t", "span_id": span_id, "parent_span_id": parent, "name": span_id,
                "start_ns": start, "end_ns": end, "attributes": {}, "events": []}

    spans = [span("root", "", 0, 10_000), span("a", "root", 1_000, 6_000),
             span("b", "root", 5_000, 12_000)]
    slices = {e["name"]: e for e in perfetto.chrome_trace(spans)["traceEvents"] if e["ph"] == "X"}
    assert (slices["b"]["ts"], slices["b"]["dur"]) == (6.0, 4.0)
    assert slices["b"]["args"][perfetto.TRIMMED] == 3_000
    assert perfetto.TRIMMED not in slices["a"]["args"]


def test_no_spans_is_an_error(tmp_path, capsys):
    (tmp_path / "metrics-rank0.jsonl").write_text('{"resourceMetrics": []}\n')
    output = str(tmp_path / "t.json")
    for module, argv in ((summary, [str(tmp_path)]), (perfetto, [str(tmp_path), "-o", output])):
        code, out = _cli(module, argv, capsys)
        assert code == 2 and "no spans found" in out.err


def test_a_cut_last_line_loses_only_that_line(tmp_path, caplog):
    from commdebug_otel.offline import summary

    line = json.dumps({"resourceSpans": [{"resource": {"attributes": [
        {"key": "torch.distributed.rank", "value": {"intValue": "0"}}]}, "scopeSpans": [{"spans": [{
            "traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331",
            "name": "train_step", "startTimeUnixNano": "1", "endTimeUnixNano": "2"}]}]}]})
    path = tmp_path / "traces-rank0.jsonl"
    path.write_text(line + "\n" + line[: len(line) // 2])
    spans = summary.load_spans([str(tmp_path)])
    assert [span["name"] for span in spans] == ["train_step"]
    assert caplog.messages == [f"commdebug-otel: skipped 1 line in {path}: line 2: not JSON (Unterminated string "
                               "starting at)"]


# --------------------------------------------------------------- report model


def test_offline_tools_do_not_import_torch():
    code = ("import sys, commdebug_otel.offline.summary, commdebug_otel.offline.perfetto, "
            "commdebug_otel.compat.report; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


def test_op_listed_follows_the_noise_levels():
    listed = {detail: [(name, is_dtensor) for name in ("aten.mm.default", "aten.view.default")
                       for is_dtensor in (True, False) if op_listed(detail, name, is_dtensor)]
              for detail in Detail}
    assert listed == {
        Detail.COLLECTIVES: [],
        Detail.DTENSOR: [("aten.mm.default", True)],
        Detail.OPS: [("aten.mm.default", True), ("aten.mm.default", False)],
        Detail.ALL: [("aten.mm.default", True), ("aten.mm.default", False),
                     ("aten.view.default", True), ("aten.view.default", False)],
    }


def _small_report():
    """Global > Net > (Net.fc with a DTensor weight, Net.act); recompute kept apart."""
    report = CommReport(recompute_apart=True)
    report.reset()
    report.add_module("Net", GLOBAL, 1, "class 'pkg.Net'")
    report.add_module("Net.fc", "Net", 2, "class 'torch.nn.modules.linear.Linear'",
                      [("weight", "(Shard(dim=0),)")])
    report.add_module("Net.act", "Net", 2, "class 'pkg.Act'")
    spans = {"fc": {"fqn": "Net.fc", "parent": "net"}, "net": {"fqn": "Net", "parent": "step"},
             "step": {"fqn": None, "parent": None}}
    chain = module_chain(spans["fc"], lambda node: node["fqn"], lambda node: spans.get(node["parent"]))
    assert chain == ["Net.fc", "Net"]
    report.count_collective("c10d_functional.all_reduce", "forward", chain)
    report.count_collective("c10d_functional.all_reduce", "recompute", chain)
    report.count_collective("c10d.broadcast_", "none", [])
    report.add_operation("Net.fc", Operation("aten.mm.default", ["[4, 8]"], ["(Shard(dim=0),)"],
                                             "DeviceMesh('cpu', [0, 1])", False, False))
    report.add_operation("Net.fc", Operation("aten.view.default", [], [], None, True, False))
    return report


def test_report_table_exact():
    report = _small_report()
    assert render_table(report, 0, colour=False, collective_modules_only=True) == (
        "Global\n  FORWARD PASS\n    *c10d_functional.all_reduce: 1\n    *c10d.broadcast_: 1\n"
        "  ACTIVATION CHECKPOINTING\n    *c10d_functional.all_reduce: 1\n"
        "    Net\n      FORWARD PASS\n        *c10d_functional.all_reduce: 1\n"
        "      ACTIVATION CHECKPOINTING\n        *c10d_functional.all_reduce: 1\n"
        "        Net.fc\n          FORWARD PASS\n            *c10d_functional.all_reduce: 1\n"
        "          ACTIVATION CHECKPOINTING\n            *c10d_functional.all_reduce: 1\n")
    yellow, red, reset = "\033[1;33m", "\033[1;31m", "\033[0m"
    fc = render_table(report, 1).split("        Net.fc\n")[1]
    # noise 1: module data, the DTensor op with its details; BACKWARD PASS is headed (an op ran
    # there) though the trivial view is not shown, as torch does.
    assert fc == (
        "        *module type: class 'torch.nn.modules.linear.Linear'\n"
        "        *Parameter List\n         *weight: (Shard(dim=0),)\n"
        f"          FORWARD PASS\n{yellow}            *c10d_functional.all_reduce: 1{reset}\n"
        f"{yellow}            **aten.mm.default{reset}\n"
        f"{red}              shape: ['[4, 8]']{reset}\n"
        f"{red}              sharding: ['(Shard(dim=0),)']{reset}\n"
        f"{red}              device mesh: DeviceMesh('cpu', [0, 1]){reset}\n"
        "          BACKWARD PASS\n"
        f"          ACTIVATION CHECKPOINTING\n{yellow}            *c10d_functional.all_reduce: 1{reset}\n"
        "        Net.act\n        *module type: class 'pkg.Act'\n")
    assert "            **aten.view.default\n" in render_table(report, 3, colour=False)


def test_report_json_exact():
    tree = render_json(_small_report(), 1)
    fc, act = tree["children"][0]["children"]
    assert fc == {
        "fqn": "Net.fc", "module_type": "class 'torch.nn.modules.linear.Linear'",
        "parameters": [["weight", "(Shard(dim=0),)"]], "children": [],
        "collectives_forward": [["c10d_functional.all_reduce", 1]],
        "collectives_backward": [["c10d_functional.all_reduce", 1]],  # recompute counts as backward
        "operations_forward": [{"name": "aten.mm.default", "input_shape": ["[4, 8]"],
                                "input_sharding": ["(Shard(dim=0),)"],
                                "device_mesh": "DeviceMesh('cpu', [0, 1])", "is_bw": False,
                                "is_activation_checkpointing": False}],
        "operations_backward": [], "operations_checkpointing": []}
    assert act["collectives_forward"] == [] and act["module_type"] == "class 'pkg.Act'"
    assert tree["collectives_forward"] == [["c10d_functional.all_reduce", 1], ["c10d.broadcast_", 1]]
    assert render_json(_small_report(), 0)["children"][0]["module_type"] == ""
