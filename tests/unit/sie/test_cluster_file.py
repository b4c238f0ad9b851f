from pathlib import Path

import pytest

from sie.cluster import load_cluster
from sie.errors import SpecError

REPO = Path(__file__).resolve().parents[3]


def test_the_example_cluster_has_what_the_demo_promises():
    cluster = load_cluster(REPO / "examples" / "cluster.yaml")
    by_id = {s.model_id: s for s in cluster.services}
    llms = [s for s in cluster.services if s.spec.model.service_type.value == "llm"]
    assert len(llms) >= 2
    assert len({s.spec.model.priority_level for s in llms}) >= 2, "LLMs of different priorities"
    assert any(s.spec.desired_replicas >= 2 for s in llms), "one LLM with two instances"
    assert any(s.spec.backend.type.value == "sklearn" for s in by_id.values()), "a scorer"
    assert cluster.settings.envoy_port == 8080 and cluster.settings.admin_port == 8000


def test_cluster_settings_typos_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec: {envoy_prot: 1}\n")
    with pytest.raises(SpecError, match="spec.envoy_prot"):
        load_cluster(path)


def test_unknown_kinds_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: Deployment\n")
    with pytest.raises(SpecError, match="expected 'ModelService' or 'Cluster'"):
        load_cluster(path)
