"""Our frames out of the script's tracebacks: where a wrapper of ours calls the script's code or torch's.

An exception raised by what we wrapped (a torch function, the script's signal handler, torch's own import)
reaches the script with a traceback that shows only the frames it would untraced::

    try:
        return function(*args, **kwargs)
    except BaseException as error:
        error.__traceback__ = without_frames_of(error.__traceback__, __file__)
        raise  # a bare raise adds no entry for this frame

Pure Python, no torch import (``_autostart`` uses it before torch exists).
"""

from __future__ import annotations

from types import TracebackType


def without_frames_of(traceback: TracebackType | None, *files: str) -> TracebackType | None:
    """``traceback`` from its first entry whose code is not in ``files`` (paths as ``__file__`` gives them),
    dropping the leading entries that are; unchanged if every entry is in them (the error is ours, and
    its frames say where)."""
    first = traceback
    while first is not None and first.tb_frame.f_code.co_filename in files:
        first = first.tb_next
    return first if first is not None else traceback
