"""Steps are the optimizer's: a step ends at ``optimizer.step()`` however many backward passes come first, on every
rank; the cut after ``NO_OPTIMIZER_CYCLES`` backward passes is for scripts with no optimizer at all."""

import pytest
import torch

from commdebug_otel import semconv
from commdebug_otel.core.recorder import NO_OPTIMIZER_CYCLES

from distributed import run_ranks
from models import Block

OPTIMIZER_STEPS = 4


def _in_trace(spans, step):
    """How many of ``spans`` are in ``step``'s trace (each train_step has its own)."""
    return sum(1 for span in spans if span.context.trace_id == step.context.trace_id)


def _accumulate(model, optimizer, micro_batches):
    for _ in range(OPTIMIZER_STEPS):
        for _ in range(micro_batches):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("made", ["before the tracer", "after the tracer"])
@pytest.mark.parametrize("micro_batches", [1, 8, 16, 64])
def test_gradient_accumulation_is_one_step_per_optimizer_step(telemetry, tracer_factory, micro_batches, made):
    """16 micro-batches per optimizer step were 5 train_steps for 4 optimizer steps (a cut after 8 backward passes
    before the first step), every torch.step after the first one off by one."""
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if made == "before the tracer" else None
    with tracer_factory():
        if optimizer is None:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        _accumulate(model, optimizer, micro_batches)
    steps = telemetry.by_name("train_step")
    assert [span.attributes[semconv.STEP] for span in steps] == list(range(OPTIMIZER_STEPS))
    assert [semconv.STEP_PART in span.attributes for span in steps] == [False] * OPTIMIZER_STEPS
    forwards = telemetry.by_name("Block forward")
    assert len(forwards) == OPTIMIZER_STEPS * micro_batches
    by_step = [_in_trace(forwards, step) for step in steps]
    assert by_step == [micro_batches] * OPTIMIZER_STEPS


def test_without_an_optimizer_a_step_is_cut_after_the_backward_passes(telemetry, tracer_factory, no_optimizer_alive):
    """No optimizer alive (one made and dropped before the tracer does not count): the cut stays."""
    model = Block()
    dropped = torch.optim.SGD(model.parameters(), lr=0.1)
    del dropped
    with tracer_factory():
        for _ in range(2 * NO_OPTIMIZER_CYCLES + 1):  # the last forward closes the second step
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert [span.attributes[semconv.STEP] for span in telemetry.by_name("train_step")] == [0, 1, 2]


def test_an_optimizer_made_later_is_known_before_it_steps(telemetry, tracer_factory, no_optimizer_alive):
    """A step already cut (no optimizer then) keeps its number; once an optimizer exists, its step() alone ends
    steps."""
    model = Block()
    with tracer_factory():
        for _ in range(NO_OPTIMIZER_CYCLES + 1):  # step 0 is cut at the ninth forward
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2 * NO_OPTIMIZER_CYCLES):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    steps = telemetry.by_name("train_step")
    assert [span.attributes[semconv.STEP] for span in steps] == [0, 1]
    forwards = telemetry.by_name("Block forward")
    assert [_in_trace(forwards, step) for step in steps] == [NO_OPTIMIZER_CYCLES, 2 * NO_OPTIMIZER_CYCLES + 1]


CHUNKS = 8  # head forward/backward passes per micro-batch on the last stage (a chunked loss)


def _pipeline_ranks(rank: int, world_size: int) -> dict:
    """Rank 1 runs a chunked loss (CHUNKS head forward/backward passes per micro-batch, then the body's backward),
    rank 0 one backward per micro-batch; both all-reduce before each optimizer step."""
    import torch.distributed as dist

    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()
    torch.manual_seed(0)
    body, head = Block(), torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                    meter_provider=telemetry.meter_provider):
        for _ in range(3):
            for _ in range(2):  # micro-batches
                hidden = body(torch.randn(CHUNKS, 4, requires_grad=True))
                if rank == 1:
                    detached = hidden.detach().requires_grad_()
                    for chunk in detached.chunk(CHUNKS):
                        head(chunk).sum().backward()
                    hidden.backward(detached.grad)
                else:
                    head(hidden).sum().backward()
            dist.all_reduce(torch.ones(1))
            optimizer.step()
    steps = telemetry.by_name("train_step")
    return {"steps": [span.attributes[semconv.STEP] for span in steps],
            "traces": [span.context.trace_id for span in steps],
            "heads": [_in_trace(telemetry.by_name("Linear forward"), step) for step in steps]}


def test_a_rank_with_a_chunked_loss_numbers_steps_as_the_others():
    """The last stage's chunked loss ran 8 backward passes per micro-batch: it split its first step and ran ahead
    of the other ranks (a healthy run then reports unfinished steps and a desync)."""
    plain, chunked = run_ranks(_pipeline_ranks, 2)
    assert plain["steps"] == chunked["steps"] == [0, 1, 2]
    assert plain["traces"] == chunked["traces"]
    assert plain["heads"] == [2, 2, 2]
    assert chunked["heads"] == [2 * CHUNKS] * 3


def test_stop_puts_optimizer_init_back(tracer_factory):
    """While a tracer runs, ``Optimizer.__init__`` remembers each optimizer made; after its stop, torch's own."""
    original = torch.optim.Optimizer.__dict__["__init__"]
    with tracer_factory():
        assert torch.optim.Optimizer.__dict__["__init__"] is not original
        assert torch.optim.Optimizer.__init__.__wrapped__ is original
    assert torch.optim.Optimizer.__dict__["__init__"] is original
