"""Trains 30 steps on the main thread under CommTracer while a side thread calls modules; prints one JSON line.

usage: side_thread.py LAYOUT [ROUNDS]

ROUNDS (default 1): the layout again with a new tracer, models and side thread, one JSON line each.

LAYOUT is the side thread's work and when it starts:

* ``before``: a serving loop (``Side(nn.Linear)`` under ``torch.no_grad()``), started before the tracer;
* ``after``: the same loop, started after the tracer, before the first training step;
* ``eval_grad``: an evaluation loop that runs forward with grad (never backward), started before the tracer;
* ``pool``: a ``ThreadPoolExecutor`` of two threads mapping serving calls, from before the tracer;
* ``one_backward``: one forward and backward of its own model (a saliency map), then the serving loop.

The switch interval is made short so that the threads interleave inside our hooks (the role's hand-back race
shows in most runs without the fix). Printed: ``steps`` (train_step's torch.step values), ``spans`` (count by
name), ``dropped`` (commdebug.telemetry.dropped by kind), ``calls`` (the side thread's module calls).
"""

import concurrent.futures
import json
import sys
import threading

import torch
from torch import nn

from commdebug_otel import CommTracer, Settings, semconv
from commdebug_otel.testing import InMemoryTelemetry

STEPS = 30


class Side(nn.Linear):
    pass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main(layout):
    telemetry = InMemoryTelemetry()
    model, side = Block(), Side(4, 4)
    stop, calls = threading.Event(), [0]

    def serve():
        with torch.no_grad():
            side(torch.randn(2, 4))
        calls[0] += 1

    def work():
        if layout == "one_backward":
            side(torch.randn(2, 4, requires_grad=True)).sum().backward()
        while not stop.is_set():
            if layout == "eval_grad":
                side(torch.randn(2, 4, requires_grad=True)).sum()
                calls[0] += 1
            else:
                serve()

    pool = concurrent.futures.ThreadPoolExecutor(2) if layout == "pool" else None
    if pool is not None:
        futures = [pool.submit(lambda: [serve() for _ in range(200)]) for _ in range(40)]
    thread = threading.Thread(target=work, daemon=True)
    if layout not in ("after", "pool"):
        thread.start()
    tracer = CommTracer(Settings(), tracer_provider=telemetry.tracer_provider,
                        meter_provider=telemetry.meter_provider).start()
    if layout == "after":
        thread.start()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        optimizer.step()
    stop.set()
    if pool is not None:
        for future in futures:
            future.cancel()
        pool.shutdown()
    elif thread.is_alive():
        thread.join()
    tracer.flush_metrics()
    tracer.stop()
    names = [span.name for span in telemetry.spans()]
    print(json.dumps({
        "steps": [span.attributes[semconv.STEP] for span in telemetry.by_name("train_step")],
        "spans": {name: names.count(name) for name in sorted(set(names))},
        "dropped": {attrs[semconv.DROPPED_KIND]: value
                    for attrs, value in telemetry.metric_points(semconv.METRIC_DROPPED)},
        "calls": calls[0],
    }))


if __name__ == "__main__":
    sys.setswitchinterval(1e-5)
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        main(sys.argv[1])
