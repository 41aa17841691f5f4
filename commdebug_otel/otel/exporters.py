"""The exporters our own providers get: OTLP (gRPC or HTTP), the OTLP-JSON files of a run folder, console;
each guarded (``export_guard``), and, once per process, the line that says tracing is on and where it sends."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from commdebug_otel.config import ExportEnv, Settings, variable
from commdebug_otel.core.ids import RNG as OWN_RNG
from commdebug_otel.core.job_identity import RankInfo
from commdebug_otel.core.redact import describe, hide_credentials
from commdebug_otel.otel._sdk import jitter_from, json_file_encoder, replace_json_file_encoder, translate_data_with
from commdebug_otel.otel.export_guard import (
    CountingMetricExporter,
    SizedSpanExporter,
    WholeLineFile,
    claim_warning,
    fold_exporter_logs,
)

_logger = logging.getLogger(__name__)


# Metric requests: at most this many data points (a few hundred bytes each) per request.
METRIC_EXPORT_BATCH_POINTS = 2000


# (signal, kind) -> (module, class): imported only when chosen.
_EXPORTER_CLASSES = {
    ("traces", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("traces", "http"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
    ("traces", "file"): ("opentelemetry.exporter.otlp.json.file", "FileSpanExporter"),
    ("traces", "console"): ("opentelemetry.sdk.trace.export", "ConsoleSpanExporter"),
    ("metrics", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "http"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "file"): ("opentelemetry.exporter.otlp.json.file", "FileMetricExporter"),
    ("metrics", "console"): ("opentelemetry.sdk.metrics.export", "ConsoleMetricExporter"),
}


def exporter_class(signal: str, kind: str) -> Any:
    """The SDK's exporter class for ``signal`` (traces, metrics) and ``kind`` (grpc, http, file, console),
    imported now; our span encodings where the SDK gives a seam for them. Raises KeyError for another pair."""
    import importlib

    module, name = _EXPORTER_CLASSES[(signal, kind)]
    exporter = getattr(importlib.import_module(module), name)
    if (signal, kind) == ("traces", "grpc"):
        return memoized_encoding(exporter)
    if (signal, kind) == ("traces", "file"):
        return _memoized_json_encoding(exporter)
    return exporter


@functools.cache
def memoized_encoding(exporter: type) -> type:
    """``exporter`` (the SDK's OTLP/gRPC span exporter) encoding with :func:`commdebug_otel.otel.encoding.encode_spans`.

    The SDK's gRPC exporter builds each request with ``self._translate_data(spans)``, its
    seam for this. The HTTP exporter calls its module's ``encode_spans`` inside ``export()``
    and has no such seam, so it keeps the SDK's encoding. ``request_bytes`` lets
    ``SizedSpanExporter`` size a batch by encoding it, once: the export sends that encoding.
    """
    from commdebug_otel.otel import encoding

    class MemoizedSpanExporter(exporter):
        _encoded: tuple[Any, Any] | None = None  # (spans, request) of the batch request_bytes sized

        def request_bytes(self, spans: Any, limit: int) -> int:
            """The exact size of ``spans``' request, in bytes. If it is at most ``limit``, an :meth:`export`
            of that same sequence next sends this encoding instead of making another (``SizedSpanExporter``
            sizes every batch); a larger one is not kept (the batch is split and encoded anew)."""
            request = encoding.encode_spans(spans)
            size = request.ByteSize()
            self._encoded = (spans, request) if size <= limit else None
            return size

        def encode_request(self, data: Any) -> Any:
            encoded = self._encoded
            return encoded[1] if encoded is not None and encoded[0] is data else encoding.encode_spans(data)

        def export(self, spans: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().export(spans, *args, **kwargs)
            finally:
                self._encoded = None  # retries are over: the request is not kept past its export

    translate_data_with(MemoizedSpanExporter, MemoizedSpanExporter.encode_request)
    MemoizedSpanExporter.__qualname__ = MemoizedSpanExporter.__name__ = f"Memoized{exporter.__name__}"
    return MemoizedSpanExporter


@functools.cache
def _memoized_json_encoding(exporter: type) -> type:
    """``exporter`` (the SDK's OTLP-JSON file span exporter) writing the lines of
    :func:`commdebug_otel.otel.encoding.encode_spans_json`: the same lines, in about 40% of the time.

    The SDK's file exporter keeps its encoder as ``self._exporter._encode`` and dumps the dict
    it returns to its stream; ours is the line itself, so it writes the line to that stream and
    returns None (nothing more to write). Where a version keeps either elsewhere, its own encoding stays.
    """
    from commdebug_otel.otel.encoding import encode_spans_json

    class MemoizedFileSpanExporter(exporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            found = json_file_encoder(self)
            if found is not None:
                holder, stream = found

                def write_line(spans: Any) -> None:
                    line = encode_spans_json(spans)
                    if line is not None and not getattr(stream, "closed", False):  # closed: the exporter says so
                        stream.write(line + "\n")  # the exporter then flushes the stream

                replace_json_file_encoder(holder, write_line)

    MemoizedFileSpanExporter.__qualname__ = MemoizedFileSpanExporter.__name__ = f"Memoized{exporter.__name__}"
    return MemoizedFileSpanExporter


def exporter_arguments(export: ExportEnv, signal: str, transport: str) -> dict[str, Any]:
    """:meth:`ExportEnv.exporter_arguments`, with the compression as ``transport``'s exporter takes it."""
    arguments = export.exporter_arguments(signal)
    if "compression" in arguments:
        if transport == "grpc":
            from grpc import Compression
        else:
            from opentelemetry.exporter.otlp.proto.http import Compression
        arguments["compression"] = Compression.NoCompression
    return arguments


class Exporters:
    """Makes the exporters of one telemetry's providers.

    Args:
        settings: ``output_dir`` and ``ranks``.
        count_dropped: ``count_dropped(kind, count)``, what the guards drop.

    Attributes:
        endpoints: OTLP endpoints in use, for warnings.
        file_directory: where the embedded default writes, once known.
        span_guards: our span exporters' guards (unsent spans at exit).
    """

    def __init__(self, settings: Settings, count_dropped: Callable[[str, int], None]) -> None:
        self._settings = settings
        self._count_dropped = count_dropped
        self.endpoints: list[str] = []
        self.file_directory: str | None = None
        self.span_guards: list[SizedSpanExporter] = []
        self._said_where = False  # that tracing is on, and where it sends, was said (once per process)

    def _file_path(self, signal: str, rank: RankInfo, export: ExportEnv) -> str | None:
        """``OUTPUT_DIR/run-<job id>/<signal>-rank<N>.jsonl``: one folder per run, shared by its ranks.

        None (said once, naming the variable) when the folder cannot be made.
        """
        directory = self._run_directory()
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)  # owner only: the files name hosts and modules
        except OSError as error:
            if claim_warning(f"output folder {directory}"):
                _logger.warning("commdebug-otel: cannot write OTLP-JSON files to %s "
                                "(OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR=%s): %s; spans and metrics that would go "
                                "there are not exported, training continues", directory,
                                self._settings.output_dir, describe(error, values=False))
            return None
        return os.path.join(directory, f"{signal}-rank{rank.rank}.jsonl")

    def run_directory(self) -> str:
        """``OUTPUT_DIR/run-<job id>``, the folder the run's OTLP-JSON files go to (not made here)."""
        return self._run_directory()

    def _run_directory(self) -> str:
        """``OUTPUT_DIR/run-<job id>``, the folder the run's OTLP-JSON files go to (not made here)."""
        if self.file_directory is None:
            from commdebug_otel.core.job_identity import job_nonce

            self.file_directory = os.path.join(
                os.path.abspath(os.path.expanduser(self._settings.output_dir)), f"run-{job_nonce()}")
        return self.file_directory

    def say_where(self, rank: RankInfo, export: ExportEnv) -> None:
        """Once per process, as its first provider starts: that tracing is on and where each signal goes, in
        one line (WARNING on local rank 0, so once per job on each node; DEBUG elsewhere); and a second when
        ``RANKS`` names ranks the job does not have."""
        if self._said_where:
            return
        self._said_where = True
        log = _logger.warning if rank.local_rank == 0 else _logger.debug
        places: dict[tuple[str, str], list[str]] = {}  # (verb, where) -> signals, in the order first named
        for kind in ("traces", "metrics"):
            for name in export.exporter_names(kind):
                if name == "otlp":
                    place = ("sending", f"as OTLP ({export.otlp_protocol(kind)}) to "
                                        f"{hide_credentials(export.otlp_endpoint(kind))}")
                elif name == "prometheus":
                    place = ("serving", "for Prometheus to scrape")
                elif name == "file":
                    if self._file_path(kind, rank, export) is None:  # makes the folder now, whichever
                        continue  # signal's provider starts first; if it cannot, that warning names the variable
                    place = ("writing", f"as OTLP-JSON lines to {self._run_directory()}")
                elif name != "none":
                    place = ("exporting", f"to {name}")
                else:
                    continue
                places.setdefault(place, []).append(kind)
        files = places.get(("writing", f"as OTLP-JSON lines to {self.file_directory}"), [])
        unset = [kind for kind in files if not (export.endpoint or export.signal(kind).endpoint)]
        why = ""
        if unset:
            variables = " or ".join(f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT" for kind in unset)
            why = (f" (no OTLP endpoint for {' and '.join(unset)}: set OTEL_EXPORTER_OTLP_ENDPOINT or {variables} "
                   "to send to a collector)")
        # Files last: the hint about an endpoint is theirs.
        said = [f"{verb} {' and '.join(kinds)} {where}"
                for (verb, where), kinds in sorted(places.items(), key=lambda item: item[0][0] == "writing")]
        spans_from = "" if self._settings.ranks is None else \
            f", spans from rank(s) {','.join(map(str, sorted(self._settings.ranks)))} only"
        if said or (not places and all(export.exporter_names(kind) == ["none"] for kind in ("traces", "metrics"))):
            log("commdebug-otel: tracing is on (%d rank(s)%s): %s%s", rank.world_size, spans_from,
                "; ".join(said) or "exporting nothing (OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER are none)",
                why)
        outside = self._settings.ranks_outside(rank.world_size)
        if outside:
            (_logger.warning if rank.rank == 0 else _logger.debug)(
                "commdebug-otel: %s names rank(s) %s, outside this job's %d rank(s) (0-%d): they trace nothing",
                variable("ranks"), ",".join(map(str, outside)), rank.world_size, rank.world_size - 1)

    def make(self, signal: str, rank: RankInfo, export: ExportEnv) -> list[Any]:
        """The exporters ``OTEL_{signal}_EXPORTER`` names (after the embedded default)."""
        exporters: list[Any] = []
        for name in export.exporter_names(signal):
            if name == "otlp":
                fold_exporter_logs()
                endpoint = export.otlp_endpoint(signal)
                self.endpoints.append(endpoint)
                transport = "http" if export.otlp_protocol(signal).startswith("http") else "grpc"
                arguments = exporter_arguments(export, signal, transport)
                if signal == "traces":
                    inner = exporter_class(signal, transport)(endpoint=endpoint, **arguments)
                    exporter: Any = SizedSpanExporter(inner, endpoint, self._count_dropped)
                else:
                    inner = exporter_class(signal, transport)(
                        endpoint=endpoint, max_export_batch_size=METRIC_EXPORT_BATCH_POINTS, **arguments)
                    exporter = CountingMetricExporter(inner, endpoint, self._count_dropped)
                jitter_from(inner, OWN_RNG)  # retries after a failed export: not the script's random numbers
                exporters.append(exporter)
            elif name == "file":
                fold_exporter_logs()
                path = self._file_path(signal, rank, export)
                if path is None:
                    continue
                guard = SizedSpanExporter if signal == "traces" else CountingMetricExporter
                extra = {"max_request_bytes": None} if signal == "traces" else {}
                stream = WholeLineFile(path)
                exporters.append(guard(exporter_class(signal, "file")(stream=stream),
                                       path, self._count_dropped, closes=stream, **extra))
            elif name == "console":
                exporters.append(exporter_class(signal, "console")())
            elif name != "none" and not (signal == "metrics" and name == "prometheus"):
                choices = ", prometheus" if signal == "metrics" else ""
                _logger.warning("commdebug-otel: ignoring OTEL_%s_EXPORTER value %r: "
                                "expected otlp%s, file, console or none", signal.upper(), name, choices)
        self.span_guards.extend(exporter for exporter in exporters if isinstance(exporter, SizedSpanExporter))
        return exporters
