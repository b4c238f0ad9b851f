"""Flags and cluster-file sections derived from a settings dataclass (sie.settings_flags)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from sie.cluster import ClusterSettings, load_cluster
from sie.errors import SpecError
from sie.settings_flags import add_flags, field_docs, from_args, from_mapping, to_argv
from sie.standalone import xds_server_argv


@dataclass(frozen=True)
class Knobs:
    """A small settings dataclass."""

    rate_s: float = 0.5
    """Seconds per step. Default 0.5 (50% of a second)."""

    count: int = 3
    """How many. Default 3."""

    on: bool = False
    """Whether. Default off."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_flags(p, Knobs, "knobs")
    return p.parse_args(argv)


def test_docstrings_become_help_and_every_field_a_flag(capsys):
    assert field_docs(Knobs) == {
        "rate_s": "Seconds per step. Default 0.5 (50% of a second).",
        "count": "How many. Default 3.",
        "on": "Whether. Default off.",
    }
    with pytest.raises(SystemExit):
        _parse(["--help"])
    out = capsys.readouterr().out
    assert "--knobs-rate-s" in out and "--knobs-count" in out and "--knobs-on" in out
    assert "50% of a second" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], Knobs()),
        (["--knobs-count", "7"], Knobs(count=7)),
        (["--knobs-rate-s=0.25", "--knobs-on", "true"], Knobs(rate_s=0.25, on=True)),
    ],
)
def test_only_the_flags_given_override(argv, expected):
    assert from_args(Knobs, _parse(argv), "knobs") == expected


def test_flags_apply_over_a_base():
    assert from_args(Knobs, _parse(["--knobs-on", "yes"]), "knobs", Knobs(count=9)) == Knobs(count=9, on=True)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--knobs-count", "1.5"], None),  # argparse: invalid int value
        (["--knobs-on", "maybe"], None),
        (["--knobs-count", "-1"], "--knobs-count: count must be >= 0"),  # the dataclass's own check
    ],
)
def test_bad_flags_exit(argv, match):
    with pytest.raises(SystemExit, match=match):
        from_args(Knobs, _parse(argv), "knobs")


def test_a_mapping_round_trips_through_the_flags():
    section = {"rate_s": -2.5, "count": 4, "on": True}
    assert from_args(Knobs, _parse(to_argv(section, "knobs")), "knobs") == Knobs(rate_s=-2.5, count=4, on=True)
    assert from_mapping(Knobs, section, "f", "knobs") == Knobs(rate_s=-2.5, count=4, on=True)
    assert from_mapping(Knobs, {"rate_s": 1}, "f", "knobs").rate_s == 1.0  # an int is a number


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"cuont": 1}, r"knobs\.cuont: unknown setting; the settings here are: count, on, rate_s"),
        ({"count": "many"}, r"knobs\.count: expected a int, got 'many'"),
        ({"count": True}, r"knobs\.count: expected a int"),
        ({"rate_s": "fast"}, r"knobs\.rate_s: expected a number"),
        ({"count": -1}, r"knobs: count must be >= 0"),
    ],
)
def test_bad_sections_name_the_key(section, match):
    with pytest.raises(SpecError, match=match):
        from_mapping(Knobs, section, "f", "knobs")


def test_the_cluster_files_weights_reach_the_xds_server_argv(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec:\n  settings:\n    weights: {queue_full: 32, knee: 0.4}\n")
    settings = load_cluster(path).settings
    assert settings.settings.weights == {"queue_full": 32, "knee": 0.4}
    argv = xds_server_argv("py", path, settings, Path("/creds"), Path("/run"))
    assert argv[-2:] == ["--weights-queue-full=32", "--weights-knee=0.4"]
    defaults = xds_server_argv("py", path, ClusterSettings(), Path("/creds"), Path("/run"))
    assert not [a for a in defaults if a.startswith("--weights")], "no section, no flags: the defaults hold"


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ("{weights: {queue_full: [1]}}", "spec.settings.weights.queue_full"),
        ("{wieghts: {}}", "spec.settings.wieghts"),
    ],
)
def test_the_cluster_files_settings_section_is_checked_for_shape(tmp_path, section, match):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: Cluster\nspec:\n  settings: {section}\n")
    with pytest.raises(SpecError, match=match):
        load_cluster(path)


