"""An unmodified training script: no commdebug_otel import. Started by torchrun or as a spawn parent.

usage: train.py STEPS [--spawn N]
Mesh: (dp=2, tp=2) FSDP2 + TP with 4 ranks, else TP over all ranks.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commdebug_otel import _demo_model as demo  # the model only; tracing comes from the environment


def train(steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = demo.parallelize(demo.Transformer(demo.ModelArgs()), mesh["tp"], mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = demo.parallelize(demo.Transformer(demo.ModelArgs()), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        tokens, targets = demo.make_batch(demo.ModelArgs(), 2, step)
        demo.train_step(model, optimizer, tokens, targets)
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    train(steps)


if __name__ == "__main__":
    steps = int(sys.argv[1])
    if "--spawn" in sys.argv:
        world = int(sys.argv[sys.argv.index("--spawn") + 1])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(world, port, steps), nprocs=world)
    else:
        train(steps)
