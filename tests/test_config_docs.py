"""Settings from the environment, and docs that stay true to the code."""

import logging
import pathlib
import random
import string

import pytest

import commdebug_otel
from commdebug_otel import Detail, Settings, TraceScope, semconv
from commdebug_otel.config import OPTIONS, markdown_table

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

GARBAGE = {
    "ENABLED": "maybe", "DETAIL": "verbose", "TRACE_EVERY": "0", "COMPLETION_EVERY": "0", "RANKS": "1,x",
    "TRACE_SCOPE": "cluster", "OUTPUT_DIR": "  ", "MAX_EVENTS_PER_SPAN": "-3",
    "METRIC_MODULE_DEPTH": "two", "SHUTDOWN_TIMEOUT": "-1", "MODULE_INCLUDE": None, "MODULE_EXCLUDE": None,
}


def test_environment_values_are_parsed():
    settings = Settings.from_env({
        "OTEL_PYTHON_COMMDEBUG_DETAIL": "DTensor", "OTEL_PYTHON_COMMDEBUG_TRACE_EVERY": "10",
        "OTEL_PYTHON_COMMDEBUG_RANKS": "0,3", "OTEL_PYTHON_COMMDEBUG_TRACE_SCOPE": "rank",
        "OTEL_PYTHON_COMMDEBUG_SHUTDOWN_TIMEOUT": "2.5",
        "OTEL_PYTHON_COMMDEBUG_MODULE_EXCLUDE": "*.norm, *.act",
    })
    assert settings.detail is Detail.DTENSOR and settings.trace_every == 10
    assert settings.ranks == frozenset({0, 3}) and settings.trace_scope is TraceScope.RANK
    assert settings.shutdown_timeout_s == 2.5 and settings.module_exclude == ("*.norm", "*.act")
    assert settings.traces_rank(3) and not settings.traces_rank(1)


@pytest.mark.parametrize("suffix", [name for name, value in GARBAGE.items() if value is not None])
def test_bad_environment_value_warns_once_and_uses_the_default(suffix, caplog):
    option = next(option for option in OPTIONS if option.suffix == suffix)
    with caplog.at_level(logging.WARNING, logger="commdebug_otel.config"):
        settings = Settings.from_env({option.env: GARBAGE[suffix]})
    assert getattr(settings, option.field) == option.default
    [record] = caplog.records
    assert option.env in record.getMessage() and option.accepted in record.getMessage()
    assert repr(GARBAGE[suffix]) in record.getMessage()


def test_fuzzed_environment_never_raises():
    rng = random.Random(1234)
    alphabet = string.ascii_letters + string.digits + ",.-_ /*\x00é"
    for _ in range(500):
        environ = {option.env: "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
                   for option in OPTIONS if rng.random() < 0.7}
        Settings.from_env(environ)


def test_bad_explicit_arguments_raise():
    with pytest.raises(ValueError, match="trace_every"):
        Settings(trace_every=0)
    with pytest.raises(ValueError, match="completion_every"):
        Settings(completion_every=0)
    with pytest.raises(ValueError, match="detail"):
        Settings(detail="loud")


def test_configuration_reference_is_generated_from_the_options_table():
    assert markdown_table() in (DOCS / "configuration.md").read_text()


def test_every_name_in_the_data_contract_is_documented():
    text = (DOCS / "semantic-conventions.md").read_text()
    names = {value for key, value in vars(semconv).items() if key.isupper() and isinstance(value, str)}
    missing = sorted(name for name in names if f"`{name}`" not in text)  # as code: "span" is in any text
    assert not missing


def test_every_public_name_is_documented():
    text = "".join(path.read_text() for path in DOCS.glob("*.md")) + (DOCS.parent / "README.md").read_text()
    missing = [name for name in commdebug_otel.__all__ if name != "__version__" and name not in text]
    assert not missing
