"""A model pod is hardened (DESIGN §10: the worker runs the model's own code): no service-account API token
mounted into it, the runtime's default seccomp profile, no privilege escalation and no capabilities in
either container, and the sidecar never root. The sidecar's own identity, the projected `sie` token, is a
volume of its own: it still mounts with automount off, and only into the sidecar."""

from __future__ import annotations

import jsonpatch
import kubernetes_validate
import pytest

from sidecar.injection import TOKEN_VOLUME, InjectorSettings, decide
from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import DeploymentSettings, desired_deployment, needs_update

DROP_ALL = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def injected_pod(obj: dict, settings: DeploymentSettings = DeploymentSettings()) -> dict:
    template = desired_deployment(obj, parse_model_service(obj), settings)["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-1", **template["metadata"]}}
    pod["spec"] = template["spec"]
    decision = decide(pod, InjectorSettings())
    assert decision.allowed and decision.patch, decision.message
    return jsonpatch.apply_patch(pod, list(decision.patch))


def test_the_pod_mounts_no_api_token_and_runs_under_runtime_default_seccomp(qwen):
    pod = injected_pod(qwen)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 10001}
    worker, sidecar = spec["containers"]
    assert worker["securityContext"] == DROP_ALL  # the image's own user: GPU images run as root
    assert sidecar["securityContext"] == {
        **DROP_ALL,
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # The sidecar's token: a projected volume the pod declares (not the automounted one), for the
    # audience sie, mounted into the sidecar only; the worker mounts nothing of SIE's.
    (token,) = [v for v in spec["volumes"] if v["name"] == TOKEN_VOLUME]
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "sie"
    assert TOKEN_VOLUME in [m["name"] for m in sidecar["volumeMounts"]]
    assert "volumeMounts" not in worker


@pytest.mark.parametrize("uid", [1000, 65532])
def test_an_operator_may_run_workers_as_a_non_root_uid(qwen, uid):
    pod = injected_pod(qwen, DeploymentSettings(worker_run_as_user=uid))
    kubernetes_validate.validate(pod, "1.32", strict=True)
    worker = pod["spec"]["containers"][0]
    assert worker["securityContext"] == {**DROP_ALL, "runAsNonRoot": True, "runAsUser": uid}


def test_a_deployment_made_before_the_hardening_is_patched_to_it(qwen):
    current = desired_deployment(qwen, parse_model_service(qwen), DeploymentSettings())
    assert not needs_update(current, current)
    pod = current["spec"]["template"]["spec"]
    del pod["automountServiceAccountToken"], pod["securityContext"], pod["containers"][0]["securityContext"]
    assert needs_update(current, desired_deployment(qwen, parse_model_service(qwen), DeploymentSettings()))
