"""Sidecar injection: a real AdmissionReview in, a JSONPatch out, applied to the pod and checked."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
from cryptography.hazmat.primitives import serialization

from sidecar.injection import A_TRUST, CONTAINER_NAME, TOKEN_VOLUME, VOLUME_NAME, InjectorSettings, decide
from sidecar.webhook import review_response
from sie.auth import Identity, Signer
from sie.auth.pki import CertificateAuthority
from sie.auth.tls import trust_bundle
from sie.auth.tokens import public_pem
from sie.spec_loader import load_model_services

ROOT = Path(__file__).resolve().parents[3]
CONTROL_URL = "https://sie-xds.sie-system.svc:8000"
SIGNER = Signer.generate()
CA = CertificateAuthority.generate()
# A trust bundle as the credentials Job makes it (the public key, then the CA's certificate), read as the
# webhook reads its --trust-file (stripped): several PEM blocks in one annotation.
TRUST = trust_bundle(public_pem(SIGNER.public), CA.cert_pem).decode().strip()
SETTINGS = InjectorSettings(sidecar_image="registry.internal/sie:0.1.0", control_url=CONTROL_URL, trust_pem=TRUST)


def qwen_spec_json() -> str:
    (service,) = load_model_services(ROOT / "examples" / "qwen2-7b-scoring.yaml")
    return json.dumps(service.to_dict())


def review() -> dict:
    doc = json.loads((Path(__file__).parent / "data" / "admission-review-pod.json").read_text())
    doc["request"]["object"]["metadata"]["annotations"]["sie.io/spec"] = qwen_spec_json()
    return doc


def pod() -> dict:
    return review()["request"]["object"]


def patched(original: dict, answer: dict) -> dict:
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    return jsonpatch.apply_patch(original, patch)


def test_review_in_patch_out_adds_sidecar_and_changes_nothing_else():
    doc = review()
    answer = review_response(doc, SETTINGS)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == doc["request"]["uid"]
    assert answer["response"]["allowed"] is True and answer["response"]["patchType"] == "JSONPatch"

    original = doc["request"]["object"]
    after = patched(original, answer)

    sidecar = after["spec"]["containers"][-1]
    assert sidecar["name"] == CONTAINER_NAME and sidecar["image"] == "registry.internal/sie:0.1.0"
    args = sidecar["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {
        "--instance-id": "$(POD_NAME)",
        "--spec-file": "/etc/sie/modelservice.json",
        "--listen": "0.0.0.0:8081",
        "--control-listen": "0.0.0.0:8082",
        "--worker-url": "http://127.0.0.1:3000",
        "--control-url": CONTROL_URL,
        "--token-file": "/var/run/secrets/sie/token",
        "--trust-file": "/etc/sie/trust.pem",
        "--node": "$(NODE_NAME)",
        "--address": "$(POD_IP):8081",
    }
    assert sidecar["ports"] == [
        {"name": "sie-sidecar", "containerPort": 8081, "protocol": "TCP"},
        {"name": "sie-control", "containerPort": 8082, "protocol": "TCP"},
    ]
    # The probes are on the control listener; the data listener serves the model's inference paths only.
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": 8082}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8082}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]}
    assert env == {"POD_NAME": "metadata.name", "NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    spec_volume, token_volume = after["spec"]["volumes"][-2:]
    assert spec_volume["name"] == VOLUME_NAME
    assert [i["fieldRef"]["fieldPath"] for i in spec_volume["downwardAPI"]["items"]] == [
        "metadata.annotations['sie.io/spec']",
        "metadata.annotations['sie.io/trust']",
    ]
    assert after["metadata"]["annotations"][A_TRUST] == TRUST
    # The sidecar's identity: a projected token for the audience `sie` only, which TokenReview checks.
    source = token_volume["projected"]["sources"][0]["serviceAccountToken"]
    assert token_volume["name"] == TOKEN_VOLUME and source["audience"] == "sie" and source["expirationSeconds"] <= 3600
    assert sidecar["volumeMounts"] == [
        {"name": VOLUME_NAME, "mountPath": "/etc/sie", "readOnly": True},
        {"name": TOKEN_VOLUME, "mountPath": "/var/run/secrets/sie", "readOnly": True},
    ]
    # Hardened, and not root: it reads its token and spec through the pod's fsGroup (the pod named none).
    assert sidecar["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert after["spec"]["securityContext"] == {"fsGroup": 10001}

    # Nothing else changed: removing what was added gives back the original, byte for byte.
    undone = copy.deepcopy(after)
    undone["spec"]["containers"].pop()
    del undone["spec"]["volumes"][-2:]
    del undone["metadata"]["annotations"][A_TRUST]
    del undone["spec"]["securityContext"]["fsGroup"]
    assert undone == original

    # The injected pod is a valid Pod for the Kubernetes API (strict: no unknown fields).
    kubernetes_validate.validate(after, "1.32", strict=True)


@pytest.mark.parametrize(
    ("security", "expected"),
    [
        (None, {"fsGroup": 10001}),  # JSON Patch cannot add into an absent object: it is created
        (
            {"seccompProfile": {"type": "RuntimeDefault"}},
            {"seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 10001},
        ),
        ({"fsGroup": 2000}, {"fsGroup": 2000}),  # kept: every container has it as a group, the sidecar too
    ],
)
def test_the_pods_fs_group_is_set_only_when_it_has_none(security, expected):
    p = pod()
    if security is None:
        del p["spec"]["securityContext"]
    else:
        p["spec"]["securityContext"] = security
    after = jsonpatch.apply_patch(p, list(decide(p, SETTINGS).patch))
    assert after["spec"]["securityContext"] == expected
    kubernetes_validate.validate(after, "1.32", strict=True)


def test_pod_without_volumes_gets_the_volume_list_created():
    doc = review()
    obj = doc["request"]["object"]
    del obj["spec"]["volumes"]
    del obj["spec"]["containers"][0]["volumeMounts"]
    after = patched(obj, review_response(doc, SETTINGS))
    assert [v["name"] for v in after["spec"]["volumes"]] == [VOLUME_NAME, TOKEN_VOLUME]
    assert [c["name"] for c in after["spec"]["containers"]] == ["worker", CONTAINER_NAME]


def test_ports_come_from_the_annotations():
    p = pod()
    p["metadata"]["annotations"].update(
        {"sie.io/worker-port": "30000", "sie.io/sidecar-port": "9000", "sie.io/control-port": "9001"}
    )
    p["spec"]["containers"][0]["ports"][0]["containerPort"] = 30000
    decision = decide(p, SETTINGS)
    after = jsonpatch.apply_patch(p, list(decision.patch))
    sidecar = after["spec"]["containers"][-1]
    assert "http://127.0.0.1:30000" in sidecar["args"] and "0.0.0.0:9000" in sidecar["args"]
    assert "0.0.0.0:9001" in sidecar["args"] and sidecar["readinessProbe"]["httpGet"]["port"] == 9001


@pytest.mark.parametrize("where", ["annotations", "labels"])
def test_label_or_annotation_requests_injection(where):
    p = pod()
    other = "labels" if where == "annotations" else "annotations"
    del p["metadata"][other]["sie.io/inject"]
    assert p["metadata"][where]["sie.io/inject"] == "true"
    assert decide(p, SETTINGS).patch


@pytest.mark.parametrize(
    "labels,annotations", [({}, {}), ({"sie.io/inject": "false"}, {}), ({}, {"sie.io/inject": "false"})]
)
def test_pods_that_do_not_ask_are_left_alone(labels, annotations):
    p = pod()
    p["metadata"]["labels"] = {k: v for k, v in p["metadata"]["labels"].items() if k != "sie.io/inject"} | labels
    p["metadata"]["annotations"] = {
        k: v for k, v in p["metadata"]["annotations"].items() if k != "sie.io/inject"
    } | annotations
    decision = decide(p, SETTINGS)
    assert decision.allowed and decision.patch == ()


def test_already_injected_pod_is_left_alone():
    doc = review()
    once = patched(doc["request"]["object"], review_response(doc, SETTINGS))
    doc["request"]["object"] = once
    answer = review_response(doc, SETTINGS)
    assert answer["response"] == {"uid": doc["request"]["uid"], "allowed": True}


def _with(annotations: dict[str, str | None]) -> dict:
    p = pod()
    for key, value in annotations.items():
        if value is None:
            p["metadata"]["annotations"].pop(key, None)
        else:
            p["metadata"]["annotations"][key] = value
    return p


@pytest.mark.parametrize(
    "change,named,reason",
    [
        ({"sie.io/inject": "yes"}, "sie.io/inject", 'must be "true" or "false"'),
        ({"sie.io/model-id": None}, "sie.io/model-id", "required"),
        ({"sie.io/model-id": "Qwen_7B"}, "sie.io/model-id", "not a model id"),
        ({"sie.io/model-id": "other-model"}, "sie.io/model-id", "differs from the model in sie.io/spec"),
        ({"sie.io/spec": None}, "sie.io/spec", "required"),
        ({"sie.io/spec": "{not json"}, "sie.io/spec", "not valid JSON"),
        ({"sie.io/spec": json.dumps({"spec": {"model": {"name": "x"}}})}, "sie.io/spec", "spec.backend"),
        ({"sie.io/priority": "P7"}, "sie.io/priority", "is not one of P0, P1, P2"),
        ({"sie.io/priority": "P0"}, "sie.io/priority", "differs from sie.io/spec (P1)"),
        ({"sie.io/service-type": "chat"}, "sie.io/service-type", "is not one of"),
        ({"sie.io/p99-latency-ms": "fast"}, "sie.io/p99-latency-ms", "is not a number"),
        ({"sie.io/p99-latency-ms": "0"}, "sie.io/p99-latency-ms", "must be above 0"),
        ({"sie.io/p99-latency-ms": "500"}, "sie.io/p99-latency-ms", "differs from sie.io/spec (350.0)"),
        ({"sie.io/max-queue-time-ms": "-1"}, "sie.io/max-queue-time-ms", "must be at least 0"),
        ({"sie.io/max-concurrent-requests": "2.5"}, "sie.io/max-concurrent-requests", "is not an integer"),
        ({"sie.io/max-concurrent-requests": "0"}, "sie.io/max-concurrent-requests", "must be at least 1"),
        ({"sie.io/worker-port": "70000"}, "sie.io/worker-port", "must be between 1 and 65535"),
        ({"sie.io/sidecar-port": "3000"}, "sie.io/sidecar-port", "is also the worker port"),
    ],
)
def test_invalid_annotations_are_refused_naming_the_annotation(change, named, reason):
    doc = review()
    doc["request"]["object"] = _with(change)
    answer = review_response(doc, SETTINGS)["response"]
    assert answer["allowed"] is False and "patch" not in answer
    message = answer["status"]["message"]
    assert f"{named}:" in message and reason in message, message
    assert answer["status"]["code"] == 400


def test_sidecar_port_taken_by_another_container_is_refused():
    p = _with({"sie.io/sidecar-port": "9090"})
    p["spec"]["containers"][0]["ports"].append({"name": "metrics", "containerPort": 9090})
    decision = decide(p, SETTINGS)
    assert not decision.allowed and "sie.io/sidecar-port: port 9090 is already used" in decision.message


def test_sla_annotations_are_optional():
    p = _with(
        {
            k: None
            for k in (
                "sie.io/priority",
                "sie.io/service-type",
                "sie.io/p99-latency-ms",
                "sie.io/max-queue-time-ms",
                "sie.io/max-concurrent-requests",
            )
        }
    )
    assert decide(p, SETTINGS).patch


def test_non_pod_and_non_create_requests_pass_untouched():
    doc = review()
    doc["request"]["operation"] = "UPDATE"
    assert review_response(doc, SETTINGS)["response"] == {"uid": doc["request"]["uid"], "allowed": True}


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"kind": "Pod"}, "expected an AdmissionReview"),
        (
            {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "1"}},
            "admissionReviewVersions",
        ),
        ({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {}}, "request.uid"),
    ],
)
def test_malformed_reviews_raise_with_the_reason(body, needle):
    with pytest.raises(ValueError, match=needle):
        review_response(body, SETTINGS)


def test_the_sidecar_accepts_the_injected_command_line_and_spec_file(tmp_path):
    """What the kubelet would run: $(VAR)s expanded, the downwardAPI file holding the sie.io/spec annotation."""
    from sidecar.settings import parse_settings

    p = pod()
    after = jsonpatch.apply_patch(p, list(decide(p, SETTINGS).patch))
    sidecar = after["spec"]["containers"][-1]
    spec_file = tmp_path / "modelservice.json"
    spec_file.write_text(after["metadata"]["annotations"]["sie.io/spec"])
    trust_file = tmp_path / "trust.pem"
    trust_file.write_text(after["metadata"]["annotations"][A_TRUST])
    env = {"$(POD_NAME)": "qwen2-7b-scoring-6d9f7c8b5d-x7k2p", "$(NODE_NAME)": "gpu-1", "$(POD_IP)": "10.1.0.7"}
    args = []
    for arg in sidecar["args"]:
        for var, value in env.items():
            arg = arg.replace(var, value)
        args.append({"/etc/sie/modelservice.json": str(spec_file), "/etc/sie/trust.pem": str(trust_file)}.get(arg, arg))
    assert sidecar["command"] == ["python", "-m", "sidecar"]
    settings = parse_settings(args)
    assert settings.spec.model_id == "qwen2-7b-scoring" and settings.spec.spec.sla.p99_latency_ms == 350
    assert (settings.instance_id, settings.node, settings.address) == (
        "qwen2-7b-scoring-6d9f7c8b5d-x7k2p",
        "gpu-1",
        "10.1.0.7:8081",
    )
    assert settings.worker_url == "http://127.0.0.1:3000" and settings.listen_port == 8081
    assert (settings.control_port, str(settings.token_file)) == (8082, "/var/run/secrets/sie/token")
    assert settings.control_url == CONTROL_URL


def test_the_default_control_url_is_the_admin_apis_https_one():
    """The admin API serves TLS only (Secret sie-admin-tls); the webhook's flag defaults to the same."""
    from sidecar.webhook import _parse

    assert InjectorSettings().control_url == CONTROL_URL
    assert _parse(["--self-signed=sie-webhook.sie-system.svc", "--trust-file=trust.pem"]).control_url == CONTROL_URL


