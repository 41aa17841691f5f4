"""A script that joins every thread but the main one at its end, as some do before they exit.

``env``: tracing from the environment, two process groups in turn (each destroyed); ``api``: a CommTracer started
and stopped. Prints ``ALIVE <names>`` (threads still alive after 15 s of joining) and exits 0 when none is.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def train(steps: int) -> None:
    net = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        net(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(net.weight.grad)
        optimizer.step()
        optimizer.zero_grad()


def group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


if sys.argv[1] == "env":
    for steps in (2, 3):  # the second group is traced anew
        group()
        train(steps)
        dist.destroy_process_group()
else:
    from commdebug_otel import CommTracer

    group()
    tracer = CommTracer().start()
    train(2)
    tracer.stop()
    dist.destroy_process_group()

deadline = time.monotonic() + 15.0
for thread in threading.enumerate():
    if thread is not threading.main_thread():
        thread.join(max(0.0, deadline - time.monotonic()))
alive = sorted(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
print("ALIVE", ",".join(alive), flush=True)
os._exit(1 if alive else 0)  # not the threads' exit: a thread left alive would keep a plain exit waiting