def test_the_cluster_files_control_plane_section_reaches_the_xds_server_argv_and_parses_back(tmp_path):
    from xds_server.settings import parse_args

    path = tmp_path / "c.yaml"
    path.write_text(
        "kind: Cluster\nspec:\n  settings:\n    control_plane: {heartbeat_timeout_s: 6, lb_policy: round_robin}\n"
    )
    settings = load_cluster(path).settings
    argv = xds_server_argv("py", path, settings, Path("/creds"), Path("/run"))
    assert "--heartbeat-timeout-s=6" in argv and "--lb-policy=round_robin" in argv
    parsed = parse_args(argv[3:], settings)  # what the child reads: its own flags over the same file
    assert parsed.loop.heartbeat_timeout_s == 6.0 and parsed.loop.lb_policy == "round_robin"


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass(frozen=True)
class Wiring:
    name: str
    """Required: no default."""

    root: Path | None = None
    """An optional path."""

    mode: Mode = Mode.FAST
    """An Enum, spelled by value."""

    color: typing.Literal["red", "blue"] = "red"
    """A Literal."""

    on: bool = dataclasses.field(default=False, metadata={"flag": "--switch"})
    """A bool under a fixed flag name; alone it means true."""

    knobs: Knobs = Knobs()
    """A nested section: not a flag here."""


def test_required_optional_enum_literal_and_renamed_flags():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_flags(parser, Wiring, "", title="")
    args = parser.parse_args(["--name", "x", "--root", "/r", "--mode", "slow", "--color", "blue", "--switch"])
    built = from_args(Wiring, args, "", knobs=Knobs(rate_s=2.0))
    assert built == Wiring("x", Path("/r"), Mode.SLOW, "blue", True, Knobs(rate_s=2.0))
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --name is required
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x", "--mode", "medium"])
    assert to_argv({"mode": Mode.SLOW, "root": None}, "") == ["--mode=slow"]
    section = from_mapping(Wiring, {"mode": "slow", "root": "/a"}, "f", "w", base=Wiring("x"))
    assert section.mode is Mode.SLOW and section.root == Path("/a")
    with pytest.raises(SpecError, match="one of red, blue"):
        from_mapping(Wiring, {"color": "green"}, "f", "w", base=Wiring("x"))


def test_the_cluster_files_node_host_section_reaches_the_node_host_argv_and_parses_back(tmp_path):
    from node_host.settings import parse_args as node_host_args
    from sie.standalone import node_host_argv

    path = tmp_path / "c.yaml"
    path.write_text("kind: Cluster\nspec:\n  settings:\n    node_host: {drain_timeout_s: 7, high_watermark: 0.9}\n")
    settings = load_cluster(path).settings
    argv = node_host_argv("py", settings, "http://127.0.0.1:8000", tmp_path, tmp_path / "t", tmp_path / "p")
    assert "--drain-timeout-s=7" in argv and "--high-watermark=0.9" in argv
    parsed = node_host_args(argv[3:])
    assert parsed.tunables.drain_timeout_s == 7.0 and parsed.tunables.high_watermark == 0.9


def test_a_nodes_list_gives_each_node_host_its_flags_and_the_control_plane_waits_for_them(tmp_path):
    from node_host.settings import parse_args as node_host_args
    from sie.standalone import node_host_argv
    from xds_server.settings import parse_args as xds_args

    path = tmp_path / "c.yaml"
    path.write_text(
        "kind: Cluster\nspec:\n  nodes:\n"
        "    - {name: a, virtual_gpus: 1x24GB}\n"
        "    - {name: b, virtual_gpus: 2x48GB, gpu_tiers: '1=gold', p0_only_tiers: gold,"
        " labels: {zone: b}, taints: ['dedicated=p0:NoSchedule']}\n"
    )
    settings = load_cluster(path).settings
    assert [n.name for n in settings.node_specs] == ["a", "b"]
    b = settings.node_specs[1]
    parsed = node_host_args(
        node_host_argv("py", settings, "http://127.0.0.1:8000", tmp_path, tmp_path / "t", tmp_path / "p", b)[3:]
    )
    assert (parsed.node, parsed.virtual_gpus, parsed.tiers, parsed.p0_only) == ("b", "2x48GB", {1: "gold"}, ["gold"])
    assert (parsed.label_map, parsed.taint_list, parsed.port) == ({"zone": "b"}, ["dedicated=p0:NoSchedule"], 0)
    assert xds_args(["--cluster-file", str(path)], settings).loop.startup_nodes == 2


def test_one_node_by_default_and_node_names_are_unique(tmp_path):
    from sie.cluster import ClusterSettings

    assert [(n.name, n.virtual_gpus) for n in ClusterSettings(virtual_gpus="1x8GB").node_specs] == [("local", "1x8GB")]
    with pytest.raises(ValueError, match="given twice: a"):
        ClusterSettings(nodes=[{"name": "a"}, {"name": "a"}])
