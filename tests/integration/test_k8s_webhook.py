"""The injection webhook as a real HTTPS process: `python -m sidecar.webhook --cert --key`, called the way
the API server calls it (TLS checked against the caBundle, for the Service's DNS name)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import re
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import jsonpatch
import kubernetes
import pytest

from sidecar.webhook import patch_ca_bundle, self_signed
from sie.spec_loader import load_model_services
from sie_testing.fake_apiserver import FakeApiServer, role_rules

ROOT = Path(__file__).resolve().parents[2]
REVIEW = ROOT / "tests" / "unit" / "k8s" / "data" / "admission-review-pod.json"
SERVICE_DNS = "sie-webhook.sie-system.svc"
pytestmark = pytest.mark.timeout(60)


def review() -> dict:
    doc = json.loads(REVIEW.read_text())
    (service,) = load_model_services(ROOT / "examples" / "qwen2-7b-scoring.yaml")
    doc["request"]["object"]["metadata"]["annotations"]["sie.io/spec"] = json.dumps(service.to_dict())
    return doc


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    made = self_signed([SERVICE_DNS], datetime.datetime.now(datetime.UTC))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "tls.crt").write_bytes(made.cert_pem)
    (folder / "tls.key").write_bytes(made.key_pem)
    return folder, made.cert_pem


@pytest.fixture
async def webhook(tls):
    folder, cert_pem = tls
    (folder / "trust.pem").write_text("-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAtest\n-----END PUBLIC KEY-----\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.webhook",
        "--cert",
        str(folder / "tls.crt"),
        "--key",
        str(folder / "tls.key"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--sidecar-image",
        "registry.internal/sie:test",
        "--trust-file",
        str(folder / "trust.pem"),
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
            assert line, "the webhook exited before listening"
            match = re.search(r"listening on https://127\.0\.0\.1:(\d+)/mutate", line)
            port = int(match.group(1)) if match else None
        context = ssl.create_default_context(cadata=cert_pem.decode())
        yield f"https://127.0.0.1:{port}", context
    finally:
        proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 10)
    assert code == 0  # SIGTERM is a clean stop


async def post(url: str, context: ssl.SSLContext, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/mutate", json=body, ssl=context, server_hostname=SERVICE_DNS) as resp:
            return resp.status, await resp.json()


async def test_review_over_https_returns_a_patch_that_injects_the_sidecar(webhook):
    url, context = webhook
    doc = review()
    status, answer = await post(url, context, doc)
    assert status == 200 and answer["response"]["allowed"] is True
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    pod = jsonpatch.apply_patch(doc["request"]["object"], patch)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["worker", "sie-sidecar"]
    assert pod["spec"]["containers"][1]["image"] == "registry.internal/sie:test"

    # the injected pod, sent again, is left alone
    doc["request"]["object"] = pod
    status, again = await post(url, context, doc)
    assert again["response"] == {"uid": doc["request"]["uid"], "allowed": True}


async def test_invalid_annotation_is_refused_with_its_name(webhook):
    url, context = webhook
    doc = review()
    doc["request"]["object"]["metadata"]["annotations"]["sie.io/priority"] = "urgent"
    status, answer = await post(url, context, doc)
    assert status == 200 and answer["response"]["allowed"] is False
    assert "sie.io/priority: 'urgent' is not one of P0, P1, P2" in answer["response"]["status"]["message"]


async def test_not_a_review_is_a_400_and_healthz_answers(webhook):
    url, context = webhook
    status, answer = await post(url, context, {"kind": "Pod"})
    assert status == 400 and answer["error"]["type"] == "invalid_admission_review"
    assert "AdmissionReview" in answer["error"]["message"]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/healthz", ssl=context, server_hostname=SERVICE_DNS) as resp:
            assert resp.status == 200


async def test_tls_is_real_a_client_that_does_not_trust_the_cert_is_refused(webhook):
    url, _ = webhook
    stranger = ssl.create_default_context()  # system roots only
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await post(url, stranger, review())
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session:
            await session.post(url.replace("https://", "http://") + "/mutate", json=review())


async def test_self_signed_cert_goes_into_the_webhook_configuration_ca_bundle(tls):
    _, cert_pem = tls
    fake = FakeApiServer(rules=role_rules("sie-webhook"))  # held to the webhook's RBAC
    await fake.start()
    try:
        fake.put(
            "mutatingwebhookconfigurations",
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "sie-sidecar-injector"},
                "webhooks": [
                    {
                        "name": "inject.sie.io",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "clientConfig": {"service": {"name": "sie-webhook", "namespace": "sie-system"}},
                    }
                ],
            },
        )
        config = kubernetes.client.Configuration()
        config.host = fake.url
        with kubernetes.client.ApiClient(config) as api:
            await asyncio.to_thread(patch_ca_bundle, "sie-sidecar-injector", cert_pem, api)
        stored = fake.get("mutatingwebhookconfigurations", "", "sie-sidecar-injector")
        assert base64.b64decode(stored["webhooks"][0]["clientConfig"]["caBundle"]) == cert_pem
        assert stored["webhooks"][0]["clientConfig"]["service"]["name"] == "sie-webhook"
        assert fake.denied == []
    finally:
        await fake.stop()
