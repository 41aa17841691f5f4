"""A plain data-parallel job with nothing of commdebug-otel in it, for `commdebug-otel run -- torchrun ...`: rank 1's
first layer becomes 60 ms slower per step from step ONSET on (a fail-slow host); 20 ms of host work per step.

usage: failslow.py STEPS ONSET fsdp|ddp   (FSDP2's fully_shard per layer and root, or DistributedDataParallel)
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

SLOW_S = 0.06


def main():
    steps, onset = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    inner = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    if sys.argv[3] == "ddp":
        model = DistributedDataParallel(inner)
    else:
        for layer in (inner[0], inner[2]):
            fully_shard(layer)
        model = fully_shard(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    inner[0].register_forward_pre_hook(lambda module, args: time.sleep(SLOW_S)
                                              if rank == 1 and step >= onset else None)
    for step in range(steps):  # noqa: B007 (the hook reads it)
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
