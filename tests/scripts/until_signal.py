"""Trains STEPS steps under CommTracer (from the environment), prints READY, then waits for a signal.

usage: until_signal.py STEPS
"""

import socket
import sys
import time

import torch
import torch.distributed as dist

from commdebug_otel import CommTracer


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 1, is_master=True), rank=0,
                            world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    CommTracer().start()
    for _ in range(int(sys.argv[1])):
        model(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(1))
        optimizer.step()
    model(torch.ones(2, 4))  # a step that has begun and will not finish
    print("READY", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
