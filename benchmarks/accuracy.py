#!/usr/bin/env python
"""Accuracy of commdebug-otel's straggler and hang answers: a fault-injection matrix, many repetitions each.

Run from the repository root (``--quick``: a few minutes; one repetition of the full matrix: 10 to 20 minutes
on 2 busy cores, so ``--minutes`` bounds the whole)::

    python benchmarks/accuracy.py [--quick] [--reps N] [--only NAME,...] [--json results.json]
    python benchmarks/bench.py --only accuracy [--quick]   # the same, as a phase of the benchmark

Each run is a real job of gloo ranks on 127.0.0.1 (one process per rank, ``torch.set_num_threads(1)``)
training the demo transformer (``commdebug_otel._demo_model``, hand-written attention) under a
``CommTracer`` tracing every step to OTLP-JSON files, with one fault injected on one rank:

* straggler faults, answered offline by ``commdebug-otel diagnose --format json`` over the run's files
  (its ``stragglers`` key: the significant (rank, module, pass) rows): ``healthy`` (no fault),
  ``fwd`` (every step, :data:`SLOW_S` in ``layers.1.feed_forward`` forward), ``bwd`` (every step, in
  ``layers.0.attention`` backward), ``intermittent`` (:data:`INTERMITTENT_S` in that forward module in
  :data:`INTERMITTENT_STEPS` only) and ``failslow`` (the forward fault from step :data:`FAILSLOW_ONSET` of
  :data:`FAILSLOW_STEPS` on). Top-1
  is right when the first row is the injected (rank, module, pass); a healthy run's every row is a
  false blame; a fault run's rows other than the injected one are counted as extra rows. The live
  fail-slow verdict is on (``OTEL_PYTHON_COMMDEBUG_STRAGGLER=on``) and its ``straggler_verdict`` spans are
  read too: whether its first ``straggler`` verdict names the slow rank, steps from the onset to it, and
  whether the first verdict naming a module names the injected (module, pass), with its steps from the onset
  ("n/a" for runs shorter than the verdict's warm-up and window, 24 steps: of the straggler scenarios only
  ``failslow`` and ``healthy`` run as many, :data:`FAILSLOW_STEPS`; a healthy run's live ``straggler`` verdict
  is a false blame too);
* hang faults, answered live by the ``stall_verdict`` span (``STALL_AFTER`` = :data:`STALL_AFTER_S`):
  ``hang_module`` (sleeps :data:`STUCK_S` in ``layers.1.feed_forward`` forward at :data:`STUCK_STEP`, once: a
  pipeline runs it per microbatch),
  ``hang_between`` (before that step's forward), ``hang_behind`` (after its backward, before the
  optimizer step: the others wait in the next step), ``hang_subgroup`` (4 ranks: every step ranks 2-3
  all-reduce on a pair group, then every rank meets at a world barrier; the stuck rank sleeps before
  the pair's all-reduce), ``desync`` (the rank broadcasts where the others all-reduce, one extra
  collective after backward) and ``dead`` (the rank exits, its sockets held open by a child as a crashed
  GPU rank's peers would hang). Right when a verdict of the stuck step names exactly the injected rank
  behind and the expected kind (``hang``, ``desync``, ``missing``); latency: seconds from the stall
  threshold to the verdict (the verdict span's end minus its start minus ``STALL_AFTER``).

Parallelisms: ``tp`` (DTensor tensor parallel over all ranks), ``ddp`` (DistributedDataParallel),
``fsdp`` (FSDP2 ``fully_shard`` per block and root), ``fsdp_tp`` (4 ranks, 2 x 2 mesh), ``pp``
(``torch.distributed.pipelining``, GPipe, 2 microbatches, one block per stage; the last stage's block is
its ``layers.0``). Load: ``quiet`` (the machine as it is) or ``burn`` (beside
``python -c 'while True: pass'``). The exit status is 0 even when a target is missed (a measurement); 1 if a run crashed
without an answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

STEPS = 16  # per straggler run; the first traced step is warm-up (left out by the model)
# failslow: the live verdict judges after its warm-up (8 steps) once 16 steps are in its window: the onset after.
FAILSLOW_ONSET = 26
FAILSLOW_STEPS = 36
SLOW_S = 0.05  # the persistent straggler's sleep per step
INTERMITTENT_S = 0.15
INTERMITTENT_STEPS = (4, 8, 11, 14)
FWD_MODULE, BWD_MODULE = "layers.1.feed_forward", "layers.0.attention"
STALL_AFTER_S = 2.0
STUCK_STEP = 3
HANG_STEPS = 6
STUCK_S = 10.0  # a stuck rank's sleep: the verdict comes well before it ends
PG_TIMEOUT_S = 14  # gloo gives up on a collective that never completes (desync, a dead peer) after this
RUN_DEADLINE_S = 150.0  # one run, start-up on a loaded machine included
TARGET_TOP1 = 0.95
TARGET_LIVE_STEPS = 6  # a fail-slow named live within this many steps of its onset

STRAGGLER_FAULTS = ("healthy", "fwd", "bwd", "intermittent", "failslow")
HANG_FAULTS = ("hang_module", "hang_between", "hang_behind", "hang_subgroup", "desync", "dead")
EXPECTED_KIND = {"desync": "desync", "dead": "missing"}  # else "hang"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One cell of the matrix: a fault on ``rank`` of a ``world``-rank ``parallel`` job, quiet or burning."""

    fault: str
    parallel: str = "tp"
    world: int = 2
    load: str = "quiet"
    rank: int = 1

    @property
    def name(self) -> str:
        return f"{self.fault}/{self.parallel}/{self.world}r/{self.load}"

    @property
    def modules(self) -> tuple[str, str]:
        """The (forward, backward) fault's modules as the rank's model names them (a pipeline's last stage
        holds the second block as its ``layers.0``)."""
        return ("layers.0.feed_forward", BWD_MODULE) if self.parallel == "pp" else (FWD_MODULE, BWD_MODULE)

    @property
    def expected(self) -> tuple[int, str, str] | None:
        """The right (rank, module suffix, pass) of a straggler fault; None for healthy and hangs."""
        if self.fault in ("fwd", "intermittent", "failslow"):
            return (self.rank, self.modules[0], "forward")
        if self.fault == "bwd":
            return (self.rank, self.modules[1], "backward")
        return None

    @property
    def onset(self) -> int:
        return FAILSLOW_ONSET if self.fault == "failslow" else 0

    @property
    def steps(self) -> int:
        # healthy runs as long as a fail-slow's: the live verdict judges them too (a false live blame counts)
        return HANG_STEPS if self.fault in HANG_FAULTS else FAILSLOW_STEPS if self.fault in ("failslow", "healthy") \
            else STEPS


