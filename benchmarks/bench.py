#!/usr/bin/env python
"""commdebug-otel overhead benchmark: step time, memory, export rate, black hole, import cost.

Run from the repository root (about 25 minutes on 2 busy cores; ``--quick`` about 8)::

    python benchmarks/bench.py [--quick] [--installed] [--json results.json]

It measures, on real multi-rank CPU jobs (gloo on 127.0.0.1, ``torch.set_num_threads(1)``)
training the demo transformer of ``commdebug_otel._demo_model`` at the size in ``MODEL``:

1. step-time ratio to an uninstrumented step for torch's ``CommDebugMode`` and three
   ``CommTracer`` configurations, interleaved in round-robin blocks so machine drift
   cancels (tensor parallel on 2 ranks; FSDP2 + TP on 4 ranks unless ``--quick``; the
   ``commdebug-otel demo`` model at its own size, tensor parallel on 2 ranks), then
   always-on against uninstrumented alone, over many rounds, for a tight estimate;
2. RSS growth of rank 0 over 1000 traced steps exporting OTLP/gRPC to a local receiver;
3. span events per second delivered to that receiver by an export-heavy run (detail ``all``);
4. step-time ratio with the collector black-holed (accepts TCP, never answers) vs live;
5. ``import commdebug_otel`` cost with tracing disabled, and that it installs no hooks;
6. scale (``--only scale``): one rank of simulated FSDP2 + TP jobs of 8 to 8,192 ranks on
   torch's fake process group (real DTensor/FSDP2/TP code, no traffic), each in a fresh
   process: spans, events and OTLP bytes per rank and step, the largest trace, metric
   series, and the traced and always-on step-time ratios, interleaved;
7. depth (``--only depth``): per-span cost of tracing every step of a chain of 50 and of 300
   nested modules (one process), with the default file exporter and with
   ``OTEL_TRACES_EXPORTER=none``: the ratio between the depths, and spans per second per core;
8. offline (``--only offline``, ``--offline-ranks N``): wall time and peak RSS of ``commdebug-otel
   summarize`` and ``diagnose`` on a 1,024-rank job of 20 traced steps (real spans of a real 4-rank
   run, ranks multiplied: about 1.5 GB);
9. drop-in (``--only dropin``): torch's ``CommDebugMode`` and our ``commdebug_otel.CommDebugMode``
   side by side, each a fresh one entered around every step (outside the timer), against
   uninstrumented steps, interleaved (the overhead phase's three workloads; TP only with ``--quick``);
10. torch import (``--only torchimport``): ``python -c "import torch"`` with and without
   ``OTEL_PYTHON_COMMDEBUG_ENABLED=true``, in pairs of alternating order: the median extra CPU (and wall)
   time of a process that imports torch and never joins a process group, and which heavy modules it loads;
11. stall watchdog (``--only stall``): always-on with the stall watchdog (``STALL_AFTER=auto``, the
   default) and the cross-rank verdict's store exchange armed, against the same with ``STALL_AFTER=off``,
   on healthy steps, interleaved (tensor parallel on 2 ranks; the live straggler verdict off in both);
12. unit costs (``--only units``): one process, one gloo rank: a chain of 200 blocks (401 module calls a
   step) and a step of 200 one-element all_reduces, uninstrumented, ours untraced, ours traced every step,
   torch's ``ModTracker`` and torch's ``CommDebugMode``, interleaved, in the training thread's CPU time (a
   loaded machine's other processes and the export threads do not count): the added nanoseconds per untraced
   module call and per untraced collective, the added microseconds per traced span (and per module pass of
   ``ModTracker`` and ``CommDebugMode``), always-on per block, and what always-on costs a 1 s step of 500
   module calls and 200 collectives;
13. accuracy (``--only accuracy``, ``--reps N``; not in the default set, it takes about 25 minutes): the
   fault-injection matrix of ``benchmarks/accuracy.py`` (straggler top-1, false blames on healthy runs,
   hang verdicts right and their latency), which also runs on its own;
14. straggler verdict (``--only straggler``): always-on with the live straggler verdict (``STRAGGLER=on``: every
   rank publishes its steps' busy times through the job's store, rank 0 judges), against ``STRAGGLER=off``, the
   stall watchdog armed in both, on healthy steps, interleaved (tensor parallel on 2 ranks).

It prints a results table and a PASS/FAIL line per target (docs/performance.md explains
every number). ``--profile`` instead runs cProfile on rank 0 of a traced TP job and prints
the hot spots in ``commdebug_otel``. By default the working tree is measured (the
repository root goes first on ``sys.path``); ``--installed`` measures the installed package.
The exit status is 0 even when a target fails (it is a measurement, not a test); 1 if a
run crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------ targets
TARGET_TRACED_VS_TORCH = 1 / 3  # our every-step overhead <= 1/3 of CommDebugMode's
TARGET_ALWAYS_ON = 1.03  # trace_every=100, ratio to uninstrumented
TARGET_RSS_MB = 5.0  # RSS growth between step 100 and step 1000
TARGET_BLACKHOLE = 1.05  # black-holed / live step-time ratio
TARGET_IMPORT_MS = 20.0  # `import commdebug_otel`, disabled
# `import torch` with OTEL_PYTHON_COMMDEBUG_ENABLED=true, minus without: CPU time (user + system), which a busy
# machine's scheduling leaves nearly alone (the wall time is printed too)
TARGET_TORCH_IMPORT_S = 0.1
TARGET_TRACE_BYTES = 5_000_000  # largest trace at 1,024 ranks (Tempo's default max_bytes_per_trace)
TARGET_ALWAYS_BYTES = 2048  # always-on, per rank per step on the wire, amortized
TARGET_SCALE_TRACED = 1.15  # traced overhead (ratio - 1) at 1,024 ranks <= 1.15 x that at 8
TARGET_DEPTH = 1.3  # per-span traced cost at the deepest chain <= 1.3 x that at the shallowest
TARGET_STALL_WATCH = 1.01  # healthy steps: watchdog + verdict exchange armed / STALL_AFTER=off, ratio of medians
TARGET_STRAGGLER = 1.01  # healthy steps: live straggler verdict on / off, ratio of medians
# The depth phase: a chain of nested modules (each a Linear, then its child; one output tensor shared by
# the whole chain in backward), traced every step against untraced, with these exporters.
DEPTHS = (50, 300)
DEPTH_EXPORTERS = ("file", "none")

# The benchmark transformer: the demo's architecture, sized so that a pass-through dispatch
# mode costs about what the issue measured on its workloads (6-13%), not the demo's tiny
# default (dim 64, 32 tokens) where every op is a few microseconds and Python overhead of
# any kind dominates. Override with BENCH_MODEL="dim=64,max_seq_len=32,batch=4".
MODEL = {"dim": 256, "ffn_hidden": 1024, "max_seq_len": 64, "batch": 8}
for _item in filter(None, os.environ.get("BENCH_MODEL", "").split(",")):
    _key, _, _value = _item.partition("=")
    MODEL[_key.strip()] = int(_value)
BATCH = MODEL["batch"]
# The scale phase: the same model with 8 transformer blocks, tensor parallel of 4 inside FSDP2 over
# world/4 data-parallel ranks, one simulated rank (rank 0) per world size.
SCALE_WORLDS = (8, 128, 1024, 8192)
SCALE_TP = 4
SCALE_LAYERS = 8
SCALE_REPORTED_WORLD = 1024  # the world size the byte and overhead targets are read at
# Always-on bytes: metrics are exported every OTEL_METRIC_EXPORT_INTERVAL (60 s by default) whatever
# the step time; amortized over the steps of one interval at this assumed step time.
ASSUMED_STEP_S = 1.0
METRIC_EXPORT_INTERVAL_S = 60.0
ALWAYS_ON_TRACE_EVERY = 100  # the documented production setting (docs/performance.md)
# The overhead phase's workloads: the benchmark model with tensor parallel (2 ranks), with FSDP2 + TP
# (4 ranks), and `commdebug-otel demo`'s own model size (ModelArgs defaults, batch 4) with tensor parallel.
OVERHEAD_WORKLOADS = ("tp", "fsdp_tp", "demo")
CONFIGS = ("uninstrumented", "torch CommDebugMode", "ours traced (every step)",
           "ours always-on (1 in 100)", "ours detail=all", "ref: empty TorchDispatchMode")
BASELINE = CONFIGS[0]
DROPIN = "ours CommDebugMode (drop-in)"
DROPIN_CONFIGS = (BASELINE, CONFIGS[1], DROPIN)
TRACED_SERVICE = "traced"  # the overhead phase's every-step tracer, as its spans name their service
STALL_ARMED = "always-on, watchdog armed"  # the stall phase's configurations
STALL_OFF = "always-on, STALL_AFTER=off"
STRAGGLER_ON = "always-on, STRAGGLER=on"  # the straggler phase's configurations
STRAGGLER_OFF = "always-on, STRAGGLER=off"


# ============================================================== parent-side helpers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BlackHole:
    """A TCP server on 127.0.0.1 that accepts every connection and never reads or answers."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read: the peer waits forever

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sock.close()
        for conn in self.accepted:
            conn.close()


