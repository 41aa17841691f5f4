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
(and its stall snapshots). The answer is read as :mod:`.otlp_json` reads files (every field
checked); a span that fails the checks fails the whole trace, with the reason.

Bounds: one deadline for the whole fetch (connecting, redirects, headers and body:
``timeout_s``, :data:`DEADLINE_S` by default; a server that sends a byte every few seconds is
cut off there), and at most ``max_bytes`` (:data:`MAX_RESPONSE_BYTES`) of answer, read in
chunks. At most :data:`MAX_REDIRECTS` redirects. Credentials: a URL's ``user:password@`` is
sent as HTTP basic authentication (not to a host it redirects to); query parameters (tokens)
are sent as given. Neither is ever printed: messages and each span's ``"file"`` carry the
URL with the userinfo and every query value replaced by ``***`` (:func:`redact_url`).

What it does not do: search, other authentication, or retries. Only the standard library's
``urllib`` is used.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from commdebug_otel.offline.otlp_json import BadData, ranked, spans_from_otlp_json

__all__ = ["BACKENDS", "DEADLINE_S", "MAX_REDIRECTS", "MAX_RESPONSE_BYTES", "BackendError", "fetch_trace",
           "redact_url", "trace_url"]

#: Backend -> (path of one trace by id, the key that holds the OTLP ``TracesData``, ids in hex).
BACKENDS = {
    "jaeger": ("/api/v3/traces/{trace_id}", "result", True),
    "tempo": ("/api/v2/traces/{trace_id}", "trace", False),
}
#: Seconds one fetch may take in all, by default.
DEADLINE_S = 60.0
#: The largest answer read, by default (bytes): one step of a 1,024-rank job is about 60 MiB of OTLP-JSON.
MAX_RESPONSE_BYTES = 512 << 20
#: Redirects followed before giving up.
MAX_REDIRECTS = 5
_CHUNK = 1 << 20


class BackendError(Exception):
    """The backend could not be reached, or did not answer with the trace (the message has no credentials)."""


def redact_url(url: str) -> str:
    """``url`` with its userinfo and every query value replaced by ``***``, without a fragment.

    >>> redact_url("https://me:secret@host:3200/t?token=abc&x=")
    'https://***@host:3200/t?token=***&x=***'
    """
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        netloc = f"***@{host}" if "@" in parts.netloc else host
        query = "&".join(f"{item.partition('=')[0]}=***" for item in parts.query.split("&") if item) \
            if parts.query else ""
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return "(a URL that cannot be parsed)"


def trace_url(backend: str, base_url: str, trace_id: str) -> str:
    """The URL of one trace: ``base_url`` (scheme, host, port, any path prefix and query) with the
    backend's path appended to its path (the query, e.g. a token, stays the query).

    Raises:
        ValueError: an unknown backend, a URL that is not http(s), or a trace id that is not 32 hex digits.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    trace_id = trace_id.strip().lower()
    if len(trace_id) != 32 or any(c not in "0123456789abcdef" for c in trace_id):
        raise ValueError(f"a trace id is 32 hex digits, got {trace_id!r}")
    try:
        parts = urllib.parse.urlsplit(base_url.strip())
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise ValueError(f"not a URL: {redact_url(base_url)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a backend URL is http://HOST[:PORT][/PREFIX] or https://..., got {redact_url(base_url)}")
    path = parts.path.rstrip("/") + BACKENDS[backend][0].format(trace_id=trace_id)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class _Deadline:
    """Shuts every socket of one fetch down when its time is up, wherever the fetch is blocked."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _opener(deadline: _Deadline, redirects: list[str]) -> urllib.request.OpenerDirector:
    """urllib's opener whose connections the deadline can cut, and whose redirects are counted."""
    class Bounded:
        def connect(self) -> None:
            super().connect()  # type: ignore[misc]
            deadline.attach(self.sock)  # type: ignore[attr-defined]

    plain = type("Connection", (Bounded, http.client.HTTPConnection), {})
    secure = type("SecureConnection", (Bounded, http.client.HTTPSConnection), {})

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(plain, req)  # type: ignore[arg-type]  # a connection class, as urllib takes

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(secure, req, context=self._context)  # type: ignore[arg-type, attr-defined]

    class Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = MAX_REDIRECTS
        max_repeats = 1

        def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
            redirects.append(newurl)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return urllib.request.build_opener(Http, Https, Redirects)


