"""No tensor value leaves the process: exception messages and stack traces as we export and log them.

A forward that raises ``ValueError(f"activation out of range: {x}")`` carries
the tensor's values in its message, and a formatted traceback repeats the
message and the source lines. What we export and log of an exception is
therefore built here:

* ``exception.type``: the exception's class name (as the OTel SDK records it);
* ``exception.message``: its message with every tensor or array repr, every
  number (integers too: token ids and labels are tensor values, and a shape
  cannot be told from them) and every bytes literal replaced by ``<values>``
  (``redacted``, the default; digits inside names such as ``conv2d`` or
  ``layers.0`` stay), the message as it is (``full``, an opt-in), or nothing
  (``none``). Only the first 4,096 characters are read, in time linear in them;
* ``exception.stacktrace``: code locations only (``File "...", line N, in f``),
  never source lines, locals or the message.

Pure Python, no torch import.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from commdebug_otel import semconv

REDACTED = "<values>"

# A repr that opens with one of these names and a parenthesis is a value dump to its closing parenthesis.
_VALUE_CALL = re.compile(r"\b(?:tensor|Tensor|DTensor|AsyncCollectiveTensor|Parameter|array|ndarray|matrix)\(")
# Every number: decimal, float, exponent, hex (floats too: float.hex()), complex; "677/926" and "0,7311" are two.
# Not the digits of a name ("conv2d", "fc_1") or of a dotted path after a name ("layers.0").
_NUMBER = re.compile(
    r"(?<![A-Za-z_\d])(?<![A-Za-z_]\.)"
    r"(?:0[xX][\da-fA-F_]*(?:\.[\da-fA-F]*)?(?:[pP][-+]?\d+)?|\d[\d_]*(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
    r"[jJ]?|\b(?:nan|inf)\b",
    re.IGNORECASE)
_BYTES = re.compile(r"\b[bB][rR]?(?:'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")")
_RUN = re.compile(r"<values>(?:[\s,;:/+\-]*<values>)+")  # "1, 2, 3" is one value dump, not three
MAX_MESSAGE_CHARS = 4096  # what is read of a message: the span limits cut exported strings shorter


def _close(text: str, start: int, opening: str, closing: str) -> int:
    """Index just past the bracket that closes the one at ``start`` (or the end of ``text``)."""
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return index + 1
    return len(text)


def redact_message(text: str) -> str:
    """``text`` with tensor and array reprs, numbers and bytes literals replaced by ``<values>``.

    Example: ``"out of range: tensor([[1.5, 2.0]]) at step 7"`` becomes
    ``"out of range: <values> at step <values>"``. Reads at most ``MAX_MESSAGE_CHARS``
    characters (a longer message ends in ``…``); every pattern is linear in them.
    """
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "…"
    parts: list[str] = []
    position = 0
    for match in _VALUE_CALL.finditer(text):
        if match.start() < position:
            continue  # inside a repr already removed
        parts.append(text[position:match.start()])
        parts.append(REDACTED)
        position = _close(text, match.end() - 1, "(", ")")
    parts.append(text[position:])
    redacted = _BYTES.sub(REDACTED, hide_credentials("".join(parts)))
    redacted = _NUMBER.sub(REDACTED, redacted)
    return _RUN.sub(REDACTED, redacted)


def valid_text(text: str) -> str:
    """``text`` as valid Unicode, so it encodes to UTF-8: surrogate pairs joined, a lone surrogate
    (``"\\udc80"``: a module name, a file name decoded with ``surrogateescape``, an exception message)
    replaced by U+FFFD, as a UTF-8 decoder replaces bytes it cannot read. ``text`` itself when it is valid.

    OTLP strings must be UTF-8: protobuf refuses the string (the SDK's exporters then drop the batch) and
    a JSON reader the line.
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def message_of(error: BaseException) -> str:
    """``str(error)``, or ``<unprintable Type>`` when its ``__str__`` raises."""
    try:
        return str(error)
    except Exception:
        return f"<unprintable {type(error).__name__}>"


# "user:password@" or "token@" before a host, with or without a scheme; and a URL's query (it may hold a key).
_USERINFO = re.compile(r"(?<![\w.+-])((?:[A-Za-z][\w+.-]*://)?)[^\s/@?#'\"]+@(?=[\w\[])")
_QUERY = re.compile(r"(://[^\s?#'\"]*)\?[^\s#'\"]*")


def hide_credentials(text: str) -> str:
    """``text`` with the credentials of any URL or endpoint in it replaced: ``http://<credentials>@host:4318/v1``.

    An endpoint may carry ``user:password@`` or an API key in its query; we name endpoints in warnings.
    """
    return _QUERY.sub(r"\1?<credentials>", _USERINFO.sub(r"\1<credentials>@", text))


def code_locations(error: BaseException) -> str:
    """The traceback of ``error`` as code locations only: no source lines, no message."""
    frames = traceback.extract_tb(error.__traceback__)
    lines = ["Traceback (most recent call last):"]
    lines.extend(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}' for frame in frames)
    lines.append(type(error).__qualname__)
    return "\n".join(lines)


def exception_attributes(error: BaseException, messages: str = "redacted") -> dict[str, Any]:
    """The ``exception`` span event's attributes for ``error``.

    ``messages``: ``redacted`` (tensor and array reprs removed), ``full`` or ``none``.
    Values are not cut here: the span limits cut long strings.
    """
    attributes: dict[str, Any] = {semconv.EXCEPTION_TYPE: type(error).__name__}
    if messages != "none":
        text = message_of(error)
        message = valid_text(text if messages == "full" else redact_message(text))
        if message:
            attributes[semconv.EXCEPTION_MESSAGE] = message
    attributes[semconv.EXCEPTION_STACKTRACE] = valid_text(code_locations(error))  # file names may hold surrogates
    attributes[semconv.EXCEPTION_ESCAPED] = "False"
    return attributes


def describe(error: BaseException, values: bool = True) -> str:
    """``Type: message``, for our own log lines.

    An ``OSError`` with an error code is written from its parts, ``[Errno 28] No space left on device:
    '/out/run-20260101-120000-1a2b3c4d/traces-rank3.jsonl'``: the file names are paths we or the OS chose,
    never tensor values, so they are shown as they are. Any other message is redacted
    (:func:`redact_message`) where ``values`` is True, the default: it may come from code that held the
    script's tensors; ``values=False`` (an exporter's or the SDK's failure, about our own endpoints and
    files) keeps its numbers, a port for one. Credentials are hidden in every case.
    """
    if isinstance(error, OSError) and error.strerror:
        message = _os_error_message(error)
    else:
        text = message_of(error)
        message = redact_message(text) if values else hide_credentials(text[:MAX_MESSAGE_CHARS])
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _os_error_message(error: OSError) -> str:
    """What ``str(error)`` says, from the attributes (a subclass's ``__str__`` may say more)."""
    message = str(error.strerror)
    if error.errno is not None:
        message = f"[Errno {error.errno}] {message}"
    if error.filename is not None:
        message += f": {error.filename!r}"
        if error.filename2 is not None:
            message += f" -> {error.filename2!r}"
    return hide_credentials(message)
