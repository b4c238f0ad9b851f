"""Settings (flags over the cluster file over defaults), the policy choice, and the Envoy bootstrap."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sie.cluster import ClusterSettings
from xds_server.bootstrap import XDS_CLUSTER, envoy_bootstrap
from xds_server.main import make_policy
from xds_server.policy.decisions import EqualWeights
from xds_server.settings import parse_args


@pytest.mark.parametrize(
    ("argv", "cluster", "expected"),
    [
        (
            [],
            None,
            {
                "host": "127.0.0.1",
                "admin_port": 8000,
                "xds_port": 18000,
                "listener_port": 8080,
                "loop.startup_sync_s": 2.0,
                "loop.debounce_s": 0.05,
            },
        ),
        (
            [],
            ClusterSettings(admin_port=9000, xds_port=19000, envoy_port=9080),
            {"admin_port": 9000, "xds_port": 19000, "listener_port": 9080},
        ),
        (
            ["--admin-port", "0", "--listener-port", "7000"],
            ClusterSettings(admin_port=9000),
            {"admin_port": 0, "listener_port": 7000},
        ),
        (["--host", "0.0.0.0"], None, {"host": "0.0.0.0", "listener_address": "0.0.0.0"}),
        (
            ["--listener-host", "10.0.0.1", "--debounce-ms", "10", "--startup-sync-s", "3"],
            None,
            {"listener_address": "10.0.0.1", "loop.debounce_s": 0.01, "loop.startup_sync_s": 3.0},
        ),
    ],
)
def test_flags_over_the_cluster_file_over_defaults(argv, cluster, expected):
    settings = parse_args(argv, cluster)
    assert {k: _get(settings, k) for k in expected} == expected


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--admin-port", "70000"], "--admin-port"),
        (["--debounce-ms", "-1"], "--debounce-ms"),
        (["--policy", "fancy"], "--policy"),
        (["--kube-api-url", "http://x", "--kubeconfig", "k"], "--kube-api-url"),
        (["--admin"], "--admin"),  # no abbreviations: a typo is not silently another flag
    ],
)
def test_bad_flags_exit_with_a_message(argv, names, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert names in f"{exc.value.code} {capsys.readouterr().err}"


def test_every_field_is_documented_and_every_default_stated_once(capsys):
    from sie.settings_flags import field_docs
    from xds_server.policy.settings import WeightSettings
    from xds_server.settings import ControlLoopSettings, KubernetesSettings, Settings, _parser

    for cls in (Settings, ControlLoopSettings, KubernetesSettings, WeightSettings):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"
    text = _parser().format_help()
    for flag, doc in [("--retire-s", "outlives its routes"), ("--kubernetes", "ModelService controller")]:
        assert flag in text and doc in " ".join(text.split())


def test_the_clusters_control_plane_section_is_a_base_the_flags_override():
    cluster = ClusterSettings.model_validate(
        {"settings": {"control_plane": {"heartbeat_timeout_s": 9, "policy": "equal"}}}
    )
    assert parse_args([], cluster).loop.heartbeat_timeout_s == 9.0
    assert parse_args([], cluster).loop.policy == "equal"
    assert parse_args(["--heartbeat-timeout-s", "4"], cluster).loop.heartbeat_timeout_s == 4.0


@pytest.mark.parametrize(
    ("section", "match"),
    [({"node_ttl": 1}, "control_plane.node_ttl: unknown setting"), ({"policy": "fancy"}, "one of sie, equal")],
)
def test_a_bad_control_plane_section_names_its_key(section, match):
    from sie.errors import SpecError

    cluster = ClusterSettings.model_validate({"settings": {"control_plane": section}})
    with pytest.raises(SpecError, match=match):
        parse_args([], cluster)


def test_bare_kubernetes_flag_still_turns_the_controller_on():
    settings = parse_args(["--kubernetes", "--namespace", "ml", "--kube-api-url", "http://127.0.0.1:1"])
    assert settings.kubernetes.enabled and settings.kubernetes.namespace == "ml"


def test_a_short_sync_window_is_warned_about():
    assert parse_args(["--startup-sync-s", "0.4"]).warnings()
    assert parse_args([]).warnings() == []


def test_policy_choice():
    from xds_server.policy.weights import WeightPolicy

    policy, name = make_policy("equal")
    assert isinstance(policy, EqualWeights) and name == "equal"
    policy, name = make_policy(None)
    assert isinstance(policy, WeightPolicy) and name == "sie"


def test_the_control_plane_refuses_to_start_without_its_credentials(capsys):
    from xds_server.main import main

    assert main(["--admin-port", "0"]) == 2
    assert "--credentials-dir is required" in capsys.readouterr().err


def test_bootstrap_points_cds_and_lds_at_ads_over_http2():
    boot = envoy_bootstrap("n1", "c1", "127.0.0.1", 18000, "/run/sie/envoy/admin.sock")
    assert boot["node"] == {"id": "n1", "cluster": "c1"}
    ads = boot["dynamic_resources"]["ads_config"]
    assert ads["api_type"] == "GRPC" and ads["grpc_services"][0]["envoy_grpc"]["cluster_name"] == XDS_CLUSTER
    assert boot["dynamic_resources"]["cds_config"] == {"ads": {}, "resource_api_version": "V3"}
    assert boot["dynamic_resources"]["lds_config"] == {"ads": {}, "resource_api_version": "V3"}
    xds = boot["static_resources"]["clusters"][0]
    assert xds["name"] == XDS_CLUSTER
    options = xds["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    endpoint = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert endpoint == {"address": "127.0.0.1", "port_value": 18000}
    assert boot["admin"]["address"] == {"pipe": {"path": "/run/sie/envoy/admin.sock", "mode": 0o600}}
    assert [c["name"] for c in boot["static_resources"]["clusters"]] == [XDS_CLUSTER]
    assert "listeners" not in boot["static_resources"], "no stats listener unless asked for"


def test_the_admin_is_a_unix_socket_and_the_stats_listener_passes_on_only_ready_and_metrics(tmp_path):
    """Envoy's admin asks no credential, shows the ADS token (/config_dump) and stops on POST /quitquitquit:
    never on TCP. A TCP listener may pass on GET /ready and /stats/prometheus, nothing else."""
    from xds_server.bootstrap import ADMIN_CLUSTER, AdminSocketError

    boot = envoy_bootstrap("n1", "c1", "127.0.0.1", 18000, "/run/admin.sock", stats_port=9901, token="t0k")
    assert boot["admin"]["address"] == {"pipe": {"path": "/run/admin.sock", "mode": 0o600}}
    (listener,) = boot["static_resources"]["listeners"]
    assert listener["address"] == {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["normalize_path"] and manager["merge_slashes"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    passed = [(r["match"]["path"], r["match"]["headers"][0]["string_match"]) for r in routes if "route" in r]
    assert passed == [("/ready", {"exact": "GET"}), ("/stats/prometheus", {"exact": "GET"})]
    assert routes[-1] == {
        "match": {"prefix": "/"},
        "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}},
    }
    (admin,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == ADMIN_CLUSTER]
    assert admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "pipe": {"path": "/run/admin.sock"}
    }
    assert "t0k" not in json.dumps(listener) + json.dumps(admin)
    # A relative path is made absolute (Envoy and its clients run elsewhere); one too long for a socket is refused.
    relative = envoy_bootstrap("n1", "c1", "h", 1, "admin.sock")["admin"]["address"]["pipe"]["path"]
    assert relative.startswith("/") and relative.endswith("/admin.sock")
    with pytest.raises(AdminSocketError, match="shorter run directory"):
        envoy_bootstrap("n1", "c1", "h", 1, "/" + "d" * 120 + "/admin.sock")


def test_bootstrap_carries_envoys_credential_and_bounds_its_connections():
    boot = envoy_bootstrap("n1", "c1", "127.0.0.1", 18000, "/run/admin.sock", token="t0k")
    service = boot["dynamic_resources"]["ads_config"]["grpc_services"][0]
    assert service["initial_metadata"] == [{"key": "authorization", "value": "Bearer t0k"}]
    (monitor,) = boot["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] > 0
    tls = envoy_bootstrap(
        "n1",
        "c1",
        "sie-xds",
        18000,
        "/run/admin.sock",
        tls={"ca_file": "/ca", "cert_file": "/c", "key_file": "/k", "server_name": "sie-xds"},
    )
    socket = tls["static_resources"]["clusters"][0]["transport_socket"]
    assert socket["typed_config"]["common_tls_context"]["validation_context"]["trusted_ca"] == {"filename": "/ca"}


# ---- the weight policy's tunables: --weights-* flags over the Cluster's settings.weights --------------


def test_weight_flags_change_a_field_and_the_policy_gets_it():
    from xds_server.policy import WeightPolicy, WeightSettings

    settings = parse_args(["--weights-queue-full", "16", "--weights-shed-after-s", "5"])
    assert settings.weights == WeightSettings(queue_full=16.0, shed_after_s=5.0)
    policy, name = make_policy(settings.loop.policy, settings.weights)
    assert name == "sie" and isinstance(policy, WeightPolicy) and policy.settings == settings.weights
    assert parse_args([]).weights == WeightSettings(), "no flag, the defaults"


def test_every_weight_setting_has_a_flag():
    import dataclasses

    from sie.settings_flags import flag_name
    from xds_server.policy import WeightSettings
    from xds_server.settings import _parser

    text = _parser().format_help()
    missing = [f.name for f in dataclasses.fields(WeightSettings) if flag_name("weights", f.name) not in text]
    assert missing == []


def test_weight_flags_win_over_the_cluster_file():
    cluster = ClusterSettings.model_validate({"settings": {"weights": {"queue_full": 32, "knee": 0.4}}})
    assert parse_args([], cluster).weights.queue_full == 32.0
    s = parse_args(["--weights-queue-full", "8"], cluster).weights
    assert (s.queue_full, s.knee) == (8.0, 0.4)


def test_the_argv_sie_up_builds_configures_the_policy(tmp_path):
    from pathlib import Path

    from sie.standalone import xds_server_argv

    cluster = ClusterSettings.model_validate({"settings": {"weights": {"hysteresis": 10, "alpha_up": 0.5}}})
    argv = xds_server_argv("py", tmp_path / "c.yaml", cluster, Path("/creds"), tmp_path)[3:]
    weights = parse_args(argv).weights  # the flags alone, without the cluster file
    assert (weights.hysteresis, weights.alpha_up) == (10, 0.5)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"queue_ful": 1}, r"spec\.settings\.weights\.queue_ful: unknown setting"),
        ({"hysteresis": 2.5}, r"spec\.settings\.weights\.hysteresis: expected a int"),
        ({"knee": "high"}, r"spec\.settings\.weights\.knee: expected a number"),
        ({"knee": 1.5}, r"spec\.settings\.weights: invalid WeightSettings: knee must lie in \[0, 1\)"),
    ],
)
def test_bad_cluster_weights_are_refused_naming_the_key(weights, match):
    from sie.errors import SpecError

    cluster = ClusterSettings.model_validate({"settings": {"weights": weights}})
    with pytest.raises(SpecError, match=match):
        parse_args([], cluster)


@pytest.mark.parametrize("argv", [["--weights-nope", "1"], ["--weights-hysteresis", "2.5"], ["--weights-knee", "1.5"]])
def test_bad_weight_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_a_bad_cluster_weight_makes_xds_server_exit_with_the_key(tmp_path, capsys):
    from xds_server.main import main

    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec: {settings: {weights: {nope: 1}}}\n")
    assert main(["--cluster-file", str(path), "--credentials-dir", str(tmp_path)]) == 2
    assert "spec.settings.weights.nope: unknown setting" in capsys.readouterr().err


def test_the_in_process_controller_takes_its_pod_rules_from_the_flags():
    settings = parse_args(
        ["--kubernetes", "--kube-p0-only-tiers", "gold, platinum", "--kube-worker-run-as-user", "1000"]
    )
    assert settings.kubernetes.p0_only == frozenset({"gold", "platinum"})
    assert settings.kubernetes.worker_run_as_user == 1000
    assert parse_args(["--kubernetes"]).kubernetes.p0_only == frozenset()
