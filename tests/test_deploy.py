"""deploy/: Kubernetes manifests, Prometheus config and alerts, Grafana dashboard, checked by tools.

- Kubernetes objects are deserialised into the official `kubernetes` client's models and
  serialised back: a misspelt or misplaced field is dropped on the way and the round trip differs;
  a missing required field raises.
- `promtool check config`, `promtool check rules` and `promtool test rules` run when promtool is
  installed (Debian's `prometheus` package has it).
- Every `radixserve:*` metric name in the alerts and the dashboard is one a real server or the
  router exports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S_KINDS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service"}
METRIC_RE = re.compile(r"radixserve:[a-zA-Z0-9_:]+")


def _k8s_objects() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _drop_none(x):
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


def test_kubernetes_objects_round_trip_through_the_official_models():
    import kubernetes  # a test dependency: missing, it fails rather than skips

    api = kubernetes.client.ApiClient()
    docs = _k8s_objects()
    assert {(d["apiVersion"], d["kind"]) for d in docs} == set(K8S_KINDS)
    for doc in docs:
        model = api._ApiClient__deserialize(doc, K8S_KINDS[(doc["apiVersion"], doc["kind"])])
        back = _drop_none(api.sanitize_for_serialization(model))
        assert back == doc, f"{doc['kind']}/{doc['metadata']['name']}: fields lost or changed in the round trip"
    # The check has teeth: a misspelt field is lost, a missing required one refused.
    import copy

    bad = copy.deepcopy(docs[0])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 1}}
    assert _drop_none(api.sanitize_for_serialization(api._ApiClient__deserialize(bad, "V1Deployment"))) != bad
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError):
        api._ApiClient__deserialize(bad, "V1Deployment")


def test_kubernetes_objects_fit_together():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s_objects()}
    for name in ("radixserve-worker", "radixserve-router"):
        dep, svc = docs[("Deployment", name)], docs[("Service", name)]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["resources"]["limits"]["cpu"]
    # A worker exits when its engine dies: something must restart it, and SIGTERM's drain must fit
    # in the grace period.
    for name in ("radixserve-worker", "radixserve-router"):
        assert docs[("Deployment", name)]["spec"]["template"]["spec"]["restartPolicy"] == "Always"
    pod = docs[("Deployment", "radixserve-worker")]["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    drain = next(float(a.split("=", 1)[1]) for a in worker["args"] if a.startswith("--graceful-shutdown-timeout="))
    assert drain + 10 <= pod["terminationGracePeriodSeconds"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/health"
    # The flags in the manifests are ones the launchers accept.
    from radixserve.launch_router import build_parser as router_parser
    from radixserve.launch_server import build_parser as server_parser

    server_parser().parse_args(worker["args"])
    router = docs[("Deployment", "radixserve-router")]["spec"]["template"]["spec"]["containers"][0]
    router_parser().parse_args(router["args"])
    # Both cap their connections below the open-file limit (slow clients must not use it up).
    assert any(a.startswith("--max-connections=") for a in worker["args"])
    assert any(a.startswith("--max-connections=") for a in router["args"])
    # The router URL the workers register with is the router Service.
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["ROUTER_URL"] == "http://radixserve-router:8000"


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def test_alert_rules_cover_the_runbook():
    rules = {r["alert"]: r for r in _alert_rules()}
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["for"]
    assert "radixserve:prefix_hit_rate" in rules["RadixservePrefixHitRateLow"]["expr"]
    assert "> 50" in rules["RadixserveQueueTooLong"]["expr"]
    assert "radixserve:token_usage > 0.95" in rules["RadixserveKVUsageHigh"]["expr"]
    assert "radixserve:kv_fragmentation > 0.15" in rules["RadixserveKVFragmentationHigh"]["expr"]
    assert "RadixserveWorkerDown" in rules


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")
@pytest.mark.parametrize("args", [["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                                  ["test", "rules", "alerts_test.yml"]])
def test_promtool(args):
    run = subprocess.run(["promtool", *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def _exported_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names |= {name + "_total", name.removesuffix("_total") + "_total"}
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_alerts_and_dashboard_use_metrics_that_exist(server):
    with server.client() as c:
        r = c.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        server_text = c.get("/metrics").text
    from radixserve.router.app import Router, RouterSettings

    router = Router(RouterSettings(worker_urls=("http://127.0.0.1:9",)))
    exported = _exported_names(server_text) | _exported_names(router.metrics.render().decode())
    used = set()
    for rule in _alert_rules():
        used |= set(METRIC_RE.findall(rule["expr"]))
    dashboard = json.loads((DEPLOY / "grafana" / "radixserve-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(METRIC_RE.findall(target["expr"]))
    assert len(used) >= 15
    missing = sorted(used - exported)
    assert not missing, f"not exported by the server or router: {missing}"


# ============================================================================ llm-d / Inference Extension
# deploy/llm-d: the workers as an InferencePool's model servers behind llm-d's endpoint picker.
# The core objects go through the official Kubernetes client's models as above. No PyPI package
# ships the Gateway API Inference Extension's or Gateway API's CRDs, and nothing may be downloaded
# here, so InferencePool and HTTPRoute are checked against minimal JSON schemas written from the
# published CRDs' field names, types, required fields, enums and bounds
# (inference.networking.k8s.io_inferencepools.yaml of the Inference Extension v1.6.0;
# gateway.networking.k8s.io_httproutes.yaml of Gateway API's standard channel, v1), every object closed to fields the
# CRD does not have; the picker's EndpointPickerConfig likewise from its published Go types
# (llm-d's inference scheduler, and llm-d-kv-cache's config for the precise prefix-cache scorer).

LLMD = DEPLOY / "llm-d"
LLMD_CORE_KINDS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
                   ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "ServiceAccount"): "V1ServiceAccount",
                   ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
                   ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_GROUP = {"type": "string", "maxLength": 253,
          "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def _closed(properties: dict, required: tuple = (), **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
            **extra}


_METADATA = {"type": "object", "required": ["name"], "properties": {"name": _NAME}}
INFERENCE_POOL_SCHEMA = _closed({
    "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
    "metadata": _METADATA,
    "spec": _closed({
        "selector": _closed({"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                             "additionalProperties": _LABEL_VALUE}}, ("matchLabels",)),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                        "items": _closed({"number": _PORT}, ("number",))},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": _closed({"group": _GROUP, "kind": _KIND, "name": _NAME,
                                      "port": _closed({"number": _PORT}, ("number",)),
                                      "failureMode": {"enum": ["FailOpen", "FailClose"]}}, ("name",)),
    }, ("selector", "targetPorts")),
}, ("apiVersion", "kind", "metadata", "spec"))
_PARENT_REF = _closed({"group": _GROUP, "kind": _KIND, "namespace": _NAME, "name": _NAME,
                       "sectionName": _NAME, "port": _PORT}, ("name",))
_BACKEND_REF = _closed({"group": _GROUP, "kind": _KIND, "name": _NAME, "namespace": _NAME, "port": _PORT,
                        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "filters": {"type": "array"}}, ("name",))
_ROUTE_MATCH = _closed({"path": _closed({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                         "value": {"type": "string", "maxLength": 1024}}),
                        "headers": {"type": "array"}, "queryParams": {"type": "array"},
                        "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                                            "PATCH"]}})
HTTP_ROUTE_SCHEMA = _closed({
    "apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"const": "HTTPRoute"}, "metadata": _METADATA,
    "spec": _closed({
        "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
        "hostnames": {"type": "array", "items": {"type": "string"}},
        "rules": {"type": "array", "maxItems": 16, "items": _closed({
            "name": _NAME, "matches": {"type": "array", "maxItems": 64, "items": _ROUTE_MATCH},
            "filters": {"type": "array"}, "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
            "timeouts": _closed({"request": _DURATION, "backendRequest": _DURATION})})},
    }),
}, ("apiVersion", "kind", "metadata", "spec"))
_UDS = _closed({"socketFile": {"type": "string", "minLength": 1}, "useTCP": {"type": "boolean"}}, ("socketFile",))
PRECISE_SCORER_PARAMS_SCHEMA = _closed({
    "tokenProcessorConfig": _closed({"blockSize": {"type": "integer", "minimum": 1},
                                     "blockSizeTokens": {"type": "integer", "minimum": 1},
                                     "hashSeed": {"type": "string"}}),
    "indexerConfig": _closed({
        "prefixStoreConfig": {"type": "object"}, "kvCacheBackendConfigs": {"type": "array"},
        "kvBlockIndexConfig": _closed({"inMemoryConfig": {"type": "object"}, "redisConfig": {"type": "object"},
                                       "valkeyConfig": {"type": "object"}, "costAwareMemoryConfig": {"type": "object"},
                                       "enableMetrics": {"type": "boolean"},
                                       "metricsLoggingInterval": {"type": "integer"}}),
        "tokenizersPoolConfig": _closed({"modelName": {"type": "string", "minLength": 1},
                                         "workersCount": {"type": "integer"}, "uds": _UDS}, ("modelName",)),
    }),
    "kvEventsConfig": _closed({"zmqEndpoint": {"type": "string"}, "topicFilter": {"type": "string"},
                               "concurrency": {"type": "integer", "minimum": 1},
                               "engineType": {"enum": ["vllm", "sglang"]}, "discoverPods": {"type": "boolean"},
                               "podDiscoveryConfig": {"type": "object"}}),
})
EPP_CONFIG_SCHEMA = _closed({
    "apiVersion": {"const": "inference.networking.x-k8s.io/v1alpha1"}, "kind": {"const": "EndpointPickerConfig"},
    "featureGates": {"type": "array"}, "saturationDetector": {"type": "object"}, "dataLayer": {"type": "object"},
    "flowControl": {"type": "object"}, "requestHandler": {"type": "object"}, "parser": {"type": "object"},
    "plugins": {"type": "array", "minItems": 1, "items": _closed(
        {"name": {"type": "string"}, "type": {"type": "string", "minLength": 1}, "parameters": {"type": "object"}},
        ("type",))},
    "schedulingProfiles": {"type": "array", "minItems": 1, "items": _closed(
        {"name": {"type": "string", "minLength": 1}, "plugins": {"type": "array", "minItems": 1, "items": _closed(
            {"pluginRef": {"type": "string", "minLength": 1}, "weight": {"type": "number"}}, ("pluginRef",))}},
        ("name", "plugins"))},
}, ("apiVersion", "kind", "plugins", "schedulingProfiles"))
LLMD_CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_SCHEMA,
                    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_SCHEMA}


def _llmd_objects() -> list[dict]:
    docs = []
    for path in sorted(LLMD.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _llmd(kind: str, name: str) -> dict:
    (doc,) = [d for d in _llmd_objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _epp_config() -> dict:
    return yaml.safe_load(_llmd("ConfigMap", "radixserve-epp-config")["data"]["epp-config.yaml"])


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def test_llmd_objects_match_their_schemas():
    import copy

    import jsonschema
    import kubernetes

    api = kubernetes.client.ApiClient()
    docs = _llmd_objects()
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    assert kinds == set(LLMD_CORE_KINDS) | set(LLMD_CRD_SCHEMAS), kinds
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in LLMD_CRD_SCHEMAS:
            jsonschema.validate(doc, LLMD_CRD_SCHEMAS[key])
        else:
            model = api._ApiClient__deserialize(doc, LLMD_CORE_KINDS[key])
            assert _drop_none(api.sanitize_for_serialization(model)) == doc, f"{doc['kind']}/{doc['metadata']['name']}"
    config = _epp_config()
    jsonschema.validate(config, EPP_CONFIG_SCHEMA)
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    jsonschema.validate(scorer["parameters"], PRECISE_SCORER_PARAMS_SCHEMA)
    # The schemas have teeth: the pre-v1 spelling of the picker's port, a missing selector, an
    # unknown scorer field are all refused.
    pool = copy.deepcopy(_llmd("InferencePool", "radixserve-pool"))
    pool["spec"]["endpointPickerRef"]["portNumber"] = 9002
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    del pool["spec"]["endpointPickerRef"]["portNumber"], pool["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    bad = copy.deepcopy(scorer["parameters"])
    bad["kvEventsConfig"]["zmqEndPoint"] = "tcp://*:5557"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, PRECISE_SCORER_PARAMS_SCHEMA)


def test_llmd_objects_fit_together():
    from radixserve.kv_events_config import binds, parse_kv_events_config
    from radixserve.launch_server import build_parser as server_parser

    pool = _llmd("InferencePool", "radixserve-pool")
    worker_dep = _llmd("Deployment", "radixserve-llmd-worker")
    pod = worker_dep["spec"]["template"]
    (worker,) = pod["spec"]["containers"]
    args = worker["args"]
    # The pool selects the worker pods, on the port they serve; the picker's reference is its Service.
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert worker_dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ((target,),) = [[p["number"] for p in pool["spec"]["targetPorts"]]]
    assert target == int(_flag(args, "--port")) == worker["ports"][0]["containerPort"]
    # The picker reads vLLM's gauge names, which a real server exports (test_metrics_the_picker_reads).
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    epp_svc = _llmd("Service", pool["spec"]["endpointPickerRef"]["name"])
    svc_ports = {p["name"]: p for p in epp_svc["spec"]["ports"]}
    assert svc_ports["grpc"]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    route = _llmd("HTTPRoute", "radixserve-route")
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    # The picker watches this pool, with its config, and may read pods and pools.
    epp_dep = _llmd("Deployment", "radixserve-epp")
    epp_spec = epp_dep["spec"]["template"]["spec"]
    epp = next(c for c in epp_spec["containers"] if c["name"] == "epp")
    assert _flag(epp["args"], "--pool-name") == pool["metadata"]["name"]
    assert epp_dep["spec"]["template"]["metadata"]["labels"].items() >= epp_svc["spec"]["selector"].items()
    config_mount = next(m["mountPath"] for m in epp["volumeMounts"] if m["name"] == "config")
    assert _flag(epp["args"], "--config-file") == config_mount + "/epp-config.yaml"
    role = _llmd("Role", "radixserve-epp")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    assert _llmd("RoleBinding", "radixserve-epp")["subjects"][0]["name"] == epp_spec["serviceAccountName"]
    # The worker's flags are ones launch_server takes, with Kubernetes' $(VAR)s filled in.
    env = {e["name"] for e in worker["env"]}
    filled = [a.replace("$(NAMESPACE)", "default").replace("$(POD_IP)", "10.0.0.7") for a in args]
    assert all(v in env for a in args for v in re.findall(r"\$\((\w+)\)", a))
    server_parser().parse_args(filled)
    events = parse_kv_events_config(_flag(filled, "--kv-events-config"))
    # Events: the worker connects to the picker's bound SUB socket through its Service, in blocks of
    # the page size the scorer hashes with, on a topic naming the pod by the endpoint the picker
    # knows (IP:port) and the model the picker tokenizes for and clients ask for.
    config = _epp_config()
    (scorer,) = [p["parameters"] for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    kv = scorer["kvEventsConfig"]
    assert events.publishes and not binds(events.endpoint) and binds(kv["zmqEndpoint"]) and not kv["discoverPods"]
    zmq_port = int(kv["zmqEndpoint"].rpartition(":")[2])
    epp_host = f"{epp_svc['metadata']['name']}.default.svc.cluster.local"
    assert events.endpoint == f"tcp://{epp_host}:{svc_ports['zmq']['port']}"
    assert svc_ports["zmq"]["targetPort"] in {p["name"] for p in epp["ports"] if p["containerPort"] == zmq_port}
    assert scorer["tokenProcessorConfig"]["blockSize"] == int(_flag(args, "--page-size"))
    model = _flag(args, "--served-model-name")
    assert events.topic.startswith(kv["topicFilter"])
    assert events.topic == f"kv@10.0.0.7:{target}@{model}"
    tokenizer = next(p["parameters"] for p in config["plugins"] if p["type"] == "tokenizer")
    assert tokenizer["modelName"] == scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == model
    # Every profile entry names a plugin that is defined.
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    assert {e["pluginRef"] for prof in config["schedulingProfiles"] for e in prof["plugins"]} <= defined


def test_metrics_the_picker_reads(server):
    """llm-d's metric names for engine-type vllm (its model-server protocol): queue, running, KV
    usage, and the block size / block count labels of vllm:cache_config_info."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    names = _exported_names(text)
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info"} <= names
    (info,) = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert int(labels["block_size"]) >= 1 and int(labels["num_gpu_blocks"]) >= 1
