"""``commdebug-otel receive``: a local OTLP receiver that writes what arrives as OTLP-JSON run folders.

For trying OTLP export where no Collector is at hand (a laptop, a login node): the job sends
OTLP/gRPC (port 4317) or OTLP/HTTP (4318) here, and each batch is appended, as one OTLP-JSON
line, to ``OUTPUT_DIR/run-<time>-<service>/{traces,metrics}-rank<N>.jsonl``: the layout of a
job's own file output, so ``summarize``, ``diagnose`` and ``perfetto`` read the folder alike.
One line is printed per batch received; Ctrl-C (or SIGTERM) stops it and prints the totals.

Runs: batches go to one folder per (``service.name``, ``torch.distributed.run_id``) of their
resource; when a rank already seen there arrives from another process (host and pid), a new
job has started and gets a new folder. Two jobs that run at the same time with the same service
name and run id share a folder: give them different ``OTEL_SERVICE_NAME`` values.

Limits and answers: a gRPC message over ``--grpc-max-mib`` (default 4, decompressed) is refused
with RESOURCE_EXHAUSTED, an HTTP body over ``--http-max-mib`` (default 20, as sent or decompressed)
with 413, both before parsing, as a default Collector does; a body that does not parse gets 400
(INVALID_ARGUMENT), a content type or encoding other than protobuf/JSON and gzip/deflate/identity
415. A resource whose ``torch.distributed.rank`` is not an integer from 0 to 2**20 - 1 is not
written: the sender gets an OTLP partial success naming it (``rejected_spans`` /
``rejected_data_points``). Each refusal is one line on stderr. An HTTP connection on which no request begins
within 60 s is closed, as is one whose request headers are not all in within 10 s of their first byte (a client
that trickles them); at most 64 are open at a time (``testing.otlp_receiver``'s ``HTTP_*`` limits).

The servers are :class:`commdebug_otel.testing.otlp_receiver.OtlpReceiver` (plaintext only).
Needs no torch.
"""

from __future__ import annotations

import argparse
import os
import re
import signal as signals
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from commdebug_otel import semconv
from commdebug_otel.offline.otlp_json import ATTRIBUTE_TYPES, BadData, decode_any_value, to_otlp_json

if TYPE_CHECKING:
    from commdebug_otel.testing.otlp_receiver import Rejected

DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_HOST = "127.0.0.1"  # this machine only: nothing is authenticated
DEFAULT_GRPC_MAX_MIB = 4.0  # the Collector's max_recv_msg_size_mib
DEFAULT_HTTP_MAX_MIB = 20.0  # the Collector's max_request_body_size


@dataclass
class _Run:
    folder: str
    processes: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (host.name, process.pid)


@dataclass
class Totals:
    """What a :class:`RunFolders` wrote: batches (requests), spans, metric data points, and the folders;
    ``rejected``: spans and points not written (their resource's rank is not a rank)."""

    batches: int = 0
    spans: int = 0
    points: int = 0
    rejected: int = 0
    folders: list[str] = field(default_factory=list)


def _rank(attributes: dict[str, Any]) -> int:
    """The resource's rank (0 when it has none), as the offline reader checks it.

    Raises:
        BadData: not an integer from 0 to ``MAX_RANKS - 1`` (a decimal string is read as one).
    """
    value = attributes.get(semconv.RANK)
    return 0 if value is None else ATTRIBUTE_TYPES[semconv.RANK](value, f"resource attribute {semconv.RANK}")


def _items(signal: str, resource: Any) -> int:
    """Spans, or metric data points, of one ResourceSpans / ResourceMetrics message."""
    if signal == "traces":
        return sum(len(scope.spans) for scope in resource.scope_spans)
    return sum(len(getattr(metric, metric.WhichOneof("data")).data_points)
               for scope in resource.scope_metrics for metric in scope.metrics if metric.WhichOneof("data"))


