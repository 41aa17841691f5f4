"""``commdebug-otel demo``: a real multi-rank training job on CPU, traced end to end.

It spawns ``--ranks`` processes (gloo on 127.0.0.1). Each trains a small
llama-style transformer for ``--steps`` optimizer steps under
:class:`commdebug_otel.CommDebugMode`, which streams spans, events and
metrics and counts collectives per module:

* 1 or 2 ranks (default 2): tensor parallel (ColwiseParallel / RowwiseParallel);
* 4 ranks (any even number from 4): FSDP2 (``fully_shard``) + TP on a 2-D mesh ``(dp=ranks/2, tp=2)``.

Other counts are refused (:func:`demo_refusal`): tensor parallel splits the model's 4 attention heads evenly.
Rank 0 prints a line as the job starts and after each step.

Telemetry goes to the configured OTLP endpoint, or to OTLP-JSON files in the
run's ``run-<time>-<id>`` folder under ``OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR``. The
demo prints where, then the per-module collective counts of rank 0.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import tempfile
import time

from commdebug_otel.config import Detail, ExportEnv, Settings

_DEMO_BATCH = 4
_DEMO_HEADS = 4  # _demo_model.ModelArgs.n_heads


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, steps: int, settings: Settings,
            result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("OTEL_SERVICE_NAME", "commdebug-otel-demo")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import _demo_model as demo_model
    from commdebug_otel.compat.debug_mode import CommDebugMode

    def say(text: str) -> None:
        if rank == 0:
            print(f"  {text}", flush=True)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    say(f"{world_size} process(es) joined the gloo group; building and sharding the model")
    try:
        with CommDebugMode(settings) as comm_mode:
            if world_size >= 4 and world_size % 2 == 0:
                mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
                tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
            else:
                tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
                dp_mesh = None
            args = demo_model.ModelArgs()
            model = demo_model.parallelize(demo_model.Transformer(args, seed=0), tp_mesh, dp_mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            losses = []
            for step in range(steps):
                began = time.perf_counter()
                tokens, targets = demo_model.make_batch(args, _DEMO_BATCH, step)
                losses.append(demo_model.train_step(model, optimizer, tokens, targets))
                say(f"step {step + 1}/{steps}: loss {losses[-1]:.3f} ({time.perf_counter() - began:.1f} s)")
        order = {fqn: index for index, fqn in enumerate(["Global", *comm_mode._modules])}
        counts = {
            fqn: {key: {str(op): n for op, n in ops.items() if n} for key, ops in by_pass.items()}
            for fqn, by_pass in sorted(comm_mode.comm_module_counts.items(),
                                       key=lambda item: order.get(item[0], len(order)))
        }  # in module-tree (forward) order
        tracer = comm_mode.tracer
        assert tracer is not None  # the drop-in traces inside its with block
        telemetry = tracer.telemetry
        telemetry.shutdown()
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as handle:
            json.dump({"counts": counts, "losses": losses, "files": telemetry.file_directory,
                       "total": comm_mode.get_total_counts()}, handle)
    finally:
        dist.destroy_process_group()


def describe_destination(settings: Settings, files: str | None = None,
                         export: ExportEnv | None = None) -> str:
    """Where spans go, in words: the OTLP endpoint(s) or the file folder (``files``, once known).

    ``export``: the standard ``OTEL_*`` variables (default: read now), by the rules the
    exporters are built with.
    """
    export = export if export is not None else ExportEnv.from_env()
    places = []
    for name in export.exporter_names("traces"):
        if name == "otlp":
            places.append(f"OTLP ({export.otlp_protocol('traces')}) to {export.otlp_endpoint('traces')}")
        elif name == "file":
            places.append(f"OTLP-JSON files in {files or os.path.abspath(settings.output_dir)}")
        else:
            places.append(name)
    return ", ".join(places) or "nowhere (OTEL_TRACES_EXPORTER=none)"


def next_steps(files: str | None) -> str:
    """What to run next, in lines: the offline commands on the run folder ``files`` when spans went to files,
    else where to look for them."""
    if not files:
        return ("next: open your trace backend's UI (Jaeger: http://localhost:16686, "
                "service \"commdebug-otel-demo\"), or\n"
                "  run `commdebug-otel receive` and the demo again to get a run folder for the offline commands")
    where = shlex.quote(files)
    return "\n".join([
        "next: read the run folder",
        f"  commdebug-otel summarize {where}   # CommDebugMode's table, rank totals, stragglers",
        f"  commdebug-otel diagnose {where}    # stuck rank, desyncs, who made the others wait",
        f"  commdebug-otel report {where} -o report.html   # one HTML page",
        f"  commdebug-otel perfetto {where} -o trace.json  # open in https://ui.perfetto.dev",
        "  (docs/getting-started.md: send to a collector, Jaeger or Tempo instead)",
    ])


def format_counts(counts: dict[str, dict[str, dict[str, int]]]) -> str:
    """The per-module collective table: one row per module with forward and backward counts."""
    rows = [("module", "forward", "backward")]
    for fqn, by_pass in counts.items():
        forward = ", ".join(f"{op.rsplit('.', 1)[-1]} x{n}" for op, n in sorted(by_pass.get("forward", {}).items()))
        backward = ", ".join(f"{op.rsplit('.', 1)[-1]} x{n}" for op, n in sorted(by_pass.get("backward", {}).items()))
        if forward or backward:
            rows.append((fqn, forward or "-", backward or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)


def demo_refusal(ranks: int) -> str | None:
    """Why the demo cannot run on ``ranks`` processes, in one line; None when it can (1, 2, or even from 4)."""
    if ranks in (1, 2) or (ranks >= 4 and ranks % 2 == 0):
        return None
    return (f"--ranks {ranks} is not supported: tensor parallel must split the model's "
            f"{_DEMO_HEADS} attention heads evenly; use 1 or 2 (tensor parallel) or an even number from 4 "
            "(FSDP2 + tensor parallel)")


def run_demo(ranks: int = 2, steps: int = 5, detail: str = "collectives") -> int:
    """Run the demo job; print where telemetry went and rank 0's per-module counts. Returns an exit code."""
    import torch.multiprocessing as mp

    settings = Settings.from_env(detail=Detail[detail.upper()])
    mode = f"FSDP2 + tensor parallel on a (dp={ranks // 2}, tp=2) mesh" if ranks >= 4 \
        else f"tensor parallel on {ranks} ranks"
    print(f"commdebug-otel demo: {mode}, {steps} steps, detail {settings.detail.label}", flush=True)
    print(f"  starting {ranks} process(es) on this machine (gloo on 127.0.0.1; importing torch takes a while)",
          flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_worker, args=(ranks, _free_port(), steps, settings, result_dir),
                           nprocs=ranks, join=True, start_method="spawn")
        results = []
        for rank in range(ranks):
            with open(os.path.join(result_dir, f"rank{rank}.json")) as handle:
                results.append(json.load(handle))
    elapsed = time.perf_counter() - started
    print(f"finished in {elapsed:.1f} s; loss {results[0]['losses'][0]:.3f} -> "
          f"{results[0]['losses'][-1]:.3f}")
    print(f"telemetry: {describe_destination(settings, results[0].get('files'))}")
    print("\ncollectives per module on rank 0 (counts include submodules; Global = all):")
    print(format_counts(results[0]["counts"]))
    totals = [result["total"] for result in results]
    print("\ncollectives per rank: " + ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(totals)))
    if len(set(totals)) > 1:
        print("note: ranks issued different numbers of collectives")
    print("\n" + next_steps(results[0].get("files")))
    sys.stdout.flush()
    return 0
