"""Offline views of exported telemetry: read OTLP-JSON files without torch or a live job.

Usage::

    from commdebug_otel.offline import diagnose, perfetto, summary

    spans = summary.load_spans(["commdebug-otel-out/run-20261130-111620-a81b07d2"])
    print(summary.format_report(spans, rank=0))      # ``commdebug-otel summarize``
    print(diagnose.format_text(diagnose.diagnose(spans)))  # ``commdebug-otel diagnose``
    perfetto.write_chrome_trace(spans, "trace.json")  # ``commdebug-otel perfetto``

Modules:

* :mod:`.otlp_json`: OTLP-JSON lines and OTLP protobuf requests as plain span and metric dicts;
  the one reader of files (:class:`.otlp_json.SpanReader`: streamed, every field checked,
  what cannot be read skipped and said once per file);
* :mod:`.model`: the span model the views share: span index (loops broken, no recursion),
  steps, collective matching across ranks, a collective's arrival (issue time);
* :mod:`.summary`: per-module collective counts (torch ``CommDebugMode``'s table and JSON tree,
  rendered by :mod:`commdebug_otel.compat.report`), per-rank totals, stragglers, top collectives;
* :mod:`.diagnose`: stuck ranks (stall snapshots), desyncs, stragglers blamed with the module
  that held them back;
* :mod:`.backends`: one trace by id from Jaeger's or Tempo's HTTP API (``diagnose --jaeger/--tempo``);
* :mod:`.perfetto`: Chrome trace-event JSON for https://ui.perfetto.dev;
* :mod:`.html_report`: ``commdebug-otel report``, one self-contained HTML page of a run;
* :mod:`.receive`: ``commdebug-otel receive``, a local OTLP receiver writing run folders;
* :mod:`.signature`: ``commdebug-otel signature``, a run's communication signature (collectives and bytes per
  step, per module, pass, op, group, dtype and cause), and the diff of two (:mod:`.compare`:
  ``commdebug-otel compare``).

Exit statuses of the commands that read files (docs/offline.md, "Exit status"): :data:`EXIT_DONE`,
:data:`EXIT_NOT_THERE` (the input was read but holds nothing of what was asked, or the output cannot be
written; ``compare``: the two differ) and :data:`EXIT_UNREADABLE` (the input gives nothing to read, or the
command line names none, as argparse's own usage errors).

Nothing here imports torch, the OTel SDK or the live tracer; importing this
package imports none of its modules.
"""

import sys

__all__ = ["EXIT_DONE", "EXIT_NOT_THERE", "EXIT_UNREADABLE", "backends", "compare", "diagnose", "html_report",
           "model", "otlp_json", "perfetto", "receive", "signature", "summary", "write_output"]

EXIT_DONE = 0
#: ``summarize --rank``/``--step`` not in the files, an output file that cannot be written (``compare``: different).
EXIT_NOT_THERE = 1
#: A missing path, no spans found (an empty folder, only garbage), spans of several runs mixed, a trace not
#: fetched from Jaeger/Tempo, or no input named: what argparse returns for a usage error too.
EXIT_UNREADABLE = 2


def write_output(command: str, path: str, text: str) -> int:
    """Write ``text`` to ``path`` (UTF-8) for ``commdebug-otel command``: :data:`EXIT_DONE`, or
    :data:`EXIT_NOT_THERE` after one line on stderr when it cannot be written."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as error:
        print(f"commdebug-otel {command}: cannot write {path}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_THERE
    return EXIT_DONE
