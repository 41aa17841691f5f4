"""The pinned Collector's configuration keys, as data: test_deploy.py checks each Collector config in deploy/ with them.

No Collector binary or container runtime here, so the tables were taken by reading upstream source: the
``mapstructure`` tags of each component's config struct (``,squash`` fields merged into their parent,
``configoptional.Optional`` fields accepting ``enabled`` as well).

* Core components and shared config types: ``open-telemetry/opentelemetry-collector`` at tag **v0.148.0**
  (``git show v0.148.0:<path>``), the version of ``otel/opentelemetry-collector-contrib:0.148.0``.
* Contrib components: ``open-telemetry/opentelemetry-collector-contrib``. Its snapshot (1.4 GB) was too large to
  fetch, so these tables come from the stored versions of the files at the commits named below, not from the
  v0.148.0 tag. Only keys that those versions have are listed, and none of them has been removed since
  (the newest stored versions still have them); a key added after them is rejected here, which errs on the safe side.

A table is a dict: key -> ``ANY`` (any value) or a nested table; ``[table]`` is a list of such tables.
"""

from __future__ import annotations

from typing import Any

ANY = None


def keys(*names: str, **nested: Any) -> dict[str, Any]:
    """A table: ``names`` take any value, ``nested`` are checked further (a dict, or a one-element list of one)."""
    return {**dict.fromkeys(names, ANY), **nested}


# --------------------------------------------------------- core v0.148.0
# config/configtls/configtls.go: Config (squashed into ClientConfig and ServerConfig)
_TLS = ("ca_file", "ca_pem", "include_system_ca_certs_pool", "cert_file", "cert_pem", "key_file", "key_pem",
        "min_version", "max_version", "cipher_suites", "reload_interval", "curve_preferences", "tpm")
TLS_CLIENT = keys(*_TLS, "insecure", "insecure_skip_verify", "server_name_override")
TLS_SERVER = keys(*_TLS, "client_ca_file", "client_ca_file_reload")
# config/confignet/confignet.go: AddrConfig (squashed into the servers below)
_ADDR = ("endpoint", "transport", "dialer")
# config/configgrpc/configgrpc.go: ServerConfig, ClientConfig
GRPC_SERVER = keys(*_ADDR, "max_recv_msg_size_mib", "max_concurrent_streams", "read_buffer_size",
                   "write_buffer_size", "keepalive", "auth", "include_metadata", "middlewares", tls=TLS_SERVER)
GRPC_CLIENT = keys("endpoint", "compression", "keepalive", "read_buffer_size", "write_buffer_size",
                   "wait_for_ready", "headers", "balancer_name", "authority", "auth", "middlewares", tls=TLS_CLIENT)
# config/confighttp/server.go: ServerConfig; config/confighttp/client.go: ClientConfig
HTTP_SERVER = keys(*_ADDR, "cors", "auth", "max_request_body_size", "include_metadata", "response_headers",
                   "compression_algorithms", "read_timeout", "read_header_timeout", "write_timeout", "idle_timeout",
                   "middlewares", "keep_alives_enabled", tls=TLS_SERVER)
HTTP_CLIENT = keys("endpoint", "proxy_url", "read_buffer_size", "write_buffer_size", "timeout", "headers", "auth",
                   "compression", "compression_params", "max_idle_conns", "max_idle_conns_per_host",
                   "max_conns_per_host", "idle_conn_timeout", "disable_keep_alives", "http2_read_idle_timeout",
                   "http2_ping_timeout", "cookies", "force_attempt_http2", "middlewares", tls=TLS_CLIENT)
# exporter/exporterhelper/internal/queuebatch/config.go (+ "enabled": config/configoptional/optional.go);
# config/configretry/backoff.go; exporter/exporterhelper/internal/timeout_sender.go ("timeout")
QUEUE = keys("enabled", "wait_for_result", "sizer", "queue_size", "block_on_overflow", "storage", "num_consumers",
             "batch")
RETRY = keys("enabled", "initial_interval", "randomization_factor", "multiplier", "max_interval", "max_elapsed_time")
# exporter/otlpexporter/config.go (type otlp_grpc, deprecated alias otlp: exporter/otlpexporter/metadata.yaml)
OTLP_GRPC_EXPORTER = {**GRPC_CLIENT, **keys("timeout", sending_queue=QUEUE, retry_on_failure=RETRY)}

