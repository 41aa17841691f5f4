"""What a traced block costs, beside torch's ModTracker: the units phase's chain of 200 blocks (``bench.ChainJob``)
in this one process (one gloo rank), every time the training thread's CPU time (``time.thread_time``).

    PYTHONPATH=$PWD python benchmarks/traced_block_probe.py time [ROUNDS]     # ours traced vs ModTracker
    PYTHONPATH=$PWD python benchmarks/traced_block_probe.py floor [ROUNDS]    # ... beside empty global hooks,
                                                                              # and those plus tensor hooks
    PYTHONPATH=$PWD python benchmarks/traced_block_probe.py emit [ROUNDS]     # span building, hand-over
    PYTHONPATH=$PWD python benchmarks/traced_block_probe.py profile [STEPS]   # cProfile of traced steps

``time`` and ``floor``: per round, each config's fastest step of 6 minus the uninstrumented fastest, the configs
interleaved; the medians over rounds, per block (forward and backward of the block and its Linear: 4 spans).
``emit``: one traced step's spans built again 15 times (the processors' hand-over left out, then timed alone on
the spans built), the fastest; the median over rounds, per span. ``profile`` writes the raw profile to
``$BENCH_PROFILE_OUT`` (default /tmp/commdebug-probe.prof). A measurement, not a test: the exit status is 0.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")

import bench
import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from commdebug_otel import CommTracer, Settings

BLOCKS = 200
STEPS = 6


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        chain = bench.ChainJob(BLOCKS)
        for _ in range(3):
            chain.step()
        tracer = CommTracer(Settings(trace_every=1, output_dir=tempfile.mkdtemp(prefix="commdebug-probe-")))
        configs = {"base": lambda: _steps(chain), "ours": lambda: _ours(chain, tracer),
                   "ModTracker": lambda: _mod_tracker(chain)}
        _ours(chain, tracer)  # the providers start
        if mode == "profile":
            _profile(chain, tracer, rounds)
        elif mode == "emit":
            _emit(chain, tracer, rounds)
        else:
            if mode == "floor":
                configs["empty hooks"] = lambda: _with_hooks(chain, _noop, _noop)
                configs["tensor hooks"] = lambda: _with_hooks(chain, _pre_tensor_hook, _post_tensor_hook)
            _interleaved(configs, rounds)
    finally:
        dist.destroy_process_group()


def _steps(chain: bench.ChainJob) -> list[float]:
    return [chain.timed_step() for _ in range(STEPS)][1:]


def _ours(chain: bench.ChainJob, tracer: CommTracer) -> list[float]:
    tracer.start()
    try:
        return _steps(chain)
    finally:
        tracer.stop()
        bench._remove_collective_kernels()


def _mod_tracker(chain: bench.ChainJob) -> list[float]:
    times = []
    for _ in range(STEPS):
        tracker = ModTracker()
        tracker.__enter__()
        try:
            times.append(chain.timed_step())
        finally:
            tracker.__exit__(None, None, None)
    return times[1:]


def _noop(*args: object) -> None:
    return None


class _TensorHook:
    __slots__ = ()

    def __call__(self, grad: torch.Tensor) -> None:
        return None


_HOOK = _TensorHook()


def _pre_tensor_hook(module: torch.nn.Module, args: tuple) -> None:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.requires_grad and arg.grad_fn is not None:
            arg.register_hook(_HOOK)


def _post_tensor_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_HOOK)


def _with_hooks(chain: bench.ChainJob, pre: object, post: object) -> list[float]:
    pre_handle = register_module_forward_pre_hook(pre)
    post_handle = register_module_forward_hook(post, with_kwargs=True)
    try:
        return _steps(chain)
    finally:
        pre_handle.remove()
        post_handle.remove()


def _interleaved(configs: dict, rounds: int) -> None:
    names = list(configs)
    rows = []
    for index in range(rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        fastest = {name: min(configs[name]()) for name in order}
        rows.append({name: (fastest[name] - fastest["base"]) / BLOCKS * 1e6 for name in names})
        print(f"round {index}: base {fastest['base'] * 1e3:.2f} ms; " + ", ".join(
            f"{name} +{rows[-1][name]:.1f}" for name in names[1:]) + " us per block"
            + f"; ours / ModTracker {rows[-1]['ours'] / rows[-1]['ModTracker']:.3f}", flush=True)
    print("median per block: " + ", ".join(f"{name} +{statistics.median(row[name] for row in rows):.1f} us"
                                           for name in names[1:])
          + f"; median ratio ours / ModTracker {statistics.median(r['ours'] / r['ModTracker'] for r in rows):.3f}"
          + f"; load average {os.getloadavg()[0]:.1f}")


def _emit(chain: bench.ChainJob, tracer: CommTracer, rounds: int) -> None:
    from commdebug_otel.otel import spans as spans_module

    emit, hand_over = spans_module.SpanBuilder.emit, spans_module._DirectSpans.hand_over
    built: list[float] = []
    handed: list[float] = []
    spans: list[int] = []

    def timed_emit(self, roots, children, trace_id, parent_span_id=0):
        if len(children) > BLOCKS // 2 and len(built) < rounds:
            captured: list = []
            spans_module._DirectSpans.hand_over = lambda direct, finished: captured.append(finished)
            try:
                times = []
                for _ in range(15):
                    began = time.thread_time()
                    emit(self, roots, children, trace_id)
                    times.append(time.thread_time() - began)
            finally:
                spans_module._DirectSpans.hand_over = hand_over
            built.append(min(times))
            spans.append(len(captured[0]))
            times = []
            for _ in range(5):
                began = time.thread_time()
                self._direct.hand_over(captured[0])
                times.append(time.thread_time() - began)
            handed.append(min(times))
        return emit(self, roots, children, trace_id, parent_span_id)

    spans_module.SpanBuilder.emit = timed_emit
    try:
        while len(built) < rounds:
            _ours(chain, tracer)
    finally:
        spans_module.SpanBuilder.emit = emit
    count = spans[0]
    print(f"{count} spans a step: building {statistics.median(built) / count * 1e6:.2f} us per span "
          f"(fastest round {min(built) / count * 1e6:.2f}), hand-over {statistics.median(handed) / count * 1e6:.2f} "
          f"us per span (fastest round {min(handed) / count * 1e6:.2f}); load average {os.getloadavg()[0]:.1f}")


def _profile(chain: bench.ChainJob, tracer: CommTracer, steps: int) -> None:
    tracer.start()
    try:
        chain.step()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            chain.step()
        profile.disable()
    finally:
        tracer.stop()
        bench._remove_collective_kernels()
    profile.dump_stats(os.environ.get("BENCH_PROFILE_OUT", "/tmp/commdebug-probe.prof"))
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
