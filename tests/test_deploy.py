"""The deploy/ stacks, statically: compose files, Collector, Jaeger, Tempo, Grafana and Kubernetes manifests agree.

No docker needed. The dashboard's metric names are checked against the names a
real Prometheus held in tests/test_prometheus.py (``grafana_dashboard.PROMETHEUS_METRICS``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from commdebug_otel import semconv
from commdebug_otel.config import OPTIONS
from commdebug_otel.otel.telemetry import MAX_ATTRIBUTE_CHARS

import collector_schema as schema
import grafana_dashboard as dash
from tools import require_program

DEPLOY = dash.DEPLOY
ROOT = DEPLOY.parent
STACKS = {"jaeger": DEPLOY / "jaeger", "tempo": DEPLOY / "tempo"}
COLLECTOR_CONFIG = DEPLOY / "common" / "otel-collector" / "config.yaml"
PROMETHEUS_CONFIG = DEPLOY / "common" / "prometheus" / "prometheus.yaml"
KUBERNETES = [DEPLOY / "kubernetes" / "torchrun-job.yaml", DEPLOY / "kubernetes" / "pytorchjob.yaml"]
KUBERNETES_GATEWAY = DEPLOY / "kubernetes" / "gateway.yaml"
SCALE = {tier: DEPLOY / "scale" / f"{tier}.yaml" for tier in ("agent", "gateway", "sampler")}
COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib:0.148.0"  # the version collector_schema.py was read at
GRPC_DEFAULT_MIB = 4
TEMPO_DEFAULT_TRACE_BYTES = 5_000_000
# Current names (Collector >= 0.144): `otlp` / `otlphttp` exporters are deprecated aliases there.
DEPRECATED_EXPORTERS = {"otlp", "otlphttp", "logging"}
PANELS = (
    "Collective rate by op", "Bytes/s by op", "Collective rate per rank",
    "Collective duration p50 / p99 by op", "Forward vs backward", "Dropped telemetry",
    "Straggler: time lost per step",
)


def _yaml(path) -> Any:
    return yaml.safe_load(path.read_text())


def _compose(stack: str) -> dict:
    return _yaml(STACKS[stack] / "docker-compose.yaml")


def _bind_mounts(service: dict) -> list[tuple[str, str]]:
    """``(source, target)`` of every bind mount (short syntax ``src:dst[:mode]`` or long syntax)."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source", ""), volume.get("target", "")
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def _image_is_pinned(image: str) -> bool:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return bool(digest)
    tag = last.rsplit(":", 1)[1]
    return bool(tag) and tag != "latest" and re.search(r"\d", tag) is not None


def _check_pipelines(config: dict, where: str) -> None:
    """Every component a pipeline (or the service) names is defined, and every defined one is used."""
    service = config["service"]
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in service["pipelines"].items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), f"{where}: pipeline {name} is empty"
        for kind in used:
            for component in pipeline.get(kind, []):
                assert component in (config.get(kind) or {}), f"{where}: {name} uses undefined {kind[:-1]} {component}"
                used[kind].add(component)
    for extension in service.get("extensions", []):
        assert extension in (config.get("extensions") or {}), f"{where}: undefined extension {extension}"
    for kind, names in used.items():
        assert set(config.get(kind) or {}) == names, f"{where}: defined but unused {kind}"


def _env_refs(text: str) -> set[str]:
    return set(re.findall(r"\$\{env:(\w+)(?::-[^}]*)?\}", text))


# ------------------------------------------------------------------ compose
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_compose_images_are_pinned_and_mounts_exist(stack):
    compose = _compose(stack)
    services = compose["services"]
    for name, service in services.items():
        assert _image_is_pinned(service["image"]), f"{stack}/{name}: image {service['image']} is not pinned"
        for source, _ in _bind_mounts(service):
            assert (STACKS[stack] / source).resolve().exists(), f"{stack}/{name}: {source} does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if not source.startswith((".", "/")):
                assert source in (compose.get("volumes") or {}), f"{stack}/{name}: undeclared volume {source}"
        for dependency in service.get("depends_on", []):
            assert dependency in services
    expected = {"otel-collector", "prometheus", "grafana", stack}
    assert expected <= set(services)
    published = {_published(port)[1] for service in services.values() for port in service.get("ports", [])}
    assert {"4317", "4318", "9090", "3000"} <= published
    assert ("16686" if stack == "jaeger" else "3200") in published


# A published port as (host address, host port): on 127.0.0.1 unless COMMDEBUG_BIND_ADDRESS opens it.
_BOUND = re.compile(r"\$\{COMMDEBUG_BIND_ADDRESS:-127\.0\.0\.1\}:(\d+):(\d+)")


