"""The standalone cluster file: ModelService documents plus an optional `kind: Cluster` document.

    kind: Cluster
    spec: {envoy_port: 8080, envoy_admin_port: 9901, admin_port: 8000, xds_port: 18000}
    ---
    kind: ModelService
    ...

Command-line flags of `sie up` override the Cluster document, which overrides the defaults.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from sie.cpu_lists import parse_tier_cpus
from sie.errors import Problem, SpecError
from sie.model_files import ModelFilePolicy, spec_problems
from sie.spec import KIND, MAX_SPEC_BYTES, ModelService
from sie.spec_loader import (
    ensure_unique,
    legacy_api_version_warning,
    load_documents,
    parse_model_service,
    problems_from_validation,
    raise_refusals,
    uses_legacy_api_version,
)

CLUSTER_KIND = "Cluster"

# A node's name becomes a file name (node-<name>.token, RUN_DIR/nodes/<name>), a token's subject and a
# column of `sie status`: no separators, no spaces, nothing a terminal would act on.
_NODE_NAME = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,62}")
NODE_NAME_RULE = "1 to 63 letters, digits, '-', '_' or '.', starting with a letter or digit"


def node_name(text: str) -> str:
    """`text` if it is a node's name (NODE_NAME_RULE), else ValueError saying so."""
    if not _NODE_NAME.fullmatch(text):
        raise ValueError(f"{text[:64]!r} is not a node name: {NODE_NAME_RULE}")
    return text


NodeName = Annotated[str, AfterValidator(node_name)]

# A name the admin API's certificate is valid for: an IP address, or a DNS name (RFC 1123 labels; a
# leading "*." for a wildcard, as X.509 allows).
_DNS_NAME = re.compile(
    r"(\*\.)?([A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
)


def certificate_name(text: str) -> str:
    """`text` if a certificate may name it (an IP address or a DNS name), else ValueError saying so."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if len(text) > 253 or not _DNS_NAME.fullmatch(text):
        raise ValueError(f"{text[:64]!r} is neither an IP address nor a DNS name")
    return text


CertificateName = Annotated[str, AfterValidator(certificate_name)]


class IngressLimits(BaseModel):
    """What one client may take of the ingress Envoy (DESIGN §10): a client that dribbles its request holds
    a connection, never a model's capacity, and not for long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_headers_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="the request's headers must arrive within this (408 otherwise)"
    )
    request_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="the whole request, body included, must arrive within this (408); "
        "how long the answer may take is each model's sla.request_timeout_ms",
    )
    stream_idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="a stream with no bytes either way for this long is closed "
        "(a streamed answer sends every token, so only a stuck one idles)",
    )
    idle_connection_timeout_s: float = Field(
        default=60.0, gt=0, le=86400, description="a connection with no request in flight for this long is closed"
    )
    max_requests_per_connection: int = Field(default=10_000, ge=1, le=10_000_000)
    max_concurrent_streams: int = Field(default=100, ge=1, le=10_000, description="streams per HTTP/2 connection")
    max_request_headers_kb: int = Field(default=60, ge=1, le=8192, description="431 above it")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=64 * 1024,
        le=1024**3,
        description="the largest request body the ingress "
        "buffers (413 above it); each model's limits.max_body_bytes is checked again by its sidecar",
    )
    max_connections: int = Field(
        default=50_000,
        ge=1,
        le=1_000_000,
        description="downstream connections Envoy holds at once (its overload "
        "manager refuses more), so no client can exhaust its file descriptors",
    )


