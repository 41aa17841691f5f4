"""A communication signature recorded live: what one block of code issues, on every rank.

Usage::

    from commdebug_otel.testing.signatures import record_signature

    with record_signature() as recording:
        model(batch).sum().backward()
        optimizer.step()
    print(recording.signature)   # {"format": "commdebug-otel.signature/2", "entries": [...], ...}

The block runs under a private :class:`~commdebug_otel.CommTracer` (every step traced, in-memory
providers: nothing is exported); its spans go through the OTLP-JSON encoding and the offline
reader's decoding, then :func:`commdebug_otel.offline.signature.tally_spans` with ``whole=True``:
everything the block issued, step by step (at least 1 step; set-up before the block's first step
is part of that step), read as a typical step and the first and last steps' differences from it. In a job of several
ranks, every rank's tally is gathered (``all_gather_object`` on the default group, after the
block, so it is not recorded), and every rank gets the job's signature. The pytest fixture
``comm_signature`` (:mod:`commdebug_otel.pytest_plugin`) is built on it.

What it does not do: record while another commdebug-otel tracer exports in this process
(``OTEL_PYTHON_COMMDEBUG_ENABLED``, ``opentelemetry-instrument``): :class:`RuntimeError`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from commdebug_otel.config import Settings
from commdebug_otel.offline.otlp_json import spans_from_otlp_json
from commdebug_otel.offline.signature import Tally, build, tally_spans
from commdebug_otel.otel.encoding import encode_spans_json
from commdebug_otel.testing import InMemoryTelemetry
from commdebug_otel.tracer import CommTracer, exporting_tracer

__all__ = ["SignatureRecording", "record_signature"]


class SignatureRecording:
    """Context manager: records the collectives of its block; :attr:`signature` once it exits.

    Args:
        gather: in a job of several ranks, gather every rank's tally into one job signature
            (every rank must then exit the block; the gathering is a collective on the default group).
            False: this rank's entries only, as rank 0 of a job of one (the same document on every
            rank of a symmetric job).
        times: add the signature's ``times`` section.

    Attributes:
        signature: the signature document, or None until the block exited without raising.

    Raises:
        RuntimeError: on entry, when another commdebug-otel tracer exports in this process.
    """

    def __init__(self, gather: bool = True, times: bool = False) -> None:
        self._gather = gather
        self._times = times
        self._telemetry: InMemoryTelemetry | None = None
        self._tracer: CommTracer | None = None
        self.signature: dict[str, Any] | None = None

    def __enter__(self) -> SignatureRecording:
        if exporting_tracer() is not None:
            raise RuntimeError("commdebug-otel: cannot record a communication signature while a commdebug-otel "
                               "tracer exports in this process (OTEL_PYTHON_COMMDEBUG_ENABLED, "
                               "opentelemetry-instrument, CommTracer): record without it")
        self.signature = None
        self._telemetry = InMemoryTelemetry()
        # Every step traced, whatever the environment says: the signature must see them all.
        self._tracer = CommTracer(Settings(), tracer_provider=self._telemetry.tracer_provider,
                                  meter_provider=self._telemetry.meter_provider)
        self._tracer.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        tracer, telemetry = self._tracer, self._telemetry
        self._tracer = self._telemetry = None
        if tracer is None or telemetry is None:
            return
        tracer.stop()
        if exc_type is not None:
            return  # other ranks may never reach the gathering: do not wait for them
        distributed = self._gather and dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        line = encode_spans_json(telemetry.spans())
        spans = spans_from_otlp_json(line) if line is not None else []
        for span in spans:
            span["rank"] = rank
        tallies = {rank: tally_spans(spans, whole=True, times=self._times).get(rank) or Tally(steps={0: {}})}
        world_size = dist.get_world_size() if distributed else 1
        if world_size > 1:
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, (rank, tallies[rank]))
            tallies = dict(gathered)
        self.signature = build(tallies, world_size, self._times)


def record_signature(gather: bool = True, times: bool = False) -> SignatureRecording:
    """A :class:`SignatureRecording` (see there); ``with record_signature() as recording: ...``."""
    return SignatureRecording(gather=gather, times=times)