def _published(port: str) -> tuple[str, str]:
    bound = _BOUND.fullmatch(str(port))
    assert bound, f"{port} is published on every interface"
    return "127.0.0.1", bound.group(1)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_compose_stacks_are_closed_by_default(stack):
    """Every port on the loopback, no anonymous Admin, a sign-in form, health checks that gate Grafana."""
    services = _compose(stack)["services"]
    for name, service in services.items():
        assert all(_published(port)[0] == "127.0.0.1" for port in service.get("ports", [])), name
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "GF_AUTH_DISABLE_LOGIN_FORM" not in grafana
    viewing = {item["name"]: item["value"] for item in _viewing()[("Deployment", "grafana")]["spec"]["template"]
               ["spec"]["containers"][0]["env"]}
    assert viewing["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer" and "GF_AUTH_DISABLE_LOGIN_FORM" not in viewing
    for name in ("prometheus", "grafana"):
        check = services[name]["healthcheck"]["test"]
        assert check[:2] == ["CMD", "wget"] and check[-1].startswith("http://localhost:"), name
    assert services["grafana"]["depends_on"]["prometheus"] == {"condition": "service_healthy"}
    readme = (DEPLOY / "README.md").read_text()
    assert "COMMDEBUG_BIND_ADDRESS=0.0.0.0 docker compose up -d" in readme and "docker compose up -d --wait" in readme


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_compose_wires_the_shared_files(stack):
    services = _compose(stack)["services"]
    collector = services["otel-collector"]
    mounted = {(STACKS[stack] / source).resolve() for source, _ in _bind_mounts(collector)}
    assert COLLECTOR_CONFIG.resolve() in mounted
    # Every ${env:VAR} the Collector config reads is set by the compose file, to this stack's backend.
    for var in _env_refs(COLLECTOR_CONFIG.read_text()):
        assert var in collector.get("environment", {}), f"{stack}: the Collector needs {var}"
    assert collector["environment"]["TRACES_OTLP_ENDPOINT"] == f"{stack}:4317"
    prometheus = services["prometheus"]
    assert "--enable-feature=exemplar-storage" in prometheus["command"]
    assert PROMETHEUS_CONFIG.resolve() in {(STACKS[stack] / s).resolve() for s, _ in _bind_mounts(prometheus)}
    grafana = dict((target, (STACKS[stack] / source).resolve()) for source, target in _bind_mounts(services["grafana"]))
    providers = _yaml(DEPLOY / "common" / "grafana" / "provisioning" / "dashboards" / "commdebug.yaml")
    [provider] = providers["providers"]
    assert grafana[provider["options"]["path"]] == dash.DASHBOARD.parent.resolve()
    assert any(target.startswith("/etc/grafana/provisioning/datasources/") for target in grafana)
    assert any(target.startswith("/etc/grafana/provisioning/dashboards/") for target in grafana)


def test_prometheus_scrapes_the_collector_exporter():
    config = _yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    collector = jobs["otel-collector"]
    assert collector["honor_labels"] is True  # keep the Collector's job/instance per worker
    targets = [t for static in collector["static_configs"] for t in static["targets"]]
    exporter = _yaml(COLLECTOR_CONFIG)["exporters"]["prometheus"]
    assert targets == ["otel-collector:" + exporter["endpoint"].rsplit(":", 1)[1]]


def test_promtool_accepts_the_prometheus_config():
    """promtool ships in Debian's prometheus package, which CI installs for test_prometheus.py."""
    promtool = require_program("promtool", package="prometheus")
    check = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------- collector
def test_collector_config_pipelines_and_sizes():
    config = _yaml(COLLECTOR_CONFIG)
    _check_pipelines(config, "collector")
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]
    assert grpc["max_recv_msg_size_mib"] > GRPC_DEFAULT_MIB
    assert "http" in config["receivers"]["otlp"]["protocols"]
    assert "batch" in config["processors"]
    exporters = config["exporters"]
    assert not {name.split("/")[0] for name in exporters} & DEPRECATED_EXPORTERS
    assert exporters["prometheus"]["endpoint"].endswith(":8889")
    assert exporters["prometheus"]["enable_open_metrics"] is True
    traces = config["service"]["pipelines"]["traces"]["exporters"]
    assert [name.split("/")[0] for name in traces] == ["otlp_grpc"]
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]


def test_jaeger_config():
    config = _yaml(STACKS["jaeger"] / "jaeger.yaml")
    _check_pipelines(config, "jaeger")
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["max_recv_msg_size_mib"] > GRPC_DEFAULT_MIB
    storage = config["extensions"]["jaeger_query"]["storage"]["traces"]
    assert storage in config["extensions"]["jaeger_storage"]["backends"]
    assert config["exporters"]["jaeger_storage_exporter"]["trace_storage"] == storage
    assert config["extensions"]["jaeger_query"]["http"]["endpoint"].endswith(":16686")


