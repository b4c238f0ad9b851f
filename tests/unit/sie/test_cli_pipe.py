"""`sie status | head`: a reader that stops early ends the command quietly, as shell tools end."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]

# `sie status` printing far more than a pipe holds (its own function stood in: no cluster needed).
LOUD_STATUS = """
import sie.cli as cli

def loud(args):
    for i in range(200_000):
        print("chat-p0  P0  llm  torch  2/2  2 ready", i)
    return 0

cli._status = loud
raise SystemExit(cli.main(["status"]))
"""


def test_a_reader_that_stops_early_ends_the_command_quietly():
    with subprocess.Popen(
        [sys.executable, "-c", LOUD_STATUS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(100).startswith(b"chat-p0")
        proc.stdout.close()  # what `head` does once it has its lines
        err = proc.stderr.read()
        code = proc.wait(timeout=30)
    assert err == b"", err.decode()
    assert code == 128 + signal.SIGPIPE


def test_a_reader_that_reads_everything_sees_the_command_succeed():
    out = subprocess.run([sys.executable, "-c", LOUD_STATUS], capture_output=True, cwd=REPO, timeout=30)
    assert out.returncode == 0 and out.stderr == b""
    assert out.stdout.count(b"\n") == 200_000
