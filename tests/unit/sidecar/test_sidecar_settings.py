"""Reading the process contract's flags and the spec file."""

import json

import pytest

from sidecar.settings import parse_settings
from sie.errors import SpecError

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
    assert (s.control_url, s.gpu_index, s.address, s.max_queue, s.drain_timeout_s) == (
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
        ("--window-size", "0"),
    ],
)
def test_bad_flags_exit_with_usage(spec_file, extra, capsys):
    with pytest.raises(SystemExit):
        parse_settings(base(spec_file, *extra))
    assert "error" in capsys.readouterr().err


def test_worker_url_must_be_http(spec_file, capsys):
    argv = base(spec_file)
    argv[argv.index("--worker-url") + 1] = "127.0.0.1:9"
    with pytest.raises(SystemExit):
        parse_settings(argv)
    assert "http://" in capsys.readouterr().err


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