def test_tempo_config_is_sized_for_step_traces():
    config = _yaml(STACKS["tempo"] / "tempo.yaml")
    assert config["overrides"]["defaults"]["global"]["max_bytes_per_trace"] > TEMPO_DEFAULT_TRACE_BYTES
    grpc = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]
    assert grpc["endpoint"].startswith("0.0.0.0:")  # Tempo >= 2.7 listens on localhost by default
    assert grpc["max_recv_msg_size_mib"] > GRPC_DEFAULT_MIB
    mib = 1024 * 1024
    assert config["server"]["grpc_server_max_recv_msg_size"] > GRPC_DEFAULT_MIB * mib
    assert config["ingester_client"]["grpc_client_config"]["max_send_msg_size"] > 16 * mib
    assert config["server"]["http_listen_port"] == 3200


# ------------------------------------------------------------------ grafana
def _datasources(stack: str) -> dict[str, dict]:
    provisioning = _yaml(STACKS[stack] / "grafana" / "datasources.yaml")
    return {source["uid"]: source for source in provisioning["datasources"]}


def _strings(node: Any):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_grafana_datasources_link_traces_and_metrics(stack):
    sources = _datasources(stack)
    assert set(sources) == {"prometheus", stack}
    prometheus, traces = sources["prometheus"], sources[stack]
    assert prometheus["type"] == "prometheus" and traces["type"] == stack
    [destination] = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": stack}
    assert traces["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"
    # Data source URLs name compose services on their container ports.
    services = _compose(stack)["services"]
    for source in sources.values():
        host = re.match(r"https?://([^:/]+):(\d+)", source["url"]).group(1)
        assert host in services
    # Grafana expands $VAR in provisioning values: PromQL's $__tags must be written $$__tags.
    for text in _strings(sources):
        assert not re.search(r"(?<!\$)\$(?!\$)\w", text.replace("$$", "")), text
    for query in traces["jsonData"]["tracesToMetrics"]["queries"]:
        assert dash.metric_names(query["query"].replace("$$", "$")) <= set(dash.PROMETHEUS_METRICS)


def test_dashboard_panels_and_queries():
    dashboard = dash.load()
    assert dashboard["title"] == "Collectives" and dashboard["uid"]
    titles = [panel["title"] for panel in dash.panels(dashboard)]
    assert len(titles) == len(set(titles))
    assert set(PANELS) <= set(titles)
    assert [panel["id"] for panel in dash.panels(dashboard)] == list(range(1, len(titles) + 1))
    assert dash.queries(dashboard)
    for title, _ref, expr in dash.queries(dashboard):
        # The same queries work for the workers' own endpoints and the Collector's exporter:
        # aggregate by our labels, never by instance; `job` only through the Job variable, whose
        # values come from Prometheus (service.namespace/service.name, service.name, or the scrape job).
        assert expr.lstrip().startswith(("sum by", "max by", "histogram_quantile(")), (title, expr)
        assert not re.search(r"\binstance\b", expr), (title, expr)
        selectors = re.findall(r"\bjob\b[^,}]*", expr)
        assert selectors and set(selectors) == {'job=~"$job"'}, (title, expr)
        if "rate(" in expr:
            assert "[$__rate_interval]" in expr, (title, expr)
        dash.render(expr, dashboard)  # every $variable is defined
    quantiles = [expr for title, _, expr in dash.queries(dashboard) if "histogram_quantile" in expr]
    assert any("0.5," in expr for expr in quantiles) and any("0.99," in expr for expr in quantiles)
    histograms = r"torch_(collective_(completion_)?duration|step_collective_wait)_seconds_bucket"
    assert all(re.search(histograms, expr) and "le," in expr for expr in quantiles)


def test_dashboard_names_are_the_names_prometheus_held():
    """tests/test_prometheus.py asserts PROMETHEUS_METRICS against a real server's names."""
    dashboard = dash.load()
    names = dash.all_metric_names(dashboard)
    assert names <= set(dash.PROMETHEUS_METRICS + dash.ON_VERDICT_METRICS)
    assert {"torch_collective_operations_total", "torch_collective_io_bytes_total",
            "torch_collective_duration_seconds_bucket", "commdebug_telemetry_dropped_total"} <= names
    # Every other Prometheus-style name in the dashboard is a label that exists.
    used = set(re.findall(r"\b(?:torch|commdebug)_\w+", dash.DASHBOARD.read_text()))
    known = (set(dash.PROMETHEUS_METRICS + dash.ON_VERDICT_METRICS) | set(dash.COLLECTIVE_LABELS)
             | set(dash.OPTIONAL_COLLECTIVE_LABELS) | set(dash.DROPPED_LABELS))
    assert used <= known, used - known


# --------------------------------------------------------------- kubernetes
def _documents() -> list[dict]:
    docs = []
    for path in KUBERNETES:
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "Job":
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "PyTorchJob":
        return [replica["template"]["spec"] for replica in doc["spec"]["pytorchReplicaSpecs"].values()]
    return []


def test_kubernetes_manifests():
    docs = _documents()
    kinds = [doc["kind"] for doc in docs]
    assert "Job" in kinds and "PyTorchJob" in kinds
    config_maps = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    known_env = {option.env for option in OPTIONS}
    specs = [spec for doc in docs for spec in _pod_specs(doc)]
    assert len(specs) == 3  # Job, PyTorchJob Master and Worker
    for spec in specs:
        containers = spec["containers"] + spec.get("initContainers", [])
        for container in containers:
            assert _image_is_pinned(container["image"]), container["image"]
        [sidecar] = [c for c in spec.get("initContainers", []) if "opentelemetry-collector" in c["image"]]
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar: the Job can complete
        [trainer] = spec["containers"]
        assert trainer["command"][0] == "torchrun"
        env = {item["name"]: item.get("value") for item in trainer["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://localhost:4317"
        assert env["OTEL_SERVICE_NAME"]
        ours = {name for name in env if name.startswith("OTEL_PYTHON_COMMDEBUG_")}
        assert ours and ours <= known_env, ours - known_env
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in containers:
            for mount in container.get("volumeMounts", []):
                assert volumes[mount["name"]]["configMap"]["name"] in config_maps
        [sidecar_volume] = [m["name"] for m in sidecar["volumeMounts"]]
        sidecar_config_text = config_maps[volumes[sidecar_volume]["configMap"]["name"]]["config.yaml"]
        sidecar_config = yaml.safe_load(sidecar_config_text)
        _check_pipelines(sidecar_config, "sidecar")
        assert sidecar_config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
        sidecar_env = {item["name"] for item in sidecar.get("env", [])}
        assert _env_refs(sidecar_config_text) <= sidecar_env
    for name, data in config_maps.items():
        for filename, text in data.items():
            if filename.endswith(".py"):
                compile(text, f"{name}/{filename}", "exec")


# --------------------------------------------------------------------- docs
def test_readme_walks_from_compose_to_the_dashboard():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("docker compose up", "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317 commdebug-otel demo",
                   "http://localhost:3000", "http://localhost:16686", "http://localhost:9090",
                   "OTEL_METRICS_EXPORTER=prometheus", "Collectives"):
        assert needle in text, needle


def test_dashboards_doc_names_every_metric_and_panel():
    text = (ROOT / "docs" / "dashboards.md").read_text()
    for name in dash.PROMETHEUS_METRICS + dash.ON_VERDICT_METRICS + dash.COLLECTIVE_LABELS + dash.DROPPED_LABELS:
        assert name in text, name
    for panel in dash.panels(dash.load()):
        assert panel["title"] in text, panel["title"]
    deploy_readme = (DEPLOY / "README.md").read_text()
    for panel in dash.panels(dash.load()):  # deploy's walk-through lists every panel with what it shows
        assert f"   | {panel['title']} | " in deploy_readme, panel["title"]


# ------------------------------------------------- collector configuration schema
def _config_maps(path) -> list[tuple[str, str]]:
    """``(name, config.yaml text)`` of every ConfigMap in a manifest that holds a Collector config."""
    return [(doc["metadata"]["name"], doc["data"]["config.yaml"])
            for doc in yaml.safe_load_all(path.read_text())
            if doc and doc["kind"] == "ConfigMap" and "config.yaml" in doc["data"]]


def _collector_configs() -> list[tuple[str, dict]]:
    """Every Collector config in deploy/: the shared one, the sidecars' and deploy/scale/'s tiers."""
    configs = [("common/otel-collector/config.yaml", _yaml(COLLECTOR_CONFIG))]
    for path in KUBERNETES + list(SCALE.values()):
        configs.extend((f"{path.parent.name}/{path.name}:{name}", yaml.safe_load(text))
                       for name, text in _config_maps(path))
    return configs


@pytest.mark.parametrize("where, config", _collector_configs(), ids=[where for where, _ in _collector_configs()])
def test_collector_configs_use_only_keys_of_the_pinned_collector(where, config):
    """Every section, component type and key exists in the pinned Collector (tests/collector_schema.py)."""
    assert schema.config_problems(config) == [], where
    _check_pipelines(config, where)
    for policy in ((config.get("processors") or {}).get("tail_sampling") or {}).get("policies", []):
        assert policy["type"] in schema.TAIL_SAMPLING_POLICY_TYPES, (where, policy)
        assert policy["type"] in policy or policy["type"] == "always_sample", (where, policy)


def test_schema_check_rejects_unknown_keys():
    config = {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "0.0.0.0:4317", "max_recv_msg_size": 64}}}},
              "processors": {"tail_sampling": {"policies": [{"name": "x", "type": "status_code",
                                                             "status_code": {"codes": ["ERROR"]}}]}},
              "exporters": {"otlp_http/x": {}}, "service": {"pipelines": {"traces": {"receiver": ["otlp"]}}}}
    assert schema.config_problems(config) == [
        "receivers.otlp.protocols.grpc.max_recv_msg_size",
        "processors.tail_sampling.policies[0].status_code.codes",
        "exporters.otlp_http/x: no such exporter in the table",
        "service.pipelines.traces.receiver",
    ]


