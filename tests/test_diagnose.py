"""``commdebug-otel diagnose``: straggler blame, stalls, desyncs, from OTLP-JSON files."""

import argparse
import base64
import http.server
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.offline import backends, diagnose, model, stragglers, summary

import test_offline_pipeline
from distributed import run_ranks
from otlp_files import checkout_env, span, write_otlp

_DELAY_S = 0.060
_STEPS = 8
_SLOW_RANK = 1
_SLOW_MODULE = "Transformer.layers.1.feed_forward"
_ODD_STEP = 2
_NOISE_S = 0.010  # a floor above the scheduling noise of ranks that share 2 CPU cores, well below the delay
_STARTUP_S = 0.4  # start-up skew: rank 1 starts the first traced step this late
_BURST_S = 0.100  # an intermittent straggler: this long in 4 of 16 steps only
_BURST_STEPS = (3, 7, 11, 15)
_LONG_STEPS = 16


def _tp_job(rank, world_size, out_dir, delay_in, odd_step=None, steps=_STEPS):
    """The demo transformer, tensor parallel on ``world_size`` gloo ranks, ``steps`` traced steps.

    ``delay_in``: ``"module"``: rank 1 sleeps ``_DELAY_S`` in ``layers.1.feed_forward``'s forward on every
    step; ``"backward"``: the same in its backward (at its input's gradient: after its children's backward);
    ``"intermittent"``: ``_BURST_S`` in its forward on steps ``_BURST_STEPS`` only; ``"between_steps"``: rank 1
    sleeps after ``optimizer.step()``, before the next step's forward; ``"startup"``: rank 1 sleeps
    ``_STARTUP_S`` before step 0 only (start-up skew); None: no delay.
    ``odd_step``: on that step both ranks all-reduce 6 floats in ``layers.0.attention``'s
    forward, rank 0 as shape [2, 3] and rank 1 as shape [6] (same bytes, so gloo runs on: a desync that
    does not hang).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel import _demo_model as demo

    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        del os.environ[name]  # the file exporter is the default only without OTEL_* settings
    torch.set_num_threads(1)
    args = demo.ModelArgs()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = demo.parallelize(demo.Transformer(args, seed=0), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    step_now = [0]

    def wrap(module, before):
        original = module.forward

        def forward(*inputs):
            before()
            return original(*inputs)

        module.forward = forward

    if delay_in == "module" and rank == _SLOW_RANK:
        wrap(model.layers[1].feed_forward, lambda: time.sleep(_DELAY_S))
    if delay_in == "intermittent" and rank == _SLOW_RANK:
        wrap(model.layers[1].feed_forward, lambda: time.sleep(_BURST_S if step_now[0] in _BURST_STEPS else 0))
    if delay_in == "backward" and rank == _SLOW_RANK:
        feed_forward = model.layers[1].feed_forward
        original = feed_forward.forward

        class _SleepInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                time.sleep(_DELAY_S)
                return grad

        feed_forward.forward = lambda x: original(_SleepInBackward.apply(x))
    if odd_step is not None:
        shape = (2, 3) if rank == 0 else (6,)

        def odd():
            if step_now[0] == odd_step:
                torch.distributed.all_reduce(torch.ones(shape))

        wrap(model.layers[0].attention, odd)
    demo.train_step(model, optimizer, *demo.make_batch(args, 2, 0))  # warm-up, untraced
    tracer = CommTracer(Settings(output_dir=out_dir))
    with tracer:
        for step in range(steps):
            step_now[0] = step
            if step and delay_in == "between_steps" and rank == _SLOW_RANK:
                time.sleep(_DELAY_S)  # "data loading": after optimizer.step(), before the forward
            if not step and delay_in == "startup" and rank == _SLOW_RANK:
                time.sleep(_STARTUP_S)  # a slower start (loading, compiling): skew, not a straggler
            demo.train_step(model, optimizer, *demo.make_batch(args, 2, step))
    tracer.telemetry.shutdown()


@pytest.fixture(scope="module")
def module_delay_run(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("module-delay"))
    run_ranks(_tp_job, 2, out_dir, "module")
    return out_dir, summary.load_spans([out_dir])


@pytest.fixture(scope="module")
def between_steps_spans(tmp_path_factory):
    """Rank 1 sleeps between steps; and at step 2 the ranks all-reduce different shapes (a desync)."""
    out_dir = str(tmp_path_factory.mktemp("between-steps"))
    run_ranks(_tp_job, 2, out_dir, "between_steps", _ODD_STEP)
    return out_dir, summary.load_spans([out_dir])


@pytest.fixture
def busy_core():
    """Another process burning a core while the job runs (the machine's own noise, made worse). At the lowest
    priority: on 2 shared cores one at equal priority takes a rank's core from it half the time, and that rank is
    then late step after step, a true straggler (rank 0 in (train_step), about 60 ms a step, seen so)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def _diagnose_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    diagnose.add_arguments(parser)
    code = diagnose.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _summarize_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    summary.add_arguments(parser)
    code = summary.run(parser.parse_args(argv))
    return code, capsys.readouterr().out


def _both(out_dir, capsys):
    """Both commands on the files as a user runs them (each reads them folded): diagnose's JSON, summarize's
    report JSON, and the straggler lines of each text."""
    _, found, _ = _diagnose_cli([str(out_dir), "--format", "json"], capsys)
    _, report = _summarize_cli([str(out_dir), "--format", "report-json"], capsys)
    texts = [_diagnose_cli([str(out_dir)], capsys)[1], _summarize_cli([str(out_dir)], capsys)[1]]
    # (host contention's rows, a rank waiting for a CPU the busy core took, are no straggler lines)
    lines = [[line for line in text.splitlines() if line.startswith(("Stragglers: ", "No straggler", "  rank "))
              and ("late in" in line or not line.startswith("  ")) and "for a CPU" not in line] for text in texts]
    return json.loads(found), json.loads(report), lines


def _lateness(spans, **kwargs):
    return stragglers.find(spans, **kwargs)["lateness"]


def _at_least(value, expected, tolerance=0.2):
    """A lower bound only: a sleep never ends early, but a busy machine (2 shared cores) adds to any delay."""
    return value >= (1 - tolerance) * expected


def _assert_each_delay_counted_once(spans, module, steps):
    """Above a 10 ms floor, the slow rank's lateness row for where the delay was holds one collective per
    delayed step.

    Other rows may appear above that floor too when the machine is busy (a rank descheduled on
    shared cores, the first traced step's exporter start): they are not asserted on.
    """
    rows = _lateness(spans, noise_floor_s=_NOISE_S)
    row = next(row for row in rows if (row["rank"], row["module"]) == (_SLOW_RANK, module))
    assert (row["collectives"], row["steps"]) == (len(steps), steps), rows


def _assert_the_one_straggler(out_dir, capsys, module, pass_, steps, only=True):
    """Both commands name the same stragglers, first (``only``: and only) the slow rank at ``module``, late beyond
    the noise in most of ``steps``."""
    found, report, lines = _both(out_dir, capsys)
    assert found["stragglers"] == report["stragglers"], (found["stragglers"], report["stragglers"])
    rows = found["stragglers"] if only else found["stragglers"][:1]
    assert [(row["rank"], row["module"], row["pass"]) for row in rows] == [(_SLOW_RANK, module, pass_)], rows
    row = rows[0]
    # The steps it was late in beyond the noise: on a busy machine the noise may hide one or two of them (and the
    # row may be late in another step too).
    assert len(set(row["late_steps"]) & set(steps)) >= stragglers.MIN_STEPS_LATE, row
    assert row["statistic"] == "binomial"
    assert row["p_value"] * row["tested"] <= stragglers.ALPHA, row
    assert lines[0] == lines[1] and lines[0][1] == f"  {stragglers.row_text(row)}", lines
    assert all(row["late_min_s"] > row["noise_cut_s"] for row in found["stragglers"])
    return row


def test_a_rank_slow_in_one_module_is_blamed_with_that_module(module_delay_run, capsys):
    out_dir, spans = module_delay_run
    rows = _lateness(spans)
    top = rows[0]
    assert (top["rank"], top["module"], top["pass"]) == (_SLOW_RANK, _SLOW_MODULE, "forward"), rows[:3]
    assert _at_least(top["lost_s"], _DELAY_S * (_STEPS - 1)), top
    # Once a step, feed_forward.w2's all_reduce waits for rank 1's sleep (step 0, warm-up, left out).
    _assert_each_delay_counted_once(spans, _SLOW_MODULE, list(range(1, _STEPS)))
    assert _at_least(top["excess_s"], _DELAY_S * (_STEPS - 1)), top
    assert top["waited_s"] == top["lost_s"]  # one other rank: it waited as long as the collective was held
    assert [row["lost_s"] for row in rows] == sorted((row["lost_s"] for row in rows), reverse=True)
    row = _assert_the_one_straggler(out_dir, capsys, _SLOW_MODULE, "forward", list(range(1, _STEPS)))
    assert row["steps_seen"] == _STEPS - 1


def test_a_rank_slow_in_one_modules_backward_is_blamed_with_its_backward(tmp_path, capsys):
    run_ranks(_tp_job, 2, str(tmp_path), "backward")
    # First: on this busy machine rank 0 has also been late in (train_step) step after step (76 ms in 3 steps).
    row = _assert_the_one_straggler(tmp_path, capsys, _SLOW_MODULE, "backward", list(range(1, _STEPS)), only=False)
    assert _at_least(row["lost_s"], _DELAY_S * (_STEPS - 1)), row


def test_an_intermittent_straggler_is_found_in_the_steps_it_was_slow(tmp_path, capsys):
    # 100 ms in 4 of 16 steps only: no majority of steps, but each far beyond the other rank's noise.
    run_ranks(_tp_job, 2, str(tmp_path), "intermittent", None, _LONG_STEPS)
    # First: on a busy machine the slow rank has also been named in (train_step) and (between steps), later in the
    # steps it slept in (the burst's echo on its own schedule).
    row = _assert_the_one_straggler(tmp_path, capsys, _SLOW_MODULE, "forward", list(_BURST_STEPS), only=False)
    assert row["steps_seen"] == _LONG_STEPS - 1, row
    assert _at_least(row["late_min_s"], _BURST_S), row


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_healthy_job_has_no_straggler_beside_a_busy_core(tmp_path, capsys, busy_core, world_size):
    run_ranks(_tp_job, world_size, str(tmp_path), None)
    found, report, lines = _both(tmp_path, capsys)
    assert found["stragglers"] == [] and report["stragglers"] == [], (found["stragglers"], report["stragglers"])
    assert found["lateness"], found  # the noise is still there to read
    assert lines == [["No straggler above the noise (step 0 left out: the first traced step, start-up skew and "
                      "warm-up; --include-warmup counts it)."]] * 2, lines


def test_a_rank_slow_between_steps_is_blamed_for_the_gap(between_steps_spans, capsys):
    out_dir, spans = between_steps_spans
    rows = _lateness(spans)
    top = rows[0]
    assert (top["rank"], top["module"], top["pass"]) == (_SLOW_RANK, diagnose.BETWEEN_STEPS, ""), rows[:3]
    assert _at_least(top["lost_s"], _DELAY_S * (_STEPS - 1)), top
    # The sleep comes before steps 1..7: each step's first collective waits for it.
    _assert_each_delay_counted_once(spans, diagnose.BETWEEN_STEPS, list(range(1, _STEPS)))
    # First: a busy machine has named a second row now and then (rank 1 in a backward module, 64 ms in 3 steps).
    _assert_the_one_straggler(out_dir, capsys, diagnose.BETWEEN_STEPS, "", list(range(1, _STEPS)), only=False)


def test_a_real_desync_names_both_sides(between_steps_spans):
    _, spans = between_steps_spans
    per_step = len([event for event in summary.collective_events(summary.step_spans(spans, 0), rank=0)])
    assert per_step == 17  # the demo transformer's tensor parallel collectives in one step
    side = {"op": "all_reduce", "dtype": "float32", "reduce_op": "sum", "module": "Transformer.layers.0.attention",
            "pass": "forward", "seq": _ODD_STEP * per_step + 1}  # after tok_embeddings' all_reduce
    assert diagnose.desyncs(spans) == [{"group": "0", "seq": _ODD_STEP * per_step + 1, "step": _ODD_STEP, "ranks": {
        0: side | {"shape": [2, 3]}, 1: side | {"shape": [6]}}}]


def test_diagnose_command(between_steps_spans, capsys):
    out_dir, spans = between_steps_spans
    code, out, _ = _diagnose_cli([out_dir, "--format", "json"], capsys)
    found = json.loads(out)
    assert code == 0 and found == json.loads(json.dumps(diagnose.diagnose(spans)))
    assert list(found) == ["errors", "stalls", "unfinished_steps", "desyncs", "stragglers", "contended", "lateness",
                           "pipeline_waits", "ranks", "missing_ranks", "steps", "noise_floor_s", "alpha",
                           "warmup_step", "warmup_steps", "watchdog", "warnings"]
    code, out, _ = _diagnose_cli([out_dir], capsys)
    assert code == 0
    text = out.splitlines()
    assert text[:8] == ["2 rank(s), finished traced steps: 0-7", "", "Errors: 0", "",
                        f"Stalls: 0 ({diagnose._no_stall_text(found['watchdog'])})", "", "Desyncs: 1",
                        f"  group 0, step {_ODD_STEP}, seq {found['desyncs'][0]['seq']}: ranks disagree"]
    assert text[8:10] == ["    rank 0: all_reduce float32 [2, 3] in Transformer.layers.0.attention forward",
                         "    rank 1: all_reduce float32 [6] in Transformer.layers.0.attention forward"]
    row = found["stragglers"][0]
    start = text.index(f"Stragglers: {len(found['stragglers'])} (rank, module, pass) late consistently and beyond "
                       "the other ranks' noise "
                       f"(Bonferroni over {row['tested']} rows, alpha 0.05) (step 0 left out: the first traced step, "
                       "start-up skew and warm-up; --include-warmup counts it):")
    assert text[start + 1] == f"  {stragglers.row_text(row)}"
    assert text[start + 2].startswith("  Lateness, noise included: lost = wall time a collective was held back")
    assert 9 < start < text.index("Pipeline waits: 0 send/recv pairs, total wait 0.000 ms")


def test_start_up_skew_and_the_first_step_are_left_out_and_said_so(tmp_path, capsys):
    # torchtitan's healthy runs headed the table with "(unattributed)" 0.35-0.63 s of start-up skew at step 0.
    run_ranks(_tp_job, 2, str(tmp_path), "startup")
    spans = summary.load_spans([tmp_path])
    rows = _lateness(spans, noise_floor_s=_NOISE_S)
    assert all(0 not in row["steps"] for row in rows), rows
    counted = _lateness(spans, noise_floor_s=_NOISE_S, include_warmup=True)
    # At least half the skew: rank 0's own start (its first collective comes later than rank 1's would) takes
    # some of it off, by as much as the machine's load makes it (0.317 s of 0.4 s seen).
    # (A loaded machine may make the same row late in a later step too: step 0 is in it, with the skew.)
    assert any(row["rank"] == _SLOW_RANK and 0 in row["steps"] and row["lost_s"] >= _STARTUP_S / 2
               for row in counted), counted
    # One slow step, even counted, is no straggler: the skew is in no straggler row.
    for include_warmup in (False, True):
        found = stragglers.find(spans, include_warmup=include_warmup)["stragglers"]
        assert all(0 not in row["late_steps"] and row["rank"] != _SLOW_RANK for row in found), found
    # summarize, the same step left out: the skew is only in the lateness that includes it.
    left_out, all_steps = summary.lateness(spans), summary.lateness(spans, include_warmup=True)
    assert (left_out["warmup_step"], all_steps["warmup_step"]) == (0, None)
    assert left_out["matched"] < all_steps["matched"]
    assert all_steps["per_rank"][_SLOW_RANK]["max_late_ms"] >= _STARTUP_S * 1e3 / 2, all_steps
    code, out, _ = _diagnose_cli([str(tmp_path)], capsys)
    assert code == 0 and "(step 0 left out: the first traced step, start-up skew and warm-up; --include-warmup " \
        "counts it)" in out, out
    assert "left out" not in _diagnose_cli([str(tmp_path), "--include-warmup"], capsys)[1]
    assert "(step 0 left out: the first traced step" in summary.format_report(spans)


_DDP_DELAY_S = 0.1
_DDP_STEPS = 5


def _ddp_job(rank, world_size, out_dir):
    """DDP over 4 linear layers, one gradient bucket each (asynchronous all_reduces in backward); rank 1 sleeps
    ``_DDP_DELAY_S`` after the forward, before ``backward()``, on each of ``_DDP_STEPS`` traced steps."""
    from torch.nn.parallel import DistributedDataParallel

    from commdebug_otel import CommTracer, Settings

    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        del os.environ[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.01)  # 16.6 KB a layer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        loss = model(torch.randn(8, 64)).sum()
        if rank == _SLOW_RANK and tracer is not None:
            time.sleep(_DDP_DELAY_S)  # in train_step, outside every module
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    tracer = None
    step()  # warm-up, untraced: DDP builds its buckets
    tracer = CommTracer(Settings(output_dir=out_dir))
    with tracer:
        for _ in range(_DDP_STEPS):
            step()
    tracer.telemetry.shutdown()


def test_ddp_buckets_late_after_one_delay_count_it_once(tmp_path):
    run_ranks(_ddp_job, 2, str(tmp_path))
    spans = summary.load_spans([tmp_path])
    buckets = [event for event in summary.collective_events(summary.step_spans(spans, 0), rank=0)]
    assert [event.name for event in buckets].count("all_reduce") == 4, [event.name for event in buckets]
    rows = _lateness(spans, noise_floor_s=_NOISE_S)
    top = rows[0]
    assert (top["rank"], top["module"]) == (_SLOW_RANK, diagnose.TRAIN_STEP), rows[:3]
    found = stragglers.find(spans)["stragglers"]
    assert [(row["rank"], row["module"], row["steps_late"]) for row in found] == [
        (_SLOW_RANK, diagnose.TRAIN_STEP, _DDP_STEPS - 1)], found
    # Each delay once, on the first bucket after it: not once per bucket (4 x as much); step 0 (warm-up) left out.
    assert (top["collectives"], top["steps"]) == (_DDP_STEPS - 1, list(range(1, _DDP_STEPS))), rows[:3]
    injected = _DDP_DELAY_S * (_DDP_STEPS - 1)
    assert _at_least(top["lost_s"], injected) and _at_least(top["excess_s"], injected), top
    # Counted per bucket, the other 3 buckets' rows would each hold about as much as the top row; what else the
    # slow rank is blamed for is scheduling noise, a fraction of it (a wall-clock bound broke: 0.61 < 0.6).
    assert sum(row["lost_s"] for row in rows[1:] if row["rank"] == _SLOW_RANK) < top["lost_s"], rows


# ------------------------------------------------------------ hand-built files

MS = 1_000_000
S = 1000 * MS


def _collective(seq, op="all_reduce", shape=(8,), group="0", size=2, **extra):
    return {semconv.COLLECTIVE_OP: op, semconv.COLLECTIVE_SEQ: seq, semconv.PROCESS_GROUP_NAME: group,
            semconv.PROCESS_GROUP_SIZE: size, semconv.COLLECTIVE_DTYPE: "float32",
            semconv.COLLECTIVE_SHAPE: list(shape), semconv.COLLECTIVE_BYTES: 4 * math.prod(shape), **extra}


def _module(rank, fqn, span_id, parent, start, end, events=(), pass_="forward", trace="t"):
    return span(rank, f"{fqn} {pass_}", span_id, parent, start, end, events, trace, world_size=2,
                **{semconv.MODULE_FQN: fqn, semconv.MODULE_PASS: pass_})


def _step(rank, step, span_id, start, end, events=(), trace="t", **attributes):
    return span(rank, "train_step", span_id, "", start, end, events, trace, world_size=2,
                **{semconv.STEP: step, **attributes})


def _load(spans, tmp_path):
    write_otlp(spans, tmp_path / "traces.jsonl")
    return summary.load_spans([tmp_path])


def _blocking(issued_ms, returned_ms, seq):
    """A blocking collective's event: stamped when the call returned, with the time it took."""
    return round(returned_ms * MS), _collective(seq, **{semconv.COLLECTIVE_DURATION: (returned_ms - issued_ms) / 1e3})


def test_straggler_blame_exact(tmp_path):
    # Step 0 on two ranks, blocking collectives (each returns when the last rank arrives): rank 1's M.a takes
    # 10 ms longer before seq 0; 0.5 ms late at seq 1 (noise); then 12 ms late at seq 2, with 11.5 ms more in
    # train_step itself since its previous arrival.
    spans = []
    for rank, (a_end, seq1, seq2) in enumerate(((20, 40, 50), (30, 40.5, 62))):
        spans += [_step(rank, 0, "s", 0, 100 * MS, [_blocking(seq1, 40.5, 1), _blocking(seq2, 62, 2)]),
                  _module(rank, "M.a", "a", "s", 1 * MS, 30 * MS, [_blocking(a_end, 30, 0)])]
    rows = _lateness(_load(spans, tmp_path))
    assert rows == [
        {"rank": 1, "module": diagnose.TRAIN_STEP, "pass": "", "lost_s": 0.012, "waited_s": 0.012, "collectives": 1,
         "steps": [0], "excess_s": 0.0115},
        {"rank": 1, "module": "M.a", "pass": "forward", "lost_s": 0.01, "waited_s": 0.01, "collectives": 1,
         "steps": [0], "excess_s": 0.01},
    ]
    # Below 1 ms, seq 1 is noise; with a lower floor it counts: rank 1 took 10.5 ms from seq 0 (left by both
    # ranks at 30 ms) to seq 1, rank 0 10 ms, both in train_step.
    assert _lateness(_load(spans, tmp_path), noise_floor_s=0.0003)[0] == {
        "rank": 1, "module": diagnose.TRAIN_STEP, "pass": "", "lost_s": 0.0125, "waited_s": 0.0125,
        "collectives": 2, "steps": [0], "excess_s": 0.012}


def test_one_late_collective_is_lateness_not_a_straggler(tmp_path):
    # A blocking all_reduce: rank 1 issues it 20 ms after rank 0, both return at 30 ms. The time the call
    # returned says nothing of who was late; the issue time (one definition, docs/diagnosis.md) does. One
    # step is no evidence of a straggler: both commands say so, and both keep the lateness.
    spans = []
    for rank, issued_ms in ((0, 5), (1, 25)):
        event = (30 * MS, {semconv.COLLECTIVE_OP: "all_reduce", semconv.COLLECTIVE_SEQ: 0,
                           semconv.PROCESS_GROUP_NAME: "0", semconv.PROCESS_GROUP_SIZE: 2,
                           semconv.COLLECTIVE_DURATION: (30 - issued_ms) / 1e3})
        spans.append(span(rank, "train_step", "s", start=0, end=40 * MS, events=[event], world_size=2,
                          **{semconv.STEP: 0}))
    spans = _load(spans, tmp_path)
    lag = summary.lateness(spans)
    assert (lag["per_rank"][1]["max_late_ms"], lag["per_rank"][1]["last"], lag["per_rank"][0]["last"]) == (20, 1, 0)
    (row,) = _lateness(spans)
    assert (row["rank"], row["lost_s"] * 1e3) == (1, 20)
    assert stragglers.find(spans)["stragglers"] == summary.report_dict(spans)["stragglers"] == []
    assert "No straggler above the noise." in summary.format_report(spans).splitlines()
    assert "No straggler above the noise." in diagnose.format_text(diagnose.diagnose(spans)).splitlines()


def _steps_late_by(late_ms, place=True, step_ms=()):
    """Steps 0.. of 100 ms (``step_ms[step]`` where given) on 2 ranks, one blocking all_reduce each;
    ``late_ms[step]``: ``(rank, ms)`` that rank issued it after the other, having spent those ms in ``M.slow``
    forward (``place=False``: in no module)."""
    spans = []
    at = 0
    for step, (late_rank, ms) in enumerate(late_ms):
        at += (step_ms[step - 1] if 0 < step <= len(step_ms) else 100) * MS if step else 0
        took = (step_ms[step] if step < len(step_ms) else 100) * MS
        for rank in (0, 1):
            issued = at + 10 * MS + (ms * MS if rank == late_rank else 0)
            event = (at + 60 * MS, _collective(step, **{semconv.COLLECTIVE_DURATION: (at + 60 * MS - issued) / 1e9}))
            spans.append(_step(rank, step, f"s{step}", at, at + took, [event], trace=f"t{step}"))
            if rank == late_rank and place:
                spans.append(_module(rank, "M.slow", f"m{step}", f"s{step}", at + 10 * MS, issued, trace=f"t{step}"))
    return spans


def test_slow_steps_right_after_the_first_are_warm_up_and_left_out(tmp_path, capsys):
    # FSDP2 on CPU ran its steps 1 and 2 at 2 to 4 times the later ones, rank 1 late there: warm-up. Steps 1-3 take
    # 300 ms against 100 ms later (over 1.5 x the median), rank 1 30 ms late in M.slow in each; then one rank or the
    # other a little late. Steps 0-3 are left out: no straggler. Counted (--include-warmup), rank 1 is one.
    late = [(1, 50), (1, 30), (1, 30), (1, 30)] + [(step % 2, 3) for step in range(4, 16)]
    spans = _load(_steps_late_by(late, step_ms=(100, 300, 300, 300)), tmp_path)
    answer = stragglers.find(spans)
    assert (answer["stragglers"], answer["warmup_step"], answer["warmup_steps"]) == ([], 3, [0, 1, 2, 3])
    assert [row["rank"] for row in stragglers.find(spans, include_warmup=True)["stragglers"]] == [1]
    assert ("No straggler above the noise (steps 0-3 left out: the first traced step and the 3 after it that took "
            "over 1.5 times the median step, start-up skew and warm-up; --include-warmup counts them).") \
        in summary.format_report(spans)
    # A slow step later in the run is no warm-up: only the steps right after the first are.
    assert model.warmup_steps(_load(_steps_late_by([(1, 3)] * 12, step_ms=(100, 100, 300)), tmp_path)) == [0]


def test_a_straggler_is_late_consistently_and_beyond_the_other_ranks_noise(tmp_path):
    # A healthy run: now one rank, now the other, a few ms late (step 0, warm-up, left out). Rank 1 is late in
    # 3 of 5 steps by 6 ms, over rank 0's 4 and 5 ms; but rank 0 is as often late beyond the 1 ms floor.
    healthy = _steps_late_by([(1, 50), (1, 6), (0, 4), (1, 6), (0, 5), (1, 6)])
    assert stragglers.find(_load(healthy, tmp_path))["stragglers"] == []
    # Rank 1 30 ms late on every counted step in M.slow, rank 0 never: q = (0 + 1) / (5 steps x 1 place + 1).
    slow = _steps_late_by([(1, 30)] * 6)
    assert stragglers.find(_load(slow, tmp_path))["stragglers"] == [{
        "rank": 1, "module": "M.slow", "pass": "forward", "lost_s": 0.15, "steps_late": 5, "steps_seen": 5,
        "late_steps": [1, 2, 3, 4, 5], "late_min_s": 0.03, "late_max_s": 0.03, "noise_cut_s": 0.001,
        "null_rate": 1 / 6, "p_value": pytest.approx((1 / 6) ** 5), "tested": 1, "statistic": "binomial"}]
    assert "  rank 1 in M.slow forward: late in 5 of 5 steps, 30 ms (noise cut 1.0 ms), p=1e-04" \
        in summary.format_report(_load(slow, tmp_path)).splitlines()
    # The same lateness with no place where rank 1 spent more time (a pipeline stage's place in the schedule, a
    # wait for a peer on another group): lateness, never a straggler.
    unplaced = stragglers.find(_load(_steps_late_by([(1, 30)] * 6, place=False), tmp_path))
    assert unplaced["stragglers"] == []
    assert [(row["rank"], row["module"], row["steps"]) for row in unplaced["lateness"]] == [
        (1, diagnose.UNATTRIBUTED, [1, 2, 3, 4, 5])]
    # Intermittent: 100 ms in 3 of 11 counted steps, both ranks 2-5 ms late now and then otherwise. The other
    # row's noise (rank 0's cells 2, 3, 4 and 5 ms: median 3.5 ms, MAD 1 ms: cut 7.9 ms) hides rank 1's small
    # delays, not its 100 ms ones.
    noise = [(0, 3), (1, 2), (0, 5), (1, 4), (0, 2), (1, 5), (0, 4), (1, 3)]
    intermittent = [(0, 1)] + [(1, 100) if step in (3, 6, 9) else noise.pop() for step in range(1, 12)]
    (row,) = stragglers.find(_load(_steps_late_by(intermittent), tmp_path))["stragglers"]
    assert (row["rank"], row["late_steps"], row["steps_seen"]) == (1, [3, 6, 9], 11), row
    assert row["noise_cut_s"] == pytest.approx(0.0035 + 3 * 1.4826 * 0.001), row
    # One slow step is an event, not a straggler.
    once = _steps_late_by([(0, 1)] + [(1, 100) if step == 6 else (step % 2, 3) for step in range(1, 12)])
    assert stragglers.find(_load(once, tmp_path))["stragglers"] == []


def test_asynchronous_collectives_count_a_delay_once(tmp_path):
    # DDP's buckets: four all_reduces issued asynchronously in M.b's backward (each returns at once). Rank 1
    # spends 50 ms longer there before the first; the other three are as late, but only by that delay. Rank 0
    # then waits for the buckets (train_step, 50 ms), and rank 1 spends 5 ms more in M.c before seq 4: lost
    # there though rank 1 left seq 3 50 ms late.
    spans = []
    for rank, late_ms in enumerate((0, 50)):
        buckets = [((11 + i + late_ms) * MS, _collective(i)) for i in range(4)]
        c_end = (94 if rank == 0 else 99) * MS
        spans += [_step(rank, 0, "s", 0, 200 * MS),
                  _module(rank, "M.b", "b", "s", 1 * MS, (14 + late_ms) * MS, buckets, pass_="backward"),
                  _module(rank, "M.c", "c", "s", 64 * MS, c_end),
                  _module(rank, "M.d", "d", "s", c_end, c_end + 7 * MS, [(c_end + 6 * MS, _collective(4))])]
    rows = _lateness(_load(spans, tmp_path))
    assert rows == [
        {"rank": 1, "module": "M.b", "pass": "backward", "lost_s": 0.05, "waited_s": 0.05, "collectives": 1,
         "steps": [0], "excess_s": 0.05},
        {"rank": 1, "module": "M.c", "pass": "forward", "lost_s": 0.005, "waited_s": 0.005, "collectives": 1,
         "steps": [0], "excess_s": 0.005},
    ], rows


def test_lateness_spread_thin_is_its_own_work_in_several_places(tmp_path):
    # Rank 1 is 2 ms late at a blocking seq 1, with 0.6 ms more in M.a, 0.7 ms in M.b and 0.7 ms in train_step:
    # no place holds a delay above the 1 ms floor, but together they do: "(several places)", which can be blamed
    # (unlike "(unattributed)", where it spent no more time anywhere).
    spans = []
    for rank, extra_us in enumerate((0, 1)):
        a_end, b_end = 10 * MS + 600_000 * extra_us, 20 * MS + 1_300_000 * extra_us
        arrival = 30 * MS + 2 * MS * extra_us
        spans += [_step(rank, 0, "s", 0, 100 * MS, [(1 * MS, _collective(0)),
                                                   (round(arrival), _collective(1))]),
                  _module(rank, "M.a", "a", "s", 1 * MS, a_end), _module(rank, "M.b", "b", "s", a_end, b_end)]
    assert _lateness(_load(spans, tmp_path)) == [
        {"rank": 1, "module": stragglers.SPREAD, "pass": "", "lost_s": 0.002, "waited_s": 0.002,
         "collectives": 1, "steps": [0], "excess_s": 0.0}]


def test_a_rank_late_because_another_process_took_its_cpu_is_host_contention_not_a_straggler(tmp_path):
    # Rank 1 30 ms late in M.slow on every step. Where its training thread waited 25 ms more than rank 0 for a CPU
    # in those steps (commdebug.step.cpu_wait_s: 27 ms against 2 ms), another process on its host had the CPU:
    # listed apart, "stragglers" is []. Where it waited as long as rank 0, its code is slow: a straggler.
    answers = []
    for rank_1_wait_s, contended in ((0.027, True), (0.002, False)):
        spans = _steps_late_by([(1, 30)] * 6)
        for step_span in spans:
            if step_span["name"] == "train_step":
                step_span["attributes"][semconv.STEP_CPU_WAIT] = rank_1_wait_s if step_span["rank"] == 1 else 0.002
        answer = stragglers.find(_load(spans, tmp_path))
        rows = answer["contended"] if contended else answer["stragglers"]
        assert [(row["rank"], row["module"], row["late_steps"]) for row in rows] == [(1, "M.slow", [1, 2, 3, 4, 5])]
        assert answer["stragglers" if contended else "contended"] == []
        assert rows[0]["cpu_wait_s"] == pytest.approx(5 * (rank_1_wait_s - 0.002))
        answers.append(answer)
    assert stragglers.format_lines(answers[0]) == [
        "No straggler above the noise (step 0 left out: the first traced step, start-up skew and warm-up; "
        "--include-warmup counts it).",
        "Host contention, not a straggler in the code: late as consistently, but waiting for a CPU that another "
        "process on its host had:",
        "  rank 1 in M.slow forward: late in 5 of 5 steps, 30 ms (noise cut 1.0 ms), p=1e-04; waited 125 ms more "
        "than the others for a CPU"]


def test_a_rank_slower_by_a_little_in_every_module_is_a_straggler_in_several_places(tmp_path):
    # Rank 1 spends 0.8 ms more in each of 5 modules (under the 1 ms floor each, 4 ms together) before every
    # step's all_reduce: its own work, spread thin. Blamed as "(several places)" in the 6 counted steps.
    spans = []
    for step in range(7):
        at = step * 100 * MS
        for rank in (0, 1):
            extra, start = (800_000 if rank == 1 else 0), at + 5 * MS
            for i in range(5):
                spans.append(_module(rank, f"M.l{i}", f"m{step}{i}", f"s{step}", start, start + 5 * MS + extra,
                                     trace=f"t{step}"))
                start += 5 * MS + extra
            event = (at + 60 * MS, _collective(step, **{semconv.COLLECTIVE_DURATION: (at + 60 * MS - start) / 1e9}))
            spans.append(_step(rank, step, f"s{step}", at, at + 100 * MS, [event], trace=f"t{step}"))
    (row,) = stragglers.find(_load(spans, tmp_path))["stragglers"]
    assert (row["rank"], row["module"], row["steps_late"], row["late_min_s"]) == (1, stragglers.SPREAD, 6, 0.004)


def _ring(seq, state, age_s, module="", op="all_reduce", shape=(8,)):
    extra = {"commdebug.collective.state": state, "commdebug.stall.age_s": age_s}
    if module:
        extra |= {semconv.MODULE_FQN: module, semconv.MODULE_PASS: "forward"}
    return _collective(seq, op, shape, **extra)


def _snapshot(rank, step, at_s, age_s, number, module, issued, completed, ring, between=False):
    """A stall snapshot as the live side exports it: its step's spans so far, marked incomplete, and ``stalled``."""
    at, trace = at_s * S, f"step{step}-"
    stall = {semconv.STEP: step, "commdebug.stall.age_s": age_s, "commdebug.stall.threshold_s": 10.0,
             "commdebug.stall.snapshot": number, "commdebug.stall.module": module,
             "commdebug.stall.pass": "forward" if module else "",
             "commdebug.stall.stack": [f"train.py:{40 + rank} in forward", "torch/nn/modules/module.py:1750"],
             "commdebug.stall.groups": ["0"], "commdebug.stall.issued_seq": [issued],
             "commdebug.stall.completed_seq": [completed]}
    events = [(at - round(ring_age * S), attrs) for ring_age, attrs in
              ((attrs["commdebug.stall.age_s"], attrs) for attrs in ring)]
    if between:
        return [span(rank, "stalled", f"x{number}", "", at - round(age_s * S), at, events, trace, world_size=2,
                     **stall, **{"commdebug.stall.between_steps": True})]
    step_start = at - round(age_s * S)
    incomplete = {"commdebug.span.incomplete": True}
    return [
        _step(rank, step, f"s{number}", step_start, at, trace=trace, **incomplete),
        span(rank, f"{module} forward", f"m{number}", f"s{number}", step_start + MS, at, trace=trace, world_size=2,
             **{semconv.MODULE_FQN: module, semconv.MODULE_PASS: "forward"}, **incomplete),
        span(rank, "stalled", f"x{number}", f"s{number}", step_start, at, events, trace, world_size=2, **stall),
    ]


def _hang():
    """Rank 1 stuck 45 s in layers.0.attention at step 3 (issued seq 56); rank 0 waits in seq 57 of wo."""
    wo = "Model.layers.0.attention.wo"
    return [
        *_snapshot(1, 3, 1030, 30.0, 1, "Model.layers.0.attention", 56, 56, [_ring(56, "completed", 30.5)]),
        *_snapshot(1, 3, 1045, 45.0, 2, "Model.layers.0.attention", 56, 56, [_ring(56, "completed", 45.5)]),
        *_snapshot(0, 3, 1045, 44.95, 2, wo, 57, 56, [_ring(56, "completed", 45.5), _ring(57, "in_flight", 44.9, wo)]),
    ]


def test_no_stall_snapshot_says_the_watchdog_had_not_fired_and_when_it_would(tmp_path):
    # Early in a hang: no snapshot yet. "Stalls: 0" alone read as "no hang".
    spans = []
    for rank in (0, 1):
        spans += [_step(rank, step, f"s{step}", 1000 * S + step * 2 * S, 1000 * S + step * 2 * S + S)
                  for step in range(4)]  # 1 s steps, the last ends at 1007 s
    found = diagnose.diagnose(_load(spans, tmp_path))
    # auto: at least 3 steps ended, 10 x the median 1 s is under the 30 s floor.
    assert found["watchdog"] == {"threshold_s": 30.0, "last_step_end_ns": 1007 * S, "due_ns": 1037 * S}
    assert "Stalls: 0 (no stall snapshot: the watchdog (OTEL_PYTHON_COMMDEBUG_STALL_AFTER) had not fired or is " \
        "off; a hang shows here only once it has. Under auto (the default) its threshold from the steps here is " \
        "30 s: for a rank stuck after its last step in the files (the last ended 1970-01-01 00:16:47 UTC), the " \
        "first snapshot is due from 1970-01-01 00:17:17 UTC (600 s when stuck between steps with no collective " \
        "in flight))" in diagnose.format_text(found).splitlines()
    # Fewer than 3 steps: 300 s (compilation, warm-up).
    assert diagnose.watchdog(_load(spans[:2] + spans[4:6], tmp_path))["threshold_s"] == 300.0


def _killed_in_a_hang():
    """Steps 0 and 1 finished on both ranks; in step 2 rank 1 is stuck in attention (issued seq 6 of group 0),
    rank 0 issued seq 7 asynchronously in wo (as NCCL or DDP's buckets return at once) and waits. The job is
    killed before the watchdog fires: at exit each rank ends its open step and exports it, what was still open
    marked ``commdebug.span.unmatched``."""
    unmatched = {semconv.SPAN_UNMATCHED: True}
    spans = []
    for rank in (0, 1):
        for step in (0, 1):
            at = step * 100 * MS
            spans.append(_step(rank, step, f"s{step}", at, at + 50 * MS, trace=f"t{step}", events=[
                (at + 10 * MS, _collective(3 * step + seq)) for seq in range(3)]))
        events = [(210 * MS, _collective(7))]
        spans += [_step(rank, 2, "s2", 200 * MS, 9 * S, trace="t2"),
                  _module(rank, "M.attention", "a", "s2", 201 * MS, 9 * S, trace="t2",
                          events=[(205 * MS, _collective(6))])]
        spans[-1]["attributes"].update(unmatched)
        if rank == 0:  # in wo, under attention
            spans.append(_module(rank, "M.attention.wo", "w", "a", 209 * MS, 9 * S, events, trace="t2"))
            spans[-1]["attributes"].update(unmatched)
    return spans


def test_a_hang_killed_before_the_watchdog_is_an_unfinished_step_not_a_desync(tmp_path):
    found = diagnose.diagnose(_load(_killed_in_a_hang(), tmp_path))
    assert found["desyncs"] == [] and found["steps"] == [0, 1]
    assert found["unfinished_steps"] == [{
        "step": 2, "missing": [], "closed_at_exit": {0: {"module": "M.attention.wo", "pass": "forward"},
                                                     1: {"module": "M.attention", "pass": "forward"}},
        "not_issued": [{"group": "0", "seq": 7, "op": "all_reduce", "issued_by": [0], "not_by": [1]}]}]
    text = diagnose.format_text(found).splitlines()
    assert text[0] == "2 rank(s), finished traced steps: 0-1"
    start = text.index("Unfinished steps: 1 (not finished on every rank: the job stopped there; ranks that issued "
                       "collectives the others never did are not out of step)")
    assert text[start + 1:start + 5] == [
        "  step 2: rank 0 ended it at exit in M.attention.wo forward (killed while inside the step); "
        "rank 1 ended it at exit in M.attention forward (killed while inside the step)",
        "    rank(s) 0 issued all_reduce (group 0, seq 7); rank(s) 1 never did: look at what they were doing",
        "", "Desyncs: 0"]
    # Rank 1 killed without the exit flush: its step 2 is missing, not "none issued".
    without = [span for span in _killed_in_a_hang() if span["rank"] == 0 or span["span_id"] not in ("s2", "a")]
    assert len(without) == 7
    found = diagnose.diagnose(_load(without, tmp_path))
    assert found["steps"] == [0, 1]
    assert [(item["step"], item["missing"], list(item["closed_at_exit"])) for item in found["unfinished_steps"]] \
        == [(2, [1], [0])]


def test_a_stall_names_the_rank_behind_and_who_waits(tmp_path):
    wo = "Model.layers.0.attention.wo"
    in_flight = {"op": "all_reduce", "group": "0", "seq": 57, "dtype": "float32", "shape": [8], "bytes": 32,
                 "module": wo, "pass": "forward", "age_s": 44.9}
    spans = _load(_hang(), tmp_path)
    found = diagnose.stalls(spans)
    # In the stuck step's trace, as its train_step copy.
    step_copy = next(s for s in spans if s["rank"] == 1 and s["name"] == "train_step")
    assert found[0].pop("trace_id") == step_copy["trace_id"]
    assert found == [{
        "rank": 1, "step": 3, "module": "Model.layers.0.attention", "pass": "forward", "age_s": 45.0,
        "threshold_s": 10.0, "snapshot": 2, "between_steps": False,
        "stack": ["train.py:41 in forward", "torch/nn/modules/module.py:1750"],
        "issued_seq": {"0": 56}, "completed_seq": {"0": 56}, "in_flight": [], "issued_by_all": [],
        "ended": False, "ended_after_s": None, "duration_s": None,
        "reason": "behind on group 0: issued seq 56, rank 0 57",
        "ahead": [{"rank": 0, "group": "0", "issued_seq": 57, "behind_seq": 56}],
        "waiting_ranks": [{"rank": 0, "step": 3, "module": wo, "pass": "forward", "age_s": 44.95,
                           "in_flight": [in_flight], "issued_by_all": []}],
        # The live verdict's rule and words (offline/hangs.py), from the same facts.
        "verdict": {"kind": "hang", "summary": f"rank 1 never entered all_reduce #57 on group 0, issued by {wo}; it "
                    "is in Model.layers.0.attention forward; rank 0 waits in it (step 3, 2 of 2 ranks reported)"},
    }]
    text = diagnose.format_text(diagnose.diagnose(spans)).splitlines()
    start = text.index("Stalls: 1")
    assert text[start + 1:start + 8] == [
        "  rank 1 is stuck in step 3 at Model.layers.0.attention forward for 45.0 s "
        "(snapshot 2; behind on group 0: issued seq 56, rank 0 57)",
        "    in flight on rank 1: nothing",
        f"    waiting for it: rank 0 in all_reduce (group 0, seq 57) from {wo} forward, 44.9 s",
        "    ahead of it: rank 0 on group 0 (issued seq 57; rank 1: 56)",
        "    stack (innermost last):",
        "      train.py:41 in forward",
        "      torch/nn/modules/module.py:1750",
    ]
    # The incomplete copies are no finished step: no stragglers, no desync from them.
    assert stragglers.find(spans)["lateness"] == [] and diagnose.desyncs(spans) == []


def test_a_rank_stuck_between_steps_and_a_rank_without_a_snapshot(tmp_path):
    # Rank 1 stalls in "data loading" (issued seq 16, the last of step 0); rank 0 waits in step 1's first.
    data_loading = [*_snapshot(1, 1, 1020, 15.0, 1, "", 16, 16, [_ring(16, "completed", 15.5)], between=True),
                    *_snapshot(0, 1, 1020, 14.9, 1, "M.a", 17, 16, [_ring(17, "in_flight", 14.8, "M.a")])]
    (stall,) = diagnose.stalls(_load(data_loading, tmp_path))
    assert (stall["rank"], stall["step"], stall["module"], stall["pass"], stall["between_steps"]) == (
        1, 1, diagnose.BETWEEN_STEPS, "", True)
    assert [(w["rank"], w["in_flight"][0]["seq"]) for w in stall["waiting_ranks"]] == [(0, 17)]
    # Rank 1 sent nothing (hung with the GIL held, say): rank 0, in flight, waits for it.
    alone = _snapshot(0, 1, 1020, 14.9, 1, "M.a", 17, 16, [_ring(17, "in_flight", 14.8, "M.a")])
    (stall,) = diagnose.stalls(_load(alone, tmp_path))
    assert (stall["rank"], stall["step"], stall["reason"]) == (1, None, "sent no snapshot while the others are stalled")
    assert [w["rank"] for w in stall["waiting_ranks"]] == [0]
    text = diagnose.format_text(diagnose.diagnose(_load(alone, tmp_path))).splitlines()
    assert text[text.index("Stalls: 1") + 1:text.index("Stalls: 1") + 3] == [
        "  rank 1 is stuck: it sent no snapshot while the others are stalled (hung in native code holding the GIL, "
        "or gone: look at its process)",
        "    waiting for it: rank 0 in all_reduce (group 0, seq 17) from M.a forward, 14.8 s"]


def test_a_stall_that_ended_says_so(tmp_path):
    # The hang of _hang (stall began at 1000 s, last snapshot at 1045 s), then rank 1 went on: its step 3 was
    # exported whole at 1050 s, marked stalled.
    final = _step(1, 3, "f", 1000 * S, 1050 * S, trace="step3-", **{semconv.STEP_STALLED: 2})
    spans = _load([*_hang(), final], tmp_path)
    (stall,) = diagnose.stalls(spans)
    assert (stall["rank"], stall["ended"], stall["ended_after_s"], stall["duration_s"]) == (1, True, 5.0, 50.0)
    text = diagnose.format_text(diagnose.diagnose(spans)).splitlines()
    assert text[text.index("Stalls: 1") + 1] == (
        "  rank 1 was stuck in step 3 at Model.layers.0.attention forward for 45.0 s "
        "(snapshot 2; behind on group 0: issued seq 56, rank 0 57) (the step ended 5.0 s later, 50.0 s in all)")
    # Between steps (data loading before step 1, from 1005 s): over when step 1 began, at 1022 s.
    data_loading = [*_snapshot(1, 1, 1020, 15.0, 1, "", 16, 16, [_ring(16, "completed", 15.5)], between=True),
                    *_snapshot(0, 1, 1020, 14.9, 1, "M.a", 17, 16, [_ring(17, "in_flight", 14.8, "M.a")])]
    for ended in (False, True):
        later = [_step(1, 1, "f", 1022 * S, 1030 * S, trace="step1-")] if ended else []
        spans = _load(data_loading + later, tmp_path)
        (stall,) = diagnose.stalls(spans)
        assert (stall["ended"], stall["ended_after_s"], stall["duration_s"]) == (
            (True, 2.0, 17.0) if ended else (False, None, None))
        text = diagnose.format_text(diagnose.diagnose(spans)).splitlines()
        assert text[text.index("Stalls: 1") + 1] == (
            f"  rank 1 {'was' if ended else 'is'} stuck between step 0 and step 1 for 15.0 s "
            "(snapshot 1; behind on group 0: issued seq 16, rank 0 17)"
            + (" (the gap ended 2.0 s later, 17.0 s in all)" if ended else ""))


def test_in_flight_leaves_out_what_every_rank_issued(tmp_path):
    # FSDP on untraced steps: c10d collectives not timed to completion still say in_flight. Rank 1 is stuck
    # having issued seq 50; rank 0 issued 51 and waits in it. Seqs 40..50 every rank issued: not what blocks.
    old = [_ring(seq, "in_flight", 20.0 - seq / 10, op="all_gather") for seq in range(40, 51)]
    spans = [*_snapshot(0, 7, 1030, 20.0, 1, "M.a", 51, 39, [*old, _ring(51, "in_flight", 14.0, op="reduce_scatter")]),
             *_snapshot(1, 7, 1030, 20.0, 1, "M.a", 50, 39, old)]
    (stall,) = diagnose.stalls(_load(spans, tmp_path))
    assert stall["rank"] == 1 and stall["in_flight"] == []
    assert [c["seq"] for c in stall["issued_by_all"]] == list(range(40, 51))
    (waiting,) = stall["waiting_ranks"]
    assert [(c["op"], c["seq"]) for c in waiting["in_flight"]] == [("reduce_scatter", 51)]
    assert [c["seq"] for c in waiting["issued_by_all"]] == list(range(40, 51))
    text = diagnose.format_text(diagnose.diagnose(_load(spans, tmp_path))).splitlines()
    assert "    waiting for it: rank 0 in reduce_scatter (group 0, seq 51), 14.0 s" in text


def test_equal_seqs_blame_the_rank_in_no_collective(tmp_path):
    # Three ranks at seq 9 on group "0": ranks 0 and 2 wait in it, rank 1 has issued it but is not waiting.
    def ring(rank):
        return [_ring(9, "completed" if rank == 1 else "in_flight", 5.0, "M.b")]

    spans = [item for rank in range(3) for item in _snapshot(rank, 4, 1010, 6.0, 1, "M.b", 9, 8, ring(rank))]
    for item in spans:
        item["resource"][semconv.WORLD_SIZE] = 3
    (stall,) = diagnose.stalls(_load(spans, tmp_path))
    assert (stall["rank"], stall["reason"]) == (1, "in no collective while the others wait in one")
    assert [w["rank"] for w in stall["waiting_ranks"]] == [0, 2]


def _world_of_3(spans):
    for item in spans:
        item["resource"][semconv.WORLD_SIZE] = 3
    return spans


def test_stalls_follow_the_live_verdict_s_rule(tmp_path):
    """diagnose names a stall's culprits by the live verdict's rule (offline/hangs.py), in its order of kinds."""
    waits = _snapshot(0, 4, 1010, 6.0, 1, "M.b", 9, 8, [_ring(9, "in_flight", 5.0, "M.b")])
    # World of 3, rank 2 sent nothing, rank 1 in no collective: the rank that sent nothing is named, not the idle one.
    idle = _snapshot(1, 4, 1010, 6.0, 1, "M.b", 9, 9, [_ring(9, "completed", 5.0, "M.b")])
    found = diagnose.stalls(_load(_world_of_3(waits + idle), tmp_path))
    assert [(stall["rank"], stall["reason"], [w["rank"] for w in stall["waiting_ranks"]], stall["verdict"]["kind"])
            for stall in found] == [(2, "sent no snapshot while the others are stalled", [0], "missing")]
    # Rank 1's latest snapshot is older than what rank 0 knows: rank 0 saw seq 57 complete, so rank 1 entered it.
    # Nobody is named from these snapshots, not even rank 1, whose record says behind.
    done = _snapshot(0, 3, 1045, 44.95, 2, "M.a", 57, 57, [_ring(57, "completed", 44.9, "M.a")])
    stale = _snapshot(1, 3, 1045, 45.0, 2, "M.a", 56, 56, [_ring(56, "completed", 45.5)])
    assert [(stall["rank"], stall["reason"], stall["verdict"]) for stall in diagnose.stalls(_load(done + stale,
                                                                                                  tmp_path))] == [
        (0, "undetermined", None), (1, "undetermined", None)]
    # Rank 1 behind on group 0, rank 0 waits there; rank 2, on group 1 only and in no collective, waits for nobody:
    # it is not listed waiting.
    behind = _snapshot(1, 4, 1010, 6.0, 1, "M.a", 8, 8, [_ring(8, "completed", 5.5)])
    apart = _snapshot(2, 4, 1010, 6.0, 1, "M.c", 3, 3, [])
    apart[-1]["attributes"]["commdebug.stall.groups"] = ["1"]
    (stall,) = diagnose.stalls(_load(_world_of_3(waits + behind + apart), tmp_path))
    assert (stall["rank"], stall["reason"], [w["rank"] for w in stall["waiting_ranks"]]) == (
        1, "behind on group 0: issued seq 8, rank 0 9", [0])


def test_stalls_of_different_times_are_apart_latest_first(tmp_path):
    early = _snapshot(1, 2, 1020, 15.0, 1, "M.a", 5, 5, []) + _snapshot(0, 2, 1020, 15.0, 1, "M.b", 6, 5, [])
    late = _snapshot(1, 9, 2000, 30.0, 1, "M.c", 40, 40, []) + _snapshot(0, 9, 2000, 30.0, 1, "M.d", 41, 40, [])
    found = diagnose.stalls(_load(early + late, tmp_path))
    assert [(stall["rank"], stall["step"], stall["module"]) for stall in found] == [(1, 9, "M.c"), (1, 2, "M.a")]


def _fingerprinted(rank, step, start, collectives, fingerprint):
    """A finished step of ``rank`` whose collectives on group "0" are ``(seq, op, shape)``, in M.a."""
    trace = f"f{step}-"
    events = [(start + (i + 1) * MS, _collective(seq, op, shape)) for i, (seq, op, shape) in enumerate(collectives)]
    attrs = {} if fingerprint is None else {
        "torch.step.collective_groups": ["0"], "torch.step.collective_fingerprints": [fingerprint],
        "torch.step.collective_counts": [len(collectives)], "torch.step.collective_first_seq": [collectives[0][0]]}
    return [_step(rank, step, "s", start, start + 50 * MS, trace=trace, **attrs),
            _module(rank, "M.a", "a", "s", start, start + 40 * MS, events, trace=trace)]


def test_desync_fingerprints_skip_equal_steps_and_a_skipped_collective_shows_the_next(tmp_path):
    ops = [(10, "all_reduce", (4,)), (11, "all_gather", (8,))]
    spans = [
        # Step 0: the events differ but the fingerprints agree (as if events were cut): skipped on trust.
        *_fingerprinted(0, 0, 0, [(0, "all_reduce", (4,))], "aa"),
        *_fingerprinted(1, 0, 0, [(0, "broadcast", (4,))], "aa"),
        # Step 1: rank 1 skipped the all_reduce: at seq 10 it shows its all_gather, at seq 11 nothing.
        *_fingerprinted(0, 1, S, ops, "bb"), *_fingerprinted(1, 1, S, [(10, "all_gather", (8,))], "cc"),
    ]
    side = {"dtype": "float32", "reduce_op": "", "module": "M.a", "pass": "forward"}
    assert diagnose.desyncs(_load(spans, tmp_path)) == [{"group": "0", "seq": 10, "step": 1, "ranks": {
        0: side | {"op": "all_reduce", "shape": [4], "seq": 10},
        1: side | {"op": "all_gather", "shape": [8], "seq": 10}}}]
    # Without fingerprints, step 0's events are compared and differ first.
    bare = [*_fingerprinted(0, 0, 0, [(0, "all_reduce", (4,))], None),
            *_fingerprinted(1, 0, 0, [(0, "broadcast", (4,))], None)]
    assert [(d["step"], d["ranks"][1]["op"]) for d in diagnose.desyncs(_load(bare, tmp_path))] == [(0, "broadcast")]
    # A rank that issued one collective fewer at the end of a step: "none" there.
    short = [*_fingerprinted(0, 1, S, ops, None), *_fingerprinted(1, 1, S, ops[:1], None)]
    none = {"op": "none", "dtype": "", "shape": [], "reduce_op": "", "module": "", "pass": "", "seq": -1}
    assert diagnose.desyncs(_load(short, tmp_path))[0]["ranks"] == {
        0: side | {"op": "all_gather", "shape": [8], "seq": 11}, 1: none}
    # One that issued nothing on the group in a finished step (it did in others): "none" at the first seq.
    nothing = [*_fingerprinted(0, 0, 0, ops, None), *_fingerprinted(1, 0, 0, ops, None),
               *_fingerprinted(0, 1, S, [(12, "all_reduce", (4,))], None), *_fingerprinted(1, 1, S, [], None)]
    assert diagnose.desyncs(_load(nothing, tmp_path)) == [{"group": "0", "seq": 12, "step": 1, "ranks": {
        0: side | {"op": "all_reduce", "shape": [4], "seq": 12}, 1: none}}]


def test_a_reduce_op_mismatch_is_a_desync(tmp_path):
    # Rank 1 all-reduces with MAX where rank 0 sums: same op, dtype and shape. The fingerprints (op|dtype|shape,
    # as before the reduce op joined them) agree: the events' reduce ops are still compared.
    def ops(reduce_op):
        return [_collective(seq, **{semconv.COLLECTIVE_REDUCE_OP: op}) for seq, op in ((0, "sum"), (1, reduce_op))]

    spans = []
    for rank, reduce_op in enumerate(("sum", "max")):
        events = [(S + (i + 1) * MS, attrs) for i, attrs in enumerate(ops(reduce_op))]
        spans += [_step(rank, 1, "s", S, S + 50 * MS, trace="r-", **{
                      "torch.step.collective_groups": ["0"], "torch.step.collective_fingerprints": ["aa"],
                      "torch.step.collective_counts": [2], "torch.step.collective_first_seq": [0]}),
                  _module(rank, "M.a", "a", "s", S, S + 40 * MS, events, trace="r-")]
    spans = _load(spans, tmp_path)
    side = {"op": "all_reduce", "dtype": "float32", "shape": [8], "module": "M.a", "pass": "forward", "seq": 1}
    assert diagnose.desyncs(spans) == [{"group": "0", "seq": 1, "step": 1, "ranks": {
        0: side | {"reduce_op": "sum"}, 1: side | {"reduce_op": "max"}}}]
    text = diagnose.format_text(diagnose.diagnose(spans)).splitlines()
    assert text[text.index("Desyncs: 1") + 2:text.index("Desyncs: 1") + 4] == [
        "    rank 0: all_reduce float32 [8] sum in M.a forward",
        "    rank 1: all_reduce float32 [8] max in M.a forward"]
    # Without fingerprints too; and a side without a recorded reduce op (a stall ring's) is not compared on it.
    for item in spans:
        for key in [key for key in item["attributes"] if key.startswith("torch.step.collective_")]:
            del item["attributes"][key]
    assert [d["seq"] for d in diagnose.desyncs(spans)] == [1]
    for item in spans:
        for event in item["events"]:
            if item["rank"] == 1:
                del event["attributes"][semconv.COLLECTIVE_REDUCE_OP]
    assert diagnose.desyncs(spans) == []


def test_a_crashed_rank_is_an_error_not_a_desync(tmp_path):
    # World of 3, rank 2 sent nothing. Step 4: rank 1's M.a forward raised after seq 10 (its step was exported,
    # cut short); rank 0 went on to seq 11 and stalled there, waiting for rank 1.
    spans = [*_fingerprinted(0, 3, 0, [(8, "all_reduce", (4,)), (9, "all_reduce", (4,))], None),
             *_fingerprinted(1, 3, 0, [(8, "all_reduce", (4,)), (9, "all_reduce", (4,))], None),
             *_fingerprinted(0, 4, S, [(10, "all_reduce", (4,)), (11, "all_gather", (8,))], None),
             *_fingerprinted(1, 4, S, [(10, "all_reduce", (4,))], None)]
    crashed = next(item for item in spans if item["rank"] == 1 and item["name"] == "M.a forward"
                   and item["attributes"] and item["trace_id"].startswith("f4"))
    crashed["status_code"] = 2
    crashed["events"].append({"name": "exception", "time_ns": crashed["end_ns"], "attributes": {
        "exception.type": "RuntimeError", "exception.message": "CUDA out of memory. Tried to allocate <n> GiB",
        "exception.stacktrace": "train.py:12 in forward", "exception.escaped": "False"}})
    for item in spans:
        item["resource"][semconv.WORLD_SIZE] = 3
    spans = _load(spans, tmp_path)
    found = diagnose.diagnose(spans)
    assert found["errors"] == [{"rank": 1, "step": 4, "module": "M.a", "pass": "forward", "type": "RuntimeError",
                                "message": "CUDA out of memory. Tried to allocate <n> GiB",
                                "stacktrace": "train.py:12 in forward"}]
    assert found["desyncs"] == []  # rank 1 issued no seq 11: it crashed, it is not out of step
    assert (found["missing_ranks"], found["steps"]) == ([2], [3])  # step 4 crashed: not a finished step
    text = diagnose.format_text(found).splitlines()
    assert text[:5] == [
        "2 rank(s), finished traced steps: 3",
        "warning: world size 3, but no spans from rank(s) 2: not traced (OTEL_PYTHON_COMMDEBUG_RANKS), their files "
        "not given, or they exported nothing", "",
        "Errors: 1",
        "  rank 1 raised in step 4 at M.a forward: RuntimeError: CUDA out of memory. Tried to allocate <n> GiB"]


def test_an_untraced_step_exported_because_it_stalled_is_not_a_finished_traced_step(tmp_path):
    spans = [*_fingerprinted(0, 0, 0, [(0, "all_reduce", (4,))], None),
             _step(0, 100, "u", S, 2 * S, trace="u-", **{semconv.STEP_STALLED: 1})]
    found = diagnose.diagnose(_load(spans, tmp_path))
    assert found["steps"] == [0]
    assert diagnose.format_text(found).splitlines()[0] == "1 rank(s), finished traced steps: 0"


def test_a_desync_that_hangs_is_found_in_the_stall_rings(tmp_path):
    # Both ranks wait at seq 20 of step 5, one in an all_reduce and one in a broadcast: no finished step 5.
    spans = [*_snapshot(0, 5, 1100, 60.0, 3, "M.a", 20, 19, [_ring(19, "completed", 61.0, "M.a"),
                                                             _ring(20, "in_flight", 59.0, "M.a")]),
             *_snapshot(1, 5, 1100, 60.0, 3, "M.a", 20, 19, [_ring(19, "completed", 61.0, "M.a"),
                                                             _ring(20, "in_flight", 59.0, "M.a", op="broadcast")])]
    spans = _load(spans, tmp_path)
    side = {"dtype": "float32", "shape": [8], "reduce_op": "", "module": "M.a", "pass": "forward", "seq": 20}
    assert diagnose.desyncs(spans) == [{"group": "0", "seq": 20, "step": 5, "ranks": {
        0: side | {"op": "all_reduce"}, 1: side | {"op": "broadcast"}}}]
    # The live verdict's rule: a desync, the smaller side (ties: the higher rank) blamed, the other waiting.
    summary = ("desync at #20 on group 0 in step 5: rank 0 issued all_reduce from M.a; rank 1 issued broadcast "
               "from M.a (2 of 2 ranks reported)")
    (stall,) = diagnose.stalls(spans)
    assert (stall["rank"], stall["reason"], stall["verdict"], [w["rank"] for w in stall["waiting_ranks"]]) == (
        1, summary, {"kind": "desync", "summary": summary}, [0])
    # Every rank waits in the same collective at the same seq: nobody to blame; each is listed, undetermined.
    same = [*_snapshot(0, 5, 1100, 60.0, 3, "M.a", 20, 19, [_ring(20, "in_flight", 59.0, "M.a")]),
            *_snapshot(1, 5, 1100, 60.0, 3, "M.a", 20, 19, [_ring(20, "in_flight", 59.0, "M.a")])]
    assert [(stall["rank"], stall["reason"], stall["waiting_ranks"], stall["verdict"])
            for stall in diagnose.stalls(_load(same, tmp_path))] == [
        (0, "undetermined", [], None), (1, "undetermined", [], None)]


def test_the_command_line_and_no_torch(tmp_path):
    write_otlp(_hang(), tmp_path / "traces.jsonl")
    code = ("import sys, json; from commdebug_otel.cli import main; status = main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'), status)")
    out = subprocess.run([sys.executable, "-c", code, "diagnose", str(tmp_path), "--format", "json"],
                         capture_output=True, text=True, env=checkout_env(), timeout=120)
    report, _, tail = out.stdout.rpartition("}\n")
    assert tail == "[] 0\n", out.stderr  # nothing of torch imported
    assert [stall["rank"] for stall in json.loads(report + "}")["stalls"]] == [1]
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "diagnose", str(empty)], capture_output=True,
                         text=True, env=checkout_env(), timeout=120)
    assert out.returncode == 2
    assert out.stderr == "commdebug-otel diagnose: no spans found (expected OTLP-JSON trace files)\n"


