import fcntl
import os
import tempfile

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


# Modules whose assertions compare ranks' timings (stragglers, a healthy job's noise, lateness bounds): under
# pytest-xdist (``-n`` in pyproject's addopts) each of their tests runs with no other worker's test beside it on the
# machine's cores, as in a serial run. The others run two at a time.
SERIAL_MODULES = frozenset({
    "test_accuracy_bench", "test_diagnose", "test_html_report", "test_offline", "test_offline_pipeline",
    "test_prometheus", "test_straggler_live",
})


class _RunLock:
    """Between the xdist workers of one run: a serial test holds ``run`` exclusively, any other test shares it.

    ``gate`` is taken first by both kinds, and a serial test keeps it while it waits and runs: workers that come to
    their next test meanwhile queue behind it rather than starve it. Locks are ``flock`` on two files named by the
    run's id; nothing is held between tests.
    """

    def __init__(self, run_id: str) -> None:
        self.folder = os.path.join(tempfile.gettempdir(), f"commdebug-otel-tests-{run_id}")
        os.makedirs(self.folder, exist_ok=True)
        self.gate = os.open(os.path.join(self.folder, "gate"), os.O_RDWR | os.O_CREAT)
        self.run = os.open(os.path.join(self.folder, "run"), os.O_RDWR | os.O_CREAT)

    def acquire(self, serial: bool) -> None:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.run, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def release(self) -> None:
        # Unlocked, not just closed: a child the test forked shares these descriptions and would hold the locks.
        fcntl.flock(self.run, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)

    def remove(self) -> None:
        """At a worker's end. A worker still running keeps its open files, on which its locks are; none can be
        waiting for this one's."""
        for name in ("gate", "run"):
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.folder)
        except OSError:  # the other worker's files are there
            pass


_run_lock: _RunLock | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup (module fixtures that run a job included), call and teardown of a test, under the run's lock."""
    global _run_lock
    # Only in an xdist worker itself: a pytest a test runs inherits the worker's environment, not its config.
    worker = getattr(item.config, "workerinput", None)
    if worker is None:  # not under xdist: one test at a time anyway
        yield
        return
    if _run_lock is None:
        _run_lock = _RunLock(worker["testrunuid"])
    _run_lock.acquire(serial=item.module.__name__.rpartition(".")[2] in SERIAL_MODULES)
    try:
        yield
    finally:
        _run_lock.release()


def pytest_sessionfinish(session):
    if _run_lock is not None:
        _run_lock.remove()
