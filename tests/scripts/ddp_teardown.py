"""One rank of a 2-rank gloo DDP job under CommTracer (from the environment) that ends as scripts do: training in
``main()``, ``destroy_process_group()`` at its end, the model freed when ``main()`` returns.

usage: ddp_teardown.py STEPS [slow-callbacks | killed | stuck]

``slow-callbacks``: each collective's completion callback (run on gloo's worker thread) first sleeps 0.5 s,
as a worker thread that waits for the GIL on a loaded machine does. Prints ``DESTROYED`` once
``destroy_process_group`` returned and ``EXITED`` when ``main()`` has returned. ``killed``: the rank is
killed (SIGKILL) right after ``destroy_process_group`` returns, as a rank that dies in teardown. ``stuck``:
it then prints ``STUCK`` and blocks for good holding the GIL (a mutex locked twice), as a destructor
joining a stuck thread does.
"""

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main(steps: int, then: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    dist.destroy_process_group()
    print("DESTROYED", flush=True)
    if then == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    elif then == "stuck":
        holding_the_gil = ctypes.PyDLL(None)
        mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t: a default mutex
        holding_the_gil.pthread_mutex_lock(mutex)
        print("STUCK", flush=True)
        holding_the_gil.pthread_mutex_lock(mutex)


if __name__ == "__main__":
    if sys.argv[2:] == ["slow-callbacks"]:
        from commdebug_otel.core import collectives

        completed = collectives._Completion.__call__

        def late(self, future):
            time.sleep(0.5)
            completed(self, future)

        collectives._Completion.__call__ = late
    main(int(sys.argv[1]), sys.argv[2] if sys.argv[2:] else "")
    print("EXITED", flush=True)
