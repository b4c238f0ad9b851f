"""bench.soak, briefly: the real stack answers every request of a steady stream and holds nothing after."""

import json

import pytest

from bench import soak

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_short_soak_answers_everything_and_leaves_nothing_in_flight(tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main(["--rate", "40", "--duration", "4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] >= 100 and doc["ok"] == doc["requests"] and doc["failed"] == []
    assert all(
        v == {"envoy_active": 0, "sidecar_in_flight": 0, "sidecar_queued": 0} for v in doc["left_in_flight"].values()
    )
    assert len(doc["left_in_flight"]) == 4
