"""A script with a C-level signal handler (``faulthandler.register``): trains, prints READY, waits for a line
on stdin (the test sends the signal meanwhile), trains on, prints DONE and exits 0.

usage: c_handler.py MODE TRACED

MODE is when the script registers faulthandler's handler:

* ``before``: ``faulthandler.register(SIGQUIT)`` before tracing starts (dump the stacks, go on);
* ``chain``: ``faulthandler.register(SIGTERM, chain=True)`` before tracing starts (dump, then the default action);
* ``after_block``: ``register(SIGQUIT)`` before three steps in a ``with CommTracer()`` block; the rest untraced;
* ``late_stop``: ``register(SIGQUIT)`` after tracing started, then ``stop()``;
* ``over_python``: ``signal.signal(SIGTERM, handler)`` then ``register(SIGTERM, chain=True)`` before tracing starts
  (dump, then the script's handler, which prints ``HANDLED <signum>``).

TRACED is 1 (``CommTracer``) or 0 (the same script untraced, the reference).
"""

import faulthandler
import signal
import sys

import torch

from commdebug_otel import CommTracer


def handler(signum, frame):
    print("HANDLED", signum, flush=True)


def main():
    mode, traced = sys.argv[1], sys.argv[2] == "1"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(count):
        for _ in range(count):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()

    if mode == "over_python":
        signal.signal(signal.SIGTERM, handler)
        faulthandler.register(signal.SIGTERM, chain=True)
    elif mode == "chain":
        faulthandler.register(signal.SIGTERM, chain=True)
    elif mode in ("before", "after_block"):
        faulthandler.register(signal.SIGQUIT)
    tracer = CommTracer() if traced else None
    if tracer is not None:
        tracer.start()
    steps(3)
    if mode == "late_stop":
        faulthandler.register(signal.SIGQUIT)
        steps(1)
    if tracer is not None and mode in ("after_block", "late_stop"):
        tracer.stop()
    print("READY", flush=True)
    sys.stdin.readline()
    steps(2)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