class ComponentSettings(BaseModel):
    """The Cluster document's `settings:`: the tunables of a component's settings dataclass, by field name.

    `weights:` holds fields of xds_server.policy.WeightSettings, `control_plane:` of
    xds_server.settings.ControlLoopSettings, `node_host:` of the node host's tunables. Each stays a plain
    mapping of scalars here, because sie/ sits below the components and never imports them (pyproject's
    import-linter contract); the component checks each key and type against its dataclass when it reads
    the cluster file or the flags derived from it (sie.settings_flags), and `sie up` passes each section
    on as those flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: dict[str, StrictBool | StrictInt | StrictFloat | StrictStr] = Field(
        default_factory=dict, max_length=256, description="WeightSettings fields, e.g. {queue_full: 32}"
    )
    control_plane: dict[str, StrictBool | StrictInt | StrictFloat | StrictStr] = Field(
        default_factory=dict,
        max_length=256,
        description="xds_server.settings.ControlLoopSettings fields, e.g. {heartbeat_timeout_s: 10}",
    )
    node_host: dict[str, StrictBool | StrictInt | StrictFloat | StrictStr] = Field(
        default_factory=dict,
        max_length=256,
        description="the node host's tunables (node_host.settings), e.g. {drain_timeout_s: 10}",
    )


class NodeSpec(BaseModel):
    """One node host `sie up` starts on this machine (a demo or test of many nodes; on real machines each
    node host runs where its GPUs are)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NodeName = Field(description=f"the node's name: {NODE_NAME_RULE}")
    virtual_gpus: str | None = Field(default=None, max_length=256, description="e.g. '2x80GB'; simulated GPUs")
    gpu_tiers: str = Field(default="", max_length=1024, description="INDEX=TIER,... (node_host --gpu-tiers)")
    p0_only_tiers: str = Field(default="", max_length=1024, description="TIER,... only P0 models may use")
    tier_cpus: str = Field(
        default="",
        max_length=1024,
        description="TIER=CPUS,... CPU cores reserved per tier, e.g. 'gold=0' (node_host --tier-cpus): a tier's "
        "instances run on its cores only, every other instance on the rest",
    )
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="matched by nodeSelector")
    taints: list[str] = Field(default_factory=list, max_length=64, description="KEY=VALUE:EFFECT, as on Kubernetes")

    @field_validator("tier_cpus")
    @classmethod
    def _tier_cpus(cls, text: str) -> str:
        parse_tier_cpus(text)  # the syntax; the node host checks the cores against the machine
        return text


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    # These four are addresses the others are given before they start (Envoy's bootstrap, the node hosts'
    # --control-url), so each is a real port: 0 ("any free one") would leave them nothing to call.
    envoy_port: int = Field(default=8080, ge=1, le=65535, description="Envoy's ingress")
    envoy_admin_port: int = Field(
        default=9901, ge=1, le=65535, description="Envoy's stats listener on loopback (/ready, /stats/prometheus)"
    )
    admin_port: int = Field(default=8000, ge=1, le=65535, description="the control plane's admin API")
    xds_port: int = Field(default=18000, ge=1, le=65535, description="the control plane's ADS (gRPC) for Envoy")
    picker_port: int = Field(
        default=18001,
        ge=0,
        le=65535,
        description="the endpoint picker beside Envoy (prefix affinity, xds_server/picker); 0 runs none",
    )
    node_port: int = Field(default=0, ge=0, le=65535, description="node host API; 0 picks a free port")
    node_name: NodeName = Field(default="local", description=f"the one node host's name: {NODE_NAME_RULE}")
    virtual_gpus: str | None = Field(default=None, description="e.g. '2x80GB'; GPUs that are simulated, labelled so")
    nodes: list[NodeSpec] = Field(
        default_factory=list,
        max_length=16,
        description="several node hosts on this machine, each with its own run directory; default one, "
        "named node_name with virtual_gpus",
    )
    eviction: Literal["drain", "kill", "off"] = Field(
        default="drain",
        description="node host pre-eviction: drain (default); kill and off are bench/eviction baselines",
    )
    admin_tls: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="HTTPS on the admin API, with a certificate from the run directory's CA, which trust.pem "
        "carries to node hosts (`sie join`) so they verify it: auto (default) when host is not loopback",
    )
    admin_tls_names: list[CertificateName] = Field(
        default_factory=list,
        max_length=32,
        description="more names the admin API's certificate is valid for, as other machines reach it (a DNS "
        "name, a NAT address); the host, this machine's name and addresses, and loopback always are",
    )
    data_dir: str = Field(default=".sie/data", description="where the demo creates its tiny models")
    run_dir: str = Field(default=".sie/run", description="pid file, logs, credentials (0700)")
    model_roots: list[str] | None = Field(
        default=None,
        max_length=32,
        description="directories model files may be loaded from (and demo models written to); default [data_dir]",
    )
    allow_unsafe_model_formats: bool = Field(
        default=False, description="let specs load pickle/joblib files (which run code) when they pin spec.model.sha256"
    )
    allow_remote_code: bool = Field(
        default=False, description="let specs set trust_remote_code and other engine arguments that run model code"
    )
    ingress: IngressLimits = Field(default_factory=IngressLimits, description="client timeouts and limits at Envoy")
    settings: ComponentSettings = Field(
        default_factory=ComponentSettings, description="component tunables, e.g. weights: the weight policy's"
    )

    @field_validator("nodes")
    @classmethod
    def _unique_nodes(cls, nodes: list[NodeSpec]) -> list[NodeSpec]:
        names = [n.name for n in nodes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"node names must be unique; given twice: {', '.join(twice)}")
        return nodes

    @model_validator(mode="after")
    def _host_a_certificate_can_name(self) -> ClusterSettings:
        # The admin API's URLs name the host (a wildcard: this machine), and over https a client checks that
        # its certificate names it: a host no certificate may carry would fail every check, after the start.
        if self.serves_tls and self.host:
            try:
                certificate_name(self.host)
            except ValueError as exc:
                raise ValueError(
                    f"host: {exc}, so the admin API's certificate cannot name it and no client could verify it: "
                    "use an IP address or a DNS name (or admin_tls: off)"
                ) from None
        return self

    @property
    def node_specs(self) -> list[NodeSpec]:
        """The node hosts `sie up` starts: `nodes`, or the one named node_name."""
        return list(self.nodes) or [NodeSpec(name=self.node_name, virtual_gpus=self.virtual_gpus)]

    @property
    def serves_tls(self) -> bool:
        """Whether the admin API serves HTTPS (admin_tls; auto: when host is not a loopback address)."""
        if self.admin_tls != "auto":
            return self.admin_tls == "on"
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host.lower() != "localhost"

    @property
    def roots(self) -> list[str]:
        return list(self.model_roots) if self.model_roots is not None else [self.data_dir]


