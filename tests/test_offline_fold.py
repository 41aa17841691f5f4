"""Issue 29 item 3: ``summarize`` reduces each file, where it is read, to what its views read (the
reader's ``fold``), and prints the same as reading every span; where reducing could change an answer
(a trace split across files, spans read twice), it reads the files again whole."""

import json
import shutil

import pytest

from commdebug_otel import semconv
from commdebug_otel.cli import main
from commdebug_otel.offline import diagnose, otlp_json, rank_read, summary

from otlp_files import span, write_otlp

_STEPS = 3
_RANKS = 4


def _collective(time_ns, seq, late=0):
    return (time_ns + late, {semconv.COLLECTIVE_OP: "all_reduce", semconv.COLLECTIVE_SEQ: seq,
                             semconv.PROCESS_GROUP_NAME: "0", semconv.PROCESS_GROUP_SIZE: _RANKS,
                             semconv.COLLECTIVE_BYTES: 1024, semconv.COLLECTIVE_DURATION: 0.001})


def _rank_spans(rank):
    """Per step: train_step > model > (layer.a: no collective > leaf, layer.b: one all_reduce); rank 2 late."""
    spans = []
    for step in range(_STEPS):
        base = step * 10**9
        ids = {name: f"{name}{step}" for name in ("s", "m", "a", "l", "b")}
        late = 5_000_000 if rank == 2 else 0
        spans += [
            span(rank, semconv.SPAN_TRAIN_STEP, ids["s"], start=base, end=base + 9 * 10**8,
                 **{semconv.STEP: step}),
            span(rank, "model forward", ids["m"], ids["s"], start=base + 1, end=base + 8 * 10**8,
                 **{semconv.MODULE_FQN: "model", semconv.MODULE_PASS: "forward"}),
            span(rank, "model.a forward", ids["a"], ids["m"], start=base + 2, end=base + 10**8,
                 **{semconv.MODULE_FQN: "model.a", semconv.MODULE_PASS: "forward"}),
            span(rank, "model.a.leaf forward", ids["l"], ids["a"], start=base + 3, end=base + 10**7,
                 **{semconv.MODULE_FQN: "model.a.leaf", semconv.MODULE_PASS: "forward"}),
            span(rank, "model.b forward", ids["b"], ids["m"], start=base + 2 * 10**8, end=base + 3 * 10**8,
                 events=[_collective(base + 25 * 10**7, step, late)],
                 **{semconv.MODULE_FQN: "model.b", semconv.MODULE_PASS: "forward"}),
        ]
    return spans