def counting_receiver():
    """An ``OtlpReceiver`` that tallies spans and events per ``service.name`` instead of keeping them."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from commdebug_otel.testing.otlp_receiver import OtlpReceiver

    class CountingReceiver(OtlpReceiver):
        def __init__(self) -> None:
            super().__init__()
            self.tally: dict[str, dict[str, Any]] = {}
            self._tally_lock = threading.Lock()

        def _record(self, signal, transport, req, size, wire, headers):
            if signal != "traces":
                return metrics_service_pb2.ExportMetricsServiceResponse()
            now = time.time()
            with self._tally_lock:
                self.requests_total = getattr(self, "requests_total", 0) + 1
            for rs in req.resource_spans:
                service = next((kv.value.string_value for kv in rs.resource.attributes
                                if kv.key == "service.name"), "?")
                spans = events = 0
                steps: list[int] = []
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        spans += 1
                        events += len(span.events)
                        if span.name == "train_step":
                            steps.extend(kv.value.int_value for kv in span.attributes
                                         if kv.key == "torch.step")
                with self._tally_lock:
                    entry = self.tally.setdefault(service, {
                        "spans": 0, "events": 0, "bytes": 0, "requests": 0, "steps": [],
                        "first_s": now, "last_s": now})
                    entry["spans"] += spans
                    entry["events"] += events
                    entry["steps"].extend(steps)
                    entry["last_s"] = now
                    entry["bytes"] += rs.ByteSize()
                    entry["requests"] += 1
            return trace_service_pb2.ExportTraceServiceResponse()

        def get(self, service: str) -> dict[str, Any]:
            with self._tally_lock:
                return dict(self.tally.get(service, {"spans": 0, "events": 0, "bytes": 0,
                                                     "requests": 0, "steps": []}))

    return CountingReceiver()


def deprioritize_other_threads() -> int:
    """Run every thread of this process but the calling one at nice 19 (Linux); returns how many.

    The local receiver stands in for a collector on another machine: on a small shared box
    its protobuf decoding would otherwise compete with the ranks for the same cores and be
    booked as tracing overhead. The ranks are spawned from the calling thread, so they keep
    its priority. Threads the receiver starts later inherit nice 19 from their creator.
    """
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return 0
    me = threading.get_native_id()
    count = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 19)
                count += 1
    return count


def child_env(endpoint: str) -> dict[str, str]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": "bench",
    }
    for name in ("OTEL_PYTHON_COMMDEBUG_ENABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED"):
        os.environ.pop(name, None)
    return env


def run_ranks(fn: Callable, world_size: int, env: dict[str, str], fake_world: int = 0,
              **kwargs: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, **kwargs)``; return their results.

    ``fake_world``: instead, ``world_size`` processes are the first ranks of a job of that many
    ranks on torch's fake process group (no traffic), each alone; ``fn`` gets ``fake_world``.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_rank_main, args=(world_size, free_port(), out_dir, env, fn, kwargs, fake_world),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception:
            for rank in range(world_size):
                log = Path(out_dir, f"rank{rank}.log")
                if log.exists():
                    sys.stderr.write(f"--- rank {rank} log (tail)\n" + log.read_text()[-4000:])
            raise
        results = []
        for rank in range(world_size):
            status, value = json.loads(Path(out_dir, f"rank{rank}.json").read_text())
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


# ================================================================ rank-side code
def _rank_main(rank: int, world_size: int, port: int, out_dir: str, env: dict[str, str],
               fn: Callable, kwargs: dict[str, Any], fake_world: int = 0) -> None:
    # Worker stderr (SDK warnings such as "Queue full, dropping span.") goes to a file: it is
    # still written, as it would be in a job, but does not flood the table.
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 2)
    world_size = fake_world or world_size
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if fake_world:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        kwargs["log_path"] = log.name
        result: Any = ("ok", fn(rank, world_size, **kwargs))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        log.flush()
        # Skip atexit: a tracer whose collector is black-holed would block exit in its flush
        # (measured separately); every result is on disk already.
        os._exit(0)


class Job:
    """The demo model, parallelized, with its optimizer and a few fixed batches."""

    def __init__(self, workload: str) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from commdebug_otel import _demo_model as dm

        self.dm = dm
        sizes = {k: v for k, v in MODEL.items() if k != "batch"}
        batch = BATCH
        if workload == "demo":  # `commdebug-otel demo`'s model and batch, tensor parallel on 2 ranks
            from commdebug_otel.demo import _DEMO_BATCH

            sizes, batch = {}, _DEMO_BATCH
        if workload == "fsdp_tp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
        elif workload == "scale":  # one rank of a large job on the fake process group
            import torch.distributed as dist

            world = dist.get_world_size()
            mesh = init_device_mesh("cpu", (world // SCALE_TP, SCALE_TP), mesh_dim_names=("dp", "tp"))
            tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
            sizes["n_layers"] = SCALE_LAYERS
        else:
            tp_mesh, dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), None
        args = dm.ModelArgs(**sizes)
        self.model = dm.parallelize(dm.Transformer(args, seed=0), tp_mesh, dp_mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=False)
        self.batches = [dm.make_batch(args, batch, i) for i in range(8)]
        self.count = 0

    def step(self) -> None:
        tokens, targets = self.batches[self.count % len(self.batches)]
        self.count += 1
        self.dm.train_step(self.model, self.optimizer, tokens, targets)

    def timed_step(self) -> float:
        """Barrier (invisible to every dispatch mode), then one step timed with perf_counter (s)."""
        import torch.distributed as dist
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # neither CommDebugMode nor ours sees the barrier
            dist.barrier()
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start


class Block:
    """Enter/exit one configuration around a block of steps."""

    def __init__(self, enter: Callable[[], Any], exit_: Callable[[Any], None],
                 per_step: bool = False) -> None:
        self.enter, self.exit, self.per_step = enter, exit_, per_step


def _tracer(settings_kwargs: dict[str, Any], service: str):
    """A CommTracer with its own Telemetry (distinct output_dir) whose spans carry ``service``.

    The SDK providers start lazily at the first span or metric and read the environment
    then, so ``service`` (OTEL_SERVICE_NAME) is set around the tracer's first block.
    """
    from commdebug_otel import CommTracer, Settings

    tracer = CommTracer(Settings(**{"output_dir": f"bench-{service}", **settings_kwargs}))
    tracer.bench_service = service
    return tracer


def _with_env(env: dict[str, str], fn: Callable[[], Any]) -> Any:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tracer_block(tracer, first_env: dict[str, str] | None = None, flush: bool = True) -> Block:
    state = {"first": True}
    if not flush:
        tracer.telemetry.force_flush = lambda *a, **k: None  # see black_hole_worker

    def enter() -> Any:
        return tracer.start()

    def exit_(_: Any) -> None:
        tracer.stop()
        _remove_collective_kernels()

    block = Block(enter, exit_)
    block.tracer = tracer
    block.state = state
    block.first_env = {"OTEL_SERVICE_NAME": tracer.bench_service, **(first_env or {})}
    return block


def _remove_collective_kernels() -> None:
    """Deregister the collective kernels, so that the next uninstrumented block is really so.

    ``CommTracer.stop()`` leaves them registered, passing collectives straight on (another
    thread may be inside one); each pass-through still boxes its arguments into Python.
    Here nothing else runs between blocks, and the next ``start()`` registers them again.
    """
    from commdebug_otel.capture.intercept import interceptor
    from commdebug_otel.capture.mode import COLLECTIVES

    kernels = interceptor(COLLECTIVES)
    if not kernels._subscribers:
        kernels._uninstall()


def _torch_block() -> Block:
    """torch's CommDebugMode, a fresh one around every step (entered and left outside the timer).

    torch 2.13's CommDebugMode cannot stay entered across steps: every forward pre-hook adds a
    module forward hook and only the last handle per FQN is removed, so the second forward in
    one context pops its parent stack twice and raises ``IndexError``.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    def enter() -> Any:
        mode = CommDebugMode()
        mode.__enter__()
        return mode

    return Block(enter, lambda mode: mode.__exit__(None, None, None), per_step=True)


def _dropin_block() -> Block:
    """Our ``commdebug_otel.CommDebugMode``, used as :func:`_torch_block` uses torch's: a fresh one per step.

    Its collective kernels are deregistered after each step, as after every tracer block.
    """
    from commdebug_otel import CommDebugMode

    def enter() -> Any:
        mode = CommDebugMode()
        mode.__enter__()
        return mode

    def exit_(mode: Any) -> None:
        mode.__exit__(None, None, None)
        _remove_collective_kernels()

    return Block(enter, exit_, per_step=True)


def _empty_mode_block() -> Block:
    """The floor of a dispatch-mode design: a TorchDispatchMode that only redispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class EmptyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def enter() -> Any:
        mode = EmptyMode()
        mode.__enter__()
        return mode

    return Block(enter, lambda mode: mode.__exit__(None, None, None))


def _run_interleaved(job: Job, blocks: dict[str, Block], rounds: int, steps_per_block: int,
                     warmup_blocks: int) -> dict[str, list[list[float]]]:
    """Round-robin: each round runs a block of every config (order rotated per round).

    The first step of every block is discarded (hooks re-registered after start()); so are
    the ``warmup_blocks`` first rounds. Returns ``{config: [[step s, ...] per round]}``.
    """
    names = list(blocks)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for round_index in range(warmup_blocks + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            block = blocks[name]
            first_env = getattr(block, "first_env", None)
            if first_env is not None and block.state["first"]:
                block.state["first"] = False
                # The tracer's first block creates its providers: give them their env.
                first_steps = getattr(block, "first_steps", steps_per_block)
                _with_env(first_env, lambda block=block, first_steps=first_steps: _run_block(job, block, first_steps))
                continue
            samples = _run_block(job, block, steps_per_block)
            if round_index >= warmup_blocks:
                times[name].append(samples)
    return times


def _run_block(job: Job, block: Block, steps: int) -> list[float]:
    if block.per_step:
        samples = []
        for _ in range(steps):
            handle = block.enter()
            try:
                samples.append(job.timed_step())
            finally:
                block.exit(handle)
        return samples[1:]
    handle = block.enter()
    try:
        samples = [job.timed_step() for _ in range(steps)]
    finally:
        block.exit(handle)
    return samples[1:]


def overhead_worker(rank: int, world_size: int, workload: str, rounds: int, steps_per_block: int,
                    log_path: str) -> dict[str, Any]:
    from commdebug_otel.config import Detail

    job = Job(workload)
    for _ in range(3):  # first steps ever: allocator, DTensor caches, gloo pairs
        job.timed_step()
    tracers = {
        CONFIGS[2]: _tracer({"trace_every": 1}, TRACED_SERVICE),
        CONFIGS[3]: _tracer({"trace_every": 100}, "always-on"),
        CONFIGS[4]: _tracer({"detail": Detail.ALL}, "detail-all"),
    }
    blocks: dict[str, Block] = {CONFIGS[0]: Block(lambda: None, lambda _: None),
                                CONFIGS[1]: _torch_block()}
    blocks.update({name: _tracer_block(tracer) for name, tracer in tracers.items()})
    blocks[CONFIGS[5]] = _empty_mode_block()
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    return {
        "times": times,
        "steps_taken": {name: tracer.recorder.steps_taken for name, tracer in tracers.items()},
        "services": {name: tracer.bench_service for name, tracer in tracers.items()},
    }


def dropin_worker(rank: int, world_size: int, workload: str, rounds: int, steps_per_block: int,
                  log_path: str) -> dict[str, Any]:
    """Uninstrumented, torch's CommDebugMode and ours, interleaved (:func:`_run_interleaved`)."""
    job = Job(workload)
    for _ in range(3):  # first steps ever: allocator, DTensor caches, gloo pairs
        job.timed_step()
    blocks = {BASELINE: Block(lambda: None, lambda _: None), CONFIGS[1]: _torch_block(), DROPIN: _dropin_block()}
    os.environ["OTEL_SERVICE_NAME"] = "dropin"
    return {"times": _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)}


class DepthJob:
    """A chain of ``depth`` nested modules, each a Linear then its child, trained with SGD.

    The innermost module's output is every module's output: in backward one tensor carries a
    backward-begin hook of every module of the chain (the worst case for backward nesting).
    """

    def __init__(self, depth: int) -> None:
        import torch

        class Nest(torch.nn.Module):
            def __init__(self, depth: int) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.inner = Nest(depth - 1) if depth > 1 else None

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = self.lin(x)
                return self.inner(x) if self.inner is not None else x

        sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * depth + 1000))
        torch.manual_seed(0)
        self.model = Nest(depth)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.input = torch.ones(2, 4)

    def step(self) -> None:
        self.model(self.input).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start

    def spans_per_step(self) -> int:
        """Spans of one traced step (``train_step`` included), counted in in-memory telemetry."""
        from commdebug_otel import CommTracer, Settings
        from commdebug_otel.testing import InMemoryTelemetry

        telemetry = InMemoryTelemetry()
        with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider):
            self.step()
            telemetry.clear()
            self.step()
        return len(telemetry.spans())


def depth_worker(rank: int, world_size: int, depth: int, rounds: int, steps_per_block: int,
                 log_path: str) -> dict[str, Any]:
    """One depth, in a process of its own: untraced and traced-every-step blocks (one per exporter), interleaved.

    A process per depth: Python's collections of its oldest generation are paid by the process whose
    step-lived objects brought them about (in one process, one depth's would fall in the other's blocks).
    """
    import gc

    job = DepthJob(depth)
    spans = job.spans_per_step()
    # The file exporter writes hundreds of MB here (FQNs grow with the depth): a folder removed at the end.
    out_dir = tempfile.mkdtemp(prefix="commdebug-bench-depth-")
    # The untraced blocks run with the collector paused: a collection of the old generation that the traced
    # blocks' objects bring about then falls in a traced block, never in the baseline (which, alone, makes few).
    blocks: dict[str, Block] = {BASELINE: Block(gc.disable, lambda _: gc.enable())}
    for exporter in DEPTH_EXPORTERS:
        # A folder per tracer: tracers with equal settings share one telemetry (and its exporters).
        service = f"depth{depth}-{exporter}"
        tracer = _tracer({"trace_every": 1, "output_dir": os.path.join(out_dir, service)}, service)
        blocks[exporter] = _tracer_block(tracer, {"OTEL_TRACES_EXPORTER": exporter})
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    # Garbage collections per traced step (file exporter), the part of the cost that grows with live objects.
    block = blocks[DEPTH_EXPORTERS[0]]
    handle = block.enter()
    try:
        job.step()
        before = [entry["collections"] for entry in gc.get_stats()]
        for _ in range(steps_per_block):
            job.step()
        after = [entry["collections"] for entry in gc.get_stats()]
    finally:
        block.exit(handle)
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"times": times, "spans": spans, "gc_per_step": [(b - a) / steps_per_block for a, b in zip(before, after)]}


def always_on_worker(rank: int, world_size: int, workload: str, rounds: int, steps_per_block: int,
                     log_path: str) -> dict[str, Any]:
    """Uninstrumented and always-on blocks only, many rounds: a tight estimate of a small ratio."""
    job = Job(workload)
    for _ in range(3):
        job.timed_step()
    tracer = _tracer({"trace_every": 100}, "always-on-long")
    blocks = {BASELINE: Block(lambda: None, lambda _: None), CONFIGS[3]: _tracer_block(tracer)}
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    return {"times": times, "steps_taken": tracer.recorder.steps_taken}


def stall_watch_worker(rank: int, world_size: int, workload: str, rounds: int, steps_per_block: int,
                       log_path: str) -> dict[str, Any]:
    """Always-on with the stall watchdog and its store exchange, and with ``STALL_AFTER=off``, interleaved.

    Each armed block starts the watchdog thread, which connects to the job's store and writes its alive
    key at its first look (1 s in): a job pays that once, so each armed block waits for it before its
    timed steps, and what is timed is the watchdog's steady state (a look a second). Returns the times
    and whether every armed block's exchange connected.
    """
    job = Job(workload)
    for _ in range(3):
        job.timed_step()
    armed_block, connected = _connected_block(_tracer({"trace_every": 100, "straggler": False}, "stall-armed"))
    blocks = {STALL_OFF: _tracer_block(_tracer({"trace_every": 100, "stall_after_s": None, "straggler": False},
                                               "stall-off")),
              STALL_ARMED: armed_block}
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    _remove_collective_kernels()
    return {"times": times, "exchange_connected": all(connected)}


