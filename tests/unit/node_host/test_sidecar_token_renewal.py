"""A sidecar's credential across its whole way, in one process with one fake wall clock: the control
plane's registry signs it into heartbeat replies (xds_server.credentials.TokenIssuer), the real admin API
answers the node agent's heartbeats, the node host writes it to the sidecar's token file
(ProcessManager.update_token, fake children), and the sidecar's reporter reads that file
(sie.auth.TokenSource) for each telemetry post the admin API checks. The token expires; a heartbeat past
half its life brings the next one, and the sidecar switches with no refused post; cut off from
heartbeats past its expiry the sidecar is refused, says so once, and recovers with the next beat."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from node_host.agent import NodeAgent
from node_host.settings import AgentSettings, NodeTunables
from sidecar.reporter import Identity as ReporterIdentity
from sidecar.reporter import Live, Reporter
from sidecar.window import EMPTY
from sie.auth import Identity, Signer, TokenAuthenticator, TokenSource, Verifier
from sie.errors import Unauthenticated
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import Clock, Spawner, supervisor
from xds_server.admin import AdminContext, make_app
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop, PendingChanges
from xds_server.credentials import TokenIssuer
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics
from xds_server.policy.decisions import EqualWeights
from xds_server.registry import Registry
from xds_server.snapshots import SnapshotCache

TTL_S = 100.0
SPEC = {
    "metadata": {"name": "scorer"},
    "spec": {
        "model": {"name": "scorer", "version": "1.0.0", "service_type": "scoring"},
        "backend": {"type": "sim"},
    },
}


class Chain:
    """The control plane (registry and admin API), one node agent, and its sidecar's reporter."""

    def __init__(self, clock: Clock, signer: Signer, registry: Registry, agent: NodeAgent, url: str):
        self.clock, self.signer, self.registry, self.agent, self.url = clock, signer, registry, agent, url
        self.verifier = Verifier({signer.kid: signer.public}, clock)

    def token_file(self):
        return self.agent.supervisor.secret_path("scorer-0", "token")

    def reporter(self, session: aiohttp.ClientSession) -> tuple[Reporter, TokenSource]:
        inst = self.agent.supervisor.instances["scorer-0"]
        source = TokenSource(path=self.token_file())  # what sidecar/main.py builds from --token-file
        who = ReporterIdentity(
            "scorer-0", "scorer", "1.0.0", inst.sidecar_address, "n1", "P2", "scoring", None, 8, True
        )
        live = Live(InstanceState.READY, 0, 0, 0, EMPTY, None, None)
        return Reporter(who, lambda: live, self.clock, asyncio.Event(), 1.0, session, self.url, source), source


@pytest.fixture
async def chain(tmp_path):
    clock = Clock(1_000_000.0)  # wall time: what tokens are stamped and checked with
    signer = Signer(Signer.generate()._private, clock)
    changes = PendingChanges(time.monotonic)
    registry = Registry(
        clock=time.monotonic,
        wall_clock=clock,
        changes=changes,
        tokens=TokenIssuer(signer, clock, node_ttl_s=TTL_S, sidecar_ttl_s=TTL_S),
    )
    registry.add_model(parse_model_service(SPEC), "file")
    registry.mark_synced()
    metrics, cache = ControlPlaneMetrics(), SnapshotCache()
    control = ControlLoop(
        registry, EqualWeights(), cache, metrics, IngressConfig(), time.monotonic, clock, changes=changes
    )
    authenticator = TokenAuthenticator(Verifier({signer.kid: signer.public}, clock))
    app = make_app(
        AdminContext(
            registry, control, metrics, AdsServer(cache, metrics, time.monotonic), time.monotonic, clock, authenticator
        )
    )
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")

    async def gpus():
        return [GPUInfo(index=0, name="virtual", total_mb=24_000.0, used_mb=0.0, virtual=True)]

    async with aiohttp.ClientSession() as session:
        agent = NodeAgent(
            AgentSettings("n1", url, NodeTunables(probe_timeout_s=0.05)),
            supervisor(tmp_path, Spawner()),
            session,
            # The node's own credential (standalone: node-n1.token), which it heartbeats with.
            credential=TokenSource(token=signer.issue(Identity.for_node("n1"))),
            gpus=gpus,
            facts={"python": "3.11.7"},
        )
        agent.address = "http://127.0.0.1:1"
        try:
            yield Chain(clock, signer, registry, agent, url), session
        finally:
            await agent.shutdown()
    await server.close()


async def test_a_renewed_sidecar_token_reaches_the_token_file_and_the_sidecar_reports_on(chain):
    chain, session = chain
    reply = await chain.agent.heartbeat_once()
    assert reply is not None and [a.instance_id for a in reply.assignments] == ["scorer-0"]
    first = reply.assignments[0].token
    assert chain.token_file().read_text() == first  # the node host started the instance with it
    assert chain.verifier.verify(first).expires_at == chain.clock.now + TTL_S
    reporter, source = chain.reporter(session)
    assert await reporter.send() and source.token == first

    chain.clock.now += TTL_S / 2 - 1
    await chain.agent.heartbeat_once()
    assert chain.token_file().read_text() == first  # most of its life left: the same one

    chain.clock.now += 1  # half its life gone: the next reply carries the next token
    inode = chain.token_file().stat().st_ino
    reply = await chain.agent.heartbeat_once()
    assert reply is not None
    second = reply.assignments[0].token
    assert second != first and chain.token_file().read_text() == second
    # Replaced, not rewritten in place: a sidecar reading meanwhile gets one whole token or the other.
    assert chain.token_file().stat().st_ino != inode and chain.token_file().stat().st_mode & 0o077 == 0
    who = chain.verifier.verify(second)
    assert (who.name, who.model, who.node, who.expires_at) == ("scorer-0", "scorer", "n1", chain.clock.now + TTL_S)
    assert chain.verifier.verify(first).name == "scorer-0"  # the old one is still good: no gap at the switch
    assert await reporter.send() and source.token == second

    chain.clock.now += TTL_S / 2
    with pytest.raises(Unauthenticated, match="expired"):
        chain.verifier.verify(first)  # the first one is spent; the sidecar holds the second
    assert await reporter.send()


async def test_a_sidecar_cut_off_from_renewals_is_refused_after_expiry_says_so_once_and_recovers(chain, caplog):
    chain, session = chain
    await chain.agent.heartbeat_once()
    reporter, source = chain.reporter(session)
    assert await reporter.send()

    chain.clock.now += TTL_S  # no heartbeat answered meanwhile (the node host is cut off): expired
    caplog.set_level(logging.INFO, logger="sidecar.reporter")
    assert not await reporter.send()
    assert not await reporter.send()
    refused = [r.getMessage() for r in caplog.records if r.name == "sidecar.reporter"]
    assert len(refused) == 1, refused  # once, not once a post
    assert "refused" in refused[0] and "401" in refused[0] and "expired" in refused[0]
    assert str(chain.token_file()) in refused[0]

    caplog.clear()
    await chain.agent.heartbeat_once()  # the node host reaches the control plane again: a fresh token
    assert chain.verifier.verify(source.token).expires_at == chain.clock.now + TTL_S
    assert await reporter.send()
    assert [r.getMessage() for r in caplog.records if r.name == "sidecar.reporter"] == [
        f"telemetry to {chain.url}/v1/telemetry works again after 0.0s"
    ]