@pytest.fixture
def job(tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    for rank in range(_RANKS):
        write_otlp(_rank_spans(rank), folder / f"traces-rank{rank}.jsonl")
    return folder


def _summarize(capsys, *argv):
    assert main(["summarize", *map(str, argv)]) == 0
    return capsys.readouterr()


def _unfolded(capsys, monkeypatch, *argv):
    """What summarize prints when it reads every span (no fold)."""
    with monkeypatch.context() as patch:
        patch.setattr(summary, "_Needs", lambda rank: None)
        return _summarize(capsys, *argv)


@pytest.mark.parametrize("argv", [(), ("--rank", 1), ("--step", 1), ("--format", "report-json"),
                                  ("--format", "json", "--step", 2, "--rank", 3),
                                  ("--include-warmup", "--format", "report-json")])
def test_folded_files_give_the_same_answers(job, capsys, monkeypatch, argv):
    folded = _summarize(capsys, job, *argv)
    assert folded == _unfolded(capsys, monkeypatch, job, *argv)
    if not argv:
        assert folded.out.startswith(f"{_STEPS * 5 * _RANKS} spans from {_RANKS} rank(s) in {_RANKS} file(s)")


def test_fold_keeps_what_summarize_reads_and_counts_the_rest(job):
    reader = otlp_json.SpanReader([job], fold=summary._Needs(0))
    spans = list(reader)
    assert not reader.unfoldable and reader.duplicates == 0
    # rank 0 whole; on the others every span under a train_step is counted into it: their collectives are in
    # each rank's read (totals and arrivals), made where the file was read
    assert len(spans) == _STEPS * 5 + (_RANKS - 1) * _STEPS
    assert sum(1 + span["folded"] for span in spans) == _RANKS * _STEPS * 5
    assert sorted((span["rank"], span["name"], span["folded"]) for span in spans if span["folded"]) == [
        (rank, semconv.SPAN_TRAIN_STEP, 4) for rank in range(1, _RANKS) for _ in range(_STEPS)]
    assert sorted(reader.digests) == list(range(_RANKS))
    read = reader.digests[2]
    assert read.totals[summary.ALL] == [_STEPS, _STEPS * 1024, {"all_reduce": _STEPS}]
    assert [read.totals[step][0] for step in range(_STEPS)] == [1] * _STEPS
    arrivals = read.times.arrivals
    assert (list(arrivals.seqs), list(arrivals.steps), read.steps) == (list(range(_STEPS)),) * 3
    assert list(arrivals.issued) == [step * 10**9 + 25 * 10**7 + 5_000_000 - 1_000_000 for step in range(_STEPS)]
    apart = otlp_json.SpanReader([job], workers=2, fold=summary._Needs(0))
    assert list(apart) == spans and not apart.unfoldable


def test_a_trace_split_across_files_is_read_again_whole(job, capsys, monkeypatch):
    """Rank 1's model.b spans in a file of their own: their parents are folded in the other file, so
    reading reduced files would lose their steps; the files are read again whole."""
    spans = _rank_spans(1)
    (job / "traces-rank1.jsonl").unlink()
    write_otlp([s for s in spans if s["name"] != "model.b forward"], job / "traces-rank1.jsonl")
    write_otlp([s for s in spans if s["name"] == "model.b forward"], job / "traces-rank1-b.jsonl")
    reader = otlp_json.SpanReader([job], fold=summary._Needs(0))
    list(reader)
    assert reader.unfoldable
    assert _summarize(capsys, job) == _unfolded(capsys, monkeypatch, job)


def test_spans_read_twice_are_counted_once_when_folded(job, capsys, monkeypatch):
    shutil.copy(job / "traces-rank2.jsonl", job / "traces-copy.jsonl")
    reader = otlp_json.SpanReader([job], fold=summary._Needs(0))
    list(reader)
    assert reader.unfoldable  # found by the spans' prints; reading again whole counts them
    folded = _summarize(capsys, job)
    assert folded == _unfolded(capsys, monkeypatch, job)
    assert f"{_STEPS * 5} spans read more than once" in folded.err


def test_a_parent_loop_in_a_file_is_not_folded(tmp_path):
    spans = _rank_spans(1)
    for one in spans:
        if one["name"] == "model forward":
            one["parent_span_id"] = one["span_id"].replace("m", "l")  # model <- model.a.leaf: a loop
    write_otlp(spans, tmp_path / "traces-rank1.jsonl")
    reader = otlp_json.SpanReader([tmp_path], fold=summary._Needs(0))
    kept = list(reader)
    assert len(kept) == len(spans) and {span["folded"] for span in kept} == {0}


def _diagnose(capsys, *argv):
    assert main(["diagnose", *map(str, argv)]) == 0
    return capsys.readouterr()


def _diagnose_unfolded(capsys, monkeypatch, *argv):
    """What diagnose prints when it reads every span (no fold, each rank's timeline built from them)."""
    with monkeypatch.context() as patch:
        patch.setattr(diagnose, "Reads", lambda: None)
        return _diagnose(capsys, *argv)


@pytest.mark.parametrize("argv", [(), ("--format", "json"), ("--include-warmup", "--noise-floor-ms", 0.5)])
def test_diagnose_reads_folded_files_the_same(job, capsys, monkeypatch, argv):
    """diagnose folds every module span without a collective; the straggler's module still comes from each
    rank's timeline, built where the file was read: here rank 2's leaf, which holds no collective, runs 5 ms
    longer in every step."""
    spans = _rank_spans(2)
    for one in spans:
        if one["name"] == "model.a.leaf forward":
            one["end_ns"] += 5_000_000
    write_otlp(spans, job / "traces-rank2.jsonl")
    folded = _diagnose(capsys, job, *argv)
    assert folded == _diagnose_unfolded(capsys, monkeypatch, job, *argv)
    if not argv:
        # Late in the 2 counted steps only: lateness, not yet a straggler (3 steps at least).
        lines = folded.out.splitlines()
        assert "No straggler above the noise (step 0 left out: the first traced step, start-up skew and warm-up; " \
            "--include-warmup counts it)." in lines
        assert ["2", "model.a.leaf", "forward", "0.010", "0.030", "0.010", "2", "2"] in [line.split() for line in lines]


def test_diagnose_reads_the_spans_folded_and_each_ranks_timeline(job):
    reader = otlp_json.SpanReader([job], workers=2, fold=diagnose.Reads())
    spans = list(reader)
    assert not reader.unfoldable and sorted(reader.digests) == list(range(_RANKS))
    # train_step and model.b (its collective) kept; model, model.a and its leaf folded into the train_step
    assert sorted({span["name"] for span in spans}) == ["model.b forward", semconv.SPAN_TRAIN_STEP]
    timeline = reader.digests[2].times.timeline
    assert dict(timeline.self_times(10**9, 10**9 + 3 * 10**8)) == {
        ("model", "forward"): 10**8 + 1, ("model.a", "forward"): 9 * 10**7 + 1,
        ("model.a.leaf", "forward"): 10**7 - 3, ("model.b", "forward"): 10**8, ("(train_step)", ""): 1}


def test_a_rank_in_two_files_is_read_whole_by_diagnose(job, capsys, monkeypatch):
    """Rank 1's steps in two files (no parent across them): one file's timeline would cut its windows
    short at the files' seam, so diagnose reads the files again whole."""
    spans = _rank_spans(1)
    (job / "traces-rank1.jsonl").unlink()
    write_otlp(spans[:5], job / "traces-rank1-step0.jsonl")
    write_otlp(spans[5:], job / "traces-rank1-later.jsonl")
    reader = otlp_json.SpanReader([job], fold=diagnose.Reads())
    list(reader)
    assert reader.unfoldable
    assert _diagnose(capsys, job, "--format", "json") == _diagnose_unfolded(capsys, monkeypatch, job, "--format",
                                                                             "json")


def test_a_desync_is_found_from_the_ranks_prints_and_told_as_read_whole(job, capsys, monkeypatch):
    """Where ranks' prints of a step's collectives differ, diagnose reads those collectives from the spans:
    the same desync as reading every span."""
    spans = _rank_spans(3)
    (event,) = next(one for one in spans if one["name"] == "model.b forward" and one["start_ns"] > 10**9)["events"]
    event["name"] = event["attributes"][semconv.COLLECTIVE_OP] = "all_gather"  # step 1's all_reduce on rank 3
    write_otlp(spans, job / "traces-rank3.jsonl")
    reads = {}
    loaded = summary.load_for_command([job], "diagnose", snapshots=True, fold=diagnose.Reads(), digests=reads)
    assert sorted(reads) == list(range(_RANKS))
    assert len({tuple(read.prints[1].values()) for read in reads.values()}) == 2
    assert [(found["step"], found["ranks"][3]["op"]) for found in diagnose.desyncs(loaded, reads)] == [
        (1, "all_gather")]
    folded = _diagnose(capsys, job, "--format", "json")
    assert folded == _diagnose_unfolded(capsys, monkeypatch, job, "--format", "json")


def test_errors_and_steps_ended_at_exit_read_folded_as_whole(job, capsys, monkeypatch):
    """Rank 1 raised in its last step's leaf (folded unless kept for the error), rank 3 was ended at exit inside
    model.a in its last step: errors and unfinished steps come from each rank's read, as from every span."""
    spans = _rank_spans(1)
    leaf = [one for one in spans if one["name"] == "model.a.leaf forward"][-1]
    leaf["status_code"] = 2
    leaf["events"] = [{"name": "exception", "time_ns": leaf["end_ns"],
                       "attributes": {"exception.type": "RuntimeError", "exception.message": "boom"}}]
    write_otlp(spans, job / "traces-rank1.jsonl")
    spans = _rank_spans(3)
    for one in spans[-5:]:
        if one["name"] in (semconv.SPAN_TRAIN_STEP, "model forward", "model.a forward"):
            one["attributes"][semconv.SPAN_UNMATCHED] = True
    write_otlp(spans, job / "traces-rank3.jsonl")
    folded = _diagnose(capsys, job, "--format", "json")
    assert folded == _diagnose_unfolded(capsys, monkeypatch, job, "--format", "json")
    found = json.loads(folded.out)
    assert [(error["rank"], error["step"], error["module"], error["type"]) for error in found["errors"]] == [
        (1, 2, "model.a.leaf", "RuntimeError")]
    assert [(step["step"], step["closed_at_exit"]) for step in found["unfinished_steps"]] == [
        (2, {"3": {"module": "model.a", "pass": "forward"}})]


def _tail(rank, step, events=()):
    """``rank``'s ``train_step_tail`` of ``step`` (after its train_step, a child of it in the files)."""
    base = step * 10**9
    return span(rank, semconv.SPAN_TRAIN_STEP_TAIL, f"t{step}", f"s{step}", start=base + 9 * 10**8 + 1,
                end=base + 95 * 10**7, events=events, **{semconv.STEP: step})


@pytest.mark.parametrize("where", ["tail", "under the tail"])
def test_a_collective_after_the_step_is_in_no_step_read_folded_as_whole(job, capsys, monkeypatch, where):
    """Rank 3 issued step 1's all_reduce after optimizer.step(): in its train_step_tail (or a span under it),
    which diagnose reads as a root in no step. Folded, the tail kept its step from its train_step (the reader's
    root_step), or was folded into it and its child took that step: the all_reduce was step 1's, and the
    desync (rank 3 issued nothing at seq 1 in step 1) was lost."""
    spans = _rank_spans(3)
    b1 = next(one for one in spans if one["name"] == "model.b forward" and one["start_ns"] > 10**9)
    events = [(19 * 10**8 + 10**7, event["attributes"]) for event in b1["events"]]  # inside the tail
    b1["events"] = []
    tail = _tail(3, 1, events if where == "tail" else ())
    spans.append(tail)
    if where == "under the tail":
        spans.append(span(3, "hook", "h1", tail["span_id"], start=tail["start_ns"] + 1, end=tail["end_ns"] - 1,
                          events=events))
    write_otlp(spans, job / "traces-rank3.jsonl")
    folded = _diagnose(capsys, job, "--format", "json")
    assert folded == _diagnose_unfolded(capsys, monkeypatch, job, "--format", "json")
    (desync,) = json.loads(folded.out)["desyncs"]
    assert (desync["step"], desync["seq"], desync["ranks"]["3"]["op"]) == (1, 1, "none")


def test_a_stalled_steps_empty_tail_does_not_make_it_traced_read_folded(job, capsys, monkeypatch):
    """The last step exported only because it stalled (no child, no event) but for an empty train_step_tail:
    diagnose reads the tail as a root, so the step is untraced; folded, the tail was counted into it."""
    for rank in range(_RANKS):
        spans = [one for one in _rank_spans(rank) if one["start_ns"] < 2 * 10**9 or one["name"] == "train_step"]
        spans[-1]["attributes"][semconv.STEP_STALLED] = 30
        write_otlp([*spans, _tail(rank, 2)], job / f"traces-rank{rank}.jsonl")
    folded = _diagnose(capsys, job)
    assert folded == _diagnose_unfolded(capsys, monkeypatch, job)
    assert folded.out.startswith(f"{_RANKS} rank(s), finished traced steps: 0-1\n")


def test_summarize_and_diagnose_digest_one_rank_read_and_stall_rings_are_no_collectives():
    """One :class:`.rank_read.RankRead` for both commands; a stall snapshot's ring events (a copy of what the
    rank issued) are not matched as collectives, read folded or whole (read whole, lateness once matched them)."""
    spans = [one for rank in range(_RANKS) for one in _rank_spans(rank)]
    ring = {**_collective(0, _STEPS)[1], semconv.COLLECTIVE_STATE: semconv.STATE_IN_FLIGHT}
    spans += [span(rank, semconv.SPAN_STALLED, "stall", start=5 * 10**9, end=5 * 10**9 + 1,
                   events=[(5 * 10**9 - rank, ring)], **{semconv.STEP: _STEPS}) for rank in range(_RANKS)]
    folded = {rank: one for part in (summary._Needs(0).digest([s for s in spans if s["rank"] == rank])
                                     for rank in range(_RANKS)) for rank, one in part.items()}
    checked = {rank: one for part in (diagnose.Reads().digest([s for s in spans if s["rank"] == rank])
                                      for rank in range(_RANKS)) for rank, one in part.items()}
    assert type(folded[2]) is type(checked[2]) is rank_read.RankRead
    assert (folded[2].totals, folded[2].groups) == (checked[2].totals, checked[2].groups)
    assert folded[2].steps == checked[2].steps == list(folded[2].times.arrivals.steps) == list(range(_STEPS))
    assert (folded[2].prints, checked[2].whole) == ({}, frozenset(range(_STEPS)))
    whole = summary.lateness(spans, include_warmup=True)
    assert (whole["matched"], whole["incomplete"]) == (_STEPS, 0)
    assert summary.lateness(spans, include_warmup=True, reads=folded) == whole
