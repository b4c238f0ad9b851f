"""The Kubernetes spelling of the ModelService contract: the CRD, generated from `sie.spec`, and the pod
annotations that carry a model's identity and SLA.

    python -m sie.crd > manifests/base/crd.yaml

The CRD's openAPIV3Schema is derived from the pydantic model, never written by hand, and a test keeps
the committed manifest equal to this output. Kubernetes wants a *structural* schema, so pydantic's JSON
schema is converted: `$ref`s are inlined, `anyOf [X, null]` becomes `X` with `nullable: true`, an
`int | str` union becomes `x-kubernetes-int-or-string`, other unions and free-form maps (backend.config's
engine arguments) keep unknown fields, `exclusiveMinimum: n` becomes OpenAPI 3.0's boolean form, and
titles and defaults are dropped. Defaults are dropped on purpose: the API server would bake them into
stored objects, and some of the model's defaults depend on other fields (sla.max_replicas follows
sla.min_replicas), which a schema default cannot say. The model applies them instead.

The model accepts both a field's name and its Kubernetes alias (`node_selector` / `nodeSelector`), and it
folds `spec.livenessProbe` / `spec.readinessProbe` under `spec.health`. A structural schema prunes fields
it does not name, so the CRD names every spelling the model accepts: a user's file means the same thing
standalone and as a custom resource.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from sie.errors import SIEError
from sie.spec import API_GROUP, KIND, ModelServiceSpec, Probe

VERSION = "v1alpha1"
PLURAL = "modelservices"
SINGULAR = "modelservice"
CRD_NAME = f"{PLURAL}.{API_GROUP}"

# Pod annotations (DESIGN.md section 3). The controller writes them on every pod of a model; the
# injection webhook reads them. `inject` is set as a label too, because a webhook's objectSelector can
# only select on labels.
A_INJECT = "sie.io/inject"
A_MODEL_ID = "sie.io/model-id"
A_GENERATION = "sie.io/generation"  # a model's build (rollouts): on the pods of every build but the first
A_PRIORITY = "sie.io/priority"
A_SERVICE_TYPE = "sie.io/service-type"
A_P99_LATENCY_MS = "sie.io/p99-latency-ms"
A_MAX_QUEUE_TIME_MS = "sie.io/max-queue-time-ms"
A_MAX_CONCURRENT = "sie.io/max-concurrent-requests"
# The ModelService itself (canonical JSON) rides on the pod, and the injected sidecar reads it as a file
# through a downwardAPI volume: the pod is self-contained and a spec change rolls the pods.
A_SPEC = "sie.io/spec"
A_WORKER_PORT = "sie.io/worker-port"
A_SIDECAR_PORT = "sie.io/sidecar-port"
A_CONTROL_PORT = "sie.io/control-port"  # the sidecar's control listener (metrics, drain, sleep, wake)
# The node label that names a node's tier: a model with `scheduling.tier: gold` runs only on nodes labelled
# sie.io/tier=gold (its pods' nodeSelector; they tolerate the taint sie.io/tier=gold:NoSchedule, which keeps
# everything else off such nodes) and its pods carry the label too. Tiered pods are Guaranteed (requests ==
# limits, whole CPUs), so the kubelet's static CPU manager gives them cores no other pod uses.
TIER_LABEL = "sie.io/tier"
# The container the webhook injects; the controller counts a pod as an endpoint only once it has it.
SIDECAR_CONTAINER = "sie-sidecar"

SLA_ANNOTATIONS = (A_MODEL_ID, A_PRIORITY, A_SERVICE_TYPE, A_P99_LATENCY_MS, A_MAX_QUEUE_TIME_MS, A_MAX_CONCURRENT)

STATUS_PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Invalid")

_KEPT = (
    "type",
    "description",
    "enum",
    "pattern",
    "format",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "required",
)
_DROPPED = ("title", "default", "$defs")


class SchemaConversionError(SIEError, ValueError):
    """The spec model uses a JSON-schema construct that a structural CRD schema cannot express."""


def spec_schema() -> dict[str, Any]:
    """The openAPIV3Schema of ModelService.spec, converted from the pydantic model."""
    by_alias = ModelServiceSpec.model_json_schema(by_alias=True)
    by_name = ModelServiceSpec.model_json_schema(by_alias=False)
    defs = {
        name: _union_properties(schema, by_name["$defs"].get(name, {}))
        for name, schema in by_alias.get("$defs", {}).items()
    }
    root = _union_properties(by_alias, by_name)
    spec = _convert(root, defs, "spec")
    # ModelServiceSpec folds these two under spec.health before validating (the Kubernetes habit).
    probe = _convert(Probe.model_json_schema(by_alias=True), defs, "spec.livenessProbe")
    probe_by_name = _convert(Probe.model_json_schema(by_alias=False), defs, "spec.livenessProbe")
    probe["properties"] = {**probe_by_name["properties"], **probe["properties"]}
    probe.pop("description", None)
    for key in ("livenessProbe", "readinessProbe"):
        spec["properties"][key] = {
            **probe,
            "nullable": True,
            "description": f"Same as health.{key}; the Kubernetes spelling.",
        }
    return spec


def status_schema() -> dict[str, Any]:
    """What the controller writes; the printer columns read phase, replicas and readyReplicas."""
    return {
        "type": "object",
        "properties": {
            "phase": {"type": "string", "enum": list(STATUS_PHASES)},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "replicas": {"type": "integer", "description": "Instances the controller asked for."},
            "readyReplicas": {"type": "integer", "description": "Instances ready to take traffic."},
            "selector": {
                "type": "string",
                "description": "The label selector of the model's pods (for the scale subresource).",
            },
            "autoscale": {
                "type": "object",
                "description": "Who sets the replica count (sie or spec.replicas), to what, and why.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "rollout": {
                "type": "object",
                "description": "The current or last rollout: phase, step, shares, the gates' figures, why.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "build": {
                "type": "object",
                "description": "The controller's record of the serving build (its generation and spec) and "
                "its rollout, so a control-plane restart resumes the rollout.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer", "format": "int64"},
                    },
                },
            },
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition `modelservices.sie.io`."""
    columns = [
        {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.summary"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "sie"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": ["msvc"],
                "categories": ["sie"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale` and external autoscalers (HPA, KEDA) set spec.replicas through this;
                    # a set spec.replicas turns SIE's own autoscaler off for the model (AutoscalePolicy).
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m sie.crd` from sie/spec.py. Do not edit; regenerate.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


def _union_properties(by_alias: dict[str, Any], by_name: dict[str, Any]) -> dict[str, Any]:
    """One object schema naming every spelling of every field (alias first, as Kubernetes writes it)."""
    out = copy.deepcopy(by_alias)
    extra = {k: v for k, v in by_name.get("properties", {}).items() if k not in out.get("properties", {})}
    for key in extra:
        if key in by_name.get("required", []):
            raise SchemaConversionError(f"{key} is required and has an alias; the CRD cannot require either spelling")
    if extra:
        out["properties"] = {**out["properties"], **extra}
    return out


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        out = _convert(target, defs, path)
        if "description" in siblings:
            out["description"] = siblings["description"]
        return out
    if "anyOf" in node:
        return _convert_union(node, defs, path)
    unknown = (
        set(node)
        - set(_KEPT)
        - set(_DROPPED)
        - {
            "properties",
            "items",
            "additionalProperties",
            "const",
            "prefixItems",
            "exclusiveMinimum",
            "exclusiveMaximum",
        }
    )
    if unknown:
        raise SchemaConversionError(f"{path}: cannot express {sorted(unknown)} in a structural schema")
    out = {k: copy.deepcopy(node[k]) for k in _KEPT if k in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[inclusive] = node[bound]
            out[bound] = True
    if "properties" in node:
        out["properties"] = {k: _convert(v, defs, f"{path}.{k}") for k, v in node["properties"].items()}
    extra = node.get("additionalProperties")
    if extra is True:
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        out["additionalProperties"] = _convert(extra, defs, f"{path}.*")
    # additionalProperties: false needs nothing: the API server prunes (or, with kubectl's default strict
    # field validation, rejects) fields the schema does not name.
    if "items" in node:
        out["items"] = _convert(node["items"], defs, f"{path}[]")
    if "prefixItems" in node:
        items = [_convert(item, defs, f"{path}[]") for item in node["prefixItems"]]
        out["items"] = (
            items[0] if all(item == items[0] for item in items) else {"x-kubernetes-preserve-unknown-fields": True}
        )
    if "type" not in out:
        raise SchemaConversionError(f"{path}: no type; a structural schema needs one on every field")
    return out


def _convert_union(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    options = [o for o in node["anyOf"] if o != {"type": "null"}]
    nullable = len(options) < len(node["anyOf"])
    if len(options) == 1:
        out = _convert(options[0], defs, path)
    else:
        types = {_convert(o, defs, path)["type"] for o in options}
        # A structural schema cannot hold a union of types; int-or-string is the one Kubernetes knows.
        out = (
            {"x-kubernetes-int-or-string": True}
            if types == {"integer", "string"}
            else {"x-kubernetes-preserve-unknown-fields": True}
        )
    if nullable:
        out["nullable"] = True
    if "description" in node:
        out["description"] = node["description"]
    return out


def validate_custom_resource(doc: dict[str, Any], crd: dict[str, Any] | None = None) -> list[str]:
    """Offline, what the API server would say about a ModelService: OpenAPI v3 schema errors, plus the
    fields it would reject under kubectl's default strict field validation (those the schema does not
    name). Empty when the object would be accepted. Needs `openapi-schema-validator` (a test extra).
    """
    from openapi_schema_validator import OAS30Validator  # imported here: only tests and tools need it

    crd = crd or crd_manifest()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    problems = [f"{_dotted(err.absolute_path)}: {err.message}" for err in OAS30Validator(schema).iter_errors(doc)]
    problems += [f"{p}: unknown field" for p in _unknown_fields(doc, schema, "")]
    problems += [f"{p}: must be an integer or a string" for p in _bad_int_or_string(doc, schema, "")]
    return problems


def _dotted(path: Any) -> str:
    return ".".join(str(p) for p in path) or "(root)"


def _unknown_fields(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return []
    out: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            sub = schema["properties"].get(key)
            if sub is None:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    out.append(f"{path}{key}")
            else:
                out += _unknown_fields(item, sub, f"{path}{key}.")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            out += _unknown_fields(item, schema["additionalProperties"], f"{path}{key}.")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            out += _unknown_fields(item, schema["items"], f"{path}{index}.")
    return [p.rstrip(".") for p in out]


def _bad_int_or_string(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if schema.get("x-kubernetes-int-or-string"):
        ok = value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
        return [] if ok else [path.rstrip(".")]
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key) or (schema.get("additionalProperties") or None)
            if isinstance(sub, dict):
                out += _bad_int_or_string(item, sub, f"{path}{key}.")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            out += _bad_int_or_string(item, schema["items"], f"{path}{index}.")
    return out


def main(argv: list[str] | None = None) -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
