"""`python -m xds_server.k8s.credentials`: make SIE's credentials in the cluster, once (the install's Job).

What standalone keeps in <run-dir>/credentials, Kubernetes keeps in objects of the system namespace:

    Secret    sie-credentials   signing.key, trust.pem   the control plane's identity key (only sie-xds mounts it)
    ConfigMap sie-trust         trust.pem                the trust bundle (sie.auth.tls): its public key(s) and the
                                                         CA's certificate; node hosts, the picker, the webhook (which
                                                         hands it to every sidecar), anyone who verifies SIE tokens
                                                         or the admin API's certificate
    Secret    sie-admin-token   token                    an admin identity for operators (`sie status`, curl)
    Secret    sie-reader-token  token                    a read-only identity for Prometheus and dashboards
    Secret    sie-ca            ca.crt, ca.key           the CA of SIE's TLS (ADS's mutual TLS, the admin API)
    Secret    sie-admin-tls     ca.crt, tls.crt, tls.key the admin API's (:8000) server certificate: the Service's
                                                         names, localhost and 127.0.0.1 (`kubectl port-forward`)
    Secret    sie-xds-tls       ca.crt, tls.crt, tls.key the control plane's ADS server certificate
    Secret    sie-envoy-tls     ca.crt, tls.crt, tls.key Envoy's client certificate (its ADS credential)

Node hosts and sidecars need no Secret: they prove themselves with projected service-account tokens
(TokenReview, xds_server.k8s.tokenreview), and a node host gets its SIE node token in heartbeat replies.

Idempotent: what exists is kept, what is missing is derived from what exists (the signing key and the CA
are made first, everything else from them), so a Job that died halfway finishes on its next run, and a
re-applied install changes no credential. One object is ever changed: a sie-trust whose trust.pem lacks
the CA's certificate (an install from before the admin API served TLS) gets it appended, keeping every key
and certificate it held; the write is a replace at the resourceVersion read, so an edit made meanwhile is
never overwritten (the Job fails and its retry reads again). sie-admin-tls is made only after that, so the
control plane, which waits for that Secret, serves TLS only once the bundle its clients read names the CA.
"""

from __future__ import annotations

import argparse
import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sie.auth import Identity, Signer
from sie.auth.pki import CertificateAuthority
from sie.auth.tls import pem_blocks, trust_bundle
from sie.auth.tokens import public_pem

log = logging.getLogger("sie.k8s.credentials")

LABELS = {"app.kubernetes.io/part-of": "sie", "app.kubernetes.io/managed-by": "sie-credentials"}
TRUST_CONFIG_MAP = "sie-trust"
# Every Secret `ensure` makes: the Job's Role names exactly these and TRUST_CONFIG_MAP (manifests/base/rbac.yaml).
SECRETS = (
    "sie-credentials",
    "sie-admin-token",
    "sie-reader-token",
    "sie-ca",
    "sie-admin-tls",
    "sie-xds-tls",
    "sie-envoy-tls",
)
TRUST_KEY = "trust.pem"
# Where `kubectl port-forward svc/sie-xds 8000` lands: `sie status --admin-url https://localhost:8000`.
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class Names:
    namespace: str = "sie-system"
    xds_service: str = "sie-xds"

    @property
    def xds_dns(self) -> list[str]:
        svc = f"{self.xds_service}.{self.namespace}.svc"
        return [svc, f"{svc}.cluster.local"]


