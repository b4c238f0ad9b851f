"""The process contract's failure modes: what a launcher sees when it gets the sidecar wrong."""

import json
import socket
import subprocess
import sys

import pytest

from sie_testing.credentials import Credentials
from sie_testing.sidecar_harness import write_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def run_sidecar(*argv):
    proc = subprocess.run([sys.executable, "-m", "sidecar", *argv], capture_output=True, text=True, timeout=30)
    return proc.returncode, proc.stderr


def base(spec, listen="127.0.0.1:0", trust=None):
    trust = trust or Credentials.create(spec.parent).trust_file
    return [
        "--instance-id",
        "m-0",
        "--spec-file",
        str(spec),
        "--listen",
        listen,
        "--worker-url",
        "http://127.0.0.1:9",
        "--node",
        "n",
        "--trust-file",
        str(trust),
    ]


def test_bad_spec_exits_2_naming_the_field(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"kind": "ModelService", "spec": {"model": {"name": "Bad_Name"}, "backend": {"type": "sim"}}})
    )
    code, err = run_sidecar(*base(spec))
    assert code == 2 and "spec.model.name" in err


def test_port_in_use_exits_1_saying_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_sidecar(*base(write_spec(tmp_path / "spec.json"), f"127.0.0.1:{port}"))
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err


def test_a_sidecar_without_readable_credentials_does_not_start(tmp_path):
    spec = write_spec(tmp_path / "spec.json")
    open_trust = tmp_path / "open.pem"
    open_trust.write_text(Credentials.create(tmp_path).trust_file.read_text())
    open_trust.chmod(0o644)  # anyone on the machine could have replaced it
    code, err = run_sidecar(*base(spec, trust=open_trust))
    assert code == 2 and "readable by others" in err
    code, err = run_sidecar(*base(spec, trust=tmp_path / "missing.pem"))
    assert code == 2 and "cannot read the trust bundle" in err


def test_missing_flag_exits_2_with_usage(tmp_path):
    code, err = run_sidecar("--instance-id", "m-0")
    assert code == 2 and "--spec-file" in err