RECEIVERS = {
    # receiver/otlpreceiver/config.go: Protocols{grpc, http}, HTTPConfig = confighttp.ServerConfig + url paths
    "otlp": keys(protocols=keys(grpc=GRPC_SERVER, http={**HTTP_SERVER, **keys(
        "traces_url_path", "metrics_url_path", "logs_url_path")})),
}
PROCESSORS = {
    # processor/batchprocessor/config.go
    "batch": keys("timeout", "send_batch_size", "send_batch_max_size", "metadata_keys", "metadata_cardinality_limit"),
    # internal/memorylimiter/config.go (processor/memorylimiterprocessor/config.go: type Config = memorylimiter.Config)
    "memory_limiter": keys("check_interval", "min_gc_interval_when_soft_limited", "min_gc_interval_when_hard_limited",
                           "limit_mib", "spike_limit_mib", "limit_percentage", "spike_limit_percentage"),
    # contrib processor/transformprocessor/config.go @ a06eecf1ed29fe263a0de977886bdd0a062bb16a,
    # processor/transformprocessor/internal/common/config.go @ ba96fac11e362dac875087feb7cf0be6fc289388
    "transform": keys("error_mode", "flatten_data", **{
        name: [keys("context", "statements")] for name in ("trace_statements", "metric_statements", "log_statements")}),
    # contrib processor/tailsamplingprocessor/config.go @ 497862f69939b03daed1915653227b6defa85c0f
    "tail_sampling": keys("decision_wait", "num_traces", "expected_new_traces_per_sec", policies=[keys(
        "name", "type", "composite", "and",
        latency=keys("threshold_ms", "upper_threshold_ms"),
        numeric_attribute=keys("key", "min_value", "max_value", "invert_match"),
        probabilistic=keys("hash_salt", "sampling_percentage"),
        status_code=keys("status_codes"),
        string_attribute=keys("key", "values", "enabled_regex_matching", "cache_max_size", "invert_match"),
        rate_limiting=keys("spans_per_second"),
        span_count=keys("min_spans", "max_spans"),
        trace_state=keys("key", "values"),
        boolean_attribute=keys("key", "value"),
        ottl_condition=keys("error_mode", "span", "spanevent"),
    )]),
}
# The same file's PolicyType constants.
TAIL_SAMPLING_POLICY_TYPES = frozenset({
    "always_sample", "latency", "numeric_attribute", "probabilistic", "status_code", "string_attribute",
    "rate_limiting", "composite", "and", "span_count", "trace_state", "boolean_attribute", "ottl_condition"})
EXPORTERS = {
    "otlp_grpc": OTLP_GRPC_EXPORTER,
    # contrib exporter/loadbalancingexporter/config.go @ 870de3632d376a989b61459319e6e8754ec1532c
    "loadbalancing": keys("routing_key", protocol=keys(otlp=OTLP_GRPC_EXPORTER), resolver=keys(
        static=keys("hostnames"), dns=keys("hostname", "port", "interval", "timeout"), k8s=keys("service", "ports"))),
    # contrib exporter/prometheusexporter/config.go @ d3911c36b220d8a3562c3dab3e1ba8b1466793ca
    # (confighttp server settings squashed: core v0.148.0's ServerConfig)
    "prometheus": {**HTTP_SERVER, **keys("namespace", "const_labels", "send_timestamps", "metric_expiration",
                                         "enable_open_metrics", "add_metric_suffixes",
                                         resource_to_telemetry_conversion=keys("enabled"))},
    # contrib exporter/prometheusremotewriteexporter/config.go @ 647b4c1fceb43ee8d938aaca6e179a1ac61f29ed
    # (confighttp client settings squashed: core v0.148.0's ClientConfig)
    "prometheusremotewrite": {**HTTP_CLIENT, **keys(
        "namespace", "external_labels", "wal", "add_metric_suffixes", retry_on_failure=RETRY,
        remote_write_queue=keys("enabled", "queue_size", "num_consumers"),
        resource_to_telemetry_conversion=keys("enabled"), target_info=keys("enabled"),
        export_created_metric=keys("enabled"))},
}
EXTENSIONS = {
    # contrib extension/healthcheckextension/config.go @ 38a02904fdb87d8d159880b426b2e4a1fb8ad0c7
    "health_check": {**HTTP_SERVER, **keys("path", response_body=keys("healthy", "unhealthy"),
                                           check_collector_pipeline=keys("enabled", "interval",
                                                                         "exporter_failure_threshold"))},
}
# otelcol/config.go; service/config.go; service/pipelines/config.go (core v0.148.0)
TOP_LEVEL = keys("receivers", "processors", "exporters", "connectors", "extensions", "service")
SERVICE = keys("telemetry", "extensions", "pipelines")
PIPELINE = keys("receivers", "processors", "exporters")
COMPONENTS = {"receivers": RECEIVERS, "processors": PROCESSORS, "exporters": EXPORTERS, "extensions": EXTENSIONS}


def unknown_keys(node: Any, table: Any, where: str) -> list[str]:
    """Every key path under ``node`` that ``table`` does not allow, as ``where.a.b`` strings (empty: all known)."""
    if table is ANY:
        return []
    if isinstance(table, list):
        if not isinstance(node, list):
            return [f"{where}: expected a list"]
        return [bad for i, item in enumerate(node) for bad in unknown_keys(item, table[0], f"{where}[{i}]")]
    if node is None:  # `http:` with no value: the component's defaults
        return []
    if not isinstance(node, dict):
        return [f"{where}: expected a mapping"]
    found = []
    for key, value in node.items():
        if key not in table:
            found.append(f"{where}.{key}")
        else:
            found.extend(unknown_keys(value, table[key], f"{where}.{key}"))
    return found


def config_problems(config: dict[str, Any]) -> list[str]:
    """Unknown sections, component types and keys in one Collector config (``type/name`` ids allowed)."""
    problems = unknown_keys(config, TOP_LEVEL, "config")
    for kind, known in COMPONENTS.items():
        for component_id, settings in (config.get(kind) or {}).items():
            component_type = component_id.split("/")[0]
            if component_type not in known:
                problems.append(f"{kind}.{component_id}: no such {kind[:-1]} in the table")
            else:
                problems.extend(unknown_keys(settings, known[component_type], f"{kind}.{component_id}"))
    service = config.get("service") or {}
    problems.extend(unknown_keys(service, SERVICE, "service"))
    for name, pipeline in (service.get("pipelines") or {}).items():
        problems.extend(unknown_keys(pipeline, PIPELINE, f"service.pipelines.{name}"))
    return problems