def _request(url: str) -> urllib.request.Request:
    """A GET of ``url`` with its userinfo moved to an Authorization header that no redirect carries."""
    parts = urllib.parse.urlsplit(url)
    request = urllib.request.Request(
        urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, "")),
        headers={"Accept": "application/json"})
    if "@" in parts.netloc:
        user = urllib.parse.unquote(parts.username or "")
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        request.add_unredirected_header("Authorization", f"Basic {token}")
    return request


def _read(response: Any, max_bytes: int, shown: str) -> bytes:
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BackendError(f"{shown}: the answer is {int(length)} bytes, over the limit of {max_bytes} "
                           "(diagnose --backend-max-mib raises it)")
    chunks, total = [], 0
    while chunk := response.read(_CHUNK):
        total += len(chunk)
        if total > max_bytes:
            raise BackendError(f"{shown}: the answer is over the limit of {max_bytes} bytes "
                               "(diagnose --backend-max-mib raises it)")
        chunks.append(chunk)
    return b"".join(chunks)


def fetch_trace(backend: str, base_url: str, trace_id: str, timeout_s: float = DEADLINE_S,
                max_bytes: int = MAX_RESPONSE_BYTES) -> list[dict[str, Any]]:
    """The spans of one trace, as :func:`.summary.load_spans` returns them (``"file"`` = the URL, redacted).

    ``backend``: ``"jaeger"`` or ``"tempo"``; ``timeout_s``: seconds for the whole fetch (connect,
    redirects, headers, body); ``max_bytes``: the largest answer read.

    Raises:
        ValueError: as :func:`trace_url`.
        BackendError: unreachable, out of time, an HTTP error (404: no such trace), a redirect loop, an
            answer over ``max_bytes``, or an answer without the trace or with a span that fails the checks.
    """
    url = trace_url(backend, base_url, trace_id)
    shown = redact_url(url)
    _, key, hex_ids = BACKENDS[backend]
    redirects: list[str] = []
    deadline = _Deadline(timeout_s)
    started = time.monotonic()
    late = BackendError(f"{shown}: no whole answer within {timeout_s:g} s (diagnose --backend-timeout raises it)")
    try:
        with _opener(deadline, redirects).open(_request(url), timeout=timeout_s) as response:
            raw = _read(response, max_bytes, shown)
    except urllib.error.HTTPError as error:
        if 300 <= error.code < 400:
            raise BackendError(f"{shown}: HTTP {error.code}: {_redirects(url, redirects)}") from None
        raise BackendError(f"{shown}: HTTP {error.code} {_reason(error)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        if deadline.expired or time.monotonic() - started >= timeout_s:
            raise late from None
        raise BackendError(f"{shown}: {getattr(error, 'reason', None) or error}") from None
    finally:
        deadline.cancel()
    if deadline.expired:  # the socket was shut down mid-body: what came is cut short
        raise late
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise BackendError(f"{shown}: not JSON ({getattr(error, 'msg', 'nested too deep')})") from None
    traces = body.get(key) if isinstance(body, dict) else None
    if not isinstance(traces, dict) or "resourceSpans" not in traces:
        raise BackendError(f"{shown}: no trace in the answer (expected {{\"{key}\": {{\"resourceSpans\": ...}}}})")
    try:
        return ranked(spans_from_otlp_json(traces, hex_ids), shown)
    except BadData as error:
        raise BackendError(f"{shown}: a span cannot be read: {error}") from None


def _redirects(url: str, redirects: list[str]) -> str:
    """What the redirects did, with each hop's URL redacted."""
    hops = [url, *redirects]
    first = next((i for i, hop in enumerate(hops) if hop in hops[:i]), None)
    if first is not None:
        chain = " -> ".join(redact_url(hop) for hop in hops[:first + 1])
        return f"a redirect loop: {chain}"
    chain = " -> ".join(redact_url(hop) for hop in hops)
    return f"more than {MAX_REDIRECTS} redirects: {chain}"


def _reason(error: urllib.error.HTTPError) -> str:
    reason = str(error.reason or "")
    return reason if len(reason) <= 200 else reason[:197] + "..."

