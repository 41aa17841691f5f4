"""docs/architecture.md's call paths name files and functions that exist (parsed, not imported), and their hops
run, in the order the page gives, in a small traced job and the offline commands (``tests/scripts/call_paths.py``
records the package's Python calls on every thread)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "commdebug_otel"
DOC = ROOT / "docs" / "architecture.md"
# `file.py:Qualified.name`: a module-level function or class, or a method of one (nested defs too).
_NAMED = re.compile(r"`((?:[\w]+/)*[\w]+\.py):([\w.]+)`")
QUESTIONS = "abcdefghi"


def _call_paths() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Call paths")
    return text[start:text.index("\n**the top", start + 1)]


def _names(tree: ast.AST) -> set[str]:
    """Every qualified name defined in ``tree``: ``f``, ``C``, ``C.m``, ``C.m.inner``."""
    found: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                found.add(name)
                walk(child, name + ".")
            elif not isinstance(child, ast.expr):
                walk(child, prefix)  # defs under if/try at the same level

    walk(tree, "")
    return found


def test_every_file_and_function_the_call_paths_name_exists():
    section = _call_paths()
    named = _NAMED.findall(section)
    assert len(named) >= 40  # the parse found the paths, not nothing
    defined: dict[str, set[str]] = {}
    missing = []
    for path, name in named:
        source = PACKAGE / path
        if not source.is_file():
            missing.append(f"{path} (no such file)")
            continue
        if path not in defined:
            defined[path] = _names(ast.parse(source.read_text(encoding="utf-8")))
        if name not in defined[path]:
            missing.append(f"{path}:{name}")
    assert missing == []


def test_every_question_has_a_path():
    section = _call_paths()
    for letter in QUESTIONS:
        answer = re.search(rf"\*\*\({letter}\) [^*]+\*\*(.*?)(?=\n\*\*\(|\Z)", section, re.S)
        assert answer is not None, letter
        assert "→" in answer.group(1) and _NAMED.search(answer.group(1)), letter


def test_the_check_catches_a_name_that_is_gone(tmp_path):
    """The parse is not vacuous: a function that does not exist is reported."""
    tree = ast.parse((PACKAGE / "core/recorder.py").read_text(encoding="utf-8"))
    names = _names(tree)
    assert "Recorder.stall_snapshot" in names and "Recorder.emit" not in names


def _answer(letter: str) -> str:
    found = re.search(rf"\*\*\({letter}\) [^*]+\*\*(.*?)(?=\n\*\*\(|\Z)", _call_paths(), re.S)
    assert found is not None, letter
    return found.group(1)


# Each path's hops, in the order they run: one list per run of arrows on the page (its parentheticals and the
# alternatives this job does not take left out). A class hop is followed through its own ``__init__``; one with
# none (a NamedTuple, a dataclass: generated code) is only named.
CHAINS = {
    "a": [["capture/tracker.py:ModuleTracker._pre_hook", "capture/tracker.py:ModuleTracker._begin",
           "core/ownership.py:ModuleOwnership.module_pre", "core/record_pool.py:RecordPool.module_record"],
          ["capture/tracker.py:ModuleTracker._end", "core/ownership.py:ModuleOwnership.module_post"],
          ["tracer.py:CommTracer._optimizer_step_post_hook",
           "core/step_lifecycle.py:StepLifecycle.optimizer_step_done",
           "core/step_lifecycle.py:StepLifecycle.close_step",
           "core/step_lifecycle.py:StepLifecycle._close", "core/step_export.py:StepExport.export",
           "core/records.py:span_tree", "core/step_export.py:StepExport.emit_tree", "otel/spans.py:SpanBuilder.emit",
           "otel/spans.py:SpanBuilder._start", "otel/spans.py:_DirectSpans.hand_over"]],
    "b": [["capture/intercept.py:CollectiveInterceptor._kernel", "core/collective_path.py:CollectivePath.collective",
           "capture/ops.py:GroupResolver.resolve", "core/collective_path.py:CollectivePath._record",
           "capture/ops.py:message", "core/collectives.py:recorded_fact", "core/fact.py:event_attributes",
           "core/collective_path.py:CollectivePath.add_event"],
          ["core/collectives.py:CollectiveCounter.count", "otel/metrics.py:CollectiveMetrics.collective",
           "core/fact.py:metric_labels"],
          ["core/collective_path.py:CollectivePath.collective", "core/collectives.py:quiet_fact",
           "core/progress.py:Progress.remember", "core/collectives.py:CollectiveCounter.count"]],
    "c": [["tracer.py:CommTracer.__init__", "tracer.py:shared_telemetry",
           "otel/telemetry.py:Telemetry.__init__"],
          ["core/step_lifecycle.py:StepLifecycle._exemplars_on", "otel/spans.py:SpanBuilder.start",
           "otel/telemetry.py:Telemetry.tracer_setup", "otel/telemetry.py:Telemetry.tracer",
           "otel/telemetry.py:Telemetry._make_tracer_provider", "otel/exporters.py:Exporters.make"],
          ["otel/telemetry.py:Telemetry.meter", "otel/telemetry.py:Telemetry._make_meter_provider"]],
    "d": [["tracer.py:CommTracer.__init__", "config.py:Settings.from_env", "config.py:read_option"],
          ["otel/telemetry.py:Telemetry._read_export_env", "config.py:ExportEnv.from_env"]],
    "e": [["stall/watchdog.py:StallWatch._run", "stall/watchdog.py:StallWatch.check",
           "core/progress.py:Progress.threshold_s", "stall/watchdog.py:training_thread_location",
           "core/recorder.py:Recorder.stall_place",
           "core/stall_snapshot.py:stall_place", "core/recorder.py:Recorder.stall_snapshot",
           "core/step_export.py:StepExport.stall_snapshot", "core/stall_snapshot.py:stalled_record",
           "core/progress.py:Progress.ring_events", "core/fact.py:ring_event_attributes",
           "core/records.py:snapshot_tree", "core/step_export.py:StepExport.emit_tree",
           "otel/spans.py:SpanBuilder.emit",
           "otel/telemetry.py:Telemetry.flush_from_watchdog"]],
    "f": [["cli.py:main", "offline/diagnose.py:run", "offline/diagnose.py:_load", "offline/load.py:load_for_command",
           "offline/otlp_json.py:SpanReader", "offline/otlp_json.py:_read_file", "offline/diagnose.py:Reads.digest",
           "offline/rank_read.py:rank_reads", "offline/stragglers.py:rank_times", "offline/otlp_json.py:_fold",
           "offline/diagnose.py:diagnose", "offline/diagnose.py:_straggler_answer", "offline/stragglers.py:find",
           "offline/stragglers.py:late_records", "offline/model.py:arrival_matches",
           "offline/model.py:Arrivals.window_start", "offline/stragglers.py:Timeline.self_times",
           "offline/stragglers.py:blame", "offline/stragglers.py:judge",
           "offline/stragglers.py:format_lines"],
          ["offline/summary.py:report_dict", "offline/summary.py:straggler_answer", "offline/stragglers.py:find"]],
    "g": [["core/step_lifecycle.py:StepLifecycle.open_step", "core/step_export.py:StepExport.trace_id",
           "core/trace_ids.py:StepTraceIds.trace_id", "core/job_identity.py:job_nonce",
           "core/job_identity.py:job_trace_id"],
          ["otel/spans.py:SpanBuilder.emit", "otel/spans.py:SpanBuilder._start", "otel/spans.py:_DirectSpans.context"]],
    "h": [["cli.py:main", "offline/signature.py:run", "offline/signature.py:read_spans",
           "offline/otlp_json.py:SpanReader", "offline/signature.py:signature_of_spans",
           "offline/signature.py:tally_spans", "offline/signature.py:build",
           "offline/signature.py:typical_step", "offline/signature.py:to_json"]],
    "i": [["cli.py:main", "offline/diagnose.py:run", "offline/diagnose.py:diagnose", "offline/diagnose.py:stalls",
           "offline/diagnose.py:_snapshot", "offline/diagnose.py:_stall_record", "offline/diagnose.py:_verdict",
           "offline/hangs.py:form_verdict"],
          ["stall/watchdog.py:StallWatch.check", "stall/watchdog.py:StallWatch._publish"],
          ["stall/watchdog.py:StallWatch._run", "stall/verdict.py:StoreExchange.poll"]],
}
# Named on the page, not run by this one-rank job: the live straggler verdict needs ranks exchanging busy times
# over many steps (tests/test_straggler_live.py runs it), an injected provider's ids (tests/test_own_ids.py), compare
# and the pytest fixture (tests/test_signature.py, tests/test_pytest_plugin.py).
NOT_RUN = {
    "f": ["core/progress.py:Progress.step_ended", "stall/straggler.py:StragglerExchange.poll",
          "stall/straggler.py:StragglerJudge.judge", "stall/straggler.py:late_from_busy",
          "stall/watchdog.py:StallWatch._export_straggler", "core/recorder.py:Recorder.stall_verdict",
          "core/step_lifecycle.py:StepLifecycle.close_step", "core/records.py:self_times",
          "stall/straggler.py:placed_records", "stall/watchdog.py:StallWatch._trace_steps"],
    "g": ["otel/spans.py:StepIdGenerator.ids"],
    # The live stall verdict needs ranks exchanging records through the store (tests/test_verdict.py runs it).
    "i": ["stall/verdict.py:progress_record", "stall/verdict.py:StoreExchange.publish",
          "stall/verdict.py:StoreExchange._records", "stall/watchdog.py:StallWatch._export_verdict",
          "core/recorder.py:Recorder.stall_verdict"],
    "h": ["offline/compare.py:run", "offline/signature.py:load", "offline/signature.py:compare",
          "offline/signature.py:format_diff", "pytest_plugin.py:comm_signature",
          "testing/signatures.py:record_signature",
          "testing/signatures.py:SignatureRecording.__exit__"],
}


def _at(text: str, hop: str, after: int) -> int:
    found = text.find(f"`{hop}`", after)
    assert found >= 0, f"{hop} is not on the page after the hop before it"
    return found


@pytest.mark.parametrize("letter", QUESTIONS)
def test_the_chains_are_the_page_s_hops_in_the_page_s_order(letter):
    answer = _answer(letter)
    for chain in CHAINS[letter]:
        position = 0
        for hop in chain:
            position = _at(answer, hop, position)
    for hop in NOT_RUN.get(letter, []):
        _at(answer, hop, 0)
    # every hop of the page is in a chain or said not to run
    named = {f"{path}:{name}" for path, name in re.findall(r"→\s*`((?:\w+/)*\w+\.py):([\w.]+)`", answer)}
    listed = {hop for chain in CHAINS[letter] for hop in chain} | set(NOT_RUN.get(letter, []))
    assert sorted(named - listed) == []


def _followed(hop: str) -> str | None:
    """The qualified name a call of ``hop`` is recorded under; None for a class with no ``__init__`` of its own."""
    path, name = hop.split(":")
    tree = ast.parse((PACKAGE / path).read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if name in classes:
        own = any(isinstance(item, ast.FunctionDef) and item.name == "__init__" for item in classes[name].body)
        return f"{path}:{name}.__init__" if own else None
    return hop


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("call_paths")
    out = folder / "calls.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "call_paths.py"), str(out),
                           str(folder / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _first_not_run(chain: list[str], calls: list[str]) -> str | None:
    """The first hop of ``chain`` not called after the hop before it (each found from the previous one's call on),
    or None when all are."""
    position = 0
    for hop in chain:
        recorded = _followed(hop)
        if recorded is None:
            continue
        try:
            position = calls.index(recorded, position) + 1
        except ValueError:
            return hop
    return None


@pytest.mark.parametrize("letter", QUESTIONS)
def test_the_hops_run_in_the_page_s_order(letter, calls):
    assert [_first_not_run(chain, calls) for chain in CHAINS[letter]] == [None] * len(CHAINS[letter])


def test_the_order_check_reports_a_hop_that_does_not_run_or_runs_only_before(calls):
    assert _first_not_run(["cli.py:main", "stall/straggler.py:StragglerExchange.poll"], calls) == \
        "stall/straggler.py:StragglerExchange.poll"
    # the job's settings are read before any command: not after the signature's output
    assert _first_not_run(["offline/signature.py:to_json", "config.py:Settings.from_env"], calls) == \
        "config.py:Settings.from_env"
    assert _followed("core/records.py:Step") == "core/records.py:Step.__init__"
    assert _followed("offline/stragglers.py:Late") is None
