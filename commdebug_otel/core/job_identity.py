"""Job identity: rank facts, the job nonce agreed by all ranks, and the trace ids of steps.

With trace scope ``job`` every rank derives the trace id of step N from
``(run id, job nonce, N)``, so Jaeger and Tempo show step N of the whole job
as one trace. ``TORCHELASTIC_RUN_ID`` is ``none`` for every torchrun job
started without ``--rdzv-id``, so a random nonce is mixed in. The nonce is
agreed through the default process group's store with ``compare_set`` (a
key-value round trip, not a collective, and it never blocks on other ranks):
the first rank to ask sets it, every other rank reads it. The key does not
outlive tracing: each rank counts itself out when its tracing ends
(:func:`leave_job`), and the last of the job's ranks deletes it.

Until the default process group exists in a job of several ranks (torchrun's
``WORLD_SIZE`` above 1), nothing that ranks must agree on is fixed
(:func:`settled`): a step that ends before ``init_process_group`` (a set-up
forward, an optimizer step, a stall snapshot) gets its trace id from a
provisional nonce of this rank's own, and the run folder, resource and
providers wait for the process group (``otel/telemetry.py``). From the first step
after it, the agreed nonce is used.

``outside_step`` segments (set-up, evaluation collectives, checkpoint saves
between steps) get the same treatment: each is named by how many training
steps closed before it (:func:`outside_step_label`), which every rank running
the same program agrees on, so the segments between two steps are one trace on
all ranks.

A job of more than ``ranks_per_trace`` ranks (``OTEL_PYTHON_COMMDEBUG_RANKS_PER_TRACE``) is cut
into trace blocks of that many consecutive ranks (:func:`trace_block`): step N of one block is one
trace, whose id also mixes in the block, so no trace grows with the job (one rank's traced step
times the block size stays under Tempo's 5 MB per trace). Every block's ``train_step`` keeps
``torch.step`` (a step is found across its traces by that attribute) and names its block in
``commdebug.trace.block``. A job of at most ``ranks_per_trace`` ranks has one trace per step, with
exactly the ids it had before blocks existed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from commdebug_otel.capture._torch import default_store
from commdebug_otel.capture.ops import backend_name
from commdebug_otel.config import RankEnv

_logger = logging.getLogger(__name__)

NONCE_KEY = "commdebug_otel/job_nonce"

# This process's tracing sessions that left the job (leave_job): session N agrees on key N. Ranks running the
# same program start and stop tracing alike, so a rank that starts again before the others left its previous
# session never reads the nonce that the last of them is about to delete.
_sessions_left = 0
# id of the default group a forked child inherited (a DataLoader worker of a rank): its store connection is the
# parent's socket, and its leaving would count for the parent. None: not a fork, or no group then.
_inherited_group: int | None = None


def _after_fork_in_child() -> None:
    global _inherited_group
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        _inherited_group = id(dist.GroupMember.WORLD) if initialized else None
    except Exception:  # a torch without distributed
        _inherited_group = None


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job. From torch.distributed once initialized, else torchrun's env."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    run_id: str
    backend: str
    distributed: bool


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Read the rank facts. torch.distributed wins over ``RANK``/``WORLD_SIZE`` once initialized.

    The rest comes from torchrun's variables in ``environ`` (default ``os.environ``), see
    :class:`~commdebug_otel.config.RankEnv`.
    """
    env = RankEnv.from_env(environ)
    rank, world_size = env.rank, env.world_size
    backend = ""
    distributed = False
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            backend = backend_name()
            distributed = True
    except Exception:  # a half-initialized group must not stop telemetry
        pass
    return RankInfo(
        rank=rank,
        world_size=world_size,
        local_rank=rank if env.local_rank is None else env.local_rank,  # unset under mp.spawn: one host
        node_rank=env.node_rank,
        run_id=env.run_id,
        backend=backend,
        distributed=distributed,
    )


def settled(info: RankInfo) -> bool:
    """Whether ``info`` is final: torch.distributed is initialized, or no process group is expected
    (``WORLD_SIZE`` unset or 1). Until then rank facts, the job nonce and the run folder are provisional."""
    return info.distributed or info.world_size <= 1


class RankCache:
    """This process's :class:`RankInfo`, read again on each call until torch.distributed is initialized.

    Call it as a function. :meth:`reset` forgets it (a forked child has its own rank).
    """

    __slots__ = ("_info",)

    def __init__(self) -> None:
        self._info: RankInfo | None = None

    def __call__(self) -> RankInfo:
        info = self._info
        if info is None or not info.distributed:
            fresh = rank_info()
            if fresh.distributed or info is None:
                self._info = info = fresh
        return info

    def reset(self) -> None:
        self._info = None


