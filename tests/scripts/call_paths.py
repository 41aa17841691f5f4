"""Run a small traced job (one gloo rank: module spans, collectives, a stall) and the offline commands over its
files, recording the package's Python calls in order on every thread; written as JSON to ``argv[1]``
(``tests/test_architecture_doc.py`` holds docs/architecture.md's call paths against it)."""

import json
import os
import pathlib
import socket
import sys
import threading
import time

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "commdebug_otel"
CALLS: list[str] = []
_ROOT = str(PACKAGE) + os.sep


def _profile(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
        if name.startswith(_ROOT):
            CALLS.append(f"{name[len(_ROOT):]}:{frame.f_code.co_qualname}")


def main(out: str, folder: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=folder, OTEL_PYTHON_COMMDEBUG_STALL_AFTER="0.5",
                      OTEL_PYTHON_COMMDEBUG_TRACE_EVERY="2")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        os.environ.pop(name, None)
    import torch
    import torch.distributed as dist
    from torch import nn

    from commdebug_otel import CommTracer
    from commdebug_otel.cli import main as cli

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.stall = False

        def forward(self, x):
            if self.stall:
                time.sleep(2.0)  # the watchdog's snapshot
            y = self.lin(x)
            dist.all_reduce(y)
            return y

    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = nn.Sequential(Layer(), Layer())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    with CommTracer():
        for step in range(4):  # steps 0 and 2 traced, 1 and 3 not; step 2 stalls
            model[1].stall = step == 2
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    run = next(pathlib.Path(folder).glob("run-*"))
    # Four ranks, rank 2 late, for the straggler model's windows (one rank matches with no other).
    sys.path.insert(0, str(PACKAGE.parent / "tests"))
    from test_offline_fold import _RANKS, _rank_spans

    from otlp_files import write_otlp

    late = pathlib.Path(folder) / "late"
    late.mkdir()
    for rank in range(_RANKS):
        write_otlp(_rank_spans(rank), late / f"traces-rank{rank}.jsonl")
    for argv in (["diagnose", str(late)], ["diagnose", str(run)], ["summarize", str(run)], ["signature", str(run)]):
        CALLS.append(f"-- {argv[0]}")
        assert cli(argv) == 0, argv
    sys.setprofile(None)
    threading.setprofile(None)
    dist.destroy_process_group()
    pathlib.Path(out).write_text(json.dumps(CALLS))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
