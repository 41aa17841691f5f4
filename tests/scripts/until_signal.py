"""Trains STEPS steps under CommTracer (from the environment), prints READY, then waits for a signal.

usage: until_signal.py STEPS [native | untraced]

``native``: wait in native code instead (a TCPStore wait for a key nobody sets, as a collective
waits for a stuck peer), where Python cannot run signal handlers. ``untraced``: the same script without the tracer.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from commdebug_otel import CommTracer


def main():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the store binds a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if sys.argv[2:] != ["untraced"]:
        CommTracer().start()
    for _ in range(int(sys.argv[1])):
        model(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(1))
        optimizer.step()
    model(torch.ones(2, 4))  # a step that has begun and will not finish
    print("READY", flush=True)
    if sys.argv[2:] == ["native"]:
        store.wait(["commdebug-test/never-set"], timedelta(seconds=120))
    time.sleep(120)


if __name__ == "__main__":
    main()
