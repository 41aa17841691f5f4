"""benchmarks/accuracy.py keeps working: one run each of a healthy and a straggler scenario, and its table."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def accuracy():
    spec = importlib.util.spec_from_file_location("accuracy_bench", REPO / "benchmarks" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_one_healthy_and_one_straggler_run(accuracy, tmp_path):
    """Two real 2-rank TP jobs. The straggler (50 ms per step in one forward module, 15 counted steps) is named
    first; the healthy run's blame count is reported, not asserted (the model's false-blame rate is what the
    benchmark measures, at most its alpha per job). Answered again from their kept files, the same answers."""
    scenarios = [accuracy.Scenario("healthy"), accuracy.Scenario("fwd")]
    results = accuracy.run_matrix(scenarios, 1, keep=str(tmp_path), log=lambda line: None)
    healthy, fwd = results
    assert "error" not in healthy and "error" not in fwd, results
    assert healthy["scenario"] == "healthy/tp/2r/quiet" and fwd["scenario"] == "fwd/tp/2r/quiet"
    assert healthy["outcomes"] == fwd["outcomes"] == {0: "finished", 1: "finished"}
    assert isinstance(healthy["false_blames"], int) and healthy["false_blames"] == len(healthy["rows"])
    assert fwd["rows"][0] == (1, "Transformer.layers.1.feed_forward", "forward")
    assert fwd["top1"] is True
    again = accuracy.rescore([*results, {"scenario": "fwd/tp/2r/quiet"}, {"scenario": "fwd/tpp/2r/quiet"}],
                             str(tmp_path))
    assert [(run["rows"], run.get("top1"), run.get("false_blames")) for run in again[:2]] == \
        [(run["rows"], run.get("top1"), run.get("false_blames")) for run in results]
    assert [run["error"] for run in again[2:]] == ["no kept files", "not a scenario of the matrix"]


def test_the_table_counts_each_kind_of_answer(accuracy, capsys):
    results = [
        {"scenario": "healthy/tp/2r/quiet", "false_blames": 0},
        {"scenario": "healthy/tp/2r/quiet", "false_blames": 2},
        {"scenario": "healthy/tp/2r/quiet", "false_blames": 0, "live_false": 1},
        {"scenario": "fwd/tp/2r/quiet", "top1": True, "extra_rows": 0, "live_rank_right": True, "live_steps": 3},
        {"scenario": "fwd/tp/2r/quiet", "top1": False, "extra_rows": 1},
        {"scenario": "fwd/tp/2r/quiet", "error": "RuntimeError: x"},
        {"scenario": "failslow/tp/2r/quiet", "top1": True, "extra_rows": 0, "live_rank_right": True,
         "live_steps": 2, "live_place_right": True, "live_place_steps": 2},
        {"scenario": "failslow/tp/2r/quiet", "top1": True, "extra_rows": 0, "live_rank_right": True,
         "live_steps": 9, "live_place_right": False},
        {"scenario": "hang_module/tp/2r/quiet", "hang_right": True, "rank_right": True, "kind_right": True,
         "latency_s": 0.5},
        {"scenario": "hang_module/tp/2r/quiet", "hang_right": False, "rank_right": True, "kind_right": False,
         "latency_s": 1.5},
    ]
    assert accuracy.table_rows(results) == [
        {"scenario": "healthy/tp/2r/quiet", "runs": "3", "errors": "0", "answer": "1/3 blame nobody",
         "detail": "0.67 false blames/run", "live": "1 false live verdicts"},
        {"scenario": "fwd/tp/2r/quiet", "runs": "3", "errors": "1", "answer": "1/3 (33%)",
         "detail": "0.50 extra rows/run", "live": "1/1 named, median 3 steps"},
        {"scenario": "failslow/tp/2r/quiet", "runs": "2", "errors": "0", "answer": "2/2 (100%)",
         "detail": "0.00 extra rows/run",
         "live": "2/2 named, median 5.5 steps; module and pass right 1/2, median 2 steps"},
        {"scenario": "hang_module/tp/2r/quiet", "runs": "2", "errors": "0", "answer": "1/2 (50%)",
         "detail": "rank 2/2, kind 1/2", "live": "1.0 s (max 1.5)"},
    ]
    accuracy.print_table(results)
    out = capsys.readouterr().out
    assert out.splitlines()[-4:] == [
        "straggler top-1 over all fault runs >= 95%: 3/5 (60%): FAIL",
        "healthy runs with a false blame (offline rows or live verdicts): none: 2/3 (3 blames): FAIL",
        "hang verdicts right: all: 1/2 (50%): FAIL",
        "fail-slows named live within 6 steps of the onset: all: 1/2 (50%): FAIL",
    ]
