"""Reading the process contract's flags and the spec file."""

import dataclasses
import json

import pytest

from sidecar.settings import Settings, SidecarTunables, build_parser, parse_settings
from sie.errors import SpecError
from sie.settings_flags import field_docs, flag_name

SPEC = {
    "kind": "ModelService",
    "spec": {
        "model": {"name": "m"},
        "backend": {"type": "sim"},
        "resources": {"max_concurrent_requests": 5},
        "sla": {"max_queue_time_ms": 250},
    },
}


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def base(spec_file, *extra):
    return [
        "--instance-id",
        "m-0",
        "--spec-file",
        spec_file,
        "--listen",
        "127.0.0.1:0",
        "--worker-url",
        "http://127.0.0.1:9/",
        "--worker-key-file",
        "/k",
        "--trust-file",
        "/t.pem",
        "--node",
        "n",
        *extra,
    ]


def test_defaults_follow_the_spec(spec_file):
    s = parse_settings(base(spec_file))
    assert (s.listen_host, s.listen_port, s.worker_url) == ("127.0.0.1", 0, "http://127.0.0.1:9")
    assert (s.control_host, s.control_port) == ("127.0.0.1", 0)  # its own listener, on a free port
    assert (s.max_concurrent, s.max_queue, s.max_queue_time_s) == (5, 20, 0.25)
    assert (s.control_url, s.gpu_index, s.address, s.token_file) == (None, None, None, None)


def test_all_flags(spec_file):
    s = parse_settings(
        base(
            spec_file,
            "--control-url",
            "http://127.0.0.1:8000",
            "--gpu-index",
            "2",
            "--address",
            "10.0.0.5:9000",
            "--max-queue",
            "0",
            "--drain-timeout-s",
            "3",
            "--token-file",
            "/tok",
            "--control-listen",
            "127.0.0.1:7000",
        )
    )
    assert (s.control_url, s.gpu_index, s.address, s.max_queue, s.tunables.drain_timeout_s) == (
        "http://127.0.0.1:8000",
        2,
        "10.0.0.5:9000",
        0,
        3.0,
    )
    assert (str(s.token_file), s.control_host, s.control_port) == ("/tok", "127.0.0.1", 7000)


def test_telemetry_needs_the_sidecars_credential(spec_file, capsys):
    with pytest.raises(SystemExit):
        parse_settings(base(spec_file, "--control-url", "http://127.0.0.1:8000"))
    assert "--token-file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ("--listen", "nohost"),
        ("--listen", "127.0.0.1:99999"),
        ("--address", "x"),
        ("--max-queue", "-1"),
        ("--drain-timeout-s", "0"),
        ("--drain-timeout-s", "3601"),  # over the Kafka connector's drain bound: it crashed at start
        ("--drain-timeout-s", "inf"),
        ("--window-size", "0"),
    ],
)
def test_bad_flags_exit_with_usage(spec_file, extra, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(base(spec_file, *extra))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage:" in err and "error" in err
    assert extra[0] in err  # the message names the flag


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--max-queue", "-1"), "--max-queue: max_queue must not be negative"),
        (("--window-size", "0"), "--window-size: window_size must be at least 1"),
        (("--recent-s", "0"), "--recent-s: recent_s must be above 0"),
        (("--probe-timeout-s", "nan"), "--probe-timeout-s: probe_timeout_s must be above 0"),
        (("--telemetry-interval-s", "-1"), "--telemetry-interval-s: telemetry_interval_s must be above 0"),
        (("--log-level", "loud"), "argument --log-level: expected one of"),
        (("--window-s", "x"), "argument --window-s"),
        (("--gpu-index", "one"), "argument --gpu-index"),
        (("--control-listen", "7000"), "--control-listen must be HOST:PORT"),
    ],
)
def test_bad_values_name_the_flag(spec_file, extra, words, capsys):
    with pytest.raises(SystemExit):
        parse_settings(base(spec_file, *extra))
    assert words in capsys.readouterr().err


def test_every_field_has_a_docstring_and_every_flag_its_help(capsys):
    for cls in (Settings, SidecarTunables):
        fields = {f.name for f in dataclasses.fields(cls)}
        docs = field_docs(cls)
        assert set(docs) == fields, cls
        assert all(len(doc) > 20 for doc in docs.values()), docs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for cls in (Settings, SidecarTunables):
        for name, doc in field_docs(cls).items():
            if name in ("spec", "tunables"):
                assert f"{flag_name('', name)} " not in out  # read from --spec-file; a section of its own flags
            else:
                assert f"{flag_name('', name)} " in out and doc in out


def test_defaults_come_from_the_dataclass(spec_file):
    s = parse_settings(base(spec_file))
    assert s.tunables == SidecarTunables()
    defaults = SidecarTunables()
    assert (defaults.drain_timeout_s, defaults.window_size, defaults.log_level) == (25.0, 1000, "INFO")
    for f in dataclasses.fields(Settings):
        if f.default is not dataclasses.MISSING and f.name != "worker_key_file":  # base() gives that one
            assert getattr(s, f.name) == f.default, f.name


def test_the_launchers_flag_spellings_parse(spec_file):
    """node_host, the webhook and the test harnesses pass these; each is one field's flag."""
    s = parse_settings(
        base(
            spec_file,
            "--control-listen",
            "[::1]:7001",
            "--max-queue",
            "7",
            "--drain-timeout-s",
            "0.3",
            "--probe-interval-s",
            "5",
            "--probe-timeout-s",
            "2",
            "--telemetry-interval-s",
            "60",
            "--window-s",
            "10",
            "--window-size",
            "50",
            "--recent-s",
            "0.25",
            "--log-level",
            "debug",
        )
    )
    assert (s.control_host, s.control_port, s.max_queue) == ("::1", 7001, 7)
    assert s.tunables == SidecarTunables(
        max_queue=7,
        drain_timeout_s=0.3,
        probe_interval_s=5.0,
        probe_timeout_s=2.0,
        telemetry_interval_s=60.0,
        window_s=10.0,
        window_size=50,
        recent_s=0.25,
        log_level="DEBUG",
    )


def test_direct_construction_is_checked_too(spec_file):
    assert SidecarTunables(log_level="warning").log_level == "WARNING"
    with pytest.raises(ValueError, match="window_size"):
        SidecarTunables(window_size=0)
    s = parse_settings(base(spec_file))
    with pytest.raises(ValueError, match="--listen must be HOST:PORT"):
        dataclasses.replace(s, listen="x")
    with pytest.raises(ValueError, match="--token-file"):
        dataclasses.replace(s, control_url="http://127.0.0.1:8000")


@pytest.mark.parametrize(
    "url", ["127.0.0.1:9", "ftp://h:1", "http://:80", "http://h:1/?q=1", "http://h:99999", "http://[::1:9"]
)
def test_worker_url_must_be_one_the_sidecar_can_call(spec_file, capsys, url):
    argv = base(spec_file)
    argv[argv.index("--worker-url") + 1] = url
    with pytest.raises(SystemExit):
        parse_settings(argv)
    assert "expected an http(s)://host[:port][/path] URL" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read"),
        ("{]", "not valid JSON"),
        ("a: &x 1", "anchors and aliases"),
        ('{"spec": {}}', "spec.model"),
    ],
)
def test_bad_spec_file_names_the_problem(tmp_path, content, words):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError, match=words):
        parse_settings(base(str(path)))
