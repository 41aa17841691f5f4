"""What leaves the process of an exception message: no tensor value in any form, in time linear in the message."""

import errno

import pytest

from commdebug_otel.core.redact import (
    MAX_MESSAGE_CHARS,
    describe,
    exception_attributes,
    hide_credentials,
    redact_message,
)


@pytest.mark.parametrize("message, exported", [
    ("out of range: tensor([[1.5, 2.0]]) at step 7", "out of range: <values> at step <values>"),
    ("activation out of range: tensor([0.7311]) (max 0.7311)", "activation out of range: <values> (max <values>)"),
    ("complex (0.7311+3.75j)", "complex (<values>)"),
    ("hex 0x1.7652bd3c36113p-1", "hex <values>"),
    ("fraction 677/926", "fraction <values>"),
    ("bytes b'_);?' and b\"\\x00\\x01\"", "bytes <values> and <values>"),
    ("comma decimal 0,7311", "comma decimal <values>"),
    ("token ids [101, 7592, 2088, 999]", "token ids [<values>]"),  # .tolist() of an integer tensor
    ("label 7592", "label <values>"),  # .item()
    ("numpy [[1 2 3]\n [4 5 6]]", "numpy [[<values>]\n [<values>]]"),
    ("nan, inf, -1e-5 and .5", "<values> and <values>"),
    ("in conv2d at layers.0.attention (fc_1)", "in conv2d at layers.0.attention (fc_1)"),  # names keep their digits
])
def test_every_form_of_a_value_is_removed_and_names_stay(message, exported):
    assert redact_message(message) == exported


def test_unclosed_brackets_and_reprs_are_read_in_linear_time():
    # "[1 " * N took seconds at N=1000 (a backtracking pattern) and stalled stop() for minutes at N=5000.
    exported = redact_message("unparsed tokens: " + "[1 " * 100_000)
    assert exported.startswith("unparsed tokens: [<values> [<values> [") and exported.endswith("…")
    assert not any(char.isdigit() for char in exported)
    assert redact_message("tensor(" * 50_000).startswith("<values>")


def test_only_the_first_characters_are_read():
    assert len(redact_message("x" * (10 * MAX_MESSAGE_CHARS))) == MAX_MESSAGE_CHARS + 1


class _Unprintable(ValueError):
    def __str__(self):
        raise RuntimeError("its __str__ raises")


def test_an_exception_whose_str_raises_is_named_not_raised():
    # Its step's spans were lost: building the exception event raised.
    assert exception_attributes(_Unprintable())["exception.message"] == "<unprintable _Unprintable>"
    assert describe(_Unprintable()) == "_Unprintable: <unprintable _Unprintable>"


@pytest.mark.parametrize("text, shown", [
    ("user:S3CRET@127.0.0.1:1", "<credentials>@127.0.0.1:1"),
    ("Failed to export to http://u:p@[::1]:4317 now", "Failed to export to http://<credentials>@[::1]:4317 now"),
    ("http://collector:4318/v1/traces?api_key=abc&x=1", "http://collector:4318/v1/traces?<credentials>"),
    ("https://collector:4317", "https://collector:4317"),
])
def test_endpoint_credentials_are_hidden(text, shown):
    assert hide_credentials(text) == shown


@pytest.mark.parametrize("messages, exported", [
    ("redacted", "activation out of range: <values>"),
    ("full", "activation out of range: tensor([0.7311])"),  # the user's opt-in
    ("none", None),
])
def test_the_exception_message_setting(telemetry, tracer_factory, messages, exported):
    import torch

    class Raises(torch.nn.Module):
        def forward(self, x):
            raise ValueError(f"activation out of range: {x}")

    with tracer_factory(exception_messages=messages), pytest.raises(ValueError):
        Raises()(torch.tensor([0.7311]))
    [event] = telemetry.one("Raises forward").events
    assert event.attributes.get("exception.message") == exported
    assert event.attributes["exception.type"] == "ValueError"


def test_the_exception_message_setting_from_the_environment(caplog):
    from commdebug_otel import Settings

    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_EXCEPTION_MESSAGES": "None"}).exception_messages == "none"
    assert Settings.from_env({"OTEL_PYTHON_COMMDEBUG_EXCEPTION_MESSAGES": "all"}).exception_messages == "redacted"
    assert "OTEL_PYTHON_COMMDEBUG_EXCEPTION_MESSAGES" in caplog.text and "redacted, full or none" in caplog.text


def test_our_own_paths_and_endpoints_are_not_redacted_in_log_lines():
    """A warning about our run folder or an export failure shows the path and the port as they are."""
    path = "/out-2026/run-20261201-224655-49acfada/traces-rank3.jsonl"
    assert describe(OSError(errno.ENOSPC, "No space left on device", path)) == (
        f"OSError: [Errno {errno.ENOSPC}] No space left on device: '{path}'")
    assert describe(FileExistsError(errno.EEXIST, "File exists", "/a/run-1", None, "/b/run-2")) == (
        f"FileExistsError: [Errno {errno.EEXIST}] File exists: '/a/run-1' -> '/b/run-2'")
    refused = ConnectionError("HTTPConnectionPool(host='u:pw@collector', port=4318): Max retries exceeded")
    assert describe(refused, values=False) == (
        "ConnectionError: HTTPConnectionPool(host='<credentials>@collector', port=4318): Max retries exceeded")
    # Anything else, by default, may have come near the script's tensors: its numbers go.
    assert describe(OSError("value tensor([1.5]) at 7")) == "OSError: value <values> at <values>"
    assert describe(ValueError(f"bad {path}")) != f"ValueError: bad {path}"
