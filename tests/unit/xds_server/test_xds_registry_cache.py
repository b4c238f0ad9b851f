"""Heartbeat replies are cached until placement's inputs move, and always reflect the current placement."""

from __future__ import annotations

from sie.auth import Signer
from sie.spec_loader import parse_model_service
from sie.wire import NodeHeartbeat
from xds_server.credentials import TokenIssuer
from xds_server.registry import Registry


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


def svc(name: str, replicas: int = 1):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": name},
                "backend": {"type": "sim"},
                "sla": {"min_replicas": replicas, "max_replicas": max(1, replicas)},
            }
        }
    )


def ids(reply: dict) -> list[str]:
    return [a["instance_id"] for a in reply["assignments"]]


def test_an_unchanged_heartbeat_gets_the_cached_reply_and_changes_invalidate_it():
    clock = Clock()
    reg = Registry(clock=clock, heartbeat_timeout_s=3.0)
    reg.add_model(svc("a", 2), "file")
    reg.mark_synced()
    beat = NodeHeartbeat(node="n1", address="http://n1")
    first = reg.heartbeat_json(beat)
    assert ids(first) == ["a-0", "a-1"]
    clock.now += 0.5
    assert reg.heartbeat_json(beat) is first  # nothing moved: no new placement, no new body

    reg.add_model(svc("b"), "api")  # a model arrives
    second = reg.heartbeat_json(beat)
    assert ids(second) == ["a-0", "a-1", "b-0"]

    # A second node comes alive: new instances would go there, existing ones stay (adoption; no GPU
    # memory is known here, so the spread repair does not move a's replicas on a guess).
    reg.heartbeat_json(NodeHeartbeat(node="n2", address="http://n2"))
    reg.put_model(svc("c"), "api")
    assert ids(reg.heartbeat_json(NodeHeartbeat(node="n2", address="http://n2"))) == ["c-0"]

    # n2 goes silent past its TTL: its instance moves back to n1 on n1's next heartbeat.
    clock.now += 5.0
    assert ids(reg.heartbeat_json(beat)) == ["a-0", "a-1", "b-0", "c-0"]


def test_replies_are_not_cached_before_the_sync_window_ends():
    reg = Registry(clock=Clock())
    reg.add_model(svc("a"), "file")
    reply = reg.heartbeat_json(NodeHeartbeat(node="n1", address="http://n1"))
    assert reply["authoritative"] is False and reply["assignments"] == []


def test_a_cached_reply_gives_way_to_a_renewed_sidecar_token():
    """Each sidecar token is re-signed on its own schedule, not the node token's: a body cached while
    only the node token was in its key carried the old sidecar token until it expired."""
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    reg = Registry(clock=clock, tokens=TokenIssuer(signer, clock, node_ttl_s=10_000, sidecar_ttl_s=100))
    reg.add_model(svc("a"), "file")
    reg.mark_synced()
    beat = NodeHeartbeat(node="n1", address="http://n1")
    first = reg.heartbeat_json(beat)
    for _ in range(49):  # a beat a second: nothing moves, the body is the cached one
        clock.now += 1
        assert reg.heartbeat_json(beat) is first
    clock.now += 1  # the sidecar token's half life has passed, long before the node token's
    second = reg.heartbeat_json(beat)
    assert second["node_token"] == first["node_token"]
    (old,), (new,) = first["assignments"], second["assignments"]
    assert new["instance_id"] == old["instance_id"] == "a-0" and new["token"] != old["token"]
    assert signer.verifier().verify(new["token"]).expires_at == clock.now + 100