@dataclass(frozen=True)
class ClusterFile:
    path: Path
    settings: ClusterSettings
    services: list[ModelService]
    # What the user should fix although the file loaded, one line each naming the file and document
    # (e.g. the source article's apiVersion); the commands print them, the loader never does.
    warnings: tuple[str, ...] = ()


def load_cluster(path: str | Path) -> ClusterFile:
    """The Cluster settings and every ModelService of a cluster file. Model packages (model-spec.yaml)
    are read from under the cluster's model roots only, and every spec is held to its file policy.
    A ModelService spelled `apiVersion: sie.lmsys.org/v1` (the source article's) is read as
    sie.io/v1alpha1, with a warning for its document in `ClusterFile.warnings`."""
    path = Path(path)
    settings = ClusterSettings()
    documents = load_documents(path)
    for label, doc in documents:
        if doc.get("kind", KIND) == CLUSTER_KIND:
            try:
                settings = ClusterSettings.model_validate(doc.get("spec") or {})
            except ValidationError as exc:
                raise SpecError(label, problems_from_validation(exc, "spec")) from None
    policy = file_policy(settings)
    services: list[ModelService] = []
    warnings: list[str] = []
    refused: list[SpecError] = []  # every document's problems are reported at once
    for label, doc in documents:
        kind = doc.get("kind", KIND)
        if kind == KIND:
            try:
                service = parse_model_service(
                    doc, label, package_roots=settings.roots, allow_legacy_api_version=True, max_bytes=MAX_SPEC_BYTES
                )
            except SpecError as exc:
                refused.append(exc)
                continue
            problems = spec_problems(service, policy)
            if problems:
                refused.append(SpecError(f"{label} (ModelService {service.model_id!r})", problems))
                continue
            services.append(service)
            if uses_legacy_api_version(doc):
                warnings.append(legacy_api_version_warning(label))
        elif kind != CLUSTER_KIND:
            problem = Problem("kind", f"expected {KIND!r} or {CLUSTER_KIND!r}, got {str(kind)[:64]!r}")
            refused.append(SpecError(label, [problem]))
    raise_refusals(refused, str(path))
    ensure_unique(services, str(path))
    return ClusterFile(path=path, settings=settings, services=services, warnings=tuple(warnings))


def file_policy(settings: ClusterSettings) -> ModelFilePolicy:
    return ModelFilePolicy(
        roots=tuple(Path(r) for r in settings.roots),
        allow_unsafe_formats=settings.allow_unsafe_model_formats,
        allow_remote_code=settings.allow_remote_code,
    )
