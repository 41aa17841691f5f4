"""One trace by id from Jaeger's or Tempo's HTTP API, as span dicts (``diagnose --jaeger/--tempo``).

Usage::

    from commdebug_otel.offline import backends, diagnose

    spans = backends.fetch_trace("jaeger", "http://localhost:16686", "4bf92f3577b34da6a3ce929d0e0e4736")
    print(diagnose.format_text(diagnose.diagnose(spans)))

* Jaeger (v2, or v1.x with the api_v3 HTTP gateway): ``GET {url}/api/v3/traces/{id}``, answering
  ``{"result": {"resourceSpans": [...]}}`` with hex ids (OTLP/JSON).
* Tempo: ``GET {url}/api/v2/traces/{id}`` with ``Accept: application/json``, answering
  ``{"trace": {"resourceSpans": [...]}, ...}`` with base64 ids (protobuf's JSON mapping).

With ``OTEL_PYTHON_COMMDEBUG_TRACE_SCOPE=job`` one trace is one training step on every rank
(and its stall snapshots). What it does not do: search, authentication beyond what the URL
carries, or retries. Only the standard library's ``urllib`` is used.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from .summary import ranked_spans

__all__ = ["BACKENDS", "BackendError", "fetch_trace", "trace_url"]

#: Backend -> (path of one trace by id, the key that holds the OTLP ``TracesData``, ids in hex).
BACKENDS = {
    "jaeger": ("/api/v3/traces/{trace_id}", "result", True),
    "tempo": ("/api/v2/traces/{trace_id}", "trace", False),
}


class BackendError(Exception):
    """The backend could not be reached, or did not answer with the trace."""


def trace_url(backend: str, base_url: str, trace_id: str) -> str:
    """The URL of one trace: ``base_url`` (scheme, host, port, any path prefix) and the backend's path.

    Raises:
        ValueError: an unknown backend, or a trace id that is not 32 hex digits.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    trace_id = trace_id.strip().lower()
    if len(trace_id) != 32 or any(c not in "0123456789abcdef" for c in trace_id):
        raise ValueError(f"a trace id is 32 hex digits, got {trace_id!r}")
    return base_url.rstrip("/") + BACKENDS[backend][0].format(trace_id=trace_id)


def fetch_trace(backend: str, base_url: str, trace_id: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The spans of one trace, as :func:`.summary.load_spans` returns them (``"file"`` = the URL).

    ``backend``: ``"jaeger"`` or ``"tempo"``; ``timeout_s``: for connecting and for each read.

    Raises:
        ValueError: as :func:`trace_url`.
        BackendError: unreachable, an HTTP error (404: no such trace), or an answer without the trace.
    """
    url = trace_url(backend, base_url, trace_id)
    _, key, hex_ids = BACKENDS[backend]
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise BackendError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise BackendError(f"{url}: {getattr(error, 'reason', error)}") from None
    except json.JSONDecodeError as error:
        raise BackendError(f"{url}: not JSON ({error})") from None
    traces = body.get(key) if isinstance(body, dict) else None
    if not isinstance(traces, dict) or "resourceSpans" not in traces:
        raise BackendError(f"{url}: no trace in the answer (expected {{\"{key}\": {{\"resourceSpans\": ...}}}})")
    return ranked_spans(traces, url, hex_ids)
