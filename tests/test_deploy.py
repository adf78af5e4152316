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