def _collector_images() -> list[str]:
    images = [service["image"] for stack in STACKS for service in _compose(stack)["services"].values()]
    for path in [*KUBERNETES, KUBERNETES_GATEWAY, *SCALE.values()]:
        images.extend(re.findall(r"image:\s*(\S+)", path.read_text()))
    return [image for image in images if "opentelemetry-collector" in image]


def test_collector_images_are_the_version_the_schema_was_read_at():
    images = _collector_images()
    # compose stacks, sidecars (the PyTorchJob's Worker is a YAML alias), the Kubernetes gateway, the scale tiers
    assert len(images) == 2 + 2 + 1 + 3
    assert set(images) == {COLLECTOR_IMAGE}


# ------------------------------------------------------------ deploy/scale/
def _scale(tier: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(SCALE[tier].read_text()) if doc}


def _scale_config(tier: str) -> dict:
    [(_, text)] = _config_maps(SCALE[tier])
    return yaml.safe_load(text)


def _cluster_dns(service: dict, namespace: str = "observability") -> str:
    return f"{service['metadata']['name']}.{namespace}.svc.cluster.local"


def _duration_s(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]


@pytest.mark.parametrize("tier", sorted(SCALE))
def test_scale_tier_workload_runs_its_config(tier):
    docs = _scale(tier)
    workload = docs.get("DaemonSet") or docs["Deployment"]
    spec = workload["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert container["image"] == COLLECTOR_IMAGE
    [(config_map, text)] = _config_maps(SCALE[tier])
    [volume] = spec["volumes"]
    assert volume["configMap"]["name"] == config_map
    [mount] = container["volumeMounts"]
    assert container["args"] == [f"--config={mount['mountPath']}/config.yaml"]
    assert _env_refs(text) <= {item["name"] for item in container.get("env", [])}
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = docs["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    listens = {receiver["endpoint"].rsplit(":", 1)[1]
               for receiver in _scale_config(tier)["receivers"]["otlp"]["protocols"].values()}
    assert listens <= {str(port["port"]) for port in service["spec"]["ports"]}


def test_scale_agents_forward_to_the_gateway_pool_which_routes_by_trace_id():
    agent, gateway, sampler = _scale("agent"), _scale("gateway"), _scale("sampler")
    assert "DaemonSet" in agent and agent["Service"]["spec"]["internalTrafficPolicy"] == "Local"
    for tier in (gateway, sampler):
        assert tier["Service"]["spec"]["clusterIP"] == "None"  # headless: DNS names every pod
    agent_config = _scale_config("agent")
    [(name, exporter)] = agent_config["exporters"].items()
    assert name.split("/")[0] == "otlp_grpc"
    assert exporter["endpoint"] == f"dns:///{_cluster_dns(gateway['Service'])}:4317"
    assert exporter["balancer_name"] == "round_robin"
    assert {p: agent_config["service"]["pipelines"][p]["exporters"] for p in ("traces", "metrics")} == \
        {"traces": [name], "metrics": [name]}
    gateway_config = _scale_config("gateway")
    balancer = gateway_config["exporters"]["loadbalancing/sampler"]
    assert balancer["routing_key"] == "traceID"
    assert balancer["resolver"]["dns"]["hostname"] == _cluster_dns(sampler["Service"])
    assert balancer["resolver"]["dns"]["port"] == "4317"
    pipelines = gateway_config["service"]["pipelines"]
    assert pipelines["traces"]["exporters"] == ["loadbalancing/sampler"]
    assert "batch" not in pipelines["traces"]["processors"]  # the balancer splits batches by trace anyway
    assert pipelines["metrics"]["exporters"] == ["prometheusremotewrite"]
    [container] = gateway["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["PROMETHEUS_REMOTE_WRITE_URL"].endswith("/api/v1/write")


# Names the library sets for tail sampling (the stall and slow-step work defines them in semconv;
# until it lands here, the getattr default is the agreed name).
STALL_NAMES = {"SPAN_STALLED": "stalled", "SPAN_INCOMPLETE": "commdebug.span.incomplete",
               "STEP_STALLED": "commdebug.step.stalled", "STEP_SLOW": "commdebug.step.slow"}
BSP_SCHEDULE_DELAY_S = 5.0  # the SDK's default OTEL_BSP_SCHEDULE_DELAY


def test_tail_sampling_keeps_stalled_failed_slow_steps_and_a_fraction_of_the_rest():
    names = {key: getattr(semconv, key, default) for key, default in STALL_NAMES.items()}
    assert names == STALL_NAMES
    config = _scale_config("sampler")
    sampling = config["processors"]["tail_sampling"]
    assert _duration_s(sampling["decision_wait"]) > BSP_SCHEDULE_DELAY_S
    policies = {policy["name"]: policy for policy in sampling["policies"]}
    assert list(policies) == ["stalled", "failed", "slow", "baseline"]
    stalled = policies["stalled"]["ottl_condition"]
    assert stalled["error_mode"] == "ignore"
    assert stalled["span"] == [
        f'name == "{names["SPAN_STALLED"]}"',
        f'attributes["{names["SPAN_INCOMPLETE"]}"] == true',
        f'name == "{semconv.SPAN_TRAIN_STEP}" and attributes["{names["STEP_STALLED"]}"] == true',
        f'name == "{semconv.SPAN_TRAIN_STEP}" and attributes["{names["STEP_STALLED"]}"] > 0',
    ]
    assert policies["failed"]["status_code"] == {"status_codes": ["ERROR"]}
    assert policies["slow"]["boolean_attribute"] == {"key": names["STEP_SLOW"], "value": True}
    assert 0 < policies["baseline"]["probabilistic"]["sampling_percentage"] < 100
    processors = config["service"]["pipelines"]["traces"]["processors"]
    assert processors.index("tail_sampling") < processors.index("batch")
    # The sampler is the last hop before the backend: it adds the link copies, as the shared config does.
    assert config["processors"]["transform/links"] == _yaml(COLLECTOR_CONFIG)["processors"]["transform/links"]


# ------------------------------------------------- issue 18, part 6: deploy defects
def _grafana_metrics_labels(tags: list[dict], span_tags: dict[str, Any]) -> list[str]:
    """Grafana's ``buildMetricsQuery`` (public/app/features/explore/TraceView/createSpanLink.tsx): a tag becomes
    a label matcher only when the span's value is truthy (``if (tagValue)``), as JavaScript sees it."""
    labels = []
    for tag in tags:
        value = span_tags.get(tag["key"])
        if value not in (None, 0, "", False):
            labels.append(f'{tag.get("value") or tag["key"]}="{value}"')
    return labels


def _set_by_transform(config: dict) -> dict[str, str]:
    """Resource attribute -> the statement of ``transform/links`` that sets it."""
    [context] = config["processors"]["transform/links"]["trace_statements"]
    assert context["context"] == "resource"
    return {re.match(r'set\(attributes\["([^"]+)"\]', statement).group(1): statement
            for statement in context["statements"]}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_trace_to_metrics_link_keeps_rank_0(stack):
    link = _datasources(stack)[stack]["jsonData"]["tracesToMetrics"]
    tags = {tag["key"]: tag["value"] for tag in link["tags"]}
    assert tags == {"commdebug.rank": "torch_distributed_rank", "commdebug.job": "job"}
    config = _yaml(COLLECTOR_CONFIG)
    assert "transform/links" in config["service"]["pipelines"]["traces"]["processors"]
    statements = _set_by_transform(config)
    assert set(tags) <= set(statements)
    copy = f'set(attributes["commdebug.rank"], Concat([attributes["{semconv.RANK}"]], ""))'
    assert statements["commdebug.rank"].startswith(copy)
    # What Grafana builds for rank 0 after the Collector (string copies) and before (the int attribute).
    after = {semconv.RANK: 0, "commdebug.rank": "0", "commdebug.job": "training/llama"}
    assert _grafana_metrics_labels(link["tags"], after) == ['torch_distributed_rank="0"', 'job="training/llama"']
    assert _grafana_metrics_labels([{"key": semconv.RANK, "value": "torch_distributed_rank"}], after) == []
    # commdebug.job is the `job` label of the Collector's Prometheus exporters: namespace/name, or name.
    assert 'Concat([attributes["service.namespace"], attributes["service.name"]], "/")' in statements["commdebug.job"]


def test_tempo_keeps_every_attribute_we_export_whole():
    """Tempo 2.9 truncates string attributes at distributor.max_attribute_bytes (default 2048), counted in bytes."""
    config = _yaml(STACKS["tempo"] / "tempo.yaml")
    assert config["distributor"]["max_attribute_bytes"] >= 4 * MAX_ATTRIBUTE_CHARS  # UTF-8: 4 bytes a character
    override = config["overrides"]["defaults"].get("ingestion", {}).get("max_attribute_bytes", 0)
    assert override == 0 or override >= 4 * MAX_ATTRIBUTE_CHARS  # a per-tenant value above 0 wins


def test_tempo_service_map_only_with_what_feeds_it():
    """A serviceMap needs Tempo's metrics generator (service-graphs) remote-writing to a Prometheus that takes it."""
    json_data = _datasources("tempo")["tempo"]["jsonData"]
    if "serviceMap" not in json_data:
        return
    tempo = _yaml(STACKS["tempo"] / "tempo.yaml")
    assert tempo["metrics_generator"]["storage"]["remote_write"]
    assert "service-graphs" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]
    assert "--web.enable-remote-write-receiver" in _compose("tempo")["services"]["prometheus"]["command"]


def test_kubernetes_gateway_runs_the_shared_config():
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERNETES_GATEWAY.read_text()) if doc}
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    [container] = spec["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert _env_refs(COLLECTOR_CONFIG.read_text()) <= set(env)  # TRACES_OTLP_ENDPOINT: compose is not the only place
    assert env["TRACES_OTLP_ENDPOINT"].endswith(":4317")
    [volume] = spec["volumes"]
    command = re.search(r"kubectl create configmap -n (\S+) (\S+) \\\s*#\s*--from-file=config\.yaml=(\S+)",
                        KUBERNETES_GATEWAY.read_text())
    assert command.group(2) == volume["configMap"]["name"]
    assert ROOT / command.group(3) == COLLECTOR_CONFIG
    [mount] = container["volumeMounts"]
    assert container["args"] == [f"--config={mount['mountPath']}/config.yaml"]
    # The sidecars' OTEL_GATEWAY_ENDPOINT names this Service in the namespace the comment creates it in.
    service = docs["Service"]
    sidecar_targets = set(re.findall(r"value:\s*(\S+\.svc\.cluster\.local:\d+)",
                                     "".join(path.read_text() for path in KUBERNETES)))
    assert sidecar_targets == {f"{_cluster_dns(service, command.group(1))}:4317"}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert {port["port"] for port in service["spec"]["ports"]} <= set(ports.values())
    assert ports["prometheus"] == int(_yaml(COLLECTOR_CONFIG)["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1])


def _dropped_kinds() -> set[str]:
    return {value for name, value in vars(semconv).items()
            if name.startswith("DROPPED_KIND_") and isinstance(value, str)}


def test_dropped_telemetry_panel_describes_every_kind():
    kinds = _dropped_kinds()
    assert {"event", "span", "step_split", "step_full"} <= kinds
    [panel] = [panel for panel in dash.panels(dash.load()) if panel["title"] == "Dropped telemetry"]
    described = set(re.findall(r"(\w+) = ", panel["description"]))
    assert described == kinds
    text = (ROOT / "docs" / "dashboards.md").read_text()
    for kind in kinds:
        assert f"`{kind}`" in text, kind


def _capacity_module():
    spec = importlib.util.spec_from_file_location("capacity", DEPLOY / "scale" / "capacity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _otlp_json_step(step: int) -> str:
    """One OTLP-JSON line (the file exporter's format): a train_step and one module span with one event."""
    trace_id = f"{step + 1:032x}"
    attribute = {"key": "torch.step", "value": {"intValue": str(step)}}
    spans = [{"traceId": trace_id, "spanId": "0" * 15 + "1", "name": semconv.SPAN_TRAIN_STEP, "kind": 1,
              "startTimeUnixNano": "1", "endTimeUnixNano": "9", "attributes": [attribute]},
             {"traceId": trace_id, "spanId": "0" * 15 + "2", "parentSpanId": "0" * 15 + "1", "kind": 1,
              "name": "Net.layer forward", "startTimeUnixNano": "2", "endTimeUnixNano": "8",
              "events": [{"timeUnixNano": "3", "name": "all_reduce"}]}]
    resource = {"attributes": [{"key": semconv.RANK, "value": {"intValue": "0"}}]}
    return json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [
        {"scope": {"name": "commdebug_otel"}, "spans": spans}]}]})