def test_the_injected_trust_bundle_reaches_the_sidecar_whole(tmp_path):
    """The annotation carries every block of the bundle; the sidecar, reading the downwardAPI file (0400),
    gets both the key its callers' tokens verify with and the CA it verifies the https control URL with."""
    import ssl

    from sie.auth.store import read_trust_bundle

    p = pod()
    after = jsonpatch.apply_patch(p, list(decide(p, SETTINGS).patch))
    annotation = after["metadata"]["annotations"][A_TRUST]
    assert annotation.count("-----BEGIN ") == 2 and len(annotation) < 2048
    (volume,) = [v for v in after["spec"]["volumes"] if v["name"] == VOLUME_NAME]
    assert volume["downwardAPI"]["defaultMode"] == 0o400
    trust_file = tmp_path / "trust.pem"
    trust_file.write_text(annotation)
    trust_file.chmod(0o400)
    trust = read_trust_bundle(trust_file)
    assert trust.verifier.verify(SIGNER.issue(Identity.admin("ops"))).name == "ops"
    assert trust.tls.verify_mode == ssl.CERT_REQUIRED and trust.tls.check_hostname
    (pinned,) = trust.tls.get_ca_certs(binary_form=True)
    assert pinned == CA.cert.public_bytes(serialization.Encoding.DER)
