"""The sidecar injection webhook: an HTTPS server for Kubernetes AdmissionReview v1.

    python -m sidecar.webhook --cert tls.crt --key tls.key --port 8443
    python -m sidecar.webhook --self-signed sie-webhook.sie-system.svc --ca-bundle-for sie-sidecar-injector

POST /mutate takes an AdmissionReview for a pod and answers with a JSONPatch (see sidecar.injection for
what the patch holds and when a pod is refused). GET /healthz answers 200 for the kubelet.

The API server only talks to a webhook over TLS and checks its certificate against the caBundle of the
MutatingWebhookConfiguration. `--self-signed NAME` makes a key and certificate for NAME at start and, with
`--ca-bundle-for CONFIG`, writes that certificate into CONFIG's caBundle through the Kubernetes API, so a
plain `kubectl apply -k manifests/` needs no certificate tooling. With `--cert/--key` (e.g. from
cert-manager) nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import logging
import signal
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from sidecar.injection import Decision, InjectorSettings, decide
from sie.errors import error_body
from sie.http import json_errors

log = logging.getLogger("sie.webhook")

ADMISSION_API = "admission.k8s.io/v1"


def review_response(review: Any, settings: InjectorSettings) -> dict[str, Any]:
    """The AdmissionReview answer to one request. Raises ValueError for a body that is not a review."""
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise ValueError("expected an AdmissionReview object")
    if review.get("apiVersion") != ADMISSION_API:
        raise ValueError(
            f"expected apiVersion {ADMISSION_API}, got {review.get('apiVersion')!r}; "
            "set admissionReviewVersions: [v1] in the webhook configuration"
        )
    request = review.get("request")
    if not isinstance(request, dict) or "uid" not in request:
        raise ValueError("the AdmissionReview has no request.uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    kind = (request.get("kind") or {}).get("kind")
    pod = request.get("object")
    if kind == "Pod" and request.get("operation", "CREATE") == "CREATE" and isinstance(pod, dict):
        decision = decide(pod, settings)
        response = _to_response(request["uid"], decision)
    return {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}


def _to_response(uid: str, decision: Decision) -> dict[str, Any]:
    if not decision.allowed:
        return {
            "uid": uid,
            "allowed": False,
            "status": {"code": 400, "reason": "Invalid", "message": f"sie sidecar injection: {decision.message}"},
        }
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode()
    return response


def make_app(settings: InjectorSettings) -> web.Application:
    async def mutate(request: web.Request) -> web.Response:
        try:
            review = await request.json()
            answer = review_response(review, settings)
        except (ValueError, json.JSONDecodeError) as exc:
            return web.json_response(
                error_body("invalid_admission_review", f"not an AdmissionReview: {exc}"), status=400
            )
        response = answer["response"]
        log.info(
            "admission uid=%s allowed=%s patched=%s %s",
            response["uid"],
            response["allowed"],
            "patch" in response,
            (response.get("status") or {}).get("message", ""),
        )
        return web.json_response(answer)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=4 * 1024 * 1024, middlewares=[json_errors()])
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    return app


@dataclass(frozen=True)
class SelfSigned:
    cert_pem: bytes
    key_pem: bytes


def self_signed(dns_names: list[str], now: datetime.datetime, days: int = 3650) -> SelfSigned:
    """A key and a self-signed certificate (also its own CA) valid for `dns_names`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return SelfSigned(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def patch_ca_bundle(config_name: str, cert_pem: bytes, api_client: Any) -> None:
    """Write our certificate into every webhook of a MutatingWebhookConfiguration (blocking call)."""
    from kubernetes import client

    api = client.AdmissionregistrationV1Api(api_client)
    current = api.read_mutating_webhook_configuration(config_name, _preload_content=False)
    # _preload_content=False returns the raw urllib3 response, which the kubernetes annotations do not model.
    webhooks = json.loads(current.data).get("webhooks") or []  # type: ignore[attr-defined]
    bundle = base64.b64encode(cert_pem).decode()
    patch = [
        {
            "op": "replace" if "caBundle" in (w.get("clientConfig") or {}) else "add",
            "path": f"/webhooks/{i}/clientConfig/caBundle",
            "value": bundle,
        }
        for i, w in enumerate(webhooks)
    ]
    api.patch_mutating_webhook_configuration(
        config_name, patch, _content_type="application/json-patch+json", _preload_content=False
    )


async def serve(
    host: str,
    port: int,
    context: ssl.SSLContext,
    settings: InjectorSettings,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve until `stop` is set; `ready` gets the bound port (useful with port 0)."""
    runner = web.AppRunner(make_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=context)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("sie injection webhook listening on https://%s:%d/mutate", host, bound)
    if ready:
        ready(bound)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("sie injection webhook stopped")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sidecar.webhook", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8443)
    p.add_argument("--cert", help="PEM certificate file")
    p.add_argument("--key", help="PEM private key file")
    p.add_argument(
        "--self-signed",
        metavar="DNS_NAMES",
        help="make a certificate for these comma-separated names instead of --cert/--key",
    )
    p.add_argument(
        "--ca-bundle-for",
        metavar="CONFIG",
        help="with --self-signed: write the certificate into this MutatingWebhookConfiguration",
    )
    p.add_argument("--sidecar-image", default=InjectorSettings.sidecar_image)
    p.add_argument(
        "--control-url",
        default=InjectorSettings.control_url,
        help="the control plane's admin API, for injected sidecars (default %(default)s)",
    )
    p.add_argument(
        "--trust-file",
        required=True,
        help="the trust bundle (PEM: the control plane's public key(s) and the CA of its admin API); injected "
        "sidecars check their callers and the https control URL against it",
    )
    p.add_argument(
        "--image-pull-policy", default=InjectorSettings.image_pull_policy, choices=["Always", "IfNotPresent", "Never"]
    )
    p.add_argument(
        "--tier-sidecar-cpu",
        default=InjectorSettings.tier_sidecar_cpu,
        help="CPUs of the sidecar in a pod of a tier (requests == limits, Guaranteed QoS); a whole number "
        "gives it exclusive cores under the kubelet's static CPU manager (default %(default)s)",
    )
    args = p.parse_args(argv)
    if bool(args.cert) != bool(args.key):
        p.error("--cert and --key go together")
    if bool(args.cert) == bool(args.self_signed):
        p.error("give either --cert and --key, or --self-signed NAMES")
    if args.ca_bundle_for and not args.self_signed:
        p.error("--ca-bundle-for needs --self-signed (with --cert the caBundle is whoever issued it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = InjectorSettings(
        sidecar_image=args.sidecar_image,
        control_url=args.control_url,
        image_pull_policy=args.image_pull_policy,
        tier_sidecar_cpu=args.tier_sidecar_cpu,
        trust_pem=Path(args.trust_file).read_text().strip(),
    )
    cert_file, key_file = args.cert, args.key
    with tempfile.TemporaryDirectory(prefix="sie-webhook-") as tmp:
        if args.self_signed:
            made = self_signed(args.self_signed.split(","), datetime.datetime.now(datetime.UTC))
            cert_file, key_file = str(Path(tmp, "tls.crt")), str(Path(tmp, "tls.key"))
            Path(cert_file).write_bytes(made.cert_pem)
            Path(key_file).write_bytes(made.key_pem)
            if args.ca_bundle_for:
                from kubernetes import client, config

                config.load_incluster_config()
                patch_ca_bundle(args.ca_bundle_for, made.cert_pem, client.ApiClient())
                log.info("wrote the caBundle of MutatingWebhookConfiguration %s", args.ca_bundle_for)
        context = server_ssl_context(cert_file, key_file)

        async def until_signalled() -> None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await serve(args.host, args.port, context, settings, stop)

        asyncio.run(until_signalled())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
