"""Each caller of the recorder holds it as a typed Protocol (core_protocols.py), and the Recorder satisfies each."""

from __future__ import annotations

import inspect
import typing

import pytest

from commdebug_otel import core_protocols, intercept, mode, stall, tracker
from commdebug_otel.config import Settings
from commdebug_otel.core_collective_path import CollectivePath
from commdebug_otel.core_ownership import ModuleOwnership
from commdebug_otel.core_thread_role import ThreadRole
from commdebug_otel.recorder import Recorder

# The callers' protocols are the recorder's; the parts' are the step lifecycle's.
PROTOCOLS = [core_protocols.CollectiveSubscriber, core_protocols.OpSubscriber, core_protocols.ModuleHooks,
             core_protocols.StallSource]
PART_PROTOCOLS = [core_protocols.CollectiveHost, core_protocols.OwnershipHost, core_protocols.ThreadRoleHost]


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
        intercept.CollectiveInterceptor.subscribe: core_protocols.CollectiveSubscriber,
        mode.CollectiveDispatchMode.__init__: core_protocols.OpSubscriber,
        tracker.ModuleTracker.__init__: core_protocols.ModuleHooks,
        stall.StallWatch.__init__: core_protocols.StallSource,
        CollectivePath.__init__: core_protocols.CollectiveHost,
        ModuleOwnership.__init__: core_protocols.OwnershipHost,
        ThreadRole.__init__: core_protocols.ThreadRoleHost,
    }
    for function, protocol in hints.items():
        names = {"recorder", "host", "steps"}
        [annotation] = [value for name, value in inspect.signature(function).parameters.items() if name in names]
        assert annotation.annotation == protocol.__name__, function.__qualname__
