import time
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


# ---- what `sie validate` lets through, `sie up` must be able to start ------------------------------------

PORTS = "envoy_port: 18080, envoy_admin_port: 19901, admin_port: 18000, xds_port: 18018"


@pytest.mark.parametrize(
    "spec, where",
    [
        ('{node_name: "bad name"}', "spec.node_name"),
        ('{node_name: "a/b"}', "spec.node_name"),
        ('{node_name: "x\\e[2Jy"}', "spec.node_name"),
        ('{nodes: [{name: "../etc"}]}', "spec.nodes.0.name"),
    ],
)
def test_a_node_name_that_is_not_one_is_refused_by_the_file(tmp_path, spec, where):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: Cluster\nspec: {spec}\n")
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    (problem,) = caught.value.problems
    assert problem.path == where and "is not a node name: 1 to 63 letters" in problem.reason
    assert "\x1b" not in str(caught.value)


@pytest.mark.parametrize("port", ["envoy_port", "envoy_admin_port", "admin_port", "xds_port"])
def test_a_port_the_others_are_given_before_they_start_cannot_be_0(tmp_path, port):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: Cluster\nspec: {{{port}: 0}}\n")
    with pytest.raises(SpecError, match=f"spec.{port}: Input should be greater than or equal to 1"):
        load_cluster(path)


