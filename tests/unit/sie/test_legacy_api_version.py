"""`apiVersion: sie.lmsys.org/v1` (the source article's spelling): read as sie.io/v1alpha1 from a standalone
cluster file, with one warning per document; refused everywhere else (CRD, admin API: parse_model_service
without allow_legacy_api_version); any other apiVersion refused everywhere."""

from __future__ import annotations

import json

import pytest

from sie.cluster import load_cluster
from sie.errors import SpecError
from sie.spec import API_VERSION
from sie.spec_loader import LEGACY_API_VERSION, parse_model_service

CLUSTER = "kind: Cluster\nspec: {envoy_port: 8080}\n"


def _service(name: str, api_version: str | None) -> str:
    head = f"apiVersion: {api_version}\n" if api_version is not None else ""
    return f"{head}kind: ModelService\nspec:\n  model: {{name: {name}}}\n  backend: {{type: sim}}\n"


def _doc(api_version: object) -> dict:
    return {
        "apiVersion": api_version,
        "kind": "ModelService",
        "spec": {"model": {"name": "a"}, "backend": {"type": "sim"}},
    }


def test_a_cluster_file_in_the_articles_spelling_loads_with_one_warning(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("---\n".join([CLUSTER, _service("old", LEGACY_API_VERSION), _service("new", API_VERSION)]))
    cluster = load_cluster(path)
    assert [s.model_id for s in cluster.services] == ["old", "new"]
    assert cluster.warnings == (
        f"{path} document 2: apiVersion sie.lmsys.org/v1 is read as sie.io/v1alpha1 (the source article's "
        "spelling); write sie.io/v1alpha1",
    )
    old = cluster.services[0]
    assert old.api_version == API_VERSION
    assert old.model_dump(by_alias=True)["apiVersion"] == API_VERSION  # what the control plane hands on


def test_each_legacy_document_gets_its_own_warning_and_a_json_file_too(tmp_path):
    path = tmp_path / "cluster.json"
    docs = [
        _doc(LEGACY_API_VERSION),
        {**_doc(LEGACY_API_VERSION), "spec": {"model": {"name": "b"}, "backend": {"type": "sim"}}},
    ]
    path.write_text(json.dumps(docs))
    warnings = load_cluster(path).warnings
    assert [w.split(":")[0] for w in warnings] == [f"{path} document 1", f"{path} document 2"]


@pytest.mark.parametrize("api_version", [API_VERSION, None])
def test_the_current_spelling_or_none_warns_of_nothing(tmp_path, api_version):
    path = tmp_path / "cluster.yaml"
    path.write_text(_service("m", api_version))
    assert load_cluster(path).warnings == ()


def test_parse_model_service_refuses_the_articles_spelling_unless_asked(tmp_path):
    with pytest.raises(SpecError) as info:
        parse_model_service(_doc(LEGACY_API_VERSION), "request body")  # the admin API's and the CRD's way
    [problem] = info.value.problems
    assert problem.path == "apiVersion"
    assert LEGACY_API_VERSION in problem.reason and f"write apiVersion: {API_VERSION}" in problem.reason
    read = parse_model_service(_doc(LEGACY_API_VERSION), allow_legacy_api_version=True)
    assert read.api_version == API_VERSION


@pytest.mark.parametrize("api_version", ["sie.lmsys.org/v2", "sie.lmsys.org/v1alpha1", "sie.io/v1", "v1", "", 1])
def test_other_api_versions_are_refused_everywhere(tmp_path, api_version):
    for allow in (False, True):
        with pytest.raises(SpecError) as info:
            parse_model_service(_doc(api_version), allow_legacy_api_version=allow)
        assert [p.path for p in info.value.problems] == ["apiVersion"]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_doc(api_version)))
    with pytest.raises(SpecError, match="apiVersion"):
        load_cluster(path)