def test_capacity_script_counts_each_traced_step(tmp_path):
    capacity = _capacity_module()
    traces = tmp_path / "traces-rank0.jsonl"
    traces.write_text("\n".join(_otlp_json_step(step) for step in range(3)) + "\n")
    sizes = capacity.step_sizes(traces)
    assert [(size.spans, size.events) for size in sizes] == [(2, 1)] * 3
    step = capacity.typical(sizes)
    assert 0 < step.gzip_bytes and 0 < step.protobuf_bytes < len(_otlp_json_step(1))
    rows = capacity.table(step, step_time_s=2.0).splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [["| 1", "1,000"], ["| 10", "100"], ["| 100", "10"]]


def test_readme_gives_the_scale_deployment_and_its_capacity():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("deploy/scale/sampler.yaml", "loadbalancing", "routing_key: traceID", "tail_sampling",
                   "--web.enable-remote-write-receiver", "python deploy/scale/capacity.py", "1 s per step"):
        assert needle in text, needle
    rows = re.findall(r"^\| (1|10|100) \| ([\d,]+) \|", text, re.MULTILINE)
    assert [every for every, _ in rows] == ["1", "10", "100"]
    spans = [int(count.replace(",", "")) for _, count in rows]
    assert spans[0] == 10 * spans[1] == 100 * spans[2]