def test_the_ports_that_may_be_0_still_may(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec: {picker_port: 0, node_port: 0}\n")
    settings = load_cluster(path).settings
    assert (settings.picker_port, settings.node_port) == (0, 0)


def test_a_flag_is_held_to_the_ranges_of_the_setting_it_overrides(tmp_path, monkeypatch, capsys):
    from sie import standalone
    from sie.cli import main

    def no_stack(*_args, **_kwargs):
        raise AssertionError("sie up went on to start a stack")

    monkeypatch.setattr(standalone, "Stack", no_stack)
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: Cluster\nspec: {{{PORTS}}}\n")
    assert main(["up", "-f", str(path), "--admin-port", "0", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--admin-port: Input should be greater than or equal to 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a/b", "x\x1b[2Jy", "bad name", "..", ""])
def test_sie_token_and_sie_join_refuse_a_node_name_that_is_not_one(tmp_path, monkeypatch, capsys, name):
    from sie.cli import main

    def no_exec(*_args):
        raise AssertionError("sie join went on to start a node host")

    monkeypatch.setattr("os.execv", no_exec)
    for argv in (
        ["token", "node", name, "--run-dir", str(tmp_path)],
        ["join", "http://127.0.0.1:1", "--node", name, "--token-file", "t", "--trust-file", "p"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "is not a node name: 1 to 63 letters" in err and "\x1b" not in err, err
    assert list(tmp_path.iterdir()) == [], "nothing was made for it"


def test_a_cluster_without_models_serves_all_of_them_at_once(tmp_path):
    from sie.standalone import Stack

    stack = Stack(tmp_path / "c.yaml", load_cluster_settings(tmp_path, PORTS), tmp_path / "run")
    stack.status = lambda: {"models": []}  # type: ignore[method-assign]  # the control plane's answer
    assert stack.all_models_serving()


def load_cluster_settings(tmp_path, spec: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: Cluster\nspec: {{{spec}}}\n")
    return load_cluster(path).settings


def test_a_host_that_does_not_resolve_is_reported_as_such_not_as_a_busy_port():
    from sie.errors import StartupError
    from sie.standalone import check_ports_free

    with pytest.raises(StartupError, match="the host 'no-such-host.invalid' does not resolve") as caught:
        check_ports_free("no-such-host.invalid", {"SIE admin API": 18000})
    assert "already in use" not in str(caught.value)


def test_a_busy_port_and_an_address_of_another_machine_are_told_apart():
    import socket

    from sie.errors import StartupError
    from sie.standalone import check_ports_free

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(StartupError, match=rf"port {port} \(SIE admin API\) is already in use on 127.0.0.1"):
            check_ports_free("127.0.0.1", {"SIE admin API": port, "endpoint picker": 0})
    with pytest.raises(StartupError, match="cannot listen on 192.0.2.1:8000 .* address of this machine"):
        check_ports_free("192.0.2.1", {"SIE admin API": 8000})  # TEST-NET-1: nobody's address


@pytest.mark.parametrize(
    "url, refused",
    [
        ("http://127.0.0.1:8000", False),
        ("http://localhost:8000", False),
        ("http://[::1]:8000", False),
        ("http://127.9.9.9:8000", False),
        ("https://10.0.0.5:8000", False),
        ("http://10.0.0.5:8000", True),
        ("http://control.example:8000", True),
    ],
)
def test_sie_join_sends_a_nodes_credential_over_plain_http_only_on_this_machine_or_when_told(url, refused):
    from sie.cli import plain_http_problem

    problem = plain_http_problem(url)
    assert (problem is not None) == refused
    if refused:
        assert "--insecure-http" in problem and "readable" in problem


def test_sie_join_refuses_plain_http_to_another_machine_before_it_starts_anything(tmp_path, capsys):
    from sie.cli import main

    argv = ["join", "http://10.0.0.5:8000", "--node", "far-1", "--token-file", "t", "--trust-file", "p"]
    assert main([*argv, "--run-dir", str(tmp_path / "n")]) == 2
    assert "--insecure-http" in capsys.readouterr().err
    assert not (tmp_path / "n").exists(), "no run directory, no lock, no node host"


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cluster.yaml"


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["validate", str(EXAMPLE), "--against", "chat-p0"],
        ["apply", "-f", str(EXAMPLE)],
        ["rollout", "status", "chat-p0"],
    ],
    ids=lambda argv: argv[0],
)
def test_the_admin_commands_send_no_token_over_plain_http_to_another_machine_unless_told(tmp_path, capsys, argv):
    """As `sie join` with a node's token: the admin token goes to an http URL of another machine only with
    --insecure-http. Here the token file is missing, so a command that got past the check says so, and
    one that did not never read it."""
    from sie.cli import main

    token = tmp_path / "missing.token"
    rest = ["--token-file", str(token), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--admin-url", "http://10.0.0.5:8000", *rest]) != 0
    err = capsys.readouterr().err
    assert f"sie {argv[0]}: http://10.0.0.5:8000 is plain HTTP to another machine" in err
    assert "--insecure-http" in err and str(token) not in err
    for allowed in (["--admin-url", "http://10.0.0.5:8000", "--insecure-http"], ["--admin-url", "http://[::1]:9"]):
        assert main([*argv, *allowed, *rest]) != 0
        err = capsys.readouterr().err
        assert "plain HTTP" not in err and f"cannot read the admin token {token}" in err, allowed


def test_a_join_token_expires_after_its_ttl_and_each_call_mints_a_fresh_one(tmp_path):
    from sie.auth import Verifier
    from sie.auth.store import CredentialDir
    from sie.cli import main

    CredentialDir(tmp_path / "credentials").ensure()
    token_file = tmp_path / "credentials" / "node-far-1.token"
    assert main(["token", "node", "far-1", "--run-dir", str(tmp_path), "--ttl-s", "600"]) == 0
    first = token_file.read_text().strip()
    who = Verifier.from_pem((tmp_path / "credentials" / "trust.pem").read_bytes()).verify(first)
    assert who.expires_at is not None and 590 <= who.expires_at - time.time() <= 600
    assert main(["token", "node", "far-1", "--run-dir", str(tmp_path)]) == 0
    second = token_file.read_text().strip()
    assert second != first
    assert (
        Verifier.from_pem((tmp_path / "credentials" / "trust.pem").read_bytes()).verify(second).expires_at
        > time.time() + 86_000
    )
    assert main(["token", "node", "far-1", "--run-dir", str(tmp_path), "--ttl-s", "0"]) == 0
    never = Verifier.from_pem((tmp_path / "credentials" / "trust.pem").read_bytes()).verify(
        token_file.read_text().strip()
    )
    assert never.expires_at is None, "--ttl-s 0 asks for a token that never expires"