def matrix(quick: bool) -> list[Scenario]:
    """The scenarios run: every fault on 2 ranks (TP; DDP, FSDP2 and pipeline parallel on the faults where they
    differ), quiet and burning; 4 ranks (FSDP2 + TP) on the faults where a 2-D mesh differs (``--quick``: a few
    of each kind)."""
    if quick:
        return [Scenario("healthy"), Scenario("fwd"), Scenario("bwd", "ddp"), Scenario("hang_module"),
                Scenario("hang_behind"), Scenario("desync")]
    loads = ("quiet", "burn")
    out = [Scenario(fault, "tp", 2, load) for load in loads for fault in STRAGGLER_FAULTS]
    out += [Scenario(fault, parallel, 2, load) for parallel in ("ddp", "fsdp") for load in loads
            for fault in ("healthy", "fwd", "bwd", "failslow")]
    out += [Scenario(fault, "pp", 2, load) for load in loads for fault in ("healthy", "fwd", "bwd", "hang_module")]
    out += [Scenario(fault, "fsdp_tp", 4, rank=2) for fault in ("healthy", "fwd", "failslow")]
    out += [Scenario("healthy", "fsdp_tp", 4, "burn", rank=2)]
    out += [Scenario(fault, "tp", 2, load) for load in loads for fault in HANG_FAULTS if fault != "hang_subgroup"]
    out += [Scenario(fault, "fsdp_tp", 4, rank=3) for fault in ("hang_module", "hang_subgroup", "dead")]
    return out