def straggler_worker(rank: int, world_size: int, workload: str, rounds: int, steps_per_block: int,
                     log_path: str) -> dict[str, Any]:
    """Always-on with the live straggler verdict on and off (the stall watchdog armed in both), interleaved.

    Each block starts its tracer's watchdog thread; the ``on`` blocks wait for its store connection before
    their timed steps (as the stall phase does), so what is timed is the exchange's steady state: a rewrite
    of this rank's record per poll with a step ended, and on rank 0 the read of every record and the test.
    Returns the times, whether every ``on`` block connected, and the verdicts said (a healthy job: none).
    """
    job = Job(workload)
    for _ in range(3):
        job.timed_step()
    on = _tracer({"trace_every": 100, "straggler": True}, "straggler-on")
    on_block, connected = _connected_block(on)
    blocks = {STRAGGLER_OFF: _tracer_block(_tracer({"trace_every": 100, "straggler": False}, "straggler-off")),
              STRAGGLER_ON: on_block}
    said: list[str] = []
    watch_stop = on_block.exit

    def exit_counting(*args: Any) -> Any:
        watch = on._stall_watch
        if watch is not None and watch.stragglers is not None:
            said.extend(verdict.summary for verdict, _ in watch.stragglers.said)
        return watch_stop(*args)

    on_block.exit = exit_counting
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    _remove_collective_kernels()
    return {"times": times, "exchange_connected": all(connected), "verdicts": said}


def _connected_block(tracer) -> tuple[Block, list[bool]]:
    """``tracer``'s block, whose entry waits for its watchdog's store connection (a job pays it once, so the
    timed steps see the steady state); and the list where each entry says whether it connected."""
    block = _tracer_block(tracer)
    start, connected = block.enter, []

    def enter_connected() -> Any:
        started = start()
        connected.append(_exchange_connected(tracer))
        return started

    block.enter = enter_connected
    return block, connected


def _exchange_connected(tracer, timeout_s: float = 30.0) -> bool:
    """Wait until ``tracer``'s stall watchdog has connected its store exchange (its first look, ~1 s)."""
    exchange, deadline = tracer._stall_watch.exchange, time.monotonic() + timeout_s
    while exchange._store is None and exchange.on and time.monotonic() < deadline:
        time.sleep(0.05)
    return exchange._store is not None


