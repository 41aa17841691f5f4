"""The straggler model's test over typed lateness records (``commdebug_otel.offline.stragglers``), without spans."""

import math
import random
import statistics

import pytest

from commdebug_otel import semconv
from commdebug_otel.offline import stragglers
from commdebug_otel.offline.stragglers import Late
from tests.otlp_files import span

MS = 1_000_000


def test_median_and_mad_of_the_other_ranks_are_exact():
    draw = random.Random(7)
    for _ in range(200):
        values = sorted(draw.choice([draw.randrange(1, 50), draw.randrange(1, 5000)])
                        for _ in range(draw.randrange(4, 40)))
        without = sorted(draw.sample(values, draw.randrange(0, len(values) - 3)))
        rest = list(values)
        for value in without:
            rest.remove(value)
        median = statistics.median(rest)
        mad = statistics.median(abs(value - median) for value in rest)
        assert stragglers._median_mad(values, without) == (median, pytest.approx(mad, abs=1e-9))


@pytest.mark.parametrize(("k", "n", "p"), [(0, 5, 0.3), (3, 11, 0.02), (7, 7, 0.5), (2, 40, 1e-4), (12, 12, 1.0)])
def test_binomial_tail(k, n, p):
    exact = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))
    assert stragglers.binomial_sf(k, n, p) == pytest.approx(exact, rel=1e-12)


def _healthy(steps, ranks, draw):
    """Every step, one collective per place, held back by a random rank by 1-6 ms."""
    places = [("M.a", "forward"), ("M.b", "forward"), ("M.a", "backward"), ("(train_step)", "")]
    return [Late(draw.randrange(ranks), step, module, pass_, draw.randrange(1, 7) * MS, 0, 0)
            for step in range(steps) for module, pass_ in places]


def test_a_healthy_job_of_many_ranks_blames_nobody():
    for seed in range(20):
        draw = random.Random(seed)
        records = _healthy(30, 8, draw)
        assert stragglers.judge(records, {rank: set(range(30)) for rank in range(8)}) == [], seed


def test_a_consistent_and_an_intermittent_straggler_among_noise():
    draw = random.Random(3)
    records = _healthy(30, 8, draw)
    records += [Late(5, step, "M.b", "forward", 40 * MS, 0, 0) for step in range(30)]
    records += [Late(2, step, "M.a", "backward", 100 * MS, 0, 0) for step in (4, 17, 25)]
    found = stragglers.judge(records, {rank: set(range(30)) for rank in range(8)})
    assert [(row["rank"], row["module"], row["pass"], row["steps_late"], row["steps_seen"]) for row in found] == [
        (5, "M.b", "forward", 30, 30), (2, "M.a", "backward", 3, 30)]
    assert found[1]["late_steps"] == [4, 17, 25] and found[1]["late_min_s"] >= 0.1  # plus a noise cell or two
    assert all(row["p_value"] * row["tested"] <= stragglers.ALPHA for row in found)


def test_a_rank_starved_just_past_the_noise_cut_is_its_tail_and_a_real_delay_is_not():
    """A loaded host holds one rank's work between steps just past the cut in a few steps: significant by count,
    but under MIN_EFFECT cuts. The same steps at three cuts are a straggler."""
    steps = {rank: set(range(8)) for rank in range(2)}
    noise = _healthy(8, 2, random.Random(4))
    [cut_row] = stragglers.judge(noise + [Late(0, step, "(between steps)", "", 40 * MS, 0, 0) for step in (2, 4, 5)],
                                 steps)
    cut = cut_row["noise_cut_s"] * 1e9
    just_past = [Late(0, step, "(between steps)", "", int(1.2 * cut), 0, 0) for step in (2, 4, 5)]
    assert stragglers.judge(noise + just_past, steps) == []
    [row] = stragglers.judge(noise + [Late(0, step, "(between steps)", "", int(3 * cut), 0, 0) for step in (2, 4, 5)],
                             steps)
    assert (row["rank"], row["module"], row["late_steps"]) == (0, "(between steps)", [2, 4, 5])


def test_one_slow_step_is_no_straggler():
    records = [Late(1, 4, "M.a", "forward", 500 * MS, 0, 0)]
    assert stragglers.judge(records, {0: set(range(10)), 1: set(range(10))}) == []


