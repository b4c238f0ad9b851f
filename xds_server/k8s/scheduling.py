"""What a ModelService may ask of the Kubernetes scheduler, as a pure check (DESIGN §3, §10).

The controller creates a model's Deployment with its own service account, so whatever a ModelService's
`scheduling` says reaches the pod spec with the controller's authority, not its author's. A ModelService
author chooses the image, so its code runs wherever the pods land. Hence, on Kubernetes:

- A toleration must name its key. An empty key with operator Exists tolerates every taint: the
  control plane's nodes and every tier's reserved nodes included.
- Keys under SIE's own prefix (`sie.io/`, the tier label and taint: crd.TIER_LABEL) and the node-role
  prefix (`node-role.kubernetes.io/`, which marks control-plane nodes) are not the author's to select or
  tolerate, in nodeSelector or tolerations. SIE sets the tier's itself, from `scheduling.tier`.
- A tier the operator reserves for P0 (`DeploymentSettings.p0_only_tiers`) refuses P1 and P2 models, as a
  node host's `--p0-only-tiers` does in standalone (the spec is then invalid, reason SpecInvalid).

Each problem names the field and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Collection

from sie.spec import ModelService, Priority

# Label and taint key prefixes (the part before "/", and its subdomains) only SIE itself may set.
RESERVED_PREFIXES = ("sie.io", "node-role.kubernetes.io")


def reserved(key: str) -> bool:
    """Whether a label or taint key is under a prefix only SIE may set."""
    prefix = key.split("/", 1)[0] if "/" in key else ""
    return any(prefix == p or prefix.endswith("." + p) for p in RESERVED_PREFIXES)


def scheduling_problems(service: ModelService, p0_only_tiers: Collection[str] = ()) -> list[str]:
    """Why the pods of `service` may not be scheduled as its spec asks (empty: they may)."""
    scheduling = service.spec.scheduling
    problems = []
    for i, toleration in enumerate(scheduling.tolerations):
        field = f"spec.scheduling.tolerations[{i}]"
        if not toleration.key:
            problems.append(
                f"{field}.key: required on Kubernetes; a toleration without a key tolerates every taint "
                "(control-plane nodes and reserved tiers' nodes included). Name the taint's key"
            )
        elif reserved(toleration.key):
            problems.append(
                f"{field}.key: {toleration.key!r} is reserved (keys under {_prefixes()}); to run on a tier's "
                "nodes set scheduling.tier"
            )
    for key in scheduling.node_selector:
        if reserved(key):
            problems.append(
                f"spec.scheduling.nodeSelector[{key!r}]: reserved (keys under {_prefixes()}); to run on a "
                "tier's nodes set scheduling.tier"
            )
    tier = scheduling.tier
    priority = service.spec.model.priority_level
    if tier is not None and tier in p0_only_tiers and priority is not Priority.P0:
        problems.append(
            f"spec.scheduling.tier: tier {tier!r} is reserved for P0 models and this model is {priority.value}; "
            "set model.priority_level to P0 or choose another scheduling.tier"
        )
    return problems


def _prefixes() -> str:
    return " and ".join(f"{p}/" for p in RESERVED_PREFIXES)
