"""The OpenTelemetry side: providers, process lifecycle and signals, exporters, span building, metrics, encoding and
export guards; every private SDK touch is in otel/_sdk.py.
"""