def job_nonce(store: Any = None) -> str:
    """An id shared by every rank of this job (one store round trip), or local if not distributed.

    ``YYYYmmdd-HHMMSS-<8 hex>``: the start time of the first rank to ask, then random bits.
    ``store``: the default group's store or a clone of it (a thread's own connection); None: the default group's.
    """
    mine = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)  # sorts by start time
    try:
        import torch.distributed as dist

        if store is None and dist.is_available() and dist.is_initialized():
            store = default_store()
        if store is not None:
            agreed = store.compare_set(nonce_key(), "", mine)
            return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    except Exception as error:  # e.g. a store without compare_set
        _logger.warning("commdebug-otel: ranks could not agree on a job id (%s); "
                        "step traces are per rank", error)
    return mine


def nonce_key() -> str:
    """The store key of the job nonce for this process's current tracing session: :data:`NONCE_KEY`, then
    ``NONCE_KEY/<n>`` after ``n`` sessions left the job."""
    return NONCE_KEY if _sessions_left == 0 else f"{NONCE_KEY}/{_sessions_left}"


def leave_job(store: Any = None) -> bool:
    """This rank's tracing session is over: count it out of the nonce key; the last of the job's ranks deletes
    the key and its count, so nothing of ours stays in the job's store.

    Last out, not "whoever wrote it": the first rank to stop cannot know whether a slower rank still has to read
    the nonce (a rank reads it at its first step end after ``init_process_group``); once every one of the
    ``world_size`` ranks has counted itself out, none will. A job where some ranks never trace (or one dies)
    leaves the key and its count (two keys per session) for the store's own end.

    ``store``: the default group's store (None: looked up). Two calls that never wait for a key (``add``,
    ``delete_key``), on the existing connection: a store whose host rank has exited fails at once rather than
    being connected to again. A forked child (a DataLoader worker) that inherited its parent's group counts
    nothing: that group, its store connection and its place in the count are the parent's. Returns True if this
    rank counted itself out (a default group of its own existed and the store answered). Never raises.
    """
    global _sessions_left
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        if _inherited_group is not None and id(dist.GroupMember.WORLD) == _inherited_group:
            return False  # a forked child's copy of its parent's group: the parent counts itself
        world_size = dist.get_world_size()
        store = default_store() if store is None else store
        key = nonce_key()
        _sessions_left += 1  # counted or not (a store gone mid-call): this session's key is not read again
        if int(store.add(f"{key}/left", 1)) >= world_size:
            store.delete_key(key)
            store.delete_key(f"{key}/left")
        return True
    except Exception as error:  # the store may be gone with the job (its host rank exited first)
        _logger.debug("commdebug-otel: could not count this rank out of the job's store: %s", error)
        return False


def step_trace_id(run_id: str, nonce: str, step: int | str, block: int | None = None) -> int:
    """The 128-bit trace id of ``step`` (a step number, or a label such as ``inference-3``).

    The first 16 bytes of SHA-256 over run id, nonce and step, and the trace block when the
    job is cut into blocks (``block`` from :func:`trace_block`; None: one trace for the job).
    """
    key = f"{run_id}/{nonce}/{step}" if block is None else f"{run_id}/{nonce}/{step}/block-{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


def trace_block(rank: int, world_size: int, ranks_per_trace: int) -> int | None:
    """The trace block of ``rank``: ``rank // ranks_per_trace``, or None when the whole job fits in one trace.

    >>> trace_block(5, 8, 16) is None  # a job of at most ranks_per_trace ranks: one trace per step
    True
    >>> [trace_block(rank, 64, 16) for rank in (0, 15, 16, 63)]
    [0, 0, 1, 3]

    Blocks are runs of consecutive ranks: torchrun numbers ranks node by node, and a device
    mesh's last dimension (tensor parallel, usually) is its run of consecutive ranks, so a
    block whose size is a multiple of the ranks per node and of that dimension keeps each
    node and each such group inside one trace.

    Raises:
        ValueError: ``ranks_per_trace`` below 1.
    """
    if ranks_per_trace < 1:
        raise ValueError(f"ranks_per_trace must be at least 1, got {ranks_per_trace!r}")
    if world_size <= ranks_per_trace:
        return None
    return rank // ranks_per_trace


def job_trace_id(info: RankInfo, nonce: str, step: int | str, ranks_per_trace: int) -> tuple[int, int | None]:
    """``(trace id, trace block)`` of ``step`` on the rank ``info`` describes, for trace scope ``job``.

    The block is None when the job is one trace per step (at most ``ranks_per_trace`` ranks).
    """
    block = trace_block(info.rank, info.world_size, ranks_per_trace)
    return step_trace_id(info.run_id, nonce, step, block), block


def outside_step_label(steps_done: int) -> str:
    """The trace label of the ``outside_step`` segments that open after ``steps_done`` training steps,
    for :func:`step_trace_id`.

    >>> outside_step_label(0)  # set-up, before the first step
    'outside-0'

    Ranks agree on it as they agree on step numbers, whatever else one rank does between steps (an
    evaluation on rank 0 alone closes a segment there and not elsewhere): all segments between two
    steps are one trace, with a root span per segment.
    """
    return f"outside-{steps_done}"
