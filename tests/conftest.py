import os

import pytest
import torch
import torch.distributed as dist

from commdebug_otel.testing import InMemoryTelemetry


@pytest.fixture
def telemetry():
    return InMemoryTelemetry()


@pytest.fixture
def tracer_factory(telemetry):
    """Build CommTracers wired to the in-memory telemetry; stops them after the test."""
    from commdebug_otel import CommTracer, Settings

    made = []

    def make(**settings):
        tracer = CommTracer(Settings(**settings), tracer_provider=telemetry.tracer_provider,
                            meter_provider=telemetry.meter_provider)
        made.append(tracer)
        return tracer

    yield make
    for tracer in made:
        tracer.stop()


@pytest.fixture(scope="session")
def single_rank_group():
    """A real one-rank gloo process group in the test process, for collectives without spawning."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the store binds a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_env_leaks(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_tracer_left_running(request):
    """A tracer left started would make every later one in this process a no-op (one exporter per process)."""
    yield
    from commdebug_otel.tracer import exporting_tracer

    tracer = exporting_tracer()
    if tracer is not None:
        tracer.stop()
        print(f"LEFT RUNNING by {request.node.nodeid}")


@pytest.fixture
def no_optimizer_alive(monkeypatch):
    """The process's optimizers as a fresh process would have them: none (the suite's other tests leave theirs
    alive in module fixtures); those the test makes are still found, through ``Optimizer.__init__``."""
    import weakref

    from commdebug_otel.capture import optimizers

    monkeypatch.setattr(optimizers.OPTIMIZERS, "_live", weakref.WeakSet())
    monkeypatch.setattr(optimizers, "optimizer_classes_made", lambda: [])