class Objects:
    """Reads and creates Secrets and ConfigMaps of one namespace, and sets a key of a ConfigMap (string
    values in, string values out)."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self._core = client.CoreV1Api(api)
        self._ns = namespace

    def secret(self, name: str) -> dict[str, str] | None:
        try:
            found = self._core.read_namespaced_secret(name, self._ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()}

    def config_map(self, name: str) -> dict[str, str] | None:
        try:
            return dict(self._core.read_namespaced_config_map(name, self._ns).data or {})
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_secret(self, name: str, data: dict[str, str]) -> None:
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, labels=LABELS),
            type="Opaque",
            data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        )
        self._create(name, lambda: self._core.create_namespaced_secret(self._ns, body))

    def create_config_map(self, name: str, data: dict[str, str]) -> None:
        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, labels=LABELS), data=data)
        self._create(name, lambda: self._core.create_namespaced_config_map(self._ns, body))

    def update_config_map(self, name: str, key: str, derive: Callable[[str | None], str | None]) -> bool:
        """Set `key` of the existing ConfigMap `name` to `derive(its value)` unless that is None; the rest
        of the object is kept. A replace at the resourceVersion read: one another client changed meanwhile
        is a 409, raised (the Job retries from a fresh read). Returns whether it wrote."""
        found = self._core.read_namespaced_config_map(name, self._ns)
        data = dict(found.data or {})
        value = derive(data.get(key))
        if value is None:
            return False
        found.data = {**data, key: value}
        self._core.replace_namespaced_config_map(name, self._ns, found)
        log.info("updated %s (%s)", name, key)
        return True

    @staticmethod
    def _create(name: str, call: Callable[[], object]) -> None:
        try:
            call()
            log.info("created %s", name)
        except ApiException as exc:
            if exc.status != 409:  # another run made it meanwhile: keep theirs
                raise


def ensure(objects: Objects, names: Names = Names()) -> list[str]:
    """Create every missing credential object, and add the CA to a trust bundle without it; returns the
    names of those it created or changed."""
    made: list[str] = []

    def secret(name: str, build: Callable[[], dict[str, str]]) -> dict[str, str]:
        found = objects.secret(name)
        if found is None:
            objects.create_secret(name, build())
            made.append(name)
            found = objects.secret(name)
        assert found is not None
        return found

    key = secret("sie-credentials", _new_signing_key)
    signer = Signer.from_pem(key["signing.key"].encode())
    public_keys = key.get("trust.pem") or public_pem(signer.public).decode()
    ca_files = secret("sie-ca", _new_ca)
    ca = CertificateAuthority.from_pem(ca_files["ca.crt"].encode(), ca_files["ca.key"].encode())
    bundle = trust_bundle(public_keys.encode(), ca.cert_pem).decode()
    if objects.config_map(TRUST_CONFIG_MAP) is None:
        objects.create_config_map(TRUST_CONFIG_MAP, {TRUST_KEY: bundle})
        made.append(TRUST_CONFIG_MAP)
    elif objects.update_config_map(TRUST_CONFIG_MAP, TRUST_KEY, lambda held: with_ca(held, bundle, ca.cert_pem)):
        made.append(TRUST_CONFIG_MAP)
    secret("sie-admin-token", lambda: {"token": signer.issue(Identity.admin("kubernetes-admin"))})
    secret("sie-reader-token", lambda: {"token": signer.issue(Identity.reader("prometheus"))})

    def pair(common_name: str, **kwargs) -> Callable[[], dict[str, str]]:
        def build() -> dict[str, str]:
            issued = ca.issue(common_name, **kwargs)
            return {
                "ca.crt": ca.cert_pem.decode(),
                "tls.crt": issued.cert_pem.decode(),
                "tls.key": issued.key_pem.decode(),
            }

        return build

    # After sie-trust names the CA (see the module's docstring).
    secret(
        "sie-admin-tls",
        pair(
            names.xds_service,
            dns_names=[*names.xds_dns, *LOOPBACK_NAMES],
            ip_addresses=LOOPBACK_IPS,
            server=True,
        ),
    )
    secret("sie-xds-tls", pair(names.xds_service, dns_names=names.xds_dns, server=True))
    secret("sie-envoy-tls", pair("sie-envoy", client=True))
    return made


def with_ca(held: str | None, bundle: str, ca_cert_pem: bytes) -> str | None:
    """What a trust ConfigMap holding `held` should hold so that it names the CA: None when it already
    does (left alone); `bundle` (public keys and CA) when it holds nothing; else `held` with the CA's
    certificate appended, so no key or certificate it trusted is dropped (a key being rotated in)."""
    if not held or not held.strip():
        return bundle
    ca = x509.load_pem_x509_certificate(ca_cert_pem)
    for block in pem_blocks(held.encode(), "CERTIFICATE"):
        try:
            if x509.load_pem_x509_certificate(block) == ca:
                return None
        except ValueError:
            continue  # not ours to judge here: the clients that read the bundle refuse it by name
    return trust_bundle(held.encode(), ca_cert_pem).decode()


def _new_signing_key() -> dict[str, str]:
    signer = Signer.generate()
    return {"signing.key": signer.private_pem().decode(), "trust.pem": public_pem(signer.public).decode()}


def _new_ca() -> dict[str, str]:
    ca = CertificateAuthority.generate("sie-ca")
    return {"ca.crt": ca.cert_pem.decode(), "ca.key": ca.key_pem.decode()}


def main(argv: list[str] | None = None) -> int:
    from xds_server.k8s.main import api_client

    p = argparse.ArgumentParser(
        prog="python -m xds_server.k8s.credentials",
        description="create SIE's credentials (Secrets, the trust ConfigMap) if missing; add the CA to the trust "
        "ConfigMap if it lacks it",
    )
    p.add_argument("--namespace", default="sie-system", help="SIE's system namespace (default sie-system)")
    p.add_argument("--xds-service", default="sie-xds", help="the control plane's Service (its TLS names)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--kube-api-url", default=None, help="API server URL without auth (kubectl proxy, tests)")
    where.add_argument("--kubeconfig", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with api_client(args.kube_api_url, args.kubeconfig) as api:
        made = ensure(Objects(api, args.namespace), Names(args.namespace, args.xds_service))
    log.info(
        "credentials in %s: %s", args.namespace, f"made or changed {', '.join(made)}" if made else "all present, kept"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