# ------------------------------------------------------------ Jaeger and Tempo

_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _base64_ids(obj):
    """OTLP/JSON's hex ids as protobuf's JSON mapping writes them (base64), as Tempo answers."""
    if isinstance(obj, list):
        return [_base64_ids(item) for item in obj]
    if not isinstance(obj, dict):
        return obj
    return {key: base64.b64encode(bytes.fromhex(value)).decode() if key in ("traceId", "spanId", "parentSpanId")
            else _base64_ids(value) for key, value in obj.items()}


@pytest.fixture
def trace_server(tmp_path):
    """A local HTTP server answering Jaeger's and Tempo's trace-by-id paths with the hung job's trace."""
    write_otlp(_hang(), tmp_path / "traces.jsonl")
    traces = {"resourceSpans": [resource for line in (tmp_path / "traces.jsonl").read_text().splitlines()
                                for resource in json.loads(line)["resourceSpans"]]}
    answers = {f"/api/v3/traces/{_TRACE_ID}": {"result": traces},  # as Jaeger's api_v3 HTTP gateway
               f"/prefix/api/v2/traces/{_TRACE_ID}": {"trace": _base64_ids(traces), "status": "COMPLETE"}}
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append((self.path, self.headers["Accept"]))
            body = answers.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {"error": {"httpCode": 404, "message": "trace not found"}}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path, requests
    server.shutdown()
    thread.join()
    server.server_close()


