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

Nothing here imports torch, the OTel SDK or the live tracer; importing this
package imports none of its modules.
"""

__all__ = ["backends", "compare", "diagnose", "html_report", "model", "otlp_json", "perfetto", "receive", "signature",
           "summary"]