def test_a_straggler_among_1024_ranks():
    """At 1,024 ranks rows of under 1 % of the cells are judged against the pooled noise (docs/performance.md)."""
    draw = random.Random(1)
    places = [(f"M.layers.{i}", p) for i in range(16) for p in ("forward", "backward")] + [("(train_step)", "")]
    records = [Late(draw.randrange(1024), step, *draw.choice(places), draw.randrange(1, 8) * MS, 0, 0)
               for step in range(20) for _ in range(13_200)]
    records += [Late(77, step, "M.layers.3", "forward", 60 * MS, 0, 0) for step in range(20)]
    found = stragglers.judge(records, {rank: set(range(20)) for rank in range(1024)})
    assert [(row["rank"], row["module"], row["pass"], row["steps_late"]) for row in found] == [
        (77, "M.layers.3", "forward", 20)]


def _p2p(op, peer, returned_ms, waited_ms=0.0):
    """A send or recv event on group "0" of 2 ranks, stamped when it returned, ``waited_ms`` after it was issued."""
    return round(returned_ms * MS), {
        semconv.COLLECTIVE_OP: op, semconv.COLLECTIVE_PEER: peer, semconv.PROCESS_GROUP_NAME: "0",
        semconv.PROCESS_GROUP_SIZE: 2, semconv.COLLECTIVE_DURATION: waited_ms / 1e3}


def _pipeline_steps(slow_ms: float, steps: int = 6, output_ms: float = 0.0) -> list[dict]:
    """Two pipeline stages, steps of 100 ms. Stage 0 runs its block M.layers.0 forward (1-11 ms), sends to stage 1
    at 11 ms and posts its recv of the gradient at 21 ms; stage 1 posts its recv at 11 ms, runs its block
    M.layers.1 forward (11-21 ms, plus ``slow_ms``), then M.output forward for ``output_ms`` (a module stage 0 has
    not), and sends back as that ends. No collective: only send/recv link the stages."""
    spans = []
    for step in range(steps):
        t0 = step * 100
        block_end = 21 + slow_ms
        back = block_end + output_ms
        spans += [
            span(0, "train_step", f"s{step}", "", t0 * MS, (t0 + 100) * MS,
                 [_p2p(semconv.SEND, 1, t0 + 11), _p2p(semconv.RECV, 1, t0 + back, back - 21)], world_size=2,
                 **{semconv.STEP: step}),
            span(0, "M.layers.0 forward", f"a{step}", f"s{step}", (t0 + 1) * MS, (t0 + 11) * MS, world_size=2,
                 **{semconv.MODULE_FQN: "M.layers.0", semconv.MODULE_PASS: "forward"}),
            span(1, "train_step", f"s{step}", "", t0 * MS, (t0 + 100) * MS,
                 [_p2p(semconv.RECV, 0, t0 + 11), _p2p(semconv.SEND, 0, t0 + back)], world_size=2,
                 **{semconv.STEP: step}),
            span(1, "M.layers.1 forward", f"b{step}", f"s{step}", (t0 + 11) * MS, (t0 + block_end) * MS,
                 world_size=2, **{semconv.MODULE_FQN: "M.layers.1", semconv.MODULE_PASS: "forward"}),
        ]
        if output_ms:
            spans.append(span(1, "M.output forward", f"c{step}", f"s{step}", (t0 + block_end) * MS, (t0 + back) * MS,
                              world_size=2, **{semconv.MODULE_FQN: "M.output", semconv.MODULE_PASS: "forward"}))
    return spans


def test_a_pipeline_stage_that_sends_late_is_the_straggler_where_it_spent_the_time():
    # Stage 0 waits 20 ms in its recv for stage 1's send: stage 1's lateness, in its block M.layers.1 forward
    # (30 ms in the step against 10 ms in stage 0's block of the same kind, M.layers.0). Step 0 is the warm-up.
    answer = stragglers.find(_pipeline_steps(slow_ms=20))
    assert answer["lateness"] == [
        {"rank": 1, "module": "M.layers.1", "pass": "forward", "lost_s": 0.1, "waited_s": 0.1, "collectives": 5,
         "steps": [1, 2, 3, 4, 5], "excess_s": 0.1}]
    [row] = answer["stragglers"]
    # 5 late of 5 steps; q = 1 / (2 ranks x 5 steps x 1 place - its own 5 + 1) = 1/6.
    assert (row["rank"], row["module"], row["pass"], row["steps_late"], row["steps_seen"]) == (
        1, "M.layers.1", "forward", 5, 5)
    assert row["null_rate"] == pytest.approx(1 / 6) and row["p_value"] == pytest.approx(6**-5)
    assert answer["steps"] == [1, 2, 3, 4, 5]