# ------------------------------------------------------------------------ the rank's side
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _build(parallel: str, world: int):
    """The demo transformer, parallelized; returns (model, its Transformer (for module lookup), batch size)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel import _demo_model as demo

    inner = demo.Transformer(demo.ModelArgs())
    if parallel == "tp":
        model = demo.parallelize(inner, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    elif parallel == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        model = demo.parallelize(inner, mesh["tp"], mesh["dp"])
    elif parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in inner.layers:
            fully_shard(block, mesh=mesh)
        model = fully_shard(inner, mesh=mesh)
    elif parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(inner)
    elif parallel == "pp":  # one block per stage: the first embeds, the last norms and projects
        rank = torch.distributed.get_rank()
        inner.layers = torch.nn.ModuleList([inner.layers[rank]])
        if rank == 0:
            inner.norm, inner.output = torch.nn.Identity(), torch.nn.Identity()
        else:
            inner.tok_embeddings = torch.nn.Identity()
        model = inner
    else:
        raise ValueError(f"parallel must be tp, fsdp, fsdp_tp, ddp or pp, not {parallel!r}")
    return model, inner


def _loss(logits, targets):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class _Faults:
    """The sleeps injected into one rank's modules: ``fwd_s`` at the start of the forward module's forward,
    ``bwd_s`` at the start of the backward module's backward (an identity on its output whose backward
    sleeps: the first thing its backward runs)."""

    def __init__(self, inner, modules: tuple[str, str]) -> None:
        import torch

        self.fwd_s = self.bwd_s = 0.0
        self.once = False  # fwd_s sleeps at the next forward only
        faults = self

        class SleepInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                if faults.bwd_s:
                    time.sleep(faults.bwd_s)
                return grad

        fwd_module, bwd_module = inner.get_submodule(modules[0]), inner.get_submodule(modules[1])
        fwd_orig, bwd_orig = fwd_module.forward, bwd_module.forward

        def fwd(*args, **kwargs):
            if faults.fwd_s:
                time.sleep(faults.fwd_s)
                if faults.once:  # a hang is one stall, also where a pipeline runs the module once per microbatch
                    faults.fwd_s = 0.0
            return fwd_orig(*args, **kwargs)

        def bwd(*args, **kwargs):
            return SleepInBackward.apply(bwd_orig(*args, **kwargs))

        fwd_module.forward, bwd_module.forward = fwd, bwd


def _die_keeping_sockets(out_dir: str) -> None:
    """Exit at once, as a crashed rank does, but leave its sockets open (a child holds them): gloo's peers then
    wait as NCCL's do for a dead rank, instead of seeing the connection close."""
    child = os.fork()
    if child == 0:
        time.sleep(PG_TIMEOUT_S + 30)
        os._exit(0)
    Path(out_dir, "child.pid").write_text(str(child))
    os._exit(3)


