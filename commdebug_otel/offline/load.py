"""The one loader of the offline commands: OTLP-JSON files (or folders of them) to span dicts, sorted by rank
and start time, with what the reader skipped said on stderr for a command.

``summarize``, ``diagnose``, ``perfetto`` and ``report`` read their files here (:func:`load_for_command`);
:func:`load_spans` is the library's entry point (``commdebug_otel.offline.summary.load_spans`` names it too).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

from commdebug_otel.offline.model import is_snapshot
from commdebug_otel.offline.otlp_json import Fold, SpanReader, ranked, spans_from_otlp_json

_log = logging.getLogger(__name__)

__all__ = ["load_for_command", "load_spans", "ranked_spans"]


def load_spans(paths: Iterable[str | os.PathLike], reader: SpanReader | None = None) -> list[dict[str, Any]]:
    """Every span in the OTLP-JSON trace files under ``paths`` (files or folders), each once.

    Read by :class:`commdebug_otel.offline.otlp_json.SpanReader`: what it skips, and why, is in its
    ``messages``; pass ``reader`` to read them, else each is logged as a warning (logger
    ``commdebug_otel.offline.load``). Objects without ``resourceSpans`` (metrics, logs,
    other JSON) are passed over.

    Returns:
        span dicts as :func:`commdebug_otel.offline.otlp_json.spans_from_otlp_json`
        makes them (``start_ns``/``end_ns``/event ``time_ns`` in ns since the Unix epoch,
        ids as lowercase hex), each with ``"rank"`` (int, the resource's
        ``torch.distributed.rank``, 0 when absent) and ``"file"`` added; sorted by
        rank, then start time.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    own = reader is None
    reader = SpanReader(paths) if reader is None else reader
    spans = list(reader)
    if own:  # nobody else will read the reader's messages: log them
        for message in reader.messages:
            _log.warning("commdebug-otel: %s", message)
    spans.sort(key=lambda span: (span["rank"], span["start_ns"]))
    return spans


def ranked_spans(request: dict, source: str, hex_ids: bool = True) -> list[dict[str, Any]]:
    """The spans of one OTLP-JSON ``ExportTraceServiceRequest`` (or ``TracesData``) dict, as :func:`load_spans`
    makes them: each with ``"rank"`` and ``"file"`` = ``source``. ``hex_ids``: as
    :func:`commdebug_otel.offline.otlp_json.parse_otlp_json`.

    Raises:
        commdebug_otel.offline.otlp_json.BadData: as :func:`.otlp_json.spans_from_otlp_json`.
    """
    return ranked(spans_from_otlp_json(request, hex_ids), source)


def load_for_command(paths: Iterable[str], command: str, snapshots: bool = False,
                     fold: Fold | None = None,
                     digests: dict[int, Any] | None = None) -> list[dict[str, Any]] | None:
    """``load_spans(paths)``, or None after telling the user (on stderr) why there is nothing to read.

    What the reader skipped (unreadable files, lines, spans read twice) is said on stderr first, one
    line per file. Large inputs are read by one process per CPU (:class:`.otlp_json.SpanReader`).
    ``snapshots``: keep the spans of stall snapshots (``diagnose``); otherwise they
    are left out, so a step that stalled is counted once, and the user is told how many were left out.
    ``fold``: what the command reads of a span (:class:`.otlp_json.SpanReader`'s ``fold``); where reducing
    the files could change an answer, they are read again whole. ``digests``: filled with the fold's
    digests (``SpanReader.digests``) when the spans returned are the reduced ones; left empty otherwise.
    """
    # The analyses only read spans: modules repeated step after step can share their attributes.
    shared = command in ("summarize", "diagnose")
    reader = SpanReader(paths, workers=None, shared=shared, fold=fold)
    try:
        spans = load_spans(paths, reader)
        if reader.unfoldable:
            spans = []
            reader = SpanReader(paths, workers=None, shared=shared)
            spans = load_spans(paths, reader)
        elif digests is not None:
            digests.update(reader.digests)
    except FileNotFoundError as error:
        print(f"commdebug-otel {command}: {error}", file=sys.stderr)
        return None
    for message in reader.messages:
        print(f"commdebug-otel {command}: {message}", file=sys.stderr)
    if reader.duplicates:
        print(f"commdebug-otel {command}: {reader.duplicates} spans read more than once (the same trace and span "
              "id: a file given twice, a linked copy, repeated lines) are counted once", file=sys.stderr)
    if not spans:
        print(f"commdebug-otel {command}: no spans found (expected OTLP-JSON trace files)", file=sys.stderr)
        return None
    if not snapshots:
        kept = [span for span in spans if not is_snapshot(span)]
        if len(kept) < len(spans):
            print(f"commdebug-otel {command}: {len(spans) - len(kept)} spans of stall snapshots left out "
                  "(`commdebug-otel diagnose` reads them)", file=sys.stderr)
        spans = kept
    return spans
