"""A real Prometheus scrapes two real gloo workers; every query of the Grafana dashboard runs against it.

The workers train a small model whose collectives are known exactly
(per step: one forward all_reduce, one forward all_gather, one backward
all_reduce; at set-up: one broadcast per parameter), with
``OTEL_METRICS_EXPORTER=prometheus``: each serves its metrics on
``OTEL_EXPORTER_PROMETHEUS_PORT`` + local rank. Rank 0 then polls Prometheus
until it holds both ranks' final values, so the processes stay up until
Prometheus has scraped everything, and returns that moment; every query below
is evaluated at it.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

import grafana_dashboard as dash
from distributed import run_ranks
from models import AllReduceInBackward
from prometheus_server import PrometheusServer, by_labels, free_port_run, prometheus_binary, query

WORLD_SIZE = 2
STEPS = 8
TRACE_EVERY = 2  # steps 0, 2, 4 and 6 are traced, and so timed: the timing histograms sample the steps
COMPLETION_EVERY = 10  # the default
STEP_PAUSE_S = 0.35  # training spans several 1 s scrapes, so rates have at least two samples
BATCH, DIM = 8, 16
FLOAT32_BYTES = 4
POLL_TIMEOUT_S = 25.0
LATE_S = 0.05  # rank 1 reaches each step's forward all_reduce this late: rank 0 waits for it
WATCHDOG_S = 55.0  # a hung rank exits hard instead of holding the test for gloo's 30 min timeout


# ------------------------------------------------------------------ the job
class _AllReduceInForward(torch.autograd.Function):
    """RowwiseParallel's output: all_reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Net(torch.nn.Module):
    """Per forward: all_reduce of [BATCH, DIM] and all_gather of [DIM]; per backward: all_reduce of [BATCH, DIM]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, DIM)
        self.fc2 = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if dist.get_rank() == 1:
            time.sleep(LATE_S)
        h = _AllReduceInForward.apply(h)
        gathered = [torch.empty(DIM) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, h.detach().mean(0))
        h = AllReduceInBackward.apply(h)
        return self.fc2(h)


def expected_collectives() -> dict[tuple[str, str], tuple[int, int]]:
    """``{(op, pass): (count, payload bytes)}`` that each rank issues."""
    activation = BATCH * DIM * FLOAT32_BYTES
    parameters = (2 * DIM * DIM + 2 * DIM) * FLOAT32_BYTES
    return {
        ("broadcast", "none"): (4, parameters),  # set-up, outside any module pass
        ("all_reduce", "forward"): (STEPS, STEPS * activation),
        ("all_gather", "forward"): (STEPS, STEPS * DIM * FLOAT32_BYTES),
        ("all_reduce", "backward"): (STEPS, STEPS * activation),
    }


def timed_steps() -> int:
    """Steps whose collectives have a ``torch.collective.duration`` point (traced, or one in COMPLETION_EVERY)."""
    return sum(1 for step in range(STEPS) if step % TRACE_EVERY == 0 or step % COMPLETION_EVERY == 0)


def expected_durations() -> dict[tuple[str, str], int]:
    """``{(op, pass): points}`` of the issue-time histogram on each rank: set-up (timed) and the timed steps."""
    return {key: n if key == ("broadcast", "none") else n // STEPS * timed_steps()
            for key, (n, _) in expected_collectives().items()}


def expected_dropped_events() -> int:
    """With a cap of 1 event per span: the 2nd collective of each traced forward span, 3 of 4 set-up broadcasts."""
    return STEPS // TRACE_EVERY + 3


def _final_values_reached(url: str, at: float) -> bool:
    want = expected_collectives()
    ranks = [str(rank) for rank in range(WORLD_SIZE)]
    counts = by_labels(query(url, "sum by (torch_distributed_rank, torch_collective_op, torch_module_pass) "
                                  "(torch_collective_operations_total)", at),
                       "torch_distributed_rank", "torch_collective_op", "torch_module_pass")
    nbytes = by_labels(query(url, "sum by (torch_distributed_rank, torch_collective_op, torch_module_pass) "
                                  "(torch_collective_io_bytes_total)", at),
                       "torch_distributed_rank", "torch_collective_op", "torch_module_pass")
    observed = by_labels(query(url, "sum by (torch_distributed_rank, torch_collective_op, torch_module_pass) "
                                    "(torch_collective_duration_seconds_count)", at),
                         "torch_distributed_rank", "torch_collective_op", "torch_module_pass")
    dropped = by_labels(query(url, "sum by (instance) (commdebug_telemetry_dropped_total)", at), "instance")
    return (counts == {(rank, *key): n for rank in ranks for key, (n, _) in want.items()}
            and nbytes == {(rank, *key): b for rank in ranks for key, (_, b) in want.items()}
            and observed == {(rank, *key): n for rank in ranks for key, n in expected_durations().items()}
            and sorted(dropped.values()) == [expected_dropped_events()] * WORLD_SIZE)


def _wait_for_a_scrape_of_the_setup(rank: int, url: str) -> None:
    """Hold training until Prometheus has scraped both ranks' set-up broadcasts.

    Prometheus starts scraping a second or more after the workers do; a run that
    ended before its first scrape would leave every rate with one sample (no
    data). Ranks agree through the store, not a collective (that would be counted).
    """
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        deadline = time.monotonic() + POLL_TIMEOUT_S
        expr = 'sum by (torch_distributed_rank) (torch_collective_operations_total{torch_collective_op="broadcast"})'
        while time.monotonic() < deadline:
            if by_labels(query(url, expr), "torch_distributed_rank") == {
                    (str(r),): 4.0 for r in range(WORLD_SIZE)}:
                break
            time.sleep(0.1)
        store.set("commdebug-test/set-up-scraped", "1")
    else:
        store.wait(["commdebug-test/set-up-scraped"])


def _train_then_wait_for_scrape(rank: int, world_size: int, prometheus_url: str) -> dict:
    """Train under CommTracer (settings and exporters from OTEL_*), then keep serving until scraped."""
    import commdebug_otel

    watchdog = threading.Timer(WATCHDOG_S, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.time()
    with commdebug_otel.CommTracer():
        for parameter in model.parameters():
            dist.broadcast(parameter.detach(), src=0)
        _wait_for_a_scrape_of_the_setup(rank, prometheus_url)
        for _ in range(STEPS):
            model(torch.randn(BATCH, DIM)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(STEP_PAUSE_S)
    trained = time.time()
    # The tracer is stopped; the meter provider with a pull endpoint (and the endpoint) lives until exit.
    result: dict = {"started": started, "trained": trained, "at": None}
    try:
        if rank == 0:
            deadline = time.monotonic() + POLL_TIMEOUT_S
            while time.monotonic() < deadline:
                at = time.time()
                if _final_values_reached(prometheus_url, at):
                    result["at"] = at
                    break
                time.sleep(0.25)
    finally:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=POLL_TIMEOUT_S + 10))
        watchdog.cancel()
    return result


# ------------------------------------------------------------------ fixture
@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """Prometheus that scraped a finished 2-rank job; ``at`` is when it held every final value."""
    prometheus_binary()  # skips (fails under CI) without Debian's prometheus
    base = free_port_run(WORLD_SIZE)
    targets = [f"127.0.0.1:{base + rank}" for rank in range(WORLD_SIZE)]
    env = {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_SERVICE_NAME": "commdebug-prometheus-test",
        "OTEL_METRICS_EXPORTER": "prometheus",
        # Spans must go somewhere for their events to be capped (with "none" no span is built).
        "OTEL_TRACES_EXPORTER": "file",
        "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": str(tmp_path_factory.mktemp("spans")),
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(base),
        "OTEL_PYTHON_COMMDEBUG_MAX_EVENTS_PER_SPAN": "1",
        "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": str(TRACE_EVERY),
        "OTEL_PYTHON_COMMDEBUG_COMPLETION_EVERY": str(COMPLETION_EVERY),
    }
    with PrometheusServer(targets, scrape_interval_s=1.0) as server:
        results = run_ranks(_train_then_wait_for_scrape, WORLD_SIZE, server.url, env=env)
        at = results[0]["at"]
        assert at is not None, (
            f"Prometheus did not hold the final values within {POLL_TIMEOUT_S} s; it holds "
            f"{query(server.url, 'torch_collective_operations_total')}\nprometheus log:\n{server.log()}")
        assert at - results[0]["started"] < 25, "the rate window (30 s) must cover the whole run"
        yield types.SimpleNamespace(server=server, at=at, targets=targets, results=results)


def _query(scraped, expr: str) -> list[dict]:
    return scraped.server.query(expr, at=scraped.at)


# -------------------------------------------------------------------- tests
def test_prometheus_holds_exactly_the_documented_names(scraped):
    names = {name for name in scraped.server.api("label/__name__/values")
             if name.startswith(("torch_", "commdebug_"))}
    assert names == set(dash.PROMETHEUS_METRICS)
    series = scraped.server.api("series", **{"match[]": "torch_collective_operations_total"})
    scrape_labels = {"__name__", "job", "instance"}
    labels = {key for item in series for key in item if key not in scrape_labels
              and not key.startswith("otel_scope_")}
    assert labels == set(dash.COLLECTIVE_LABELS)  # no mesh dim (WORLD is no mesh dimension), no fqn
    dropped = scraped.server.api("series", **{"match[]": "commdebug_telemetry_dropped_total"})
    assert {key for item in dropped for key in item if key not in scrape_labels
            and not key.startswith("otel_scope_")} == set(dash.DROPPED_LABELS)
    up = by_labels(_query(scraped, "up"), "instance")
    assert up == {(target,): 1.0 for target in scraped.targets}


def test_counters_are_exact_per_rank(scraped):
    want = expected_collectives()
    for rank in range(WORLD_SIZE):
        counts = by_labels(_query(scraped, f'sum by (torch_collective_op, torch_module_pass) '
                                           f'(torch_collective_operations_total{{torch_distributed_rank="{rank}"}})'),
                           "torch_collective_op", "torch_module_pass")
        assert counts == {key: n for key, (n, _) in want.items()}
        nbytes = by_labels(_query(scraped, f'sum by (torch_collective_op, torch_module_pass) '
                                           f'(torch_collective_io_bytes_total{{torch_distributed_rank="{rank}"}})'),
                           "torch_collective_op", "torch_module_pass")
        assert nbytes == {key: b for key, (_, b) in want.items()}
    all_reduces = by_labels(_query(scraped, 'sum by (torch_distributed_rank) '
                                            '(torch_collective_operations_total{torch_collective_op="all_reduce"})'),
                            "torch_distributed_rank")
    assert all_reduces == {(str(rank),): 2.0 * STEPS for rank in range(WORLD_SIZE)}
    # Every collective of a timed step is observed once by the histogram; every bucket series ends at +Inf = count.
    inf = by_labels(_query(scraped, 'sum by (torch_distributed_rank) '
                                    '(torch_collective_duration_seconds_bucket{le="+Inf"})'),
                    "torch_distributed_rank")
    assert 0 < timed_steps() < STEPS
    assert inf == {(str(rank),): float(sum(expected_durations().values())) for rank in range(WORLD_SIZE)}
    group = by_labels(_query(scraped, "count by (torch_process_group_name, torch_process_group_size) "
                                      "(torch_collective_operations_total)"),
                      "torch_process_group_name", "torch_process_group_size")
    assert list(group) == [("0", str(WORLD_SIZE))]


def test_dashboard_uses_only_names_prometheus_held(scraped):
    dashboard = dash.load()
    held = set(scraped.server.api("label/__name__/values"))
    # The straggler panel's series exists once the live verdict named a rank: a healthy job holds none.
    assert dash.all_metric_names(dashboard) - set(dash.ON_VERDICT_METRICS) <= held
    for name, var in dash.variables(dashboard).items():
        if var["type"] == "datasource":
            continue  # which Prometheus: not a query
        metric, label = dash.label_values_query(dash.variable_definition(var))
        values = scraped.server.api(f"label/{label}/values", **{"match[]": metric})
        assert values, f"variable ${name} would offer no values"
        if label == "torch_distributed_rank":
            assert sorted(values) == [str(rank) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("title, ref, expr", dash.queries(dash.load()),
                         ids=[f"{title}/{ref}" for title, ref, _ in dash.queries(dash.load())])
def test_every_dashboard_query_returns_data(scraped, title, ref, expr):
    result = _query(scraped, dash.render(expr, dash.load()))
    if dash.metric_names(expr) & set(dash.ON_VERDICT_METRICS):
        assert result == [], result  # a healthy job (and the live verdict off, the default): no straggler drawn
        return
    assert result, f"panel {title!r} query {ref} returned no data"
    values = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(value) and value > 0 for value in values), (title, ref, result)


def _panel_result(scraped, title: str) -> list[dict]:
    dashboard = dash.load()
    [expr] = [expr for panel_title, _, expr in dash.queries(dashboard) if panel_title == title]
    return _query(scraped, dash.render(expr, dashboard))


def test_dashboard_totals_are_exact(scraped):
    per_rank_op: dict[tuple[str, str], float] = {}
    for (op, _), (n, _) in expected_collectives().items():
        for rank in range(WORLD_SIZE):
            per_rank_op[(str(rank), op)] = per_rank_op.get((str(rank), op), 0.0) + n
    issued = _panel_result(scraped, "Collectives issued per rank and op (since start)")
    assert by_labels(issued, "torch_distributed_rank", "torch_collective_op") == per_rank_op
    dropped = _panel_result(scraped, "Dropped telemetry (since start)")
    assert by_labels(dropped, "commdebug_dropped_kind") == {
        ("event",): float(WORLD_SIZE * expected_dropped_events())}


def test_dashboard_rates_split_by_the_right_labels(scraped):
    by_op = by_labels(_panel_result(scraped, "Collective rate by op"), "torch_collective_op")
    assert set(by_op) == {("broadcast",), ("all_reduce",), ("all_gather",)}
    # Per step: all_reduce twice (forward and backward), all_gather once.
    assert by_op[("all_reduce",)] > by_op[("all_gather",)] > 0
    per_rank = by_labels(_panel_result(scraped, "Collective rate per rank"), "torch_distributed_rank")
    assert set(per_rank) == {(str(rank),) for rank in range(WORLD_SIZE)}
    dashboard = dash.load()
    [passes] = [expr for title, ref, expr in dash.queries(dashboard)
                if title == "Forward vs backward" and ref == "A"]
    by_pass = by_labels(_query(scraped, dash.render(passes, dashboard)), "torch_module_pass")
    assert set(by_pass) == {("forward",), ("backward",), ("none",)}
    assert by_pass[("forward",)] > by_pass[("backward",)] > 0  # 2 forward collectives per step, 1 backward


def _ref_result(scraped, title: str, ref: str) -> list[dict]:
    dashboard = dash.load()
    [expr] = [expr for panel_title, panel_ref, expr in dash.queries(dashboard)
              if panel_title == title and panel_ref == ref]
    return _query(scraped, dash.render(expr, dashboard))


def test_step_signals_name_the_rank_the_others_wait_for(scraped):
    ranks = {(str(rank),) for rank in range(WORLD_SIZE)}
    for metric in ("torch_step_duration_seconds_count", "torch_step_collective_wait_seconds_count"):
        counts = by_labels(_query(scraped, f"sum by (torch_distributed_rank) ({metric})"), "torch_distributed_rank")
        assert counts == {rank: float(STEPS) for rank in ranks}, metric
    waited = by_labels(_query(scraped, "sum by (torch_distributed_rank) (torch_step_collective_wait_seconds_sum)"),
                       "torch_distributed_rank")
    assert waited[("0",)] >= 0.8 * LATE_S * STEPS  # rank 0 waits for the late rank at every step
    assert waited[("1",)] < waited[("0",)] / 4  # the straggler waits least
    steps = by_labels(_query(scraped, "sum by (torch_distributed_rank) (torch_step_duration_seconds_sum)"),
                      "torch_distributed_rank")
    assert min(steps.values()) >= LATE_S * STEPS  # both ranks' steps carry the delay
    assert set(by_labels(_ref_result(scraped, "Collective wait per step, per rank", "A"), "torch_distributed_rank")) \
        == ranks
    ages = by_labels(_panel_result(scraped, "Step age per rank"), "torch_distributed_rank")
    assert set(ages) == ranks and all(0 < age < WATCHDOG_S for age in ages.values())


def test_completion_time_per_rank_names_the_late_rank(scraped):
    # Where nothing blocks on the CPU (DDP's reducer waits in C++) completion times still separate the ranks:
    # rank 0's forward all_reduce completes when rank 1 arrives, LATE_S later; rank 1's at once.
    done = by_labels(_panel_result(scraped, "Collective completion time per rank (c10d)"), "torch_distributed_rank")
    assert set(done) == {(str(rank),) for rank in range(WORLD_SIZE)}
    assert done[("0",)] > 4 * done[("1",)], done


def test_seq_panels_are_exact_per_rank_and_group(scraped):
    last = 4 + 3 * STEPS - 1  # set-up broadcasts, then three collectives per step, all on the default group
    title = "Collective seq per rank and group (issued / completed)"
    for ref in ("A", "B"):
        seqs = by_labels(_ref_result(scraped, title, ref), "torch_distributed_rank", "torch_process_group_name")
        assert seqs == {(str(rank), "0"): float(last) for rank in range(WORLD_SIZE)}, ref


def test_time_in_collectives_scales_the_timed_steps_to_every_collective(scraped):
    """Issue times are taken on timed steps only (4 of 8, and the 4 set-up broadcasts): the panel multiplies
    their mean by every collective issued, where summing them would leave out the untimed steps' collectives.

    Per label set the factor is operations over timed points: 2 for the step collectives, 1 for the
    broadcasts; each ``rate`` extrapolates its own series to the window's edges, so it is not exact."""
    panel = by_labels(_panel_result(scraped, "Time in collectives per rank"), "torch_distributed_rank")
    summed = by_labels(_query(scraped, "sum by (torch_distributed_rank) "
                                       "(rate(torch_collective_duration_seconds_sum[30s]))"), "torch_distributed_rank")
    assert set(panel) == set(summed) == {(str(rank),) for rank in range(WORLD_SIZE)}
    for rank in panel:
        assert 1.2 < panel[rank] / summed[rank] < 4, rank