def _wire_run(world_size: int) -> tuple[Job, dict[str, Any]]:
    """Set-up and 3 steps traced with the default settings into in-memory telemetry, with this
    rank's real resource; what one rank sends, as the OTLP exporters encode it."""
    from commdebug_otel import CommTracer, Settings, semconv
    from commdebug_otel.core.job_identity import rank_info, trace_block
    from commdebug_otel.otel.metrics import DURATION_BUCKETS_S, STEP_BUCKETS_S
    from commdebug_otel.otel.telemetry import build_resource
    from commdebug_otel.testing import InMemoryTelemetry
    from commdebug_otel.testing.wire import metric_series, metric_wire, trace_wire

    settings = Settings()
    telemetry = InMemoryTelemetry(resource=build_resource(rank_info()))
    with CommTracer(settings, tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        job = Job("scale")  # set-up is traced too: the outside-0 trace
        for _ in range(3):
            job.step()
    _remove_collective_kernels()
    spans = telemetry.spans()
    per_trace = trace_wire(spans)
    [last] = [span for span in spans if span.name == "train_step" and span.attributes[semconv.STEP] == 2]
    step_spans = [span for span in spans if span.context.trace_id == last.context.trace_id]
    step_bytes = per_trace[last.context.trace_id]
    largest = max(per_trace.values(), key=lambda wire: wire.raw)
    # Trace scope job: every rank of the trace block adds about as much to each trace.
    sharing = world_size if trace_block(0, world_size, settings.ranks_per_trace) is None else settings.ranks_per_trace
    data = telemetry.metric_reader.get_metrics_data()
    series = metric_series(data)
    # Prometheus series per data point: a histogram's buckets, +Inf, _sum and _count; else one.
    collective, step = len(DURATION_BUCKETS_S) + 3, len(STEP_BUCKETS_S) + 3
    per_point = {semconv.METRIC_DURATION: collective, semconv.METRIC_COMPLETION: collective,
                 semconv.METRIC_STEP_DURATION: step, semconv.METRIC_STEP_WAIT: step}
    return job, {
        "spans_per_rank_step": len(step_spans),
        "events_per_rank_step": sum(len(span.events) for span in step_spans),
        "step_bytes": dataclasses.asdict(step_bytes),
        "largest_rank_trace_bytes": dataclasses.asdict(largest),
        "ranks_per_trace": sharing,
        "trace_block": last.attributes.get(semconv.TRACE_BLOCK),
        "metric_bytes_per_export": dataclasses.asdict(metric_wire(data)),
        "metric_series_per_rank": sum(series.values()),
        "metric_series_by_instrument": series,
        "prometheus_series_per_rank": sum(count * per_point.get(name, 1)
                                          for name, count in series.items()),
        "metric_rank_label": settings.metric_rank_label_on(world_size),
    }


def scale_worker(rank: int, world_size: int, rounds: int, steps_per_block: int, log_path: str) -> dict[str, Any]:
    """One rank of a ``world_size``-rank FSDP2 + TP job (fake process group): wire sizes, then
    uninstrumented / traced / always-on blocks interleaved, exporting OTLP/gRPC to the receiver."""
    job, wire = _wire_run(world_size)
    for _ in range(2):
        job.timed_step()
    blocks = {BASELINE: Block(lambda: None, lambda _: None),
              "traced": _tracer_block(_tracer({"trace_every": 1}, "scale-traced")),
              "always-on": _tracer_block(_tracer({"trace_every": ALWAYS_ON_TRACE_EVERY}, "scale-always-on"))}
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    return {"wire": wire, "times": times}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    Memory freed but kept by the allocator is no leak, and it moves RSS by several MiB either way
    from one sample to the next (docs/performance.md, "RSS growth").
    """
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return False
    return True


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")  # find_library runs ldconfig: once


def memory_and_rate_worker(rank: int, world_size: int, steps: int, warmup: int, rate_steps: int,
                           log_path: str) -> dict[str, Any]:
    """Part 1: RSS over ``steps`` traced steps. Part 2: an export-heavy run at detail all."""
    import gc

    import torch.distributed as dist

    from commdebug_otel.config import Detail

    job = Job("tp")
    out: dict[str, Any] = {}
    tracer = _tracer({"trace_every": 1}, "rss")
    samples, untrimmed = [], []
    os.environ["OTEL_SERVICE_NAME"] = "rss"
    started = time.time()
    with tracer:
        for index in range(1, steps + 1):
            job.step()
            if index % 100 == 0 or index == warmup:
                gc.collect()
                untrimmed.append((index, _rss_bytes()))
                out["heap_trimmed"] = _trim_heap()
                samples.append((index, _rss_bytes()))
    out["rss"], out["rss_untrimmed"] = samples, untrimmed
    out["rss_wall_s"] = time.time() - started
    out["rss_steps_traced"] = tracer.recorder.steps_taken

    dist.barrier()
    tracer = _tracer({"trace_every": 1, "detail": Detail.ALL}, "events")
    os.environ["OTEL_SERVICE_NAME"] = "events"
    started = time.time()
    with tracer:
        for _ in range(rate_steps):
            job.step()
    out["rate_window"] = (started, time.time())  # stop() has flushed every span
    return out


def black_hole_worker(rank: int, world_size: int, rounds: int, steps_per_block: int,
                      live_endpoint: str, hole_endpoint: str, log_path: str,
                      prefill_steps: int = 45) -> dict[str, Any]:
    """Interleave uninstrumented / traced to a live receiver / traced into a black hole.

    Both tracers skip the flush that ``stop()`` does at the end of each block: the SDK's
    ``BatchSpanProcessor.force_flush`` ignores its timeout (opentelemetry-python#4568), so
    against a black hole it would block the training thread 10 s per queued batch. That
    blocking is measured once, at the end, in a side thread.
    """
    job = Job("tp")
    for _ in range(3):
        job.timed_step()
    live = _tracer({"trace_every": 1}, "live")
    hole = _tracer({"trace_every": 1}, "black-hole")
    live_block = _tracer_block(live, {"OTEL_EXPORTER_OTLP_ENDPOINT": live_endpoint}, flush=False)
    hole_block = _tracer_block(hole, {"OTEL_EXPORTER_OTLP_ENDPOINT": hole_endpoint}, flush=False)
    # Fill the span queue (2048 spans, about 57 per step) before timing, so the timed blocks
    # see the steady state of a dead collector: every new span drops the oldest.
    hole_block.first_steps = prefill_steps
    blocks = {"uninstrumented": Block(lambda: None, lambda _: None),
              "ours, live receiver": live_block, "ours, black-holed": hole_block}
    times = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    # How long would CommTracer.stop()'s flush block with the collector black-holed?
    flush_s: float | None = None
    if rank == 0:
        from commdebug_otel.otel.telemetry import Telemetry

        done = threading.Event()
        began = time.perf_counter()
        flusher = threading.Thread(target=lambda: (Telemetry.force_flush(hole.telemetry), done.set()),
                                   daemon=True)
        flusher.start()
        flusher.join(12.0)
        flush_s = time.perf_counter() - began if done.is_set() else None
    dropped = 0
    with contextlib.suppress(OSError):
        dropped = Path(log_path).read_text().count("Queue full")
    return {"times": times, "flush_s": flush_s, "queue_full_warnings": dropped}


def profile_worker(rank: int, world_size: int, steps: int, log_path: str, workload: str = "tp") -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    job = Job(workload)
    tracer = _tracer({"trace_every": 1}, "profile")
    os.environ["OTEL_SERVICE_NAME"] = "profile"
    tracer.start()
    for _ in range(5):
        job.step()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        job.step()
    profiler.disable()
    wall = time.perf_counter() - started
    tracer.stop()
    if rank != 0:
        return {}
    profiler.dump_stats(os.environ.get("BENCH_PROFILE_OUT", os.path.join(tempfile.gettempdir(),
                                                                           "commdebug-bench.prof")))
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = []
    for (path, line, func), (_cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"where": f"{Path(path).name}:{line}({func})", "path": path, "calls": nc,
                     "tottime_s": tt, "cumtime_s": ct})
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(40)
    return {"rows": rows, "total_s": total, "wall_s": wall, "steps": steps,
            "text": buffer.getvalue()}


# ================================================================ statistics
def per_round_ratios(per_rank: list[dict[str, list[list[float]]]], name: str) -> list[float]:
    """Per round: median over the block's steps of (max over ranks), divided by the baseline's."""
    ratios = []
    for round_index in range(len(per_rank[0][BASELINE])):
        def med(config: str, round_index: int = round_index) -> float:
            steps = zip(*(rank_times[config][round_index] for rank_times in per_rank))
            return statistics.median(max(step) for step in steps)

        ratios.append(med(name) / med(BASELINE))
    return ratios


def step_ms(per_rank: list[dict[str, list[list[float]]]], name: str) -> float:
    rows = [max(step) for r in range(len(per_rank[0][name]))
            for step in zip(*(rank_times[name][r] for rank_times in per_rank))]
    return 1000 * statistics.median(rows)


def slowest_rank_steps(per_rank: list[dict[str, list[list[float]]]], name: str) -> list[list[float]]:
    """Per round, the block's step times (s), each the slowest rank's."""
    return [[max(step) for step in zip(*(rank_times[name][r] for rank_times in per_rank))]
            for r in range(len(per_rank[0][name]))]


def pooled_ratio(ours: list[list[float]], base: list[list[float]], resamples: int = 2000) -> dict[str, float]:
    """Median of all our steps over the median of all baseline steps, with a 95% bootstrap CI.

    The bootstrap resamples whole rounds (pairs of adjacent blocks), so drift between rounds
    widens the interval instead of hiding in it. Also the ratio of means, which counts the
    occasional traced step at its full cost.
    """
    import random

    def ratio(indices: list[int]) -> float:
        return (statistics.median(t for i in indices for t in ours[i])
                / statistics.median(t for i in indices for t in base[i]))

    rounds = range(len(ours))
    rng = random.Random(0)
    samples = sorted(ratio([rng.choice(rounds) for _ in rounds]) for _ in range(resamples))
    all_ours = [t for block in ours for t in block]
    all_base = [t for block in base for t in block]
    return {"median": ratio(list(rounds)), "ci_low": samples[int(0.025 * resamples)],
            "ci_high": samples[int(0.975 * resamples) - 1],
            "mean_ratio": statistics.fmean(all_ours) / statistics.fmean(all_base),
            "steps": len(all_ours), "step_ms": 1000 * statistics.median(all_ours),
            "base_step_ms": 1000 * statistics.median(all_base)}


def summarize(ratios: list[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def config_rows(per_rank: list, names) -> dict[str, dict[str, float]]:
    """Each configuration's step-time ratio to the untraced one (median, quartiles, range) and step time
    in ms, printed as a table; ``per_rank``: each rank's ``times``."""
    rows = {}
    print(f"{'configuration':28} {'step ms':>8} {'ratio':>7} {'IQR':>15} {'min..max':>15}")
    for name in names:
        stats = summarize(per_round_ratios(per_rank, name))
        stats["step_ms"] = step_ms(per_rank, name)
        rows[name] = stats
        print(f"{name:28} {stats['step_ms']:8.2f} {stats['median']:7.3f} "
              f"{stats['q1']:7.3f}..{stats['q3']:<7.3f} {stats['min']:7.3f}..{stats['max']:<7.3f}")
    return rows


# ================================================================ the phases
def phase_overhead(rx, workload: str, world_size: int, rounds: int, steps_per_block: int,
                   report: dict[str, Any]) -> None:
    print(f"\n== step-time overhead: {workload}, {world_size} ranks, {rounds} rounds x "
          f"{steps_per_block} steps per config (first step of each block discarded)", flush=True)
    began = time.perf_counter()
    spans_before = rx.get(TRACED_SERVICE)["spans"]  # the receiver counts every workload's alike
    results = run_ranks(overhead_worker, world_size, child_env(rx.grpc_endpoint), workload=workload,
                        rounds=rounds, steps_per_block=steps_per_block)
    per_rank = [result["times"] for result in results]
    rows = config_rows(per_rank, CONFIGS)
    # Which steps did each of our tracers trace? (start/stop/start keeps counting steps)
    traced = {}
    for name, service in results[0]["services"].items():
        steps = sorted(set(rx.get(service)["steps"]))
        traced[name] = {"steps_counted": results[0]["steps_taken"][name], "traced_steps": steps}
    always = traced[CONFIGS[3]]
    print(f"always-on tracer: {always['steps_counted']} steps counted across its blocks, traced "
          f"steps {always['traced_steps']} (trace_every=100; start/stop/start keeps the counter)")
    # Spans per rank and traced step, as received; per-span cost = added step time / those spans.
    every = traced[CONFIGS[2]]
    spans = (rx.get(TRACED_SERVICE)["spans"] - spans_before) / max(1, world_size * every["steps_counted"])
    added_s = (rows[CONFIGS[2]]["step_ms"] - rows[BASELINE]["step_ms"]) / 1000
    per_span = added_s / spans if spans else float("nan")
    every.update(spans_per_rank_step=spans, us_per_span=per_span * 1e6,
                 spans_per_s_per_core=1 / per_span if per_span > 0 else float("inf"))
    print(f"traced every step: {spans:.0f} spans per rank and step, {per_span * 1e6:.0f} us of added step time per "
          f"span ({every['spans_per_s_per_core']:,.0f} spans/s per core: each rank runs on its own core)")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report[f"overhead_{workload}"] = {"ranks": world_size, "rounds": rounds,
                                      "steps_per_block": steps_per_block, "configs": rows,
                                      "traced": traced}


def phase_dropin(rx, workload: str, world_size: int, rounds: int, steps_per_block: int,
                 report: dict[str, Any]) -> None:
    print(f"\n== CommDebugMode drop-in vs torch's: {workload}, {world_size} ranks, {rounds} rounds x "
          f"{steps_per_block} steps per config, a fresh mode per step (first step of each block discarded)",
          flush=True)
    began = time.perf_counter()
    results = run_ranks(dropin_worker, world_size, child_env(rx.grpc_endpoint), workload=workload,
                        rounds=rounds, steps_per_block=steps_per_block)
    per_rank = [result["times"] for result in results]
    rows = config_rows(per_rank, DROPIN_CONFIGS)
    ours_vs_torch = pooled_ratio(slowest_rank_steps(per_rank, DROPIN), slowest_rank_steps(per_rank, CONFIGS[1]))
    print(f"ours / torch's, pooled: {ours_vs_torch['median']:.3f} (95% CI {ours_vs_torch['ci_low']:.3f}.."
          f"{ours_vs_torch['ci_high']:.3f})")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report[f"dropin_{workload}"] = {"ranks": world_size, "rounds": rounds, "steps_per_block": steps_per_block,
                                    "configs": rows, "ours_vs_torch": ours_vs_torch}


def _paired_phase(title: str, worker: Callable[..., dict[str, Any]], rx, workload: str, world_size: int,
                  rounds: int, steps_per_block: int, configs: tuple[str, str]) -> tuple[list[dict], dict[str, Any]]:
    """Run ``worker`` on every rank and pool the ratio of ``configs[0]``'s steps to ``configs[1]``'s (the
    slowest rank's per step). Returns the workers' results and the stats."""
    print(f"\n== {title}: {workload}, {world_size} ranks, {rounds} rounds x {steps_per_block} steps per config "
          f"(first step of each block discarded)", flush=True)
    results = run_ranks(worker, world_size, child_env(rx.grpc_endpoint), workload=workload,
                        rounds=rounds, steps_per_block=steps_per_block)
    per_rank = [result["times"] for result in results]
    return results, pooled_ratio(slowest_rank_steps(per_rank, configs[0]), slowest_rank_steps(per_rank, configs[1]))


def _print_paired(stats: dict[str, Any], names: tuple[str, str], after_steps: str, after_means: str,
                  began: float) -> None:
    print(f"{names[0]} {stats['base_step_ms']:.2f} ms, {names[1]} {stats['step_ms']:.2f} ms per step "
          f"(medians of {stats['steps']} steps each){after_steps}")
    print(f"ratio of medians {stats['median']:.4f} (95% CI {stats['ci_low']:.4f}..{stats['ci_high']:.4f}); "
          f"ratio of means {stats['mean_ratio']:.4f}{after_means}")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)


def phase_always_on(rx, workload: str, world_size: int, rounds: int, steps_per_block: int,
                    report: dict[str, Any]) -> None:
    began = time.perf_counter()
    results, stats = _paired_phase("always-on (trace 1 step in 100) vs uninstrumented", always_on_worker, rx,
                                   workload, world_size, rounds, steps_per_block, (CONFIGS[3], BASELINE))
    traced = sorted(set(rx.get("always-on-long")["steps"]))
    stats.update(steps_counted=results[0]["steps_taken"], traced_steps=traced)
    _print_paired(stats, ("uninstrumented", "always-on"), "", f" (includes the traced steps {traced} at full cost)",
                  began)
    report[f"always_on_{workload}"] = {"ranks": world_size, "rounds": rounds,
                                       "steps_per_block": steps_per_block, **stats}


def phase_stall_watch(rx, workload: str, world_size: int, rounds: int, steps_per_block: int,
                      report: dict[str, Any]) -> None:
    began = time.perf_counter()
    results, stats = _paired_phase("stall watchdog + verdict exchange armed vs STALL_AFTER=off, always-on, healthy "
                                   "steps", stall_watch_worker, rx, workload, world_size, rounds, steps_per_block,
                                   (STALL_ARMED, STALL_OFF))
    stats["exchange_connected"] = all(result["exchange_connected"] for result in results)
    _print_paired(stats, ("STALL_AFTER=off", "armed"),
                  f"; every rank's exchange connected: {stats['exchange_connected']}", "", began)
    report[f"stall_watch_{workload}"] = {"ranks": world_size, "rounds": rounds,
                                         "steps_per_block": steps_per_block, **stats}


def phase_straggler(rx, workload: str, world_size: int, rounds: int, steps_per_block: int,
                    report: dict[str, Any]) -> None:
    began = time.perf_counter()
    results, stats = _paired_phase("live straggler verdict on vs STRAGGLER=off, always-on, healthy steps",
                                   straggler_worker, rx, workload, world_size, rounds, steps_per_block,
                                   (STRAGGLER_ON, STRAGGLER_OFF))
    stats["exchange_connected"] = all(result["exchange_connected"] for result in results)
    stats["verdicts"] = [line for result in results for line in result["verdicts"]]
    _print_paired(stats, ("STRAGGLER=off", "on"), f"; every rank's exchange connected: "
                  f"{stats['exchange_connected']}; verdicts on this healthy job: {len(stats['verdicts'])}", "",
                  began)
    report[f"straggler_{workload}"] = {"ranks": world_size, "rounds": rounds,
                                       "steps_per_block": steps_per_block, **stats}


def phase_memory_and_rate(rx, steps: int, warmup: int, rate_steps: int, report: dict[str, Any]) -> None:
    print(f"\n== RSS over {steps} traced steps (rank 0, OTLP/gRPC to a local receiver), then "
          f"export rate ({rate_steps} steps at detail all)", flush=True)
    began = time.perf_counter()
    results = run_ranks(memory_and_rate_worker, 2, child_env(rx.grpc_endpoint), steps=steps,
                        warmup=warmup, rate_steps=rate_steps)
    def growth(series: list) -> tuple[float, float, str]:
        """MiB from the warm-up on: the fitted trend and last minus first; and the samples as text."""
        samples = dict(series)
        # The allocator moves RSS by several MiB either way from one sample to the next; a leak
        # is a trend: the least-squares slope over every sample from the warm-up on.
        fitted = sorted((index, value) for index, value in samples.items() if index >= warmup)
        slope = statistics.linear_regression([i for i, _ in fitted], [v for _, v in fitted]).slope
        text = ", ".join(f"{index}: {value / 2**20:.1f}" for index, value in sorted(samples.items()))
        return slope * (steps - warmup) / 2**20, (samples[steps] - samples[warmup]) / 2**20, text

    trimmed = results[0].get("heap_trimmed", False)
    growth_mb, endpoints_mb, trend = growth(results[0]["rss"])
    raw_growth_mb, raw_endpoints_mb, raw_trend = growth(results[0]["rss_untrimmed"])
    print(f"RSS MiB by step{' (after malloc_trim)' if trimmed else ''}: {trend}")
    if trimmed:
        print(f"before malloc_trim: {raw_trend} (trend {raw_growth_mb:+.2f} MiB, last minus first "
              f"{raw_endpoints_mb:+.2f} MiB)")
    print(f"RSS growth step {warmup} -> {steps}: {growth_mb:+.2f} MiB by the fitted trend "
          f"(last sample minus first: {endpoints_mb:+.2f} MiB) "
          f"({results[0]['rss_wall_s']:.1f} s, {steps / results[0]['rss_wall_s']:.1f} steps/s)")
    rss = rx.get("rss")
    rss_rate = rss["events"] / results[0]["rss_wall_s"]

    events = rx.get("events")
    start = min(result["rate_window"][0] for result in results)
    end = max(max(result["rate_window"][1] for result in results), events.get("last_s", 0))
    wall = end - start
    rate = events["events"] / wall
    steps_seen = len(events["steps"])
    print(f"export-heavy run: {events['events']} events in {events['spans']} spans "
          f"({events['bytes'] / 2**20:.1f} MiB, {events['requests']} requests) from 2 ranks in "
          f"{wall:.1f} s -> {rate:,.0f} events/s; train_step spans received {steps_seen}/"
          f"{2 * rate_steps}")
    print(f"(collectives-only run above: {rss['events']} events, {rss['spans']} spans, "
          f"{rss_rate:,.0f} events/s)")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report["rss"] = {"steps": steps, "warmup": warmup, "growth_mib": growth_mb,
                     "endpoints_mib": endpoints_mb, "heap_trimmed": trimmed,
                     "samples_mib": {k: v / 2**20 for k, v in results[0]["rss"]},
                     "untrimmed": {"growth_mib": raw_growth_mb, "endpoints_mib": raw_endpoints_mb,
                                   "samples_mib": {k: v / 2**20 for k, v in results[0]["rss_untrimmed"]}},
                     "steps_per_s": steps / results[0]["rss_wall_s"],
                     "events": rss["events"], "spans": rss["spans"]}
    report["event_rate"] = {"events": events["events"], "spans": events["spans"],
                            "bytes": events["bytes"], "wall_s": wall, "events_per_s": rate,
                            "steps": rate_steps, "train_steps_received": steps_seen,
                            "events_per_step_per_rank": events["events"] / max(1, 2 * rate_steps)}


def phase_black_hole(rx, rounds: int, steps_per_block: int, report: dict[str, Any]) -> None:
    print(f"\n== collector black-holed vs live: tp, 2 ranks, {rounds} rounds x {steps_per_block} "
          f"steps per config", flush=True)
    began = time.perf_counter()
    with BlackHole() as hole:
        results = run_ranks(black_hole_worker, 2, child_env(rx.grpc_endpoint), rounds=rounds,
                            steps_per_block=steps_per_block, live_endpoint=rx.grpc_endpoint,
                            hole_endpoint=hole.endpoint)
        connections = len(hole.accepted)
    per_rank = [result["times"] for result in results]
    names = list(per_rank[0])
    rows = {}
    for name in names:
        stats = summarize(per_round_ratios(per_rank, name))
        stats["step_ms"] = step_ms(per_rank, name)
        rows[name] = stats
    # black-holed / live, per round
    live_r = per_round_ratios(per_rank, "ours, live receiver")
    hole_r = per_round_ratios(per_rank, "ours, black-holed")
    versus = summarize([hole / live for hole, live in zip(hole_r, live_r)])
    for name, stats in rows.items():
        print(f"{name:28} {stats['step_ms']:8.2f} ms  ratio to uninstrumented {stats['median']:.3f} "
              f"(IQR {stats['q1']:.3f}..{stats['q3']:.3f})")
    flush_s = results[0]["flush_s"]
    flush_text = f"{flush_s:.1f} s" if flush_s is not None else "> 12 s (still blocked)"
    print(f"black-holed / live: {versus['median']:.3f} (IQR {versus['q1']:.3f}..{versus['q3']:.3f}, "
          f"min..max {versus['min']:.3f}..{versus['max']:.3f}); {connections} connections held; "
          f"'Queue full, dropping span' warnings: "
          f"{sum(result['queue_full_warnings'] for result in results)}")
    print(f"CommTracer.stop()'s flush against the black hole (rank 0): {flush_text}")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report["black_hole"] = {"configs": rows, "versus_live": versus, "flush_s": flush_s,
                            "connections": connections,
                            "queue_full_warnings": sum(r["queue_full_warnings"] for r in results)}


IMPORT_CHECK = r"""
import json, sys
import commdebug_otel
loaded_torch = "torch" in sys.modules
import torch
import torch.optim.optimizer as optim
from torch.nn.modules import module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
print(json.dumps({
    "torch_imported_by_package": loaded_torch,
    "otel_sdk_imported": "opentelemetry.sdk" in sys.modules,
    "forward_pre_hooks": len(module._global_forward_pre_hooks),
    "forward_hooks": len(module._global_forward_hooks),
    "dispatch_modes": len(_get_current_dispatch_mode_stack()),
    "optimizer_post_hooks": len(optim._global_optimizer_post_hooks),
    "collective_kernels": int(torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")),
    "package": commdebug_otel.__file__,
}))
"""


def scale_row(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One world size's row of ``{"scale": [...]}`` from its processes' results (one per pass; their
    rounds pooled; bytes from the first, raw as sent by default)."""
    wire = results[0]["wire"]
    times = [{name: [block for result in results for block in result["times"][name]]
              for name in results[0]["times"]}]
    step, metric = wire["step_bytes"], wire["metric_bytes_per_export"]
    steps_per_export = METRIC_EXPORT_INTERVAL_S / ASSUMED_STEP_S

    def always(kind: str) -> float:
        return step[kind] / ALWAYS_ON_TRACE_EVERY + metric[kind] / steps_per_export

    traced, always_on = (summarize(per_round_ratios(times, name)) for name in ("traced", "always-on"))
    return {
        "world": world,
        "spans_per_rank_step": wire["spans_per_rank_step"],
        "events_per_rank_step": wire["events_per_rank_step"],
        "bytes_per_rank_step_traced": step["raw"],
        "bytes_per_rank_step_always": round(always("raw")),
        "largest_trace_bytes": wire["largest_rank_trace_bytes"]["raw"] * wire["ranks_per_trace"],
        "metric_series_per_rank": wire["metric_series_per_rank"],
        "overhead_traced": traced["median"],
        "overhead_always": always_on["median"],
        # the same, gzip'd (OTEL_EXPORTER_OTLP_COMPRESSION=gzip), and what stands behind each number
        "gzip": {"bytes_per_rank_step_traced": step["gzip"], "bytes_per_rank_step_always": round(always("gzip")),
                 "largest_trace_bytes": wire["largest_rank_trace_bytes"]["gzip"] * wire["ranks_per_trace"]},
        "ranks_per_trace": wire["ranks_per_trace"],
        "largest_trace_bytes_one_trace_per_job": wire["largest_rank_trace_bytes"]["raw"] * world,
        "metric_bytes_per_export": metric,
        "metric_rank_label": wire["metric_rank_label"],
        "metric_series_per_job": wire["metric_series_per_rank"] * world,
        "metric_label_sets_per_job": wire["metric_series_per_rank"] * (world if wire["metric_rank_label"] else 1),
        "prometheus_series_per_rank": wire["prometheus_series_per_rank"],
        "metric_series_by_instrument": wire["metric_series_by_instrument"],
        "overhead_traced_iqr": [traced["q1"], traced["q3"]],
        "overhead_always_iqr": [always_on["q1"], always_on["q3"]],
        "step_ms": {name: step_ms(times, name) for name in (BASELINE, "traced", "always-on")},
    }


def phase_scale(rx, worlds: tuple[int, ...], rounds: int, steps_per_block: int, report: dict[str, Any],
                passes: int = 2) -> None:
    """Each world size runs ``passes`` times, a fresh process each, in the order 8, 128, ..., then
    backwards (ABBA), ``rounds`` rounds each: drift of a shared machine over the phase then hits every
    world size alike instead of favouring the first."""
    print(f"\n== scale: rank 0 of simulated FSDP2 + TP jobs (fake process group, mesh (world/{SCALE_TP}, "
          f"{SCALE_TP}), {SCALE_LAYERS} transformer blocks), a fresh process per world size and pass; default "
          f"settings and always-on (trace_every={ALWAYS_ON_TRACE_EVERY}); {passes} passes (world sizes up, then "
          f"down) x {rounds} rounds x {steps_per_block} steps per config, interleaved", flush=True)
    print(f"bytes: OTLP protobuf request bodies as the exporters encode them, raw (the Python OTLP exporters' "
          f"default: no compression) and gzip'd; always-on = traced step / {ALWAYS_ON_TRACE_EVERY} + one metric "
          f"export / {METRIC_EXPORT_INTERVAL_S / ASSUMED_STEP_S:.0f} steps (export every "
          f"{METRIC_EXPORT_INTERVAL_S:.0f} s, assumed step time {ASSUMED_STEP_S:.0f} s)")
    began = time.perf_counter()
    rows = []
    print(f"{'world':>6} {'spans':>5} {'events':>6} {'traced B':>9} {'(gzip)':>7} {'always B':>8} {'(gzip)':>6} "
          f"{'largest trace':>13} {'(1 trace/job)':>13} {'series':>6} {'rank lbl':>8} {'traced':>6} {'always':>6}")
    results: dict[int, list[dict[str, Any]]] = {world: [] for world in worlds}
    order = [world for index in range(passes) for world in (worlds if index % 2 == 0 else worlds[::-1])]
    for world in order:
        results[world].append(run_ranks(scale_worker, 1, child_env(rx.grpc_endpoint), fake_world=world,
                                        rounds=rounds, steps_per_block=steps_per_block)[0])
    for world in worlds:
        row = scale_row(world, results[world])
        rows.append(row)
        print(f"{world:6d} {row['spans_per_rank_step']:5d} {row['events_per_rank_step']:6d} "
              f"{row['bytes_per_rank_step_traced']:9,d} {row['gzip']['bytes_per_rank_step_traced']:7,d} "
              f"{row['bytes_per_rank_step_always']:8,d} {row['gzip']['bytes_per_rank_step_always']:6,d} "
              f"{row['largest_trace_bytes']:13,d} {row['largest_trace_bytes_one_trace_per_job']:13,d} "
              f"{row['metric_series_per_rank']:6d} {'on' if row['metric_rank_label'] else 'off':>8} "
              f"{row['overhead_traced']:6.3f} {row['overhead_always']:6.3f}", flush=True)
    untraced_ms = ", ".join(f"{row['step_ms'][BASELINE]:.1f}" for row in rows)
    print(f"(largest trace: the largest of this rank's traces, set-up included, times the ranks sharing it: "
          f"blocks of {rows[-1]['ranks_per_trace']} ranks past that size; '1 trace/job': the same without blocks. "
          f"Untraced step ms {untraced_ms})")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report["scale"] = rows


def phase_depth(rounds: int, steps_per_block: int, report: dict[str, Any]) -> None:
    deepest = 4 * DEPTHS[-1] + 1  # spans of a traced step of the deepest chain (checked below)
    print(f"\n== nesting depth: chains of {' and '.join(map(str, DEPTHS))} nested modules (a Linear, then the "
          f"child; one output shared by the chain), a process per depth, traced every step vs untraced, exporters "
          f"{', '.join(DEPTH_EXPORTERS)}; {rounds} rounds per config of blocks of about {steps_per_block * deepest:,} "
          f"spans ({steps_per_block} steps at depth {DEPTHS[-1]}), configs interleaved (first step of each block "
          f"discarded)", flush=True)
    began = time.perf_counter()
    env = {name: value for name, value in child_env("").items() if not name.startswith("OTEL_EXPORTER")}
    rows: dict[str, dict[str, Any]] = {}
    print(f"{'depth':>5} {'spans':>5} {'steps':>5} {'untraced ms':>11} " + " ".join(
        f"{exporter + ' ms':>9} {'us/span':>8} {'spans/s':>8}" for exporter in DEPTH_EXPORTERS) + "  gc per step")
    for depth in DEPTHS:
        # Blocks of equal spans at every depth: each then sees its share of the old generation's collections.
        steps = 1 + round((steps_per_block - 1) * deepest / (4 * depth + 1))
        result = run_ranks(depth_worker, 1, env, depth=depth, rounds=rounds, steps_per_block=steps)[0]
        times, spans = result["times"], result["spans"]
        # Per block the mean step; traced minus untraced per round (paired), then the mean over rounds:
        # a collection of the old generation comes every few blocks, and an amortized cost must count it
        # (a median over rounds would leave it out where it is rare and keep it where it is frequent).
        base = [statistics.fmean(block) for block in times[BASELINE]]
        row = {"spans_per_step": spans, "steps_per_block": steps, "untraced_ms": 1000 * statistics.fmean(base),
               "gc_collections_per_step": result["gc_per_step"]}
        cells = []
        for exporter in DEPTH_EXPORTERS:
            traced = [statistics.fmean(block) for block in times[exporter]]
            per_span = statistics.fmean((t - b) / spans for t, b in zip(traced, base))
            row[exporter] = {"traced_ms": 1000 * statistics.fmean(traced), "us_per_span": per_span * 1e6,
                             "spans_per_s_per_core": 1 / per_span if per_span > 0 else float("inf")}
            cells.append(f"{row[exporter]['traced_ms']:9.2f} {per_span * 1e6:8.1f} "
                         f"{row[exporter]['spans_per_s_per_core']:8,.0f}")
        gc_text = "/".join(f"{count:.2f}" for count in row["gc_collections_per_step"])
        print(f"{depth:5d} {spans:5d} {steps:5d} {row['untraced_ms']:11.2f} " + " ".join(cells) + f"  {gc_text}",
              flush=True)
        rows[str(depth)] = row
    shallow, deep = rows[str(DEPTHS[0])], rows[str(DEPTHS[-1])]
    if deep["spans_per_step"] != deepest:
        print(f"(note: {deep['spans_per_step']} spans per step at depth {DEPTHS[-1]}, not {deepest}: blocks unequal)")
    ratios = {exporter: deep[exporter]["us_per_span"] / shallow[exporter]["us_per_span"]
              for exporter in DEPTH_EXPORTERS}
    print(f"per-span cost, depth {DEPTHS[-1]} / depth {DEPTHS[0]}: " + ", ".join(
        f"{exporter} {ratio:.2f}x" for exporter, ratio in ratios.items()) + " (spans/s: per core of the "
        "training thread, 1 / per-span cost; gc: collections per traced step, generations 0/1/2)")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report["depth"] = {"rounds": rounds, "steps_per_block": steps_per_block, "depths": rows, "ratio": ratios}


# The unit-cost phase: blocks of the chain (each a Block holding a Linear: 2 module calls, 4 module passes with
# backward) and one-element all_reduces per step; the real step its costs are projected onto.
UNIT_BLOCKS = 200
UNIT_COLLECTIVES = 200
REAL_STEP = {"seconds": 1.0, "module_calls": 500, "collectives": 200}
TARGET_UNIT_BLOCK_US = 2.0  # always-on (1 in 100), per block of the chain, forward plus backward
UNIT_CHAIN_CONFIGS = (BASELINE, "ours untraced", "ours traced (every step)", "torch ModTracker",
                      "torch CommDebugMode")
UNIT_COLLECTIVE_CONFIGS = (BASELINE, "ours untraced", "ours traced (every step)", "torch CommDebugMode")


class ChainJob:
    """``UNIT_BLOCKS`` blocks in a root's ModuleList (each a Linear(8, 8) then a ReLU), trained with SGD;
    ``top_level``: the step calls each block itself (a loop over layers, pipeline stages), no root call."""

    def __init__(self, blocks: int, top_level: bool = False) -> None:
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.lin(x))

        class Chain(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for block in self.blocks:
                    x = block(x)
                return x

        torch.manual_seed(0)
        self.model = Chain()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.input = torch.ones(2, 8)
        self.module_calls = 2 * blocks + (0 if top_level else 1)
        self.module_passes = 2 * self.module_calls  # forward and backward of each call
        self.top_level = top_level

    def step(self) -> None:
        if self.top_level:
            x = self.input
            for block in self.model.blocks:
                x = block(x)
        else:
            x = self.model(self.input)
        x.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def timed_step(self) -> float:
        """The training thread's CPU time for the step: on a loaded machine the wall time adds other processes'
        turns, and the process's CPU time the export threads of the block before (not this block's cost)."""
        start = time.thread_time()
        self.step()
        return time.thread_time() - start


class CollectiveJob:
    """A step of ``UNIT_COLLECTIVES`` one-element all_reduces in one module's forward, then an SGD step."""

    def __init__(self, collectives: int) -> None:
        import torch
        import torch.distributed as dist

        class Comm(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(1))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for _ in range(collectives):
                    dist.all_reduce(x)
                return self.weight * 1.0

        self.model = Comm()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.input = torch.ones(1)

    top_level = False
    step, timed_step = ChainJob.step, ChainJob.timed_step


def _mod_tracker_block() -> Block:
    """torch's ``ModTracker`` (forward and backward of every module, no collectives), a fresh one per step."""
    from torch.distributed._tools.mod_tracker import ModTracker

    def enter() -> Any:
        tracker = ModTracker()
        tracker.__enter__()
        return tracker

    return Block(enter, lambda tracker: tracker.__exit__(None, None, None), per_step=True)


def unit_costs_worker(rank: int, world_size: int, rounds: int, steps_per_block: int, out_dir: str,
                      log_path: str) -> dict[str, Any]:
    """The chain and the collective step, each config's blocks interleaved; spans per traced step counted."""
    chain, collectives = ChainJob(UNIT_BLOCKS), CollectiveJob(UNIT_COLLECTIVES)
    results: dict[str, Any] = {}
    for name, job, configs in (("chain", chain, UNIT_CHAIN_CONFIGS), ("collectives", collectives,
                                                                      UNIT_COLLECTIVE_CONFIGS)):
        for _ in range(3):
            job.step()
        # Untraced: one step in a billion traced (the first, in the warm-up); traced: every step, file exporter.
        untraced = _tracer({"trace_every": 10**9, "output_dir": os.path.join(out_dir, f"{name}-untraced")},
                           f"units-{name}-untraced")
        traced = _tracer({"trace_every": 1, "output_dir": os.path.join(out_dir, f"{name}-traced")},
                         f"units-{name}-traced")
        blocks = {BASELINE: Block(lambda: None, lambda _: None), configs[1]: _tracer_block(untraced),
                  configs[2]: _tracer_block(traced)}
        if "torch ModTracker" in configs:
            blocks["torch ModTracker"] = _mod_tracker_block()
        blocks["torch CommDebugMode"] = _torch_block()
        results[name] = _run_interleaved(job, blocks, rounds, steps_per_block, warmup_blocks=1)
    from commdebug_otel import CommTracer, Settings
    from commdebug_otel.testing import InMemoryTelemetry

    telemetry = InMemoryTelemetry()  # spans of one traced step of the chain, train_step included
    with CommTracer(Settings(), tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider):
        chain.step()
        telemetry.clear()
        chain.step()
    return {"times": results, "chain_spans": len(telemetry.spans()), "module_calls": chain.module_calls,
            "python_calls": _call_counts(out_dir),
            "module_passes": chain.module_passes}


def our_python_calls(job: Any, settings: dict[str, Any], steps: int = 4) -> float:
    """Calls of functions of this package per step on the training thread (``sys.setprofile``), steps after
    the first of a started tracer: a count, which a loaded machine does not change."""
    import commdebug_otel

    root = os.path.dirname(os.path.abspath(commdebug_otel.__file__))
    counted = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            counted[0] += 1

    tracer = _tracer(settings, "units-count")
    tracer.start()
    try:
        job.step()
        sys.setprofile(profile)
        try:
            for _ in range(steps):
                job.step()
        finally:
            sys.setprofile(None)
    finally:
        tracer.stop()
        _remove_collective_kernels()
    return counted[0] / steps


def _call_counts(out_dir: str) -> dict[str, Any]:
    """Our Python calls per untraced and per traced step, chains of 20 and ``UNIT_BLOCKS`` blocks, nested in a
    root and called at top level; per module call: the difference over the module calls between the two."""
    counts: dict[str, Any] = {}
    for layout, top_level in (("nested", False), ("top_level", True)):
        small, large = ChainJob(20, top_level), ChainJob(UNIT_BLOCKS, top_level)
        row = {}
        for kind, every in (("untraced", 10**9), ("traced", 1)):
            settings = {"trace_every": every, "output_dir": os.path.join(out_dir, f"count-{layout}-{kind}")}
            few, many = our_python_calls(small, settings), our_python_calls(large, settings)
            row[kind] = {"per_step_20": few, f"per_step_{UNIT_BLOCKS}": many,
                         "per_module_call": (many - few) / (large.module_calls - small.module_calls)}
        counts[layout] = row
    return counts


def _paired_diff_s(times: dict[str, list[list[float]]], name: str) -> float:
    """Per round the fastest step of ``name`` minus the baseline's fastest; the median over rounds (seconds).

    The fastest: a loaded machine only adds to a thread's CPU time (a core shared with another process's
    thread runs it slower), so the least is the nearest to the step's own cost."""
    return statistics.median(min(ours) - min(base) for ours, base in zip(times[name], times[BASELINE]))


def phase_units(rounds: int, steps_per_block: int, report: dict[str, Any]) -> None:
    print(f"\n== unit costs: one process, one gloo rank; a chain of {UNIT_BLOCKS} blocks ({2 * UNIT_BLOCKS + 1} "
          f"module calls a step) and a step of {UNIT_COLLECTIVES} one-element all_reduces; {rounds} rounds of "
          f"{steps_per_block}-step blocks per config, interleaved (first step of each block discarded); the training "
          f"thread's CPU time per step; per round the fastest step minus the uninstrumented fastest, the median over "
          f"rounds",
          flush=True)
    began = time.perf_counter()
    env = {name: value for name, value in child_env("").items() if not name.startswith("OTEL_EXPORTER")}
    out_dir = tempfile.mkdtemp(prefix="commdebug-bench-units-")
    try:
        result = run_ranks(unit_costs_worker, 1, env, rounds=rounds, steps_per_block=steps_per_block,
                           out_dir=out_dir)[0]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    chain, coll = result["times"]["chain"], result["times"]["collectives"]
    calls, passes, spans = result["module_calls"], result["module_passes"], result["chain_spans"]
    base_ms = 1000 * statistics.median(min(block) for block in chain[BASELINE])
    untraced_s, traced_s = _paired_diff_s(chain, "ours untraced"), _paired_diff_s(chain, "ours traced (every step)")
    mod_s, cdm_s = _paired_diff_s(chain, "torch ModTracker"), _paired_diff_s(chain, "torch CommDebugMode")
    coll_base_ms = 1000 * statistics.median(min(block) for block in coll[BASELINE])
    coll_untraced_s = _paired_diff_s(coll, "ours untraced")
    coll_traced_s = _paired_diff_s(coll, "ours traced (every step)")
    coll_cdm_s = _paired_diff_s(coll, "torch CommDebugMode")
    always_block_us = (untraced_s + (traced_s - untraced_s) / ALWAYS_ON_TRACE_EVERY) / UNIT_BLOCKS * 1e6
    row = {
        "chain_step_ms": base_ms, "module_calls_per_step": calls, "spans_per_traced_step": spans,
        "untraced_ns_per_module_call": untraced_s / calls * 1e9,
        "traced_us_per_span": traced_s / spans * 1e6,
        "mod_tracker_us_per_module_pass": mod_s / passes * 1e6,
        "comm_debug_mode_us_per_module_pass": cdm_s / passes * 1e6,
        "always_on_us_per_block": always_block_us,
        "traced_us_per_block": traced_s / UNIT_BLOCKS * 1e6,
        "mod_tracker_us_per_block": mod_s / UNIT_BLOCKS * 1e6,
        "comm_debug_mode_us_per_block": cdm_s / UNIT_BLOCKS * 1e6,
        "collective_step_ms": coll_base_ms,
        "untraced_ns_per_collective": coll_untraced_s / UNIT_COLLECTIVES * 1e9,
        "traced_us_per_collective": coll_traced_s / UNIT_COLLECTIVES * 1e6,
        "comm_debug_mode_us_per_collective": coll_cdm_s / UNIT_COLLECTIVES * 1e6,
    }
    real = REAL_STEP
    untraced_real_s = (row["untraced_ns_per_module_call"] * real["module_calls"]
                       + row["untraced_ns_per_collective"] * real["collectives"]) / 1e9
    traced_real_s = (row["traced_us_per_span"] * (2 * real["module_calls"] + 1)
                     + row["traced_us_per_collective"] * real["collectives"]) / 1e6
    row["real_step"] = {**real, "untraced_added_ms": untraced_real_s * 1e3, "traced_added_ms": traced_real_s * 1e3,
                        "always_on_ratio": 1 + (untraced_real_s + (traced_real_s - untraced_real_s)
                                                / ALWAYS_ON_TRACE_EVERY) / real["seconds"]}
    print(f"chain: uninstrumented step {base_ms:.2f} ms of CPU; {calls} module calls, {spans} spans a traced step")
    print(f"  ours untraced        {row['untraced_ns_per_module_call']:8.0f} ns per module call")
    print(f"  ours traced          {row['traced_us_per_span']:8.2f} us per span ({row['traced_us_per_block']:.1f} us "
          f"per block)")
    print(f"  torch ModTracker     {row['mod_tracker_us_per_module_pass']:8.2f} us per module pass "
          f"({row['mod_tracker_us_per_block']:.1f} us per block)")
    print(f"  torch CommDebugMode  {row['comm_debug_mode_us_per_module_pass']:8.2f} us per module pass "
          f"({row['comm_debug_mode_us_per_block']:.1f} us per block)")
    print(f"  ours always-on (1 in {ALWAYS_ON_TRACE_EVERY}): {always_block_us:.2f} us per block, forward plus backward")
    counts = row["python_calls"] = result["python_calls"]
    for layout, kinds in counts.items():
        print(f"  our Python calls per step, {layout} chain of 20 / {UNIT_BLOCKS} blocks: " + "; ".join(
            f"{kind} {c['per_step_20']:.0f} / {c[f'per_step_{UNIT_BLOCKS}']:.0f} ({c['per_module_call']:.2f} per "
            f"module call)" for kind, c in kinds.items()))
    print(f"collectives: uninstrumented step {coll_base_ms:.2f} ms of CPU")
    print(f"  ours untraced        {row['untraced_ns_per_collective']:8.0f} ns per collective")
    print(f"  ours traced          {row['traced_us_per_collective']:8.2f} us per collective")
    print(f"  torch CommDebugMode  {row['comm_debug_mode_us_per_collective']:8.2f} us per collective")
    rs = row["real_step"]
    print(f"a {real['seconds']:.0f} s step of {real['module_calls']} module calls and {real['collectives']} "
          f"collectives: untraced +{rs['untraced_added_ms']:.2f} ms, traced +{rs['traced_added_ms']:.1f} ms, "
          f"always-on (1 in {ALWAYS_ON_TRACE_EVERY}) {rs['always_on_ratio']:.4f}x")
    print(f"({time.perf_counter() - began:.0f} s)", flush=True)
    report["units"] = row


OFFLINE_RANKS = 1024  # the offline phase's job: ranks (a multiple of OFFLINE_SOURCE_RANKS) of 20 traced steps
OFFLINE_SOURCE_RANKS = 4  # ranks of the real run copied (the demo model, FSDP2 + TP on a (2, 2) mesh)
OFFLINE_STEPS = 20
TARGET_OFFLINE_S = 60.0
TARGET_OFFLINE_BYTES = 1e9


def make_offline_job(out_dir: Path, ranks: int = OFFLINE_RANKS) -> dict[str, Any]:
    """A ``ranks``-rank job of ``OFFLINE_STEPS`` traced steps: the real spans of a real run, ranks multiplied.

    Runs ``commdebug-otel demo --ranks 4`` (every step traced), then writes each of its 4 trace files
    ``ranks / 4`` times with the rank, the world size, the process group names (each copy its own
    groups, so collectives match within a copy as in the real run) and the trace ids (each copy its own
    traces, shared by its ranks) changed: the same lines, bytes and span shapes a real job writes.
    Returns ``{"bytes", "files", "source_bytes"}``.
    """
    import re

    source = out_dir / "source"
    source.mkdir(parents=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update(OTEL_PYTHON_COMMDEBUG_TRACE_EVERY="1", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "commdebug_otel.cli", "demo", "--ranks", str(OFFLINE_SOURCE_RANKS),
                    "--steps", str(OFFLINE_STEPS)], cwd=source, env=env, check=True, capture_output=True)
    (run,) = (source / "commdebug-otel-out").glob("run-*")
    job = out_dir / "job"
    job.mkdir()
    written = source_bytes = 0
    for rank in range(OFFLINE_SOURCE_RANKS):
        text = (run / f"traces-rank{rank}.jsonl").read_text()
        source_bytes += len(text)
        text = text.replace(f'"torch.distributed.rank","value":{{"intValue":"{rank}"}}',
                            '"torch.distributed.rank","value":{"intValue":"@RANK@"}')
        text = re.sub(r'("torch\.distributed\.world_size","value":\{"intValue":")\d+"', rf'\g<1>{ranks}"', text)
        text = re.sub(r'("torch\.process_group\.name","value":\{"stringValue":"[^"]*)"', r'\1.@COPY@"', text)
        text = re.sub(r'("traceId":"[0-9a-f]{24})[0-9a-f]{8}"', r'\1@TRACE@"', text)
        for copy in range(ranks // OFFLINE_SOURCE_RANKS):
            out = (text.replace("@RANK@", str(copy * OFFLINE_SOURCE_RANKS + rank)).replace("@COPY@", str(copy))
                   .replace("@TRACE@", f"{copy:08x}"))
            (job / f"traces-rank{copy * OFFLINE_SOURCE_RANKS + rank}.jsonl").write_text(out)
            written += len(out)
    shutil.rmtree(source)
    return {"bytes": written, "files": ranks, "source_bytes": source_bytes}


def phase_offline(ranks: int, report: dict[str, Any]) -> None:
    """Wall time, CPU time and peak RSS (``/usr/bin/time -f "%U %S %M"``: the largest process's) of ``summarize``
    and ``diagnose`` on a generated job."""
    print(f"\n== offline: summarize and diagnose on a {ranks}-rank job of {OFFLINE_STEPS} traced steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="commdebug-offline-") as tmp:
        made = make_offline_job(Path(tmp), ranks)
        row: dict[str, Any] = {"ranks": ranks, "steps": OFFLINE_STEPS, **made}
        print(f"generated {made['bytes'] / 1e6:,.0f} MB in {made['files']} files "
              f"(from {made['source_bytes'] / 1e6:.1f} MB of a real 4-rank run)", flush=True)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        for command in ("summarize", "diagnose"):
            began = time.perf_counter()
            done = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", sys.executable, "-m", "commdebug_otel.cli",
                                   command, str(Path(tmp) / "job")], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - began
            user, system, peak_kb = done.stderr.split()[-3:] if done.stderr.strip() else ("0", "0", "0")
            # CPU seconds (its worker processes' too) say what the wall time means on a loaded machine.
            cpu, peak = float(user) + float(system), int(peak_kb) * 1024
            row[command] = {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": peak, "returncode": done.returncode}
            print(f"  {command}: {wall:.1f} s ({cpu:.1f} s of CPU), peak RSS {peak / 1e6:,.0f} MB "
                  f"(exit {done.returncode}; load average {os.getloadavg()[0]:.1f})", flush=True)
    report["offline"] = row


def phase_import(use_tree: bool, report: dict[str, Any]) -> None:
    print("\n== import cost with tracing disabled", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "OTEL_PYTHON_COMMDEBUG_ENABLED"}
    if use_tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    totals = []
    for _ in range(7):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import commdebug_otel"],
                              env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
        for line in proc.stderr.splitlines():
            parts = [part.strip() for part in line.split("|")]
            if len(parts) == 3 and parts[2] == "commdebug_otel":
                totals.append(int(parts[1]))
    import_us = statistics.median(totals[1:]) if len(totals) > 1 else float("nan")

    def startup_ms(code: str) -> float:
        walls = []
        for _ in range(7):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True,
                           cwd=tempfile.gettempdir())
            walls.append(time.perf_counter() - began)
        return 1000 * statistics.median(walls[1:])

    bare = startup_ms("pass")
    with_import = startup_ms("import commdebug_otel")
    check = json.loads(subprocess.run([sys.executable, "-c", IMPORT_CHECK], env=env, check=True,
                                      capture_output=True, text=True,
                                      cwd=tempfile.gettempdir()).stdout)
    enabled_env = dict(env, OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_TRACES_EXPORTER="none",
                       OTEL_METRICS_EXPORTER="none")
    control = json.loads(subprocess.run([sys.executable, "-c", IMPORT_CHECK], env=enabled_env,
                                        capture_output=True, text=True,
                                        cwd=tempfile.gettempdir()).stdout or "{}")
    hooks = (check["forward_pre_hooks"] + check["forward_hooks"] + check["dispatch_modes"]
             + check["optimizer_post_hooks"] + check["collective_kernels"])
    print(f"-X importtime cumulative for commdebug_otel: {import_us / 1000:.2f} ms "
          f"(median of {max(0, len(totals) - 1)}; {check['package']})")
    print(f"interpreter start + import: {with_import:.1f} ms vs bare start {bare:.1f} ms "
          f"(delta {with_import - bare:+.1f} ms, includes the .pth check)")
    print(f"disabled: imports torch={check['torch_imported_by_package']}, OTel SDK="
          f"{check['otel_sdk_imported']}; hooks after import: forward pre {check['forward_pre_hooks']}, "
          f"forward {check['forward_hooks']}, dispatch modes {check['dispatch_modes']}, optimizer "
          f"post {check['optimizer_post_hooks']}, collective kernels {check['collective_kernels']}")
    if control:
        print(f"control with OTEL_PYTHON_COMMDEBUG_ENABLED=true: forward pre hooks "
              f"{control['forward_pre_hooks']}, dispatch modes {control['dispatch_modes']} (pushed "
              f"only while a traced step is open), optimizer post {control['optimizer_post_hooks']}, "
              f"collective kernels {control['collective_kernels']}")
    report["import"] = {"importtime_ms": import_us / 1000, "startup_delta_ms": with_import - bare,
                        "hooks_when_disabled": hooks, "check": check, "enabled_control": control}


TORCH_IMPORT_CHECK = """
import json, sys, time
began = time.perf_counter()
import torch
json.dump({"import_s": time.perf_counter() - began, "modules": len(sys.modules),
           "heavy": sorted(m for m in ("opentelemetry.sdk", "torch.distributed.tensor", "sympy",
                                       "commdebug_otel.tracer") if m in sys.modules)}, sys.stdout)
"""


def phase_torch_import(use_tree: bool, report: dict[str, Any], pairs: int = 9) -> None:
    """``python -c "import torch"`` with and without ``OTEL_PYTHON_COMMDEBUG_ENABLED=true`` (the environment
    start), in pairs whose order alternates so machine drift cancels: the median of the pairs' differences."""
    print("\n== import torch under the environment start (a process that never joins a process group)", flush=True)
    import site

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    path = [str(REPO)] if use_tree else []
    pth = any((Path(folder) / "commdebug_otel.pth").is_file() for folder in site.getsitepackages())
    if not pth:  # a checkout without the .pth: `commdebug-otel run`'s bootstrap, in both runs of a pair
        import commdebug_otel

        path.insert(0, str(Path(commdebug_otel.__file__).parent / "_bootstrap"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, env.get("PYTHONPATH")]))
    enabled = dict(env, OTEL_PYTHON_COMMDEBUG_ENABLED="true", OTEL_TRACES_EXPORTER="none",
                   OTEL_METRICS_EXPORTER="none")

    import resource

    def run_s(environ: dict[str, str]) -> tuple[float, float]:
        """(wall, CPU: user + system) seconds of one ``python -c "import torch"``."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], env=environ, check=True, cwd=tempfile.gettempdir())
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    run_s(env)  # page cache warm for both
    differences, cpu_differences, plain_walls, enabled_walls = [], [], [], []
    for index in range(pairs):
        if index % 2:
            on, off = run_s(enabled), run_s(env)
        else:
            off, on = run_s(env), run_s(enabled)
        differences.append(on[0] - off[0])
        cpu_differences.append(on[1] - off[1])
        plain_walls.append(off[0])
        enabled_walls.append(on[0])

    def check(environ: dict[str, str]) -> dict[str, Any]:
        return json.loads(subprocess.run([sys.executable, "-c", TORCH_IMPORT_CHECK], env=environ, check=True,
                                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout)

    plain, traced = check(env), check(enabled)
    extra = statistics.median(differences)
    extra_cpu = statistics.median(cpu_differences)
    print(f"{pairs} pairs ({'the installed .pth' if pth else 'the bootstrap sitecustomize'}): median wall "
          f"{statistics.median(plain_walls):.3f} s plain, {statistics.median(enabled_walls):.3f} s with "
          f"ENABLED=true; median difference {extra * 1000:+.0f} ms wall (pairs {min(differences) * 1000:+.0f}.."
          f"{max(differences) * 1000:+.0f} ms), {extra_cpu * 1000:+.0f} ms CPU (pairs "
          f"{min(cpu_differences) * 1000:+.0f}..{max(cpu_differences) * 1000:+.0f} ms)")
    print(f"modules after import torch: {plain['modules']} plain, {traced['modules']} with ENABLED=true; heavy "
          f"modules loaded with ENABLED=true: {traced['heavy'] or 'none'} (plain: {plain['heavy'] or 'none'})")
    report["torch_import"] = {"pairs": pairs, "pth": pth, "extra_s": extra, "differences_s": differences,
                              "extra_cpu_s": extra_cpu, "cpu_differences_s": cpu_differences,
                              "plain_s": statistics.median(plain_walls),
                              "enabled_s": statistics.median(enabled_walls),
                              "modules": [plain["modules"], traced["modules"]],
                              "heavy": [plain["heavy"], traced["heavy"]]}


def check_restart() -> dict[str, Any]:
    """start/stop/start on one CommTracer keeps counting steps (in-process, in-memory exporter)."""
    import torch
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from commdebug_otel import CommTracer, Settings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = CommTracer(Settings(trace_every=3), tracer_provider=provider,
                        meter_provider=MeterProvider())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        tracer.start()
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        tracer.stop()
    steps = sorted(span.attributes["torch.step"] for span in exporter.get_finished_spans()
                   if span.name == "train_step")
    hooks_left = len(torch.nn.modules.module._global_forward_pre_hooks)
    return {"traced_steps": steps, "ok": steps == [0, 3] and hooks_left == 0,
            "hooks_left": hooks_left}


def phase_accuracy(quick: bool, reps: int, report: dict[str, Any]) -> None:
    """benchmarks/accuracy.py's matrix (``reps`` runs per scenario; 0: its default), its table and targets."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accuracy_bench", Path(__file__).with_name("accuracy.py"))
    accuracy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = accuracy  # its dataclass looks its module up
    spec.loader.exec_module(accuracy)
    reps = reps or (2 if quick else 5)
    print(f"\n== accuracy: {reps} runs of each fault-injection scenario")
    results = accuracy.run_matrix(accuracy.matrix(quick), reps)
    accuracy.print_table(results)
    report["accuracy"] = {"runs": results, "targets": accuracy.targets(results)}


# ================================================================ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="TP only, fewer rounds and steps")
    parser.add_argument("--installed", action="store_true",
                        help="measure the installed package, not the working tree")
    parser.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    parser.add_argument("--profile", action="store_true",
                        help="only cProfile rank 0 of a traced TP job and print our hot spots")
    parser.add_argument("--profile-workload", default="tp", choices=("tp", "demo"),
                        help="the workload --profile runs (default tp)")
    parser.add_argument("--only", default="overhead,dropin,always,stall,straggler,memory,blackhole,depth,units,import,"
                                          "torchimport,scale",
                        help="comma list of phases to run (default: all)")
    parser.add_argument("--reps", type=int, default=0, metavar="N",
                        help="runs per scenario of the accuracy phase (default 5, --quick 2)")
    parser.add_argument("--offline-ranks", type=int, default=OFFLINE_RANKS, metavar="N",
                        help=f"ranks of the offline phase's job, a multiple of {OFFLINE_SOURCE_RANKS} "
                             f"(default {OFFLINE_RANKS}: about 1.5 GB)")
    args = parser.parse_args(argv)
    if not args.installed:
        sys.path.insert(0, str(REPO))
    os.environ.pop("OTEL_PYTHON_COMMDEBUG_ENABLED", None)

    import torch

    import commdebug_otel

    print(f"commdebug-otel benchmark: torch {torch.__version__}, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; package {Path(commdebug_otel.__file__).parent}")
    print(f"command: python benchmarks/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    began = time.perf_counter()

    if args.profile:
        return run_profile(args.profile_workload)

    phases = set(args.only.split(","))
    q = args.quick
    report: dict[str, Any] = {"quick": q, "torch": torch.__version__, "cpus": os.cpu_count(),
                              "load_average_start": os.getloadavg()[0]}
    restart = check_restart()
    print(f"start/stop/start on one CommTracer (trace_every=3, 3 x 2 steps): traced steps "
          f"{restart['traced_steps']} -> {'ok' if restart['ok'] else 'BROKEN'}")
    report["restart"] = restart
    try:
        with counting_receiver() as rx:
            print(f"local receiver: {deprioritize_other_threads()} threads at nice 19 (a stand-in for "
                  f"a collector elsewhere)")
            if "overhead" in phases:
                phase_overhead(rx, "tp", 2, rounds=4 if q else 24, steps_per_block=5,
                               report=report)
                if not q:
                    phase_overhead(rx, "fsdp_tp", 4, rounds=12, steps_per_block=4, report=report)
                phase_overhead(rx, "demo", 2, rounds=10 if q else 40, steps_per_block=5, report=report)
            if "dropin" in phases:
                phase_dropin(rx, "tp", 2, rounds=6 if q else 24, steps_per_block=5, report=report)
                if not q:
                    phase_dropin(rx, "fsdp_tp", 4, rounds=12, steps_per_block=4, report=report)
                    phase_dropin(rx, "demo", 2, rounds=24, steps_per_block=5, report=report)
            if "always" in phases:
                phase_always_on(rx, "tp", 2, rounds=80 if q else 100, steps_per_block=6, report=report)
                if not q:
                    phase_always_on(rx, "fsdp_tp", 4, rounds=60, steps_per_block=6, report=report)
            if "stall" in phases:
                phase_stall_watch(rx, "tp", 2, rounds=8 if q else 20, steps_per_block=20, report=report)
            if "straggler" in phases:
                phase_straggler(rx, "tp", 2, rounds=8 if q else 20, steps_per_block=40, report=report)
            if "memory" in phases:
                phase_memory_and_rate(rx, steps=300 if q else 1000, warmup=100,
                                      rate_steps=10 if q else 30, report=report)
            if "blackhole" in phases:
                phase_black_hole(rx, rounds=3 if q else 6, steps_per_block=5, report=report)
            if "depth" in phases:
                phase_depth(rounds=12 if q else 40, steps_per_block=11, report=report)
            if "units" in phases:
                phase_units(rounds=10 if q else 20, steps_per_block=6, report=report)
            if "offline" in phases:
                phase_offline(args.offline_ranks, report)
            if "scale" in phases:
                phase_scale(rx, (8, 1024) if q else SCALE_WORLDS, rounds=4 if q else 8, steps_per_block=5,
                            report=report, passes=1 if q else 2)
    except Exception:
        traceback.print_exc()
        return 1
    if "accuracy" in phases:
        phase_accuracy(q, args.reps, report)
    if "import" in phases:
        phase_import(not args.installed, report)
    if "torchimport" in phases:
        phase_torch_import(not args.installed, report)
    report["load_average_end"] = os.getloadavg()[0]
    report["wall_s"] = time.perf_counter() - began
    print_targets(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


def print_targets(report: dict[str, Any]) -> None:
    print(f"\n== targets (wall {report['wall_s']:.0f} s, load average "
          f"{report['load_average_start']:.2f} -> {report['load_average_end']:.2f})")
    lines = []
    for workload in OVERHEAD_WORKLOADS:
        if f"overhead_{workload}" in report:
            configs = report[f"overhead_{workload}"]["configs"]
            ours = configs[CONFIGS[2]]["median"] - 1
            theirs = configs[CONFIGS[1]]["median"] - 1
            rate = report[f"overhead_{workload}"]["traced"][CONFIGS[2]].get("spans_per_s_per_core", float("nan"))
            lines.append((f"[{workload}] traced overhead <= 1/3 of CommDebugMode's",
                          f"{ours * 100:+.1f}% vs {theirs * 100:+.1f}% (limit {theirs / 3 * 100:+.1f}%; "
                          f"{rate:,.0f} spans/s/core)",
                          theirs > 0 and ours <= theirs * TARGET_TRACED_VS_TORCH))
        dropin = report.get(f"dropin_{workload}")
        if dropin is not None:
            ours, theirs = dropin["configs"][DROPIN]["median"], dropin["configs"][CONFIGS[1]]["median"]
            lines.append((f"[{workload}] CommDebugMode drop-in costs at most torch's",
                          f"{ours:.3f}x vs {theirs:.3f}x (pooled ours/torch {dropin['ours_vs_torch']['median']:.3f})",
                          ours <= theirs))
        always = report.get(f"always_on_{workload}")
        if always is not None:
            lines.append((f"[{workload}] always-on (1 in 100) <= {TARGET_ALWAYS_ON:.2f}x",
                          f"{always['median']:.3f}x (95% CI {always['ci_low']:.3f}..{always['ci_high']:.3f}; "
                          f"mean {always['mean_ratio']:.3f}x)", always["median"] <= TARGET_ALWAYS_ON))
        stall = report.get(f"stall_watch_{workload}")
        if stall is not None:
            lines.append((f"[{workload}] stall watchdog armed / off <= {TARGET_STALL_WATCH:.2f}x",
                          f"{stall['median']:.3f}x (95% CI {stall['ci_low']:.3f}..{stall['ci_high']:.3f}; mean "
                          f"{stall['mean_ratio']:.3f}x; exchange connected: {stall['exchange_connected']})",
                          stall["exchange_connected"] and stall["median"] <= TARGET_STALL_WATCH))
        straggler = report.get(f"straggler_{workload}")
        if straggler is not None:
            lines.append((f"[{workload}] straggler verdict on / off <= {TARGET_STRAGGLER:.2f}x, no verdict",
                          f"{straggler['median']:.3f}x (95% CI {straggler['ci_low']:.3f}..{straggler['ci_high']:.3f}; "
                          f"mean {straggler['mean_ratio']:.3f}x; exchange connected: "
                          f"{straggler['exchange_connected']}; verdicts: {len(straggler['verdicts'])})",
                          straggler["exchange_connected"] and straggler["median"] <= TARGET_STRAGGLER
                          and not straggler["verdicts"]))
    if "rss" in report:
        rss = report["rss"]
        trimmed = ", heap trimmed" if rss.get("heap_trimmed") else ""
        lines.append((f"RSS growth step {rss['warmup']} -> {rss['steps']} <= {TARGET_RSS_MB:.0f} MB",
                      f"{rss['growth_mib'] * 2**20 / 1e6:+.2f} MB (fitted trend{trimmed}; endpoints "
                      f"{rss['endpoints_mib'] * 2**20 / 1e6:+.2f} MB)", rss["growth_mib"] * 2**20 / 1e6
                      <= TARGET_RSS_MB))
    if "black_hole" in report:
        versus = report["black_hole"]["versus_live"]["median"]
        lines.append((f"black-holed / live <= {TARGET_BLACKHOLE:.2f}", f"{versus:.3f}",
                      versus <= TARGET_BLACKHOLE))
    if "import" in report:
        imp = report["import"]
        lines.append((f"import (disabled) <= {TARGET_IMPORT_MS:.0f} ms, no hooks",
                      f"{imp['importtime_ms']:.2f} ms, {imp['hooks_when_disabled']} hooks",
                      imp["importtime_ms"] <= TARGET_IMPORT_MS and imp["hooks_when_disabled"] == 0))
    if "torch_import" in report:
        imp = report["torch_import"]
        lines.append((f"import torch with ENABLED=true, no process group: <= +{TARGET_TORCH_IMPORT_S:.1f} s, no "
                      f"SDK or DTensor", f"{imp['extra_cpu_s'] * 1000:+.0f} ms CPU, {imp['extra_s'] * 1000:+.0f} ms "
                      f"wall (medians of {imp['pairs']} pairs), heavy modules {imp['heavy'][1] or 'none'}",
                      imp["extra_cpu_s"] <= TARGET_TORCH_IMPORT_S and set(imp["heavy"][1]) <= set(imp["heavy"][0])))
    for what, measured, met in report.get("accuracy", {}).get("targets", ()):
        lines.append((f"[accuracy] {what}", measured, met))
    rows = {row["world"]: row for row in report.get("scale", ())}
    at = rows.get(SCALE_REPORTED_WORLD)
    if at is not None:
        lines.append((f"[scale] largest trace at {at['world']:,} ranks <= {TARGET_TRACE_BYTES / 1e6:.0f} MB",
                      f"{at['largest_trace_bytes'] / 1e6:.2f} MB ({at['ranks_per_trace']} ranks per trace; "
                      f"gzip {at['gzip']['largest_trace_bytes'] / 1e6:.2f} MB)",
                      at["largest_trace_bytes"] <= TARGET_TRACE_BYTES))
        lines.append((f"[scale] always-on <= {TARGET_ALWAYS_BYTES} B/rank/step (raw)",
                      f"{at['bytes_per_rank_step_always']:,} B (gzip {at['gzip']['bytes_per_rank_step_always']:,} B)",
                      at["bytes_per_rank_step_always"] <= TARGET_ALWAYS_BYTES))
        lines.append((f"[scale] always-on <= {TARGET_ALWAYS_ON:.2f}x at {at['world']:,} ranks",
                      f"{at['overhead_always']:.3f}x (IQR {at['overhead_always_iqr'][0]:.3f}.."
                      f"{at['overhead_always_iqr'][1]:.3f})", at["overhead_always"] <= TARGET_ALWAYS_ON))
        small = rows.get(min(rows))
        ours, base = at["overhead_traced"] - 1, small["overhead_traced"] - 1
        lines.append((f"[scale] traced overhead at {at['world']:,} <= {TARGET_SCALE_TRACED:.2f}x that at "
                      f"{small['world']}", f"{ours * 100:+.1f}% vs {base * 100:+.1f}% (limit "
                      f"{base * TARGET_SCALE_TRACED * 100:+.1f}%)", ours <= base * TARGET_SCALE_TRACED))
    if "depth" in report:
        depth = report["depth"]
        exporter = DEPTH_EXPORTERS[0]  # the default; with "none" no span is built (per-span cost ~0: noise)
        ratio = depth["ratio"][exporter]
        costs = " vs ".join(f"{depth['depths'][str(d)][exporter]['us_per_span']:.1f}" for d in DEPTHS)
        rate = depth["depths"][str(DEPTHS[-1])][exporter]["spans_per_s_per_core"]
        lines.append((f"[depth, {exporter}] per span at {DEPTHS[-1]} <= {TARGET_DEPTH}x at {DEPTHS[0]}",
                      f"{ratio:.2f}x ({costs} us/span; {rate:,.0f} spans/s/core)", ratio <= TARGET_DEPTH))
        deep = depth["depths"][str(DEPTHS[-1])]
        ratios = {name: deep[name]["traced_ms"] / deep["untraced_ms"] for name in DEPTH_EXPORTERS}
        lines.append((f"[depth {DEPTHS[-1]}] exporter none the cheapest traced step",
                      ", ".join(f"{name} {value:.3f}x" for name, value in ratios.items()) + " untraced",
                      min(ratios, key=ratios.get) == "none"))
    if "units" in report:
        units = report["units"]
        lines.append((f"[units] always-on <= {TARGET_UNIT_BLOCK_US:.0f} us per block of a {UNIT_BLOCKS}-block chain",
                      f"{units['always_on_us_per_block']:.2f} us ({units['untraced_ns_per_module_call']:.0f} ns per "
                      f"untraced module call)", units["always_on_us_per_block"] <= TARGET_UNIT_BLOCK_US))
        untraced_calls = max(kinds["untraced"]["per_module_call"] for kinds in units["python_calls"].values())
        lines.append(("[units] untraced: no Python of ours per module call (< 0.05)", f"{untraced_calls:.2f} calls per "
                      "module call (nested and top-level chains)", untraced_calls < 0.05))
        lines.append(("[units] a traced block <= torch ModTracker's",
                      f"{units['traced_us_per_block']:.1f} us vs {units['mod_tracker_us_per_block']:.1f} us",
                      units["traced_us_per_block"] <= units["mod_tracker_us_per_block"]))
    if "offline" in report:
        off = report["offline"]
        for command in ("summarize", "diagnose"):
            got = off[command]
            lines.append((f"[offline {off['ranks']} ranks, {off['bytes'] / 1e9:.2f} GB] {command} <= "
                          f"{TARGET_OFFLINE_S:.0f} s, <= {TARGET_OFFLINE_BYTES / 1e9:.0f} GB",
                          f"{got['wall_s']:.1f} s ({got.get('cpu_s', 0):.1f} s of CPU), "
                          f"{got['peak_rss_bytes'] / 1e6:,.0f} MB",
                          got["returncode"] == 0 and got["wall_s"] <= TARGET_OFFLINE_S
                          and got["peak_rss_bytes"] <= TARGET_OFFLINE_BYTES))
    if "event_rate" in report:
        print(f"(info) span events delivered: {report['event_rate']['events_per_s']:,.0f} /s")
    for label, value, ok in lines:
        print(f"{'PASS' if ok else 'FAIL'}  {label:48} {value}")


def run_profile(workload: str = "tp", steps: int = 40) -> int:
    print(f"\n== cProfile, rank 0 of {workload} on 2 ranks, traced every step, {steps} steps", flush=True)
    with counting_receiver() as rx:
        result = run_ranks(profile_worker, 2, child_env(rx.grpc_endpoint), steps=steps, workload=workload)[0]
    ours = [row for row in result["rows"] if "commdebug_otel" in row["path"]
            and not row["path"].endswith("_demo_model.py")]
    own = sum(row["tottime_s"] for row in ours)
    print(f"profiled {result['steps']} steps: {result['total_s'] / result['steps'] * 1000:.2f} ms "
          f"per step under cProfile; commdebug_otel self time "
          f"{own / result['steps'] * 1000:.2f} ms per step ({own / result['total_s'] * 100:.1f}%)")
    print("\ncommdebug_otel functions by self time (ms per step):")
    for row in sorted(ours, key=lambda r: -r["tottime_s"])[:20]:
        print(f"  {row['tottime_s'] / result['steps'] * 1000:7.3f} self  "
              f"{row['cumtime_s'] / result['steps'] * 1000:7.3f} cum  "
              f"{row['calls'] / result['steps']:7.1f} calls/step  {row['where']}")
    default_out = os.path.join(tempfile.gettempdir(), "commdebug-bench.prof")
    print(f"\nraw profile: {os.environ.get('BENCH_PROFILE_OUT', default_out)}")
    print("\nall functions by cumulative time (top 40):")
    print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
