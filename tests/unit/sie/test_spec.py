"""The ModelService spec: what validates, and what is refused with which field path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pydantic
import pytest
import yaml

from sie.errors import SpecError
from sie.spec import MAX_SPEC_BYTES, ModelService, Priority, spec_size
from sie.spec_loader import (
    load_model_services,
    merge_model_package_spec,
    package_spec_to_partial,
    parse_model_service,
)

REPO = Path(__file__).resolve().parents[3]
ARTICLE_SPEC = REPO / "examples" / "qwen2-7b-scoring.yaml"
ARTICLE_PACKAGE = REPO / "examples" / "qwen2-7b-scoring" / "model-spec.yaml"

MINIMAL = {
    "apiVersion": "sie.io/v1alpha1",
    "kind": "ModelService",
    "metadata": {"name": "m"},
    "spec": {"model": {"name": "m"}, "backend": {"type": "torch"}},
}


def with_changes(**changes) -> dict:
    """MINIMAL with dotted-path changes applied, e.g. with_changes(**{"spec.sla.min_replicas": 3})."""
    doc = copy.deepcopy(MINIMAL)
    for dotted, value in changes.items():
        node = doc
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return doc


def test_the_source_articles_spec_validates():
    (svc,) = load_model_services(ARTICLE_SPEC)
    assert svc.model_id == "qwen2-7b-scoring"
    assert svc.spec.model.version == "1.2.0"
    assert svc.spec.backend.type.value == "sglang"
    assert svc.spec.backend.config.tp_size == 2
    assert svc.spec.backend.config.model_extra == {"attention_backend": "flashinfer"}
    assert svc.spec.scheduling.node_selector == {"nvidia.com/gpu.product": "A100-80gb"}
    assert svc.spec.scheduling.tolerations[0].effect == "NoSchedule"
    assert svc.spec.health.liveness is not None and svc.spec.health.liveness.period_seconds == 30
    assert svc.spec.resources.gpu_count == 1
    assert (svc.spec.sla.min_replicas, svc.spec.sla.max_replicas) == (2, 4)
    assert svc.spec.desired_replicas == 2


def test_the_model_package_spec_merges_under_the_model_service():
    service_doc = yaml.safe_load(ARTICLE_SPEC.read_text())
    package = yaml.safe_load(ARTICLE_PACKAGE.read_text())
    merged = parse_model_service(merge_model_package_spec(service_doc, package))
    assert merged.spec.resources.min_gpu_memory_mb == 12288
    assert merged.spec.resources.max_concurrent_requests == 128
    assert merged.spec.input_schema.fields[0].max_length == 4096
    assert merged.spec.output_schema.fields[0].range == (0.0, 1.0)
    # the ModelService wins where both speak
    assert merged.spec.sla.min_replicas == 2
    assert merged.spec.model.image == "registry.internal/qwen2-7b-scoring:v1.2.0"


def test_model_service_wins_on_conflict():
    service = with_changes(**{"spec.resources": {"max_concurrent_requests": 7}, "spec.backend": {"type": "sim"}})
    merged = parse_model_service(
        merge_model_package_spec(service, {"max_concurrent_requests": 128, "backend": "torch"})
    )
    assert merged.spec.resources.max_concurrent_requests == 7
    assert merged.spec.backend.type.value == "sim"


def test_model_package_is_read_from_the_model_path_under_a_package_root_only(tmp_path):
    (tmp_path / "model-spec.yaml").write_text(ARTICLE_PACKAGE.read_text())
    doc = with_changes(**{"spec.model": {"name": "m", "path": str(tmp_path)}})
    assert parse_model_service(doc, package_roots=[tmp_path.parent]).spec.resources.min_gpu_memory_mb == 12288
    # No roots, or a path outside them: the spec is read as written, and no file is opened.
    assert parse_model_service(doc).spec.resources.min_gpu_memory_mb is None
    assert parse_model_service(doc, package_roots=[tmp_path / "elsewhere"]).spec.resources.min_gpu_memory_mb is None
    dotted = with_changes(**{"spec.model": {"name": "m", "path": str(tmp_path / "x" / "..")}})
    assert parse_model_service(dotted, package_roots=[tmp_path.parent]).spec.resources.min_gpu_memory_mb is None


def test_unknown_package_key_is_refused():
    with pytest.raises(SpecError, match="max_concurent"):
        package_spec_to_partial({"max_concurent_requests": 3})


@pytest.mark.parametrize(
    "changes, path, reason",
    [
        ({"spec.model.priority_level": "P9"}, "spec.model.priority_level", "'P0', 'P1' or 'P2'"),
        (
            {"spec.resources": {"min_gpu_memory_mb": -1}},
            "spec.resources.min_gpu_memory_mb",
            "greater than or equal to 0",
        ),
        (
            {"spec.sla": {"min_replicas": 3, "max_replicas": 2}},
            "spec.sla",
            "min_replicas (3) is above max_replicas (2)",
        ),
        ({"spec.input_schema": {"fields": [{"name": "text"}]}}, "spec.input_schema.fields.0.type", "Field required"),
        (
            {"spec.input_schema": {"fields": [{"name": "x", "type": "string", "range": [0, 1]}]}},
            "spec.input_schema.fields.0",
            "range applies to numbers",
        ),
        (
            {"spec.input_schema": {"fields": [{"name": "x", "type": "float32", "range": [1, 0]}]}},
            "spec.input_schema.fields.0",
            "low 1.0 is above high 0.0",
        ),
        (
            {"spec.input_schema": {"fields": [{"name": "x", "type": "string"}, {"name": "x", "type": "bool"}]}},
            "spec.input_schema.fields",
            "declared twice",
        ),
        ({"spec.backend": {"type": "tensorflow"}}, "spec.backend.type", "'sglang', 'torch'"),
        (
            {"spec.backend": {"type": "sglang", "requires": ["cuda>>12"]}},
            "spec.backend.requires",
            "not a version constraint",
        ),
        ({"spec.model": {"name": "Bad_Name"}, "metadata": {"name": "Bad_Name"}}, "spec.model.name", "pattern"),
        ({"spec.resources": {"limits": {"memory": "32 gigs"}}}, "spec.resources.limits", "not a Kubernetes quantity"),
        (
            {"spec.resources": {"max_concurrent_requests": 0}},
            "spec.resources.max_concurrent_requests",
            "greater than or equal to 1",
        ),
        ({"spec.sla": {"p99_latency_ms": 0}}, "spec.sla.p99_latency_ms", "greater than 0"),
        (
            {"spec.replicas": 5, "spec.sla": {"min_replicas": 1, "max_replicas": 2}},
            "spec",
            "replicas (5) must lie within",
        ),
        ({"spec.modle": {"name": "m"}}, "spec.modle", "unknown field"),
        (
            {"spec.scheduling": {"tolerations": [{"operator": "Sometimes"}]}},
            "spec.scheduling.tolerations.0.operator",
            "'Equal' or 'Exists'",
        ),
        ({"metadata": {"name": "other"}}, "", "differs from spec.model.name"),
        (
            {"spec.kafka_input": {"bootstrap_servers": "nohost", "topic": "a", "group_id": "g", "output_topic": "b"}},
            "spec.kafka_input.bootstrap_servers",
            "not host:port",
        ),
        (
            {"spec.kafka_input": {"bootstrap_servers": "h:1", "topic": "a", "group_id": "g", "output_topic": "a"}},
            "spec.kafka_input",
            "output_topic must differ",
        ),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(changes, path, reason):
    with pytest.raises(SpecError) as info:
        parse_model_service(with_changes(**changes), "test.yaml")
    problems = [(p.path, p.reason) for p in info.value.problems]
    assert any(p == path and reason in r for p, r in problems), problems
    assert "test.yaml" in str(info.value)


def test_errors_list_every_problem_not_just_the_first():
    doc = with_changes(**{"spec.model.priority_level": "P7", "spec.resources": {"min_gpu_memory_mb": -5}})
    with pytest.raises(SpecError) as info:
        parse_model_service(doc)
    assert {p.path for p in info.value.problems} >= {"spec.model.priority_level", "spec.resources.min_gpu_memory_mb"}


def test_defaults():
    svc = parse_model_service(MINIMAL)
    assert svc.spec.model.priority_level is Priority.P1
    assert svc.spec.desired_replicas == 1
    assert svc.spec.sla.route_timeout_ms == 15_000
    assert Priority.P0.rank < Priority.P2.rank


def test_max_replicas_defaults_to_min_replicas():
    svc = parse_model_service(with_changes(**{"spec.sla": {"min_replicas": 3}}))
    assert svc.spec.sla.max_replicas == 3


def test_probes_both_under_spec_and_health_are_refused():
    doc = with_changes(**{"spec.livenessProbe": {"periodSeconds": 3}, "spec.health": {"livenessProbe": {}}})
    with pytest.raises(SpecError, match="both under spec and under spec.health"):
        parse_model_service(doc)


def test_round_trip_through_canonical_json():
    (svc,) = load_model_services(ARTICLE_SPEC)
    again = parse_model_service(json.loads(json.dumps(svc.to_dict())))
    assert again == svc


def test_a_file_with_several_documents(tmp_path):
    path = tmp_path / "two.yaml"
    second = with_changes(**{"metadata": {"name": "n"}, "spec.model": {"name": "n"}})
    path.write_text(yaml.safe_dump(MINIMAL) + "---\n" + yaml.safe_dump(second))
    assert [s.model_id for s in load_model_services(path)] == ["m", "n"]


def test_every_refused_document_of_a_file_is_named_at_once(tmp_path):
    path = tmp_path / "three.yaml"
    bad_sla = with_changes(**{"spec.sla": {"min_replicas": 3, "max_replicas": 1}})
    bad_name = with_changes(**{"metadata": {"name": "n"}, "spec.model": {"name": "N_"}})
    path.write_text(yaml.safe_dump(bad_sla) + "---\n" + yaml.safe_dump(MINIMAL) + "---\n" + yaml.safe_dump(bad_name))
    with pytest.raises(SpecError) as caught:
        load_model_services(path)
    assert caught.value.source == str(path)
    assert [p.path.split(" ")[:2] for p in caught.value.problems] == [
        ["document", "1"],
        ["document", "3"],
    ]
    assert "document 1 (ModelService 'm') spec.sla" in str(caught.value)
    with pytest.raises(SpecError) as caught:  # the file named another way: the same labels
        load_model_services(f"{tmp_path}//./three.yaml")
    assert caught.value.problems[0].path.startswith("document 1 ")
    # One refused document keeps its own error, as before.
    path.write_text(
        yaml.safe_dump(bad_sla)
        + "---\n"
        + yaml.safe_dump(with_changes(metadata={"name": "n"}, **{"spec.model": {"name": "n"}}))
    )
    with pytest.raises(SpecError) as caught:
        load_model_services(path)
    assert caught.value.source == f"{path} document 1 (ModelService 'm')"


def test_a_duplicate_model_in_one_file_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "---\n" + yaml.safe_dump(MINIMAL))
    with pytest.raises(SpecError, match="defined twice"):
        load_model_services(path)


def test_json_files_and_lists(tmp_path):
    path = tmp_path / "models.json"
    path.write_text(json.dumps([MINIMAL]))
    assert [s.model_id for s in load_model_services(path)] == ["m"]


def test_unparseable_file_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("spec: [unclosed")
    with pytest.raises(SpecError, match="broken.yaml"):
        load_model_services(path)


def test_model_service_is_immutable():
    svc = parse_model_service(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        svc.spec.model.name = "x"  # type: ignore[misc]
    assert isinstance(svc, ModelService)


@pytest.mark.parametrize(
    ("rollout", "path"),
    [
        ({"steps": [0, 100]}, "spec.rollout.steps"),
        ({"steps": [50, 20, 100]}, "spec.rollout.steps"),
        ({"steps": [10, 50]}, "spec.rollout.steps"),
        ({"steps": list(range(1, 101))}, "spec.rollout.steps"),
        ({"hold_s": -1}, "spec.rollout.hold_s"),
        ({"hold_s": 1e12}, "spec.rollout.hold_s"),
        ({"gates": {"max_p99_ratio": 0.5}}, "spec.rollout.gates.max_p99_ratio"),
        ({"gates": {"min_requests": 0}}, "spec.rollout.gates.min_requests"),
        ({"gates": {"max_error_rate_increase": 2}}, "spec.rollout.gates.max_error_rate_increase"),
        ({"max_surge": -1}, "spec.rollout.max_surge"),
        ({"auto_rollback": "yes please"}, "spec.rollout.auto_rollback"),
        ({"progress_deadline_s": 0}, "spec.rollout.progress_deadline_s"),
        ({"progress_deadline_s": 1e12}, "spec.rollout.progress_deadline_s"),
        ({"starved_deadline_s": 0.5}, "spec.rollout.starved_deadline_s"),
        ({"starved_deadline_s": float("inf")}, "spec.rollout.starved_deadline_s"),
        ({"canary": True}, "spec.rollout.canary"),
    ],
)
def test_a_bad_rollout_block_is_refused_naming_the_field(rollout, path):
    doc = {"kind": "ModelService", "spec": {"model": {"name": "m"}, "backend": {"type": "sim"}, "rollout": rollout}}
    with pytest.raises(SpecError) as exc:
        parse_model_service(doc, "m.yaml")
    assert any(p.path == path for p in exc.value.problems), exc.value.problems


@pytest.mark.parametrize(
    ("autoscale", "path"),
    [
        ({"target_concurrency": 0}, "spec.autoscale.target_concurrency"),
        ({"tolerance": 5}, "spec.autoscale.tolerance"),
        ({"scale_down_window_s": -3}, "spec.autoscale.scale_down_window_s"),
        ({"max_step_up": 0}, "spec.autoscale.max_step_up"),
        ({"min": 1}, "spec.autoscale.min"),
    ],
)
def test_a_bad_autoscale_block_is_refused_naming_the_field(autoscale, path):
    doc = {"kind": "ModelService", "spec": {"model": {"name": "m"}, "backend": {"type": "sim"}, "autoscale": autoscale}}
    with pytest.raises(SpecError) as exc:
        parse_model_service(doc, "m.yaml")
    assert any(p.path == path for p in exc.value.problems), exc.value.problems


def test_a_spec_larger_than_a_spec_may_be_is_refused_naming_its_size():
    doc = {
        "metadata": {"name": "m", "annotations": {"notes": "x" * MAX_SPEC_BYTES}},
        "spec": {"model": {"name": "m"}, "backend": {"type": "sim"}},
    }
    with pytest.raises(SpecError) as caught:
        parse_model_service(doc, max_bytes=MAX_SPEC_BYTES)
    assert f"a spec may have at most {MAX_SPEC_BYTES:,}" in str(caught.value)
    # One accepted before the bound (restored from the state file, recovered from a node) is still read.
    assert parse_model_service(doc).model_id == "m"
    doc["metadata"]["annotations"]["notes"] = "x" * (MAX_SPEC_BYTES - 10_000)
    assert spec_size(parse_model_service(doc).to_dict()) <= MAX_SPEC_BYTES
