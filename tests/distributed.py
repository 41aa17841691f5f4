"""Run a function on N gloo ranks on 127.0.0.1 and collect each rank's return value."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# torch, imported once in the forkserver, is already there in each rank it forks: a spawned rank spends 3-5 s (more
# on a loaded machine) importing it, and the suite starts a few hundred ranks.
_PRELOAD = ["torch", "torch.distributed"]
# These start tracing from commdebug_otel.pth at interpreter start-up, which a forked rank does not go through.
_PTH_PREFIX = "OTEL_PYTHON_COMMDEBUG_"


class _CallersFd:
    """The caller's file descriptor ``fd`` (its stdout or stderr now, which pytest's capfd may have swapped), sent
    to a forked rank through the forkserver; a forked rank would otherwise write to the server's."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _worker(rank: int, world_size: int, port: int, out_dir: str, payload: bytes,
            environ: dict, env: dict, stdio: tuple[int, int] | None) -> None:
    import torch.distributed as dist

    if stdio is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for received, fd in zip(stdio, (1, 2)):
            os.dup2(received, fd)
            os.close(received)
    # A forked rank has the forkserver's environment, taken when it started: set the caller's before the test's
    # module is imported (unpickling ``fn``), as a spawned rank has it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    result: Any
    try:
        fn, args = pickle.loads(payload)
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


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
              spawn: bool = False) -> list[Any]:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; return their results.

    The ranks are forked from a forkserver that has torch imported, with the caller's environment (then ``env``),
    working directory, stdout and stderr, as spawned ones would have them. ``spawn=True`` starts fresh interpreters:
    for a job that must not see what forked jobs before it left behind (Inductor's compiled code in a job that
    asserts on what is seen while compiling).

    Raises:
        AssertionError: with the rank's traceback when any rank raised.
    """
    environ = dict(os.environ)
    # Started by the first call, the forkserver keeps the environment of that moment: one that would start tracing
    # at start-up would have every later rank traced. Such a caller gets spawned ranks, as the .pth needs.
    spawn = spawn or any(value.strip() for name, value in environ.items() if name.startswith(_PTH_PREFIX))
    if not spawn:
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        stdio = None if spawn else (_CallersFd(1), _CallersFd(2))
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, pickle.dumps((fn, args)), environ,
                                          env or {}, stdio),
                           nprocs=world_size, join=True, start_method="spawn" if spawn else "forkserver")
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
