"""Run a function on N gloo ranks on 127.0.0.1 and collect each rank's return value."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable,
            args: tuple, env: dict) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer that left first (its store gone): the result stands
                pass
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)
    # torch's own teardown aborts now and then ("terminate called without an active exception", SIGABRT) in a
    # process that ran compiled blocks under FSDP2 with gloo, our tracer or not (4 of 15 plain runs): the
    # result is written, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | None = None) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return their results.

    Raises:
        AssertionError: with the rank's traceback when any rank raised.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, env or {}),
                           nprocs=world_size, join=True, start_method="spawn")
        results, failures = [], []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as handle:
                status, value = pickle.load(handle)
            if status != "ok":
                failures.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if failures:
            raise AssertionError("\n".join(failures))
        return results
