"""Each caller of the recorder holds it as a typed Protocol (protocols.py), and the Recorder satisfies each."""

from __future__ import annotations

import inspect
import typing

import pytest

from commdebug_otel.capture import intercept, mode, tracker
from commdebug_otel.config import Settings
from commdebug_otel.core import protocols
from commdebug_otel.core.collective_path import CollectivePath
from commdebug_otel.core.ownership import ModuleOwnership
from commdebug_otel.core.recorder import Recorder
from commdebug_otel.core.thread_role import ThreadRole, ThreadRoleHost
from commdebug_otel.stall import watchdog as stall

# The callers' protocols are the recorder's; the parts' are the step lifecycle's.
PROTOCOLS = [protocols.CollectiveSubscriber, protocols.OpSubscriber, protocols.ModuleHooks,
             protocols.StallSource]
PART_PROTOCOLS = [protocols.CollectiveHost, protocols.OwnershipHost, ThreadRoleHost]


def _members(protocol: type) -> dict[str, object]:
    """The attributes and methods a protocol declares, its bases' included."""
    found: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, typing.Protocol, typing.Generic) or not getattr(klass, "_is_protocol", False):
            continue
        found.update({name: None for name in getattr(klass, "__annotations__", {})})
        found.update({name: value for name, value in vars(klass).items()
                      if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return found


@pytest.mark.parametrize("protocol", PROTOCOLS + PART_PROTOCOLS, ids=lambda protocol: protocol.__name__)
def test_the_recorder_has_everything_each_protocol_declares(protocol):
    recorder = Recorder(Settings(), None, None)
    if protocol in PART_PROTOCOLS:
        recorder = recorder._steps
    assert _members(protocol)
    for name, declared in _members(protocol).items():
        assert hasattr(recorder, name), f"{protocol.__name__}.{name}"
        if callable(declared) and not isinstance(declared, property):
            wanted = list(inspect.signature(declared).parameters)[1:]
            assert list(inspect.signature(getattr(recorder, name)).parameters) == wanted, name


def test_callers_hold_the_recorder_as_a_protocol_not_any():
    hints = {
        intercept.CollectiveInterceptor.subscribe: protocols.CollectiveSubscriber,
        mode.CollectiveDispatchMode.__init__: protocols.OpSubscriber,
        tracker.ModuleTracker.__init__: protocols.ModuleHooks,
        stall.StallWatch.__init__: protocols.StallSource,
        CollectivePath.__init__: protocols.CollectiveHost,
        ModuleOwnership.__init__: protocols.OwnershipHost,
        ThreadRole.__init__: ThreadRoleHost,
    }
    for function, protocol in hints.items():
        names = {"recorder", "host", "steps"}
        [annotation] = [value for name, value in inspect.signature(function).parameters.items() if name in names]
        assert annotation.annotation == protocol.__name__, function.__qualname__