class RunFolders:
    """Appends each received request, split by resource, to its run folder's per-rank file; says one line per batch.

    Args:
        output_dir: where run folders are made (created if missing).
        out: where the lines go (default stdout).
    """

    def __init__(self, output_dir: str, out: TextIO | None = None) -> None:
        self.output_dir = os.path.abspath(os.path.expanduser(output_dir))
        self._out = out if out is not None else sys.stdout
        self._runs: dict[tuple[str, str], list[_Run]] = {}
        self._lock = threading.Lock()  # requests arrive on several server threads
        self.totals = Totals()

    def _run_for(self, attributes: dict[str, Any], rank: int) -> _Run:
        key = (str(attributes.get(semconv.SERVICE_NAME, "unknown_service")), str(attributes.get(semconv.RUN_ID, "")))
        process = (str(attributes.get(semconv.HOST_NAME, "")), str(attributes.get(semconv.PROCESS_PID, "")))
        runs = self._runs.setdefault(key, [])
        for run in reversed(runs):
            if run.processes.get(rank) == process:
                return run
        if runs and rank not in runs[-1].processes:
            run = runs[-1]
        else:  # first sight, or this rank came back from another process: a new job
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", key[0])[:40]
            folder = os.path.join(self.output_dir, f"run-{time.strftime('%Y%m%d-%H%M%S')}-{name}")
            suffix = 1
            while os.path.exists(folder if suffix == 1 else f"{folder}-{suffix}"):
                suffix += 1
            run = _Run(folder if suffix == 1 else f"{folder}-{suffix}")
            os.makedirs(run.folder, mode=0o700)
            runs.append(run)
            self.totals.folders.append(run.folder)
        run.processes[rank] = process
        return run

    def write(self, received: Any) -> Rejected | None:
        """Write one :class:`~commdebug_otel.testing.otlp_receiver.ReceivedRequest`; print its line.

        Returns what was not written (spans or data points of resources whose rank is not a rank,
        and why), for the sender's partial-success answer; None when all of it was.

        Raises:
            OSError: a folder or file cannot be made or written (what was written before stays).
        """
        from commdebug_otel.testing.otlp_receiver import Rejected

        signal = received.signal
        unit = "span(s)" if signal == "traces" else "point(s)"
        resources = received.request.resource_spans if signal == "traces" else received.request.resource_metrics
        said: list[str] = []
        rejected, reasons = 0, []
        with self._lock:
            for resource in resources:
                attributes = {kv.key: decode_any_value(kv.value) for kv in resource.resource.attributes}
                try:
                    rank = _rank(attributes)
                except BadData as error:
                    count = _items(signal, resource)
                    rejected += count
                    reasons.append(str(error))
                    said.append(f"{count} {unit} not written: {error}")
                    continue
                run = self._run_for(attributes, rank)
                part = type(received.request)()
                (part.resource_spans if signal == "traces" else part.resource_metrics).append(resource)
                path = os.path.join(run.folder, f"{signal}-rank{rank}.jsonl")
                with open(path, "a", encoding="utf-8") as handle:
                    handle.write(to_otlp_json(part) + "\n")
                count = _items(signal, resource)
                if signal == "traces":
                    self.totals.spans += count
                else:
                    self.totals.points += count
                said.append(f"rank {rank}: {count} {unit} -> {os.path.relpath(path)}")
            self.totals.batches += 1
            self.totals.rejected += rejected
            print(f"{time.strftime('%H:%M:%S')} {signal} over {received.transport}, "
                  f"{received.size_bytes / 1024:.1f} KiB: {'; '.join(said) or 'empty'}", file=self._out, flush=True)
        if not reasons:
            return None
        more = f" (and {len(reasons) - 1} more resource(s))" if len(reasons) > 1 else ""
        return Rejected(rejected, f"not written: {reasons[0]}{more}")


def _mib(text: str) -> float:
    from commdebug_otel.testing.otlp_receiver import MAX_LIMIT_BYTES

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value * (1 << 20) <= MAX_LIMIT_BYTES:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number of MiB > 0 and < 2048, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``receive``'s arguments to ``parser``."""
    from commdebug_otel.config import read_option

    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                        help=f"OTLP/gRPC port (default {DEFAULT_GRPC_PORT}; 0 = any free port)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"OTLP/HTTP port (default {DEFAULT_HTTP_PORT}; 0 = any free port)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}, this machine only; 0.0.0.0 for every "
                             "interface: nothing is authenticated or encrypted)")
    parser.add_argument("--grpc-max-mib", type=_mib, default=DEFAULT_GRPC_MAX_MIB, metavar="MIB",
                        help=f"the largest OTLP/gRPC message, decompressed (default {DEFAULT_GRPC_MAX_MIB:g}, "
                             "the Collector's); a larger one is refused with RESOURCE_EXHAUSTED")
    parser.add_argument("--http-max-mib", type=_mib, default=DEFAULT_HTTP_MAX_MIB, metavar="MIB",
                        help=f"the largest OTLP/HTTP body, as sent and decompressed (default "
                             f"{DEFAULT_HTTP_MAX_MIB:g}, the Collector's); a larger one is answered 413")
    parser.add_argument("-o", "--output-dir", default=read_option("output_dir"),
                        help="where run folders are written (default OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR, "
                             "else ./commdebug-otel-out)")
    parser.epilog = (
        "then run the job with OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317 (or http://localhost:4318 and "
        "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf), and read the folder with "
        "commdebug-otel summarize|diagnose|perfetto")


def run(args: argparse.Namespace) -> int:
    """Receive until Ctrl-C or SIGTERM. Returns 0, or 1 when a port cannot be bound."""
    from commdebug_otel.testing.otlp_receiver import OtlpReceiver

    folders = RunFolders(args.output_dir)
    receiver = OtlpReceiver(host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                            on_request=folders.write, keep=False,
                            max_receive_message_bytes=max(1, int(args.grpc_max_mib * (1 << 20))),
                            max_http_body_bytes=max(1, int(args.http_max_mib * (1 << 20))))
    try:
        receiver.start()
    except OSError as error:
        print(f"commdebug-otel receive: {error}; choose others with --grpc-port / --http-port", file=sys.stderr)
        return 1
    print(f"receiving OTLP/gRPC on {receiver.grpc_endpoint} and OTLP/HTTP on {receiver.http_endpoint}, writing "
          f"run folders under {folders.output_dir}; Ctrl-C stops", flush=True)
    stop = threading.Event()
    previous = signals.signal(signals.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()
        signals.signal(signals.SIGTERM, previous)
    totals = folders.totals
    print(f"stopped: {totals.batches} batch(es), {totals.spans} span(s), {totals.points} metric point(s)"
          + (f", {totals.rejected} not written" if totals.rejected else "")
          + (f", {receiver.refused} request(s) refused" if receiver.refused else "")
          + "".join(f"\n  {os.path.relpath(folder)}" for folder in totals.folders), flush=True)
    return 0
