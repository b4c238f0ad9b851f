"""The node host's settings (node_host.settings): a docstring per field, the flags `sie up` and the tests
spawn it with, bad values refused naming their flag, and the cluster file's section."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from node_host.ledger import Watermarks
from node_host.settings import (
    AgentSettings,
    EvictionMode,
    NodeHostSettings,
    NodeTunables,
    parse_args,
    parser,
)
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.settings_flags import field_docs, from_mapping, to_argv
from sie.wire import HEARTBEAT_INTERVAL_S

REQUIRED = [
    "--control-url",
    "http://127.0.0.1:8000",
    "--node",
    "n1",
    "--run-dir",
    "/tmp/run",
    "--token-file",
    "/tmp/n1.token",
    "--trust-file",
    "/tmp/trust.pem",
]


@pytest.mark.parametrize("cls", [NodeTunables, NodeHostSettings, AgentSettings])
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == []


def test_help_is_the_docstrings(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    shown = re.sub(r"\s+", "", capsys.readouterr().out)
    for cls in (NodeTunables, NodeHostSettings):
        for name, doc in field_docs(cls).items():
            if name in ("tunables", "files"):  # nested sections: their own flags
                continue
            assert re.sub(r"\s+", "", doc) in shown, name


def test_the_required_flags_alone_give_the_defaults():
    settings = parse_args(REQUIRED)
    assert settings == NodeHostSettings(
        control_url="http://127.0.0.1:8000",
        node="n1",
        run_dir=Path("/tmp/run"),
        token_file=Path("/tmp/n1.token"),
        trust_file=Path("/tmp/trust.pem"),
    )
    assert settings.host == "127.0.0.1" and settings.port == 0 and settings.log_level == "INFO"
    assert settings.virtual_gpus is None and settings.tiers == {} and settings.p0_only == []
    assert settings.tunables == NodeTunables()
    assert settings.tunables.heartbeat_interval_s == HEARTBEAT_INTERVAL_S
    assert settings.tunables.eviction is EvictionMode.DRAIN
    assert settings.tunables.watermarks == Watermarks()
    assert settings.files == ModelFilePolicy()


def test_every_existing_flag_spelling_parses():
    """The command lines of sie/standalone.py, tests/integration and the README, every flag given."""
    settings = parse_args(
        [
            "--control-url",
            "http://127.0.0.1:8000",
            "--node",
            "n1",
            "--host",
            "127.0.0.2",
            "--port",
            "8123",
            "--run-dir",
            "/tmp/run",
            "--token-file",
            "/tmp/n1.token",
            "--trust-file",
            "/tmp/trust.pem",
            "--model-root",
            "/models/a",
            "--model-root",
            "/models/b",
            "--allow-unsafe-model-formats",
            "--allow-remote-code",
            "--virtual-gpus",
            "2x80GB",
            "--heartbeat-interval-s",
            "0.2",
            "--high-watermark",
            "0.8",
            "--low-watermark",
            "0.6",
            "--gpu-tiers",
            "0=gold,1=shared",
            "--p0-only-tiers",
            "gold",
            "--eviction",
            "kill",
            "--drain-timeout-s",
            "3",
            "--log-level",
            "debug",
        ]
    )
    assert (settings.host, settings.port, settings.virtual_gpus) == ("127.0.0.2", 8123, "2x80GB")
    assert settings.tiers == {0: "gold", 1: "shared"} and settings.p0_only == ["gold"]
    assert settings.log_level == "debug"
    assert settings.files == ModelFilePolicy(
        roots=(Path("/models/a"), Path("/models/b")), allow_unsafe_formats=True, allow_remote_code=True
    )
    assert settings.tunables == NodeTunables(
        heartbeat_interval_s=0.2,
        high_watermark=0.8,
        low_watermark=0.6,
        eviction=EvictionMode.KILL,
        drain_timeout_s=3.0,
    )
    agent = settings.agent()
    assert (agent.node, agent.control_url, agent.tunables) == ("n1", "http://127.0.0.1:8000", settings.tunables)


@pytest.mark.parametrize("mode", ["drain", "kill", "off"])
def test_eviction_modes(mode):
    assert parse_args([*REQUIRED, "--eviction", mode]).tunables.eviction is EvictionMode(mode)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "70000"),
        ("--port", "http"),
        ("--eviction", "evict"),
        ("--drain-timeout-s", "0"),
        ("--heartbeat-interval-s", "-1"),
        ("--wake-timeout-s", "soon"),
        ("--high-watermark", "1.5"),
        ("--low-watermark", "0"),
        ("--gpu-tiers", "gold"),
        ("--gpu-tiers", "\u00b2=gold"),
        ("--virtual-gpus", "lots"),
        ("--log-level", "loud"),
        ("--node", ""),
    ],
)
def test_a_bad_value_exits_naming_its_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_watermarks_in_the_wrong_order_exit_naming_the_flags():
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, "--low-watermark", "0.95"])
    assert str(exc.value.code).startswith("--low-watermark: ") and "low < high" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, "--high-watermark", "0.5", "--low-watermark", "0.7", "--drain-timeout-s", "9"])
    assert "--high-watermark" in str(exc.value.code) and "--low-watermark" in str(exc.value.code)


@pytest.mark.parametrize("flag", ["--control-url", "--node", "--run-dir", "--token-file", "--trust-file"])
def test_a_missing_required_flag_exits_naming_it(flag, capsys):
    at = REQUIRED.index(flag)
    with pytest.raises(SystemExit) as exc:
        parse_args(REQUIRED[:at] + REQUIRED[at + 2 :])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"drain_timeout_s": 0.0}, "drain_timeout_s"),
        ({"high_watermark": 1.2}, "high_watermark"),
        ({"high_watermark": 0.5, "low_watermark": 0.6}, "low < high"),
    ],
)
def test_tunables_built_directly_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NodeTunables(**kwargs)


def test_host_settings_built_directly_are_checked():
    base = {
        "control_url": "http://cp",
        "node": "n1",
        "run_dir": Path("r"),
        "token_file": Path("t"),
        "trust_file": Path("p"),
    }
    assert NodeHostSettings(**base).port == 0
    with pytest.raises(ValueError, match="port"):
        NodeHostSettings(**base, port=-1)
    with pytest.raises(ValueError, match="gpu_tiers"):
        NodeHostSettings(**base, gpu_tiers="0:gold")


def test_the_cluster_section_is_the_tunables_and_goes_on_as_flags():
    section = {"drain_timeout_s": 5, "eviction": "off", "high_watermark": 0.85, "heartbeat_interval_s": 0.25}
    tunables = from_mapping(NodeTunables, section, "cluster.yaml (kind: Cluster)", "spec.settings.node_host")
    assert tunables == NodeTunables(
        drain_timeout_s=5.0, eviction=EvictionMode.OFF, high_watermark=0.85, heartbeat_interval_s=0.25
    )
    assert parse_args([*REQUIRED, *to_argv(section, "")]).tunables == tunables
    every = {f.name: getattr(NodeTunables(), f.name) for f in dataclasses.fields(NodeTunables)}
    assert parse_args([*REQUIRED, *to_argv(every, "")]).tunables == NodeTunables()


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"node": "n1"}, r"spec\.settings\.node_host\.node: unknown setting"),
        ({"eviction": "evict"}, r"spec\.settings\.node_host\.eviction"),
        ({"drain_timeout_s": -1}, r"drain_timeout_s"),
    ],
)
def test_a_bad_cluster_section_names_its_key(section, match):
    with pytest.raises(SpecError, match=match):
        from_mapping(NodeTunables, section, "cluster.yaml (kind: Cluster)", "spec.settings.node_host")


def test_only_the_tunables_are_in_their_group():
    """The cluster section's flags are NodeTunables' fields and nothing else (to_argv relies on it)."""
    p = parser()
    group = next(g for g in p._action_groups if "NodeTunables" in (g.title or ""))
    dests = {a.dest for a in group._group_actions}
    assert dests == {f.name for f in dataclasses.fields(NodeTunables)}


def test_labels_and_taints_parse_and_bad_ones_name_the_item():
    from node_host.settings import parse_labels, parse_taints

    assert parse_labels("zone=a, gpu=h100") == {"zone": "a", "gpu": "h100"}
    assert parse_taints("dedicated=p0:NoSchedule,spot:PreferNoSchedule") == [
        "dedicated=p0:NoSchedule",
        "spot:PreferNoSchedule",
    ]
    with pytest.raises(ValueError, match="'zone'"):
        parse_labels("zone")
    with pytest.raises(ValueError, match="'dedicated=p0:Never'"):
        parse_taints("dedicated=p0:Never")


def test_tier_cpus_reserve_cores_per_tier():
    settings = parse_args(
        [*REQUIRED, "--tier-cpus", "gold=0", "--p0-only-tiers", "gold"], allowed_cpus=frozenset({0, 1})
    )
    plan = settings.cpu_plan(frozenset({0, 1}))
    assert plan.cpus_for("gold") == {0} and plan.cpus_for(None) == {1}
    assert settings.agent().cpu_tiers == ("gold",)
    assert parse_args(REQUIRED).agent().cpu_tiers == () and not parse_args(REQUIRED).cpu_plan({0, 1}).isolating


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("gold=4", "tier 'gold' asks for CPU 4, not among the CPUs this node host may use"),
        ("gold=0-1", "leaving none for the shared pool"),
        ("gold=0;silver=0", "CPU 0 is given to both tier 'gold' and tier 'silver'"),
    ],
)
def test_tier_cpus_that_do_not_fit_this_machine_exit_naming_the_flag(value, match):
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, "--tier-cpus", value], allowed_cpus=frozenset({0, 1}))
    assert str(exc.value.code).startswith("--tier-cpus: ") and match in str(exc.value.code)


@pytest.mark.parametrize("value", ["0", "gold=", "gold=a", "gold=1;gold=2"])
def test_malformed_tier_cpus_exit_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*REQUIRED, f"--tier-cpus={value}"], allowed_cpus=frozenset({0, 1, 2}))
    assert exc.value.code == 2 and "argument --tier-cpus:" in capsys.readouterr().err


def test_tier_cpus_built_directly_are_checked():
    base = {"control_url": "http://cp", "node": "n1", "run_dir": Path("r"), "token_file": Path("t")}
    with pytest.raises(ValueError, match="tier_cpus: .*names no tier"):
        NodeHostSettings(**base, trust_file=Path("p"), tier_cpus="0")
