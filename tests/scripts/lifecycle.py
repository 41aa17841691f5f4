"""An unmodified script whose set-up runs before init_process_group, with DataLoader workers.

usage: lifecycle.py STEPS [--before forward|step|stall|none] [--loaders] [--spawn N]
Under torchrun (RANK/WORLD_SIZE set), or as a ``torch.multiprocessing.spawn`` parent with ``--spawn N``.
``--before``: what runs before ``init_process_group``: one forward, one forward + backward + optimizer step,
or a pause long enough for a stall snapshot (``OTEL_PYTHON_COMMDEBUG_STALL_AFTER`` set short by the caller).
``--loaders``: DataLoaders with two ``spawn``, two ``forkserver`` and two ``fork`` workers (their dataset
calls a module), iterated before and after the process group exists.
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Data(torch.utils.data.Dataset):
    """Each item goes through a module (a transform), as torchvision's transforms do."""

    def __init__(self) -> None:
        self.transform = Scale()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(torch.full((4,), float(index)))


def loaders() -> list:
    return [torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context=context)
            for context in ("spawn", "forkserver", "fork")]


def main(steps: int, before: str, with_loaders: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if before in ("forward", "step"):
        loss = model(torch.ones(2, 4)).sum()
        if before == "step":
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    elif before == "stall":
        time.sleep(float(os.environ.get("PAUSE_S", "3")))
    if with_loaders:
        for loader in loaders():
            for batch in loader:
                model(batch).sum()
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(steps):
        ddp(torch.full((2, 4), float(step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, argv: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    main(*argv)


def _args() -> tuple:
    before = sys.argv[sys.argv.index("--before") + 1] if "--before" in sys.argv else "none"
    return int(sys.argv[1]), before, "--loaders" in sys.argv


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        world = int(sys.argv[sys.argv.index("--spawn") + 1])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(world, port, list(_args())), nprocs=world)
    else:
        main(*_args())
