"""Every exported span ends at or after its start, and its events lie within it: on a normal traced run, in the
stall snapshots of a rank hung in a backward, and in a run ended by an exception (real gloo ranks)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from commdebug_otel import semconv

from distributed import run_ranks
from models import AllReduceLinear, MaybeBoom

HANG_S = 2.5
DIRECT_SNAPSHOT = 99  # the snapshot number of the one the test takes itself


def time_faults(spans: list[tuple[str, int, int, list[int], dict]]) -> list[str]:
    """``(name, start_ns, end_ns, event times, attributes)`` of each span -> what is wrong with its times.

    A ``stalled`` span's events are the ring of recent collectives, which reaches back past the stall's start
    (the steps before it): for those only "not after the span's end" holds.
    """
    faults = []
    for name, start, end, events, attrs in spans:
        where = (f"{name} (snapshot {attrs.get(semconv.STALL_SNAPSHOT)}, "
                 f"incomplete {attrs.get(semconv.SPAN_INCOMPLETE)})")
        if end < start:
            faults.append(f"{where} ends {(start - end) / 1e6:.3f} ms before it starts")
        low = None if name == semconv.SPAN_STALLED else start
        for event in events:
            if event > end or (low is not None and event < low):
                faults.append(f"{where} has an event {(event - start) / 1e6:.3f} ms from its start, "
                              f"{(end - start) / 1e6:.3f} ms long")
    return faults


def _times(telemetry) -> list[tuple[str, int, int, list[int], dict]]:
    return [(span.name, span.start_time, span.end_time, [event.timestamp for event in span.events],
             dict(span.attributes)) for span in telemetry.span_exporter.get_finished_spans()]


def _normal_run(rank: int, world_size: int) -> list:
    """Accumulation, collectives in forward and between steps (a step's tail), an evaluation under no_grad."""
    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    model = nn.Sequential(AllReduceLinear(4), nn.ReLU(), AllReduceLinear(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        for _ in range(3):
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            dist.all_reduce(torch.ones(1))  # logging after the step: its train_step_tail
            with torch.no_grad():
                model(torch.ones(2, 4))
    return _times(telemetry)


_HANG: dict = {}  # this rank's hang: the seconds, and the event set once the backward is hung


class _HangInBackward(torch.autograd.Function):
    """Identity; its backward hangs where asked, then all-reduces the gradient (the other rank waits there)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        seconds = _HANG.get("seconds", 0.0)
        if seconds:
            _HANG["seconds"] = 0.0
            _HANG["hung"].set()
            time.sleep(seconds)
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad)
        return grad


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return _HangInBackward.apply(self.proj(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.lm_head = Head()

    def forward(self, x):
        return self.lm_head(self.body(x))


def _hung_in_backward(rank: int, world_size: int) -> dict:
    """Rank 1 hangs in lm_head's backward at step 1 (rank 0 waits for it in that backward's all_reduce); the
    watchdogs take snapshots. Rank 1 also takes one itself, with a clock read before the backward began: what
    a watchdog does that read the clock, then published its record while the rank went on into the backward."""
    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    torch.manual_seed(0)
    model = LM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _HANG["hung"] = threading.Event()
    with CommTracer(Settings(stall_after_s=1.0), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider) as tracer:
        for step in range(3):
            loss = model(torch.ones(2, 4)).sum()
            snapshot = None
            if rank == 1 and step == 1:
                _HANG["seconds"] = HANG_S
                before = time.time_ns()
                snapshot = threading.Thread(target=lambda now=before: _HANG["hung"].wait(10) and (
                    tracer.recorder.stall_snapshot(now, 2.0, 1.0, DIRECT_SNAPSHOT,
                                                   tracer.recorder.stall_place(("", "", [])))))
                snapshot.start()
            loss.backward()
            if snapshot is not None:
                snapshot.join(10)
            optimizer.step()
    return {"spans": _times(telemetry)}


def test_a_normal_traced_run_has_no_span_out_of_time():
    runs = run_ranks(_normal_run, 2)
    for spans in runs:
        assert {name for name, *_ in spans} >= {"train_step", "train_step_tail", "Sequential forward",
                                                 "Sequential backward", "Sequential.0 forward"}
        assert time_faults(spans) == []


def test_a_snapshot_of_a_rank_hung_in_backward_has_no_span_out_of_time():
    """A snapshot read the clock, then the rank began lm_head's backward: that open span ended 3 ms before it
    began (``lm_head backward``, incomplete, -3.1 ms)."""
    waiting, hung = run_ranks(_hung_in_backward, 2)
    direct = [span for span in hung["spans"] if span[4].get(semconv.STALL_SNAPSHOT) == DIRECT_SNAPSHOT]
    incomplete = {name for name, _, _, _, attrs in direct if attrs.get(semconv.SPAN_INCOMPLETE)}
    assert incomplete == {"train_step", "LM backward", "LM.lm_head backward"}
    assert time_faults(hung["spans"]) == []
    assert time_faults(waiting["spans"]) == []


def test_a_run_ended_by_an_exception_has_no_span_out_of_time(telemetry, tracer_factory):
    model = MaybeBoom()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="boom"), tracer_factory():
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        model(torch.ones(2, 4), explode=True)
    spans = _times(telemetry)
    errors = [name for name, *_ in spans if name == "MaybeBoom.boom forward"]
    assert errors == ["MaybeBoom.boom forward"]
    assert time_faults(spans) == []


def test_the_check_finds_a_span_that_ends_before_it_starts():
    spans = [("lm_head backward", 10_000_000, 6_900_000, [], {semconv.SPAN_INCOMPLETE: True}),
             ("stalled", 5, 9, [1, 9], {}), ("x forward", 5, 9, [4], {})]
    assert time_faults(spans) == ["lm_head backward (snapshot None, incomplete True) ends 3.100 ms before it starts",
                                  "x forward (snapshot None, incomplete None) has an event -0.000 ms from its "
                                  "start, 0.000 ms long"]