def test_a_pipeline_stage_late_by_a_module_the_other_stage_has_not_is_the_models_split_not_a_straggler():
    # Stage 1 also runs the output layer (8 ms) before it sends back: stage 0 waits 8 ms every step, by the model's
    # split. Its block takes what stage 0's does: no place of a kind both run, so "(pipeline stage)", not blamed.
    answer = stragglers.find(_pipeline_steps(slow_ms=0, output_ms=8))
    assert [(row["rank"], row["module"], row["steps"], row["excess_s"]) for row in answer["lateness"]] == [
        (1, stragglers.STAGE, [1, 2, 3, 4, 5], 0.0)]
    assert answer["stragglers"] == []
    # The same stage also slow in its block is blamed there, the output layer's share aside: 20 ms over stage 0's.
    answer = stragglers.find(_pipeline_steps(slow_ms=20, output_ms=8))
    assert [(row["rank"], row["module"], row["pass"], row["steps_late"]) for row in answer["stragglers"]] == [
        (1, "M.layers.1", "forward", 5)]


def test_module_kinds_replace_layer_indices_and_leave_out_the_parenthesised_places():
    kinds = stragglers.module_kinds({("Net.layers.12.attention.wq", "forward"): 3, ("Net.layers.4.attention.wq",
                                     "forward"): 5, ("Net.output", "forward"): 2, (stragglers.TRAIN_STEP, ""): 9})
    assert kinds == {("Net.layers.*.attention.wq", "forward"): {"Net.layers.12.attention.wq": 3,
                                                                "Net.layers.4.attention.wq": 5},
                     ("Net.output", "forward"): {"Net.output": 2}}


def test_a_pipeline_whose_sends_meet_posted_recvs_has_no_straggler():
    answer = stragglers.find(_pipeline_steps(slow_ms=0))
    assert answer["lateness"] == [] and answer["stragglers"] == [] and answer["steps"] == [1, 2, 3, 4, 5]


def test_a_recv_posted_in_the_step_before_waits_out_the_pipelines_fill_not_a_straggler():
    # Stage 1 ends each step at 90 ms and posts its recv of the next step's data in that step's train_step_tail;
    # stage 0 sends it 21 ms later, after its optimizer step and its next forward: the fill, every step.
    spans = [span(1, "outside_step", "o", "", 0, 11 * MS, [_p2p(semconv.RECV, 0, 11, 11)], world_size=2)]
    for step in range(6):
        t0 = step * 100
        spans += [
            span(0, "train_step", f"s{step}", "", t0 * MS, (t0 + 100) * MS, [_p2p(semconv.SEND, 1, t0 + 11)],
                 world_size=2, **{semconv.STEP: step}),
            span(0, "M.l0 forward", f"a{step}", f"s{step}", (t0 + 1) * MS, (t0 + 11) * MS, world_size=2,
                 **{semconv.MODULE_FQN: "M.l0", semconv.MODULE_PASS: "forward"}),
            span(1, "train_step", f"s{step}", "", t0 * MS, (t0 + 90) * MS, world_size=2, **{semconv.STEP: step}),
            span(1, "train_step_tail", f"t{step}", f"s{step}", (t0 + 90) * MS, (t0 + 111) * MS,
                 [_p2p(semconv.RECV, 0, t0 + 111, 21)], world_size=2, **{semconv.STEP: step}),
        ]
    answer = stragglers.find(spans)
    assert answer["lateness"] == [] and answer["stragglers"] == []


def test_a_row_late_in_few_steps_must_stand_far_out_of_the_noise_and_one_late_in_most_need_not():
    # 2 ranks, 30 steps, a 1 ms floor and no other lateness: the cut is the floor. Rank 0 late in 5 of the 27
    # steps from its first late one (p = 3e-3 x 1 row, significant): at 2 ms (2 cuts) that is the noise's tail of a
    # rank with more to do, at 4 ms (4 cuts >= MIN_EFFECT_SPARSE) a straggler. Late in every step from step 20 (a
    # fail-slow), 2 ms is one (>= MIN_EFFECT): 10 of the 10 steps since its first late one.
    seen = {rank: set(range(30)) for rank in (0, 1)}

    def rows(steps, ms):
        return [(row["rank"], row["steps_late"]) for row in stragglers.judge(
            [Late(0, step, stragglers.BETWEEN_STEPS, "", ms * MS, ms * MS, ms * MS) for step in steps], seen)]

    assert rows((3, 9, 15, 21, 27), 2) == []
    assert rows((3, 9, 15, 21, 27), 4) == [(0, 5)]
    assert rows(range(20, 30), 2) == [(0, 10)]