# ------------------------------------------------------ reaching the stack, viewing on Kubernetes
KUBERNETES_VIEWING = DEPLOY / "kubernetes" / "viewing.yaml"


def _readme_section(title: str) -> str:
    text = (DEPLOY / "README.md").read_text()
    start = text.index(f"\n{title}\n")
    following = re.search(r"\n#{2,3} ", text[start + len(title) + 2:])
    return text[start:start + len(title) + 2 + (following.start() if following else len(text))]


def test_the_pull_path_scrapes_every_local_rank_of_an_8_gpu_node():
    jobs = {job["job_name"]: job for job in _yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    targets = [t for static in jobs["commdebug-workers"]["static_configs"] for t in static["targets"]]
    # OTEL_EXPORTER_PROMETHEUS_PORT's default (9464) plus the local rank, as ExportEnv.prometheus_port gives it
    from commdebug_otel.config import ExportEnv

    ports = [ExportEnv.from_env({}).prometheus_port(local_rank) for local_rank in range(8)]
    assert targets == [f"host.docker.internal:{port}" for port in ports]
    assert f"`host.docker.internal:{ports[0]}`-`{ports[-1]}`" in (DEPLOY / "README.md").read_text()


def test_your_own_job_switches_tracing_on_and_says_how_to_reach_the_collector_from_elsewhere():
    own = _readme_section("## Your own job")
    assert "export OTEL_PYTHON_COMMDEBUG_ENABLED=true\n" in own
    known = {option.env for option in OPTIONS}
    assert set(re.findall(r"OTEL_PYTHON_COMMDEBUG_\w+", own)) <= known
    elsewhere = _readme_section("### When the job runs in a container or on another host")
    for stack in STACKS:
        compose = _compose(stack)
        network = f"{compose['name']}_default"  # compose's default network: the project name, then _default
        assert f"`{network}`" in elsewhere
        ports = compose["services"]["otel-collector"]["ports"][:2]
        assert [_published(port)[1] for port in ports] == ["4317", "4318"]
    assert "`http://otel-collector:4317`" in elsewhere and "--network commdebug-jaeger_default" in elsewhere
    assert "--add-host=host.docker.internal:host-gateway" in elsewhere
    health = _yaml(COLLECTOR_CONFIG)["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    assert f"http://STACK-HOST:{health}" in elsewhere


def _viewing() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(KUBERNETES_VIEWING.read_text())
            if doc}


def test_kubernetes_viewing_stack_is_made_from_the_compose_stacks_files():
    docs = _viewing()
    text = KUBERNETES_VIEWING.read_text()
    made = {name: (key, ROOT / source) for name, key, source in re.findall(
        r"kubectl create configmap -n observability (\S+) \\\s*#\s*--from-file=([^=\s]+)=(\S+)", text)}
    assert all(source.is_file() for _, source in made.values())
    compose = _compose("jaeger")["services"]
    for name in ("jaeger", "prometheus", "grafana"):
        spec = docs[("Deployment", name)]["spec"]["template"]["spec"]
        [container] = spec["containers"]
        assert container["image"] == compose[name]["image"]  # the versions the stacks pin
        maps = {volume["name"]: volume["configMap"]["name"] for volume in spec["volumes"] if "configMap" in volume}
        assert set(maps.values()) <= set(made), set(maps.values()) - set(made)
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        # Each ConfigMap's key lands where the compose stack mounts the same file.
        compose_mounts = {target for entry in compose[name].get("volumes", []) if ":" in entry
                          for target in [entry.split(":")[1]]}
        for volume, config_map in maps.items():
            key, source = made[config_map]
            path = f"{mounts[volume]}/{key}"
            assert path in compose_mounts or f"{mounts[volume]}" in compose_mounts, (name, path)
    # The Grafana data sources' URLs and the gateway's trace endpoint name these Services on their ports.
    services = {name: {port["port"] for port in doc["spec"]["ports"]} for (kind, name), doc in docs.items()
                if kind == "Service"}
    for source in _yaml(STACKS["jaeger"] / "grafana" / "datasources.yaml")["datasources"]:
        host, port = re.match(r"https?://([^:/]+):(\d+)", source["url"]).groups()
        assert int(port) in services[host], source["url"]
    gateway = {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERNETES_GATEWAY.read_text()) if doc}
    [container] = gateway["Deployment"]["spec"]["template"]["spec"]["containers"]
    endpoint = {item["name"]: item["value"] for item in container["env"]}["TRACES_OTLP_ENDPOINT"]
    assert endpoint == f"{_cluster_dns(docs[('Service', 'jaeger')], 'observability')}:4317"
    # The shared Prometheus config scrapes the gateway Service's exporter port by its name.
    jobs = {job["job_name"]: job for job in _yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    [target] = jobs["otel-collector"]["static_configs"][0]["targets"]
    name, port = target.split(":")
    assert name == gateway["Service"]["metadata"]["name"]
    assert int(port) in {p["port"] for p in gateway["Service"]["spec"]["ports"]}
    readme = (DEPLOY / "README.md").read_text()
    for config_map, (key, source) in made.items():
        assert f"{config_map} \\\n    --from-file={key}={source.relative_to(ROOT)}" in readme, config_map
    assert "Dashboards → New → Import" in readme


def test_the_dashboard_names_no_data_source_uid():
    dashboard = dash.load()
    [variable] = [var for var in dash.variables(dashboard).values() if var["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("datasource", "prometheus")
    assert dash.datasource_uids(dashboard) == {"${datasource}"}
    # Provisioned stacks start on their own Prometheus (uid prometheus).
    assert variable["current"]["value"] == "prometheus"
    for stack in STACKS:
        assert "prometheus" in _datasources(stack)
