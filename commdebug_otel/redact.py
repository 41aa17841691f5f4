"""No tensor value leaves the process: exception messages and stack traces as we export and log them.

A forward that raises ``ValueError(f"activation out of range: {x}")`` carries
the tensor's values in its message, and a formatted traceback repeats the
message and the source lines. What we export and log of an exception is
therefore built here:

* ``exception.type``: the exception's class name (as the OTel SDK records it);
* ``exception.message``: its message with every tensor or array repr, and
  every bracketed list of numbers that holds a float or more than 16 numbers,
  replaced by ``<values>``, and every other float literal too (a scalar read
  with ``.item()``) (``redacted``, the default; integers and short integer
  lists such as shapes stay), the message as it is (``full``, an opt-in), or nothing (``none``);
* ``exception.stacktrace``: code locations only (``File "...", line N, in f``),
  never source lines, locals or the message.

Pure Python, no torch import.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

REDACTED = "<values>"

# A repr that opens with one of these names and a parenthesis is a value dump to its closing parenthesis.
_VALUE_CALL = re.compile(r"\b(?:tensor|Tensor|DTensor|AsyncCollectiveTensor|Parameter|array|ndarray|matrix)\(")
# numpy's str(), tolist(): a bracketed block of numbers only. Kept when it holds at most
# _MAX_KEPT_INTEGERS integers and no float (a shape, a rank list, an index).
_NUMBER_BLOCK = re.compile(r"\[[\s\[\],.\deE+\-]*\d[\s\[\],.\deE+\-]*\]|\[[\s\[\],]*(?:nan|inf)[^\]]*\]")
_FLOAT = re.compile(r"\d\.|\.\d|\de[+\-]?\d|nan|inf", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")
_MAX_KEPT_INTEGERS = 16
# Not inside a dotted version or name ("2.13.0", "layers.0.attention").
_FLOAT_LITERAL = re.compile(
    r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+(?=[eE][-+]?\d))(?:[eE][-+]?\d+)?(?!\w|\.\d)|\b(?:nan|inf)\b",
    re.IGNORECASE)


def _values_or_shape(match: re.Match) -> str:
    block = match.group(0)
    if _FLOAT.search(block) or len(_NUMBER.findall(block)) > _MAX_KEPT_INTEGERS:
        return REDACTED
    return block


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
    """``text`` with tensor, array and number-list reprs and float literals replaced by ``<values>``.

    Example: ``"out of range: tensor([[1.5, 2.0]])"`` becomes ``"out of range: <values>"``.
    """
    parts: list[str] = []
    position = 0
    for match in _VALUE_CALL.finditer(text):
        if match.start() < position:
            continue  # inside a repr already removed
        parts.append(text[position:match.start()])
        parts.append(REDACTED)
        position = _close(text, match.end() - 1, "(", ")")
    parts.append(text[position:])
    redacted = _NUMBER_BLOCK.sub(_values_or_shape, "".join(parts))
    redacted = _FLOAT_LITERAL.sub(REDACTED, redacted)  # a scalar read out with .item()
    return redacted


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
    attributes: dict[str, Any] = {"exception.type": type(error).__name__}
    if messages != "none":
        text = str(error)
        message = text if messages == "full" else redact_message(text)
        if message:
            attributes["exception.message"] = message
    attributes["exception.stacktrace"] = code_locations(error)
    attributes["exception.escaped"] = "False"
    return attributes


def describe(error: BaseException) -> str:
    """``Type: redacted message``, for our own log lines."""
    message = redact_message(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
