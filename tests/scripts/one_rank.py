"""A one-rank gloo job traced by CommTracer from the environment; prints when training is done.

usage: one_rank.py STEPS [--fork] [--stop]

--stop: end with ``CommTracer.stop()`` (as leaving ``with CommTracer()`` does) before exit;
prints "EXIT HANDLERS DONE <time>" after every exit handler of ours has run.
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

from commdebug_otel import CommTracer


class AllReduceLinear(torch.nn.Module):
    def __init__(self, collectives=True):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.collectives = collectives

    def forward(self, x):
        out = self.lin(x)
        if self.collectives:
            dist.all_reduce(out.detach())
        return out


def train(steps, collectives=True):
    model = AllReduceLinear(collectives)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()


def main():
    steps = int(sys.argv[1])
    # Registered first, so it runs last of the exit handlers (they run in reverse order).
    atexit.register(lambda: print(f"EXIT HANDLERS DONE {time.time():.3f}", flush=True))
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the store binds a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tracer = CommTracer().start()
    if "--fork" in sys.argv:
        import multiprocessing

        # A process group does not survive fork: the child trains without collectives.
        child = multiprocessing.get_context("fork").Process(target=train, args=(steps, False))
        child.start()
        child.join()
        assert child.exitcode == 0
        print("CHILD PID", child.pid, flush=True)
    else:
        train(steps)
    print(f"TRAINING DONE {time.time():.3f}", flush=True)
    if "--stop" in sys.argv:
        tracer.stop()
    del tracer  # exit flushes through atexit


if __name__ == "__main__":
    main()
