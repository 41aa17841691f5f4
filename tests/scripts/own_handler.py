"""Trains under CommTracer, sets up the script's own signal handling, prints READY, waits for a line on stdin,
trains on and exits 0 by itself.

usage: own_handler.py MODE

MODE is how the script handles SIGTERM once tracing started:

* ``late``: ``signal.signal(SIGTERM, handler)`` after three traced steps;
* ``after_block``: three steps in a ``with CommTracer()`` block, then ``signal.signal`` (two more steps untraced);
* ``chained``: a handler that calls the one it found when that is a function (Lightning's SignalConnector);
* ``ignored``: ``SIG_IGN`` after three traced steps;
* ``asyncio``: an event loop adds and removes a SIGTERM handler (``SIG_DFL`` again, the wakeup fd cleared),
  two more steps, then READY: the default action ends the process (no line is read);
* ``asyncio_last``: the same after the last step (no step boundary follows), then READY, and no line is read;
* ``asyncio_ignored``: the same, then ``SIG_IGN`` after three traced steps.

The handler prints ``HANDLED <signum>``.
"""

import asyncio
import signal
import sys
import time

import torch

from commdebug_otel import CommTracer


def handler(signum, frame):
    print("HANDLED", signum, flush=True)


def add_and_remove_a_handler():
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, print, "never")
    loop.run_until_complete(asyncio.sleep(0))
    loop.remove_signal_handler(signal.SIGTERM)
    loop.close()


def main():
    mode = sys.argv[1]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(count):
        for _ in range(count):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()

    if mode == "after_block":
        with CommTracer():
            steps(3)
        signal.signal(signal.SIGTERM, handler)
    else:
        CommTracer().start()
        steps(3)
        if mode == "late":
            signal.signal(signal.SIGTERM, handler)
        elif mode == "chained":
            found = signal.getsignal(signal.SIGTERM)

            def compose(signum, frame):
                handler(signum, frame)
                if callable(found):
                    found(signum, frame)

            signal.signal(signal.SIGTERM, compose)
        elif mode == "ignored":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif mode == "asyncio":
            add_and_remove_a_handler()
        elif mode == "asyncio_ignored":
            add_and_remove_a_handler()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps(2)
    if mode == "asyncio_last":
        add_and_remove_a_handler()
    print("READY", flush=True)
    if mode in ("asyncio", "asyncio_last"):
        time.sleep(120)
    sys.stdin.readline()  # the parent sent the signal and waited past the rescue's grace
    steps(2)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