def rank_main(spec: dict[str, Any]) -> None:
    """One rank of a run (``--worker``): RANK, WORLD_SIZE, MASTER_* and the tracer's settings in the environment."""
    import torch
    import torch.distributed as dist

    from commdebug_otel import CommTracer
    from commdebug_otel import _demo_model as demo

    torch.set_num_threads(1)
    scenario = Scenario(**spec["scenario"])
    rank, world = int(os.environ["RANK"]), scenario.world
    mine = rank == scenario.rank
    fault = scenario.fault
    outcome = "finished"
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        model, inner = _build(scenario.parallel, world)
        faults = _Faults(inner, scenario.modules)
        schedule = None
        if scenario.parallel == "pp":
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            stage = PipelineStage(model, rank, world, torch.device("cpu"))
            schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        pair = dist.new_group([2, 3]) if fault == "hang_subgroup" else None  # every rank makes it
        steps = scenario.steps
        with CommTracer() as tracer:
            if fault == "dead":
                # A rank gone before its watchdog's first look is "unknown" (documented): let it look first.
                exchange, deadline = tracer._stall_watch.exchange, time.monotonic() + 30
                while exchange._store is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            for step in range(steps):
                stuck = mine and step == STUCK_STEP
                if stuck and fault == "hang_between":
                    time.sleep(STUCK_S)
                if stuck and fault == "dead":
                    _die_keeping_sockets(spec["out_dir"])
                slow = mine and (fault in ("fwd", "bwd") or (fault == "failslow" and step >= scenario.onset))
                faults.fwd_s = SLOW_S if slow and fault != "bwd" else 0.0
                faults.bwd_s = SLOW_S if slow and fault == "bwd" else 0.0
                if mine and fault == "intermittent" and step in INTERMITTENT_STEPS:
                    faults.fwd_s = INTERMITTENT_S
                faults.once = stuck and fault == "hang_module"
                if faults.once:
                    faults.fwd_s = STUCK_S
                tokens, targets = demo.make_batch(demo.ModelArgs(), 2, step)
                if schedule is None:
                    _loss(model(tokens), targets).backward()
                elif rank == 0:
                    schedule.step(tokens)
                else:
                    schedule.step(target=targets, losses=[])
                if fault == "hang_subgroup":
                    if stuck:
                        time.sleep(STUCK_S)  # before the pair's all-reduce
                    if rank in (2, 3):
                        dist.all_reduce(torch.ones(2), group=pair)
                    dist.barrier()
                if fault == "desync":
                    if stuck:
                        dist.broadcast(torch.ones(2), src=0)
                    else:
                        dist.all_reduce(torch.ones(2))
                if stuck and fault == "hang_behind":
                    time.sleep(STUCK_S)  # after the step's collectives: the others wait in the next step's first
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except Exception as error:  # gloo's timeout ends a job that can never finish (desync, a dead peer)
        outcome = f"raised {type(error).__name__}"
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps({"outcome": outcome}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a peer still hung in gloo's teardown must not hold this one


# ------------------------------------------------------------------------ the harness's side
def _rank_env(scenario: Scenario, rank: int, port: int, trace_dir: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OTEL_", "TORCHELASTIC_")) and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(scenario.world), OMP_NUM_THREADS="1",
               OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=trace_dir, OTEL_PYTHON_COMMDEBUG_TRACE_EVERY="1",
               OTEL_METRIC_EXPORT_INTERVAL="60000", OTEL_PYTHON_COMMDEBUG_STALL_AFTER=(
                   str(STALL_AFTER_S) if scenario.fault in HANG_FAULTS else "auto"))
    if scenario.fault not in HANG_FAULTS:  # the live fail-slow verdict, read from its straggler_verdict spans
        env["OTEL_PYTHON_COMMDEBUG_STRAGGLER"] = "on"
    return env


def run_once(scenario: Scenario, keep: str | None = None) -> dict[str, Any]:
    """Run ``scenario`` once; return its outcomes per rank and the answers read from its files."""
    out_dir = tempfile.mkdtemp(prefix="commdebug-acc-")
    trace_dir = os.path.join(out_dir, "traces")
    burner = None
    if scenario.load == "burn":
        # It burns while its parent lives: a matrix stopped midway (SIGTERM, Ctrl-C) leaves no burner behind.
        burner = subprocess.Popen([sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"])
    port = _free_port()
    spec = json.dumps({"scenario": dataclasses.asdict(scenario), "out_dir": out_dir})
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", spec], env=_rank_env(scenario, rank, port,
                                                                                          trace_dir),
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(out_dir, f"err{rank}"), "w"))
             for rank in range(scenario.world)]
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, RUN_DEADLINE_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if burner is not None:
            burner.kill()
            burner.wait()
        child = Path(out_dir, "child.pid")
        if child.exists():
            try:
                os.kill(int(child.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall_s = time.monotonic() - started
    outcomes = {}
    for rank in range(scenario.world):
        path = Path(out_dir, f"rank{rank}.json")
        outcomes[rank] = json.loads(path.read_text())["outcome"] if path.exists() else "gone"
    result = {"scenario": scenario.name, "wall_s": round(wall_s, 1), "outcomes": outcomes}
    try:
        if scenario.fault in HANG_FAULTS:
            result.update(_hang_answer(scenario, trace_dir))
        else:
            result.update(_straggler_answer(scenario, trace_dir))
    except Exception as error:  # one run's failure is reported, the matrix goes on
        result["error"] = f"{type(error).__name__}: {error}"
        result["stderr"] = [Path(out_dir, f"err{rank}").read_text()[-2000:] for rank in range(scenario.world)]
    if keep:
        result["kept"] = os.path.join(keep, scenario.name.replace("/", "_") + f"-{int(time.time())}")
        shutil.copytree(out_dir, result["kept"])
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _diagnose(trace_dir: str) -> dict[str, Any]:
    """``commdebug-otel diagnose --format json TRACE_DIR``'s answer (its own entry point, in this process)."""
    import contextlib
    import io

    from commdebug_otel.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli(["diagnose", "--format", "json", trace_dir])
    if status != 0:
        raise RuntimeError(f"diagnose exit {status}: {err.getvalue()[-500:]}")
    return json.loads(out.getvalue())


def _spans(trace_dir: str, name: str) -> list[dict[str, Any]]:
    from commdebug_otel.offline.summary import load_spans

    return [span for span in load_spans([trace_dir]) if span["name"] == name]


def _straggler_answer(scenario: Scenario, trace_dir: str) -> dict[str, Any]:
    """Top-1 right or not, false blames, extra rows; the live fail-slow verdict when one exists."""
    from commdebug_otel import semconv

    found = _diagnose(trace_dir)
    rows = found["stragglers"]
    answer = [(row["rank"], row["module"], row["pass"]) for row in rows]
    # Rows of host contention (a rank waiting for a CPU another process had): kept for the reader, not scored.
    result: dict[str, Any] = {"rows": answer, "contended": [(row["rank"], row["module"], row["pass"])
                                                            for row in found.get("contended", [])]}
    expected = scenario.expected
    if expected is None:
        result["false_blames"] = len(rows)
    else:
        result["top1"] = bool(answer) and _same(answer[0], expected)
        result["extra_rows"] = sum(not _same(row, expected) for row in answer)
    verdicts = _spans(trace_dir, getattr(semconv, "SPAN_STRAGGLER_VERDICT", "straggler_verdict"))
    if verdicts:
        named = sorted((span for span in verdicts if span["attributes"].get("commdebug.verdict.kind") == "straggler"),
                       key=lambda span: span["attributes"].get(semconv.STEP, 0))
        if expected is None:
            result["live_false"] = len(named)
        elif named:
            first = named[0]["attributes"]
            result["live_rank_right"] = list(first.get("commdebug.verdict.behind_ranks", [])) == [scenario.rank]
            result["live_steps"] = first.get(semconv.STEP, 0) - scenario.onset
            # Where: the first verdict that names a module (with the rank, or in a second verdict).
            placed = [span["attributes"] for span in named if span["attributes"].get(semconv.VERDICT_MODULE)]
            result["live_place_right"] = bool(placed) and _same(
                (next(iter(placed[0][semconv.VERDICT_BEHIND_RANKS])), placed[0][semconv.VERDICT_MODULE],
                 placed[0][semconv.VERDICT_PASS]), expected)
            if placed:
                result["live_place"] = [placed[0][semconv.VERDICT_MODULE], placed[0][semconv.VERDICT_PASS]]
                result["live_place_steps"] = placed[0].get(semconv.STEP, 0) - scenario.onset
        else:
            result["live_rank_right"] = False
    elif scenario.steps >= _live_first_step():  # a run too short for the live verdict reports "n/a"
        if expected is None:
            result["live_false"] = 0
        else:
            result["live_rank_right"] = False
    return result


def _live_first_step() -> int:
    """The first step the live verdict can name a rank at: its warm-up, then a full window."""
    from commdebug_otel.stall import straggler

    return straggler.WARMUP_STEPS + straggler.MIN_STEPS_JUDGED


def _same(row: tuple[int, str, str], expected: tuple[int, str, str]) -> bool:
    return row[0] == expected[0] and row[2] == expected[2] and (
        row[1] == expected[1] or row[1].endswith("." + expected[1]))


def _hang_answer(scenario: Scenario, trace_dir: str) -> dict[str, Any]:
    """The stuck step's verdicts: right when there is one naming the rank and kind; seconds past the threshold."""
    from commdebug_otel import semconv

    verdicts = [span for span in _spans(trace_dir, semconv.SPAN_STALL_VERDICT)
                if span["attributes"].get(semconv.STEP) in (STUCK_STEP, STUCK_STEP + 1)]
    kind = EXPECTED_KIND.get(scenario.fault, semconv.VERDICT_KIND_HANG)
    said = [(span["attributes"][semconv.VERDICT_KIND], list(span["attributes"][semconv.VERDICT_BEHIND_RANKS]),
             span["attributes"].get(semconv.VERDICT_SUMMARY, "")) for span in verdicts]
    first = min(verdicts, key=lambda span: span["end_ns"]) if verdicts else None
    return {
        "verdicts": said,
        "hang_right": len(said) == 1 and said[0][0] == kind and said[0][1] == [scenario.rank],
        "rank_right": bool(said) and all(behind == [scenario.rank] for _, behind, _ in said),
        "kind_right": bool(said) and all(k == kind for k, _, _ in said),
        "latency_s": None if first is None else round(
            (first["end_ns"] - first["start_ns"]) / 1e9 - STALL_AFTER_S, 2),
    }


# ------------------------------------------------------------------------ the table
def _wrong(runs: list[dict[str, Any]]) -> str:
    """The rows of ``runs`` that are not a right first row, counted: ``" (rank 1 (train_step) x2, ...)"`` or ``""``."""
    counts: dict[str, int] = {}
    for run in runs:
        for rank, module, pass_ in run.get("rows", ())[1 if run.get("top1") else 0:]:
            place = module.split(".", 1)[1] if "." in module and not module.startswith("(") else module
            text = f"rank {rank} {place} {pass_}".rstrip()
            counts[text] = counts.get(text, 0) + 1
    return " (" + ", ".join(f"{text} x{n}" for text, n in sorted(counts.items())) + ")" if counts else ""


def _pct(hits: int, total: int) -> str:
    return f"{hits}/{total} ({100 * hits / total:.0f}%)" if total else "n/a"


def table_rows(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per scenario, in the order first run."""
    by: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by.setdefault(result["scenario"], []).append(result)
    rows = []
    for name, runs in by.items():
        fault = name.split("/")[0]
        answered = [run for run in runs if "error" not in run]
        row = {"scenario": name, "runs": str(len(runs)), "errors": str(len(runs) - len(answered))}
        if fault in HANG_FAULTS:
            lat = [run["latency_s"] for run in answered if run.get("latency_s") is not None]
            row.update(answer=_pct(sum(run["hang_right"] for run in answered), len(runs)),
                       detail=f"rank {sum(run['rank_right'] for run in answered)}/{len(runs)}, "
                              f"kind {sum(run['kind_right'] for run in answered)}/{len(runs)}",
                       live=f"{statistics.median(lat):.1f} s (max {max(lat):.1f})" if lat else "n/a")
        elif fault == "healthy":
            blames = [run["false_blames"] for run in answered]
            live = [run["live_false"] for run in answered if "live_false" in run]
            nobody = sum(run["false_blames"] == 0 and not run.get("live_false") for run in answered)
            row.update(answer=f"{nobody}/{len(runs)} blame nobody",
                       detail=f"{sum(blames) / max(1, len(blames)):.2f} false blames/run{_wrong(answered)}",
                       live=f"{sum(live)} false live verdicts" if live else "n/a")
        else:
            steps = [run["live_steps"] for run in answered if run.get("live_rank_right")]
            live_seen = [run for run in answered if "live_rank_right" in run]
            extra = [run["extra_rows"] for run in answered]
            placed = [run for run in live_seen if "live_place_right" in run]
            where = ""
            if placed:
                place_steps = [run["live_place_steps"] for run in placed if run["live_place_right"]]
                where = f"; module and pass right {len(place_steps)}/{len(placed)}" + (
                    f", median {statistics.median(place_steps)} steps" if place_steps else "")
            row.update(answer=_pct(sum(run["top1"] for run in answered), len(runs)),
                       detail=f"{sum(extra) / max(1, len(extra)):.2f} extra rows/run{_wrong(answered)}",
                       live=(f"{len(steps)}/{len(live_seen)} named, median {statistics.median(steps)} steps{where}"
                             if steps else (f"0/{len(live_seen)} named" if live_seen else "n/a")))
        rows.append(row)
    return rows


def targets(results: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """The four targets over every run: (what, measured, met). A run without an answer is a miss."""
    faults = [run for run in results if run["scenario"].split("/")[0] not in ("healthy", *HANG_FAULTS)]
    healthy = [run for run in results if run["scenario"].startswith("healthy/") and "error" not in run]
    hangs = [run for run in results if run["scenario"].split("/")[0] in HANG_FAULTS]
    hits = sum(run.get("top1", False) for run in faults)
    blamed = sum(run["false_blames"] + run.get("live_false", 0) for run in healthy)
    right = sum(run.get("hang_right", False) for run in hangs)
    failslow = [run for run in results if run["scenario"].startswith("failslow/")]
    live = sum(run.get("live_rank_right", False) and run.get("live_steps", TARGET_LIVE_STEPS + 1) <= TARGET_LIVE_STEPS
               for run in failslow)
    return [
        (f"straggler top-1 over all fault runs >= {TARGET_TOP1:.0%}", _pct(hits, len(faults)),
         bool(faults) and hits / len(faults) >= TARGET_TOP1),
        ("healthy runs with a false blame (offline rows or live verdicts): none",
         f"{sum(run['false_blames'] + run.get('live_false', 0) > 0 for run in healthy)}/{len(healthy)} ({blamed} "
         f"blame{'' if blamed == 1 else 's'})"
         if healthy else "n/a",
         bool(healthy) and blamed == 0),
        ("hang verdicts right: all", _pct(right, len(hangs)), bool(hangs) and right == len(hangs)),
        (f"fail-slows named live within {TARGET_LIVE_STEPS} steps of the onset: all", _pct(live, len(failslow)),
         bool(failslow) and live == len(failslow)),
    ]


def print_table(results: list[dict[str, Any]]) -> None:
    """The markdown table of :func:`table_rows`, then a PASS/FAIL line per target (:func:`targets`)."""
    head = ("scenario", "runs", "answer right", "detail", "live verdict", "errors")
    keys = ("scenario", "runs", "answer", "detail", "live", "errors")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in table_rows(results):
        print("| " + " | ".join(row[key] for key in keys) + " |")
    print()
    for what, measured, met in targets(results):
        print(f"{what}: {measured}: {'no run' if measured == 'n/a' else 'PASS' if met else 'FAIL'}")


def run_matrix(scenarios: list[Scenario], reps: int, keep: str | None = None, log=print,
               budget_s: float = 0.0, save=None) -> list[dict[str, Any]]:
    """Every scenario ``reps`` times, interleaved (rep by rep) so machine drift spreads over all of them.

    ``budget_s`` (> 0): no rep is begun that the last one's duration says would end past it (the reps run
    are complete). ``save(results)`` is called after each run (a matrix stopped midway keeps its answers).
    """
    results: list[dict[str, Any]] = []
    began = time.monotonic()
    for rep in range(reps):
        rep_began = time.monotonic()
        for scenario in scenarios:
            result = run_once(scenario, keep)
            results.append(result)
            brief = {key: value for key, value in result.items() if key not in ("outcomes", "stderr")}
            log(f"[rep {rep + 1}/{reps}] {json.dumps(brief)}")
            if save is not None:
                save(results)
        now = time.monotonic()
        if budget_s and rep + 1 < reps and now + (now - rep_began) - began > budget_s:
            log(f"[stopped after {rep + 1} reps: another would pass the {budget_s:.0f} s budget]")
            break
    return results


def rescore(results: list[dict[str, Any]], keep: str) -> list[dict[str, Any]]:
    """Each run of ``results`` answered again from its files kept under ``keep`` (``--keep`` when it ran), by this
    working tree's ``diagnose`` (its live verdicts are the spans the run exported). A run's folder is its
    ``"kept"``, else its scenario's folders in time order matched to its runs in order."""
    kept = [path for path in Path(keep).iterdir() if path.name.rsplit("-", 1)[-1].isdigit()]
    folders: dict[str, list[str]] = {}
    for path in sorted(kept, key=lambda path: int(path.name.rsplit("-", 1)[1])):
        folders.setdefault(path.name.rsplit("-", 1)[0], []).append(str(path))
    scenarios = {scenario.name: scenario for scenario in matrix(False)}
    seen: dict[str, int] = {}
    out = []
    for run in results:
        name = run["scenario"].replace("/", "_")
        order = seen.get(name, 0)
        seen[name] = order + 1
        mine = folders.get(name, [])
        folder = run.get("kept") or (mine[order] if order < len(mine) else None)
        scenario = scenarios.get(run["scenario"])
        if folder is None or scenario is None:
            out.append(dict(run) | {"error": "no kept files" if scenario else "not a scenario of the matrix"})
            continue
        answer = dict(run)
        for key in ("rows", "contended", "top1", "extra_rows", "false_blames", "live_rank_right", "live_steps",
                    "live_place_right", "live_place", "live_place_steps", "live_false", "verdicts", "hang_right",
                    "error"):
            answer.pop(key, None)
        trace_dir = os.path.join(folder, "traces")
        answer.update(_hang_answer(scenario, trace_dir) if scenario.fault in HANG_FAULTS else
                      _straggler_answer(scenario, trace_dir))
        out.append(answer)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a few scenarios of each kind on 2 ranks")
    parser.add_argument("--reps", type=int, default=0, help="runs per scenario (default 5, --quick 2)")
    parser.add_argument("--only", default="", help="comma-separated scenario names or name prefixes "
                                                   "(fault/parallel/NrR/load), e.g. healthy,fwd/tp")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="begin no rep that would end past this many minutes (default: run every rep)")
    parser.add_argument("--json", help="write every run's answer here (rewritten after each run)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a --json file's runs (no runs)")
    parser.add_argument("--keep", help="copy each run's files (traces, rank outcomes) under this folder")
    parser.add_argument("--rescore", metavar="JSON", help="answer a --json file's runs again from the files --keep "
                                                          "kept (no runs), print the table; with --json, write them")
    args = parser.parse_args(argv)
    if args.worker:
        rank_main(json.loads(args.worker))
        return 0
    sys.path.insert(0, str(REPO))  # the working tree's package, as the ranks import it (PYTHONPATH)
    if args.table:
        print_table(json.loads(Path(args.table).read_text()))
        return 0
    if args.rescore:
        if not args.keep:
            parser.error("--rescore needs --keep: the folder the runs' files were kept in")
        results = rescore(json.loads(Path(args.rescore).read_text()), args.keep)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        print_table(results)
        return 0
    scenarios = matrix(args.quick)
    if args.only:
        wanted = [item.strip() for item in args.only.split(",") if item.strip()]
        scenarios = [s for s in scenarios if any(s.name == w or s.name.startswith(w + "/") for w in wanted)]
        if not scenarios:
            parser.error(f"--only {args.only!r} matches no scenario; names: "
                         + ", ".join(s.name for s in matrix(False)))
    reps = args.reps or (2 if args.quick else 5)
    started, load = time.monotonic(), os.getloadavg()[0]
    print(f"command: python benchmarks/accuracy.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    save = None
    if args.json:
        def save(results: list[dict[str, Any]]) -> None:
            Path(args.json).write_text(json.dumps(results, indent=1))

    results = run_matrix(scenarios, reps, args.keep, budget_s=args.minutes * 60, save=save)
    print(f"\naccuracy: {len(results)} runs in {time.monotonic() - started:.0f} s ({len(results) // len(scenarios)} "
          f"reps of {len(scenarios)} scenarios; load average {load:.1f} -> {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs)\n")
    print_table(results)
    return 1 if any("error" in run for run in results) else 0


if __name__ == "__main__":
    sys.exit(main())