def test_a_trace_from_jaeger_or_tempo_reads_as_the_files(trace_server, capsys):
    url, files, requests = trace_server
    expected = json.loads(json.dumps(diagnose.diagnose(summary.load_spans([files]))))
    for argv in (["--jaeger", url], ["--tempo", url + "/prefix/"]):
        code, out, err = _diagnose_cli([*argv, "--trace-id", _TRACE_ID.upper(), "--format", "json"], capsys)
        assert (code, err) == (0, "")
        assert json.loads(out) == expected
    assert requests == [(f"/api/v3/traces/{_TRACE_ID}", "application/json"),
                        (f"/prefix/api/v2/traces/{_TRACE_ID}", "application/json")]
    spans = backends.fetch_trace("jaeger", url, _TRACE_ID)
    assert {span["file"] for span in spans} == {f"{url}/api/v3/traces/{_TRACE_ID}"}


def test_backend_errors_are_one_line(trace_server, capsys):
    url, _, _ = trace_server
    missing = "0" * 32
    assert _diagnose_cli(["--tempo", url, "--trace-id", missing], capsys) == (
        2, "", f"commdebug-otel diagnose: {url}/api/v2/traces/{missing}: HTTP 404 Not Found\n")
    assert _diagnose_cli(["--jaeger", url, "--trace-id", "xyz"], capsys) == (
        2, "", "commdebug-otel diagnose: a trace id is 32 hex digits, got 'xyz'\n")
    assert _diagnose_cli(["--jaeger", url], capsys) == (
        2, "", "commdebug-otel diagnose: --jaeger needs --trace-id ID\n")
    assert _diagnose_cli([], capsys) == (
        2, "", "commdebug-otel diagnose: give PATH..., or --jaeger URL / --tempo URL with --trace-id ID\n")
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    code, _, err = _diagnose_cli(["--jaeger", closed, "--trace-id", _TRACE_ID], capsys)
    assert code == 2 and err.startswith(f"commdebug-otel diagnose: {closed}/api/v3/traces/{_TRACE_ID}: ")


