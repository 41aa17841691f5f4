"""The Grafana dashboard as data: its PromQL, metric names and variables, and the names Prometheus holds.

Shared by ``test_prometheus.py`` (real scrape) and ``test_deploy.py`` (static).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "common" / "grafana" / "dashboards" / "collectives.json"

# Exactly the series names a real Prometheus held after scraping OTel's Prometheus
# exporter (test_prometheus.py asserts this list against the server).
PROMETHEUS_METRICS = (
    "torch_collective_operations_total",
    "torch_collective_io_bytes_total",
    "torch_collective_duration_seconds_bucket",
    "torch_collective_duration_seconds_count",
    "torch_collective_duration_seconds_sum",
    "torch_collective_completion_duration_seconds_bucket",
    "torch_collective_completion_duration_seconds_count",
    "torch_collective_completion_duration_seconds_sum",
    "commdebug_telemetry_dropped_total",
    "torch_step_duration_seconds_bucket",
    "torch_step_duration_seconds_count",
    "torch_step_duration_seconds_sum",
    "torch_step_collective_wait_seconds_bucket",
    "torch_step_collective_wait_seconds_count",
    "torch_step_collective_wait_seconds_sum",
    "torch_step_age_seconds",
    "torch_collective_seq_issued",
    "torch_collective_seq_completed",
)
# Series that exist only once the live straggler verdict named a rank (a healthy scrape holds none).
ON_VERDICT_METRICS = ("commdebug_straggler_lost_seconds",)
# Labels on the collective series (the device-mesh dim label only when the group is a mesh dim;
# torch_module_fqn only with OTEL_PYTHON_COMMDEBUG_METRIC_MODULE_DEPTH > 0).
COLLECTIVE_LABELS = (
    "torch_collective_op", "torch_module_pass", "torch_process_group_name",
    "torch_process_group_size", "torch_distributed_rank",
)
OPTIONAL_COLLECTIVE_LABELS = ("torch_device_mesh_dim_name", "torch_module_fqn")
DROPPED_LABELS = ("commdebug_dropped_kind", "torch_distributed_rank")

# Grafana's built-in interval variables, made concrete for a 1 s scrape interval.
BUILTINS = {
    "$__rate_interval": "30s",
    "${__rate_interval}": "30s",
    "$__interval": "2s",
    "${__interval}": "2s",
    "$__range": "60s",
    "${__range}": "60s",
}

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                 "offset", "and", "or", "unless", "le", "inf", "nan"}


def load(path: pathlib.Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' collapsed children included."""
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` for every Prometheus target of every panel."""
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                out.append((panel.get("title", ""), target.get("refId", ""), target["expr"]))
    return out


def datasource_uids(dashboard: dict[str, Any]) -> set[str]:
    """Every datasource uid the dashboard names (panels, targets, variables, annotations)."""
    uids: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            source = node.get("datasource")
            if isinstance(source, dict) and "uid" in source:
                uids.add(source["uid"])
            elif isinstance(source, str):
                uids.add(source)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(dashboard)
    return uids


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in dashboard.get("templating", {}).get("list", [])}


def render(expr: str, dashboard: dict[str, Any]) -> str:
    """``expr`` with Grafana's interval variables made concrete and every template variable at "All".

    Raises:
        KeyError: for a ``$variable`` the dashboard does not define.
    """
    for name, value in BUILTINS.items():
        expr = expr.replace(name, value)
    defined = variables(dashboard)

    def value_of(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        var = defined[name]
        return var.get("allValue") or ".*"

    return _VAR.sub(value_of, expr)


def label_values_query(definition: str) -> tuple[str, str]:
    """``label_values(metric{...}, label)`` -> ``(metric, label)``."""
    match = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)\s*",
                         definition)
    if match is None:
        raise ValueError(f"not a label_values(metric, label) query: {definition!r}")
    return match.group(1), match.group(2)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (labels, functions and keywords removed)."""
    text = re.sub(r"\{[^}]*\}", " ", expr)                           # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)                           # range selectors
    text = re.sub(r'"[^"]*"', " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        rest = text[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function call or a keyword
        if re.fullmatch(r"\d+(\.\d+)?|e\d+", word):
            continue
        names.add(word)
    return names


def variable_definition(var: dict[str, Any]) -> str:
    """The ``label_values(...)`` text of a query variable."""
    query = var.get("query")
    if isinstance(query, dict):
        query = query.get("query", "")
    return var.get("definition") or query or ""


def all_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Series names used by every panel query and every query variable."""
    names = set()
    for _, _, expr in queries(dashboard):
        names |= metric_names(expr)
    for var in variables(dashboard).values():
        if var.get("type") == "query":
            names.add(label_values_query(variable_definition(var))[0])
    return names
