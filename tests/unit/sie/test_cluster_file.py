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


def test_every_refused_document_of_a_cluster_file_is_named_at_once(tmp_path):
    # sie validate, sie apply and sie up read the file this way: a user fixes it in one pass.
    path = tmp_path / "c.yaml"
    path.write_text(
        "kind: ModelService\nspec: {model: {name: a, path: a.skops}, backend: {type: sklearn, config: {demo: 'yes'}}}\n"
        "---\nkind: ModelService\nspec: {model: {name: ok}, backend: {type: sim}}\n"
        "---\nkind: ModelService\nspec: {model: {name: c, path: c.joblib}, backend: {type: sklearn}}\n"
        "---\nkind: Deployment\n"
    )
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    assert caught.value.source == str(path)
    assert [p.path for p in caught.value.problems] == [
        "document 1 (ModelService 'a') spec.backend.config.demo",
        "document 3 (ModelService 'c') spec.model.path",  # the file policy: no pickles unless allowed
        "document 4 kind",
    ]
    assert "got 'yes'" in caught.value.problems[0].reason


def test_status_tables_show_models_instances_and_gpus():
    from sie.status_table import gpu_rows, model_rows, render

    status = {
        "models": [
            {
                "model_id": "chat",
                "priority": "P0",
                "service_type": "llm",
                "backend": "torch",
                "desired_replicas": 2,
                "instances": [
                    {"instance_id": "chat-0", "state": "ready"},
                    {"instance_id": "chat-1", "state": "sleeping"},
                ],
            }
        ],
        "nodes": [
            {
                "node": "local",
                "gpus": [
                    {
                        "index": 0,
                        "name": "virtual GPU",
                        "total_mb": 81920,
                        "used_mb": 40960,
                        "utilization": None,
                        "virtual": True,
                    }
                ],
            }
        ],
    }
    (row,) = model_rows(status)
    assert row["INSTANCES"] == "1/2" and row["STATE"] == "1 ready, 1 sleeping"
    (gpu,) = gpu_rows(status)
    assert gpu["KIND"] == "virtual" and gpu["MEMORY"] == "40.0/80.0 GiB (50%)" and gpu["UTIL"] == "-"
    assert "virtual" in render(gpu_rows(status))


def test_status_tables_show_a_lost_node_and_a_failed_gpu():
    from sie.status_table import gpu_rows, node_rows

    gpu = {"index": 1, "name": "virtual GPU", "total_mb": 1024, "used_mb": 0, "virtual": True, "failed": "Xid 79"}
    status = {
        "nodes": [
            {"node": "a", "health": "ready", "live": True, "last_seen_age_s": 0.2, "instances": 3, "gpus": [gpu]},
            {"node": "b", "health": "lost", "live": False, "lost_at": 990.0, "last_seen_age_s": 40.0, "gpus": []},
        ],
        "node_events": [{"node": "b", "kind": "lost", "detail": "no heartbeat for 30.1 s (timeout 30 s)"}],
    }
    a, b = node_rows(status, now=1000.0)
    assert (a["HEALTH"], a["GPUS"], a["LAST EVENT"]) == ("ready", "1 (1 failed)", "-")
    assert (b["HEALTH"], b["SEEN"]) == ("lost 10s", "40.0s ago") and b["LAST EVENT"].startswith("lost: no heartbeat")
    assert gpu_rows(status)[0]["HEALTH"] == "failed: Xid 79"


def test_an_instance_row_says_why_it_waits_or_else_why_it_is_where_it_is():
    from sie.status_table import instance_rows

    status = {
        "models": [
            {
                "instances": [
                    {"instance_id": "a-0", "state": "ready", "placement": "placed on n2: 4096 MiB fits on GPU 1"},
                    {"instance_id": "b-0", "state": "ready", "cache_hit_rate": 0.834},
                    {
                        "instance_id": "a-1",
                        "state": "failed",
                        "detail": "pending: not enough GPU memory",
                        "placement": "x",
                    },
                ]
            }
        ]
    }
    ready, cached, waiting = instance_rows(status)
    assert cached["CACHE-HIT"] == "83%"
    assert ready["DETAIL"] == "placed on n2: 4096 MiB fits on GPU 1" and ready["CACHE-HIT"] == "-"
    assert waiting["DETAIL"] == "pending: not enough GPU memory"


def test_an_instance_row_shows_the_cores_it_may_use():
    from sie.status_table import instance_rows, render

    status = {
        "models": [
            {
                "instances": [
                    {"instance_id": "scorer-0", "state": "ready", "cpus": "0"},
                    {"instance_id": "chat-0", "state": "ready", "cpus": "1-3"},
                    {"instance_id": "free-0", "state": "ready", "cpus": ""},
                    {"instance_id": "pod-0", "state": "ready"},
                ]
            }
        ]
    }
    rows = instance_rows(status)
    assert [r["CPUS"] for r in rows] == ["0", "1-3", "all", "-"]
    assert render(rows).splitlines()[0].split()[:5] == ["INSTANCE", "STATE", "ADDRESS", "NODE", "CPUS"]


def test_a_node_may_reserve_cpus_per_tier_and_a_malformed_list_is_refused(tmp_path):
    from sie.standalone import node_host_argv

    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec:\n  nodes:\n  - {name: n1, tier_cpus: 'gold=0', p0_only_tiers: gold}\n")
    settings = load_cluster(path).settings
    argv = node_host_argv("py", settings, "http://cp", tmp_path, tmp_path / "t", tmp_path / "p")
    assert argv[argv.index("--tier-cpus") + 1] == "gold=0"
    path.write_text("kind: Cluster\nspec:\n  nodes:\n  - {name: n1, tier_cpus: 'gold'}\n")
    with pytest.raises(SpecError, match="tier_cpus.*names no tier"):
        load_cluster(path)


@pytest.mark.parametrize(
    ("nodes", "allowed", "infra"),
    [
        ([{"name": "n1"}], {0, 1}, None),  # no tier cores: nothing pinned
        ([{"name": "n1", "tier_cpus": "gold=0"}], {0, 1}, {1}),
        ([{"name": "n1", "tier_cpus": "gold=0"}, {"name": "n2", "tier_cpus": "silver=2"}], {0, 1, 2, 3}, {1, 3}),
        ([{"name": "n1", "tier_cpus": "gold=0"}, {"name": "n2", "tier_cpus": "gold=1"}], {0, 1}, None),  # none left
    ],
)
def test_sie_up_keeps_its_own_processes_off_the_tiers_cores(nodes, allowed, infra):
    from sie.cluster import NodeSpec
    from sie.standalone import infrastructure_cpus

    got = infrastructure_cpus([NodeSpec(**n) for n in nodes], frozenset(allowed))
    assert got == (None if infra is None else frozenset(infra))