def test_send_and_recv_outside_the_step_do_not_shift_the_seqs():
    # The pipeline of test_offline_pipeline: rank 1's first recv is on outside_step, before its step.
    spans = test_offline_pipeline._hand_built_pipeline()
    assert diagnose.desyncs(spans) == []
    assert diagnose.diagnose(spans)["pipeline_waits"] == test_offline_pipeline._HAND_BUILT_WAITS


_RAISES = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, is_master=True), rank=0, world_size=1)


class Boom(torch.nn.Module):
    def forward(self, x):
        if sys.argv[1] == "module" and step == 2:
            raise ValueError("bad batch")
        return x


model = torch.nn.Sequential(torch.nn.Linear(4, 4), Boom())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    model(torch.ones(2, 4)).sum().backward()
    if sys.argv[1] == "loop" and step == 2:
        raise ValueError("bad batch")
    optimizer.step()
"""


@pytest.mark.parametrize(("where", "trace_every", "at"), [
    ("loop", "100", "outside any module call"),  # an untraced step: exported because it raised
    ("loop", "1", "outside any module call"),
    ("module", "1", "at Sequential.1 forward"),  # the module span holds it, the step does not again
])
def test_an_exception_that_ends_the_script_is_an_error_in_its_step(tmp_path, capsys, where, trace_every, at):
    """The script's unhandled exception, between module calls or in one, is diagnose's error in its step, once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_PYTHON_COMMDEBUG_ENABLED="1", OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=str(tmp_path),
               OTEL_PYTHON_COMMDEBUG_TRACE_EVERY=trace_every, OTEL_PYTHON_COMMDEBUG_EXCEPTION_MESSAGES="full")
    done = subprocess.run([sys.executable, "-c", _RAISES, where], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: bad batch"), done.stderr
    [run] = tmp_path.glob("run-*")
    found = json.loads(_diagnose_cli([str(run), "--format", "json"], capsys)[1])
    assert [(e["rank"], e["step"], e["type"], e["message"]) for e in found["errors"]] == [
        (0, 2, "ValueError", "bad batch")]
    text = _diagnose_cli([str(run)], capsys)[1]
    assert f"  rank 0 raised in step 2 {at}: ValueError: bad batch" in text.splitlines()
