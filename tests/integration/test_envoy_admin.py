"""Envoy's admin interface asks no credential, shows the ADS bearer token in /config_dump and stops Envoy on
POST /quitquitquit, so only Envoy's own user may reach it (DESIGN §10): a REAL Envoy, bootstrapped as
`sie up` bootstraps it (a token, a stats port), has its admin on a Unix socket (0600, in a 0700 directory)
and no TCP port that answers more than GET /ready and /stats/prometheus."""

from __future__ import annotations

import errno
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sie.auth import ENVOY_TOKEN, CredentialDir
from sie_testing.polling import eventually
from tests.integration.standalone_helpers import connect_as_nobody, listening_tcp_ports
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in
from xds_server.main import XdsServer
from xds_server.settings import ControlLoopSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _call(url: str, method: str = "GET") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stats_port(listeners: dict) -> int:
    (stats,) = [s for s in listeners["listener_statuses"] if s["name"] == "stats"]
    return int(stats["local_address"]["socket_address"]["port_value"])


async def test_envoys_admin_is_a_socket_of_its_user_and_no_tcp_port_shows_the_token_or_stops_it(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("kind: ModelService\nspec: {model: {name: chat}, backend: {type: sim}}\n")
    creds = CredentialDir(tmp_path / "credentials").ensure()
    token = creds.token(ENVOY_TOKEN)
    loop = ControlLoopSettings(startup_sync_s=0.2)
    settings = Settings(cluster_file=cluster, credentials_dir=creds.path, admin_port=0, xds_port=0, loop=loop)
    server = XdsServer(settings, signer=creds.signer())
    envoy = None
    try:
        await server.start()
        socket_path = admin_socket_in(tmp_path)
        bootstrap = envoy_bootstrap("n", "c", "127.0.0.1", server.xds_port, socket_path, stats_port=0, token=token)
        envoy = EnvoyProcess(bootstrap, tmp_path)
        envoy.start()
        await envoy.wait_ready(20)  # through the socket
        assert envoy.pid is not None
        listeners = await eventually(
            lambda: envoy.admin_json("/listeners?format=json"), what="the ingress listener from ADS"
        )
        stats = _stats_port(listeners)

        # Over TCP, Envoy listens on its stats port and the ingress ADS gave it: no admin port.
        tcp = listening_tcp_ports(envoy.pid)
        assert stats in tcp and len(tcp) == 2, tcp
        for port in tcp:
            base = f"http://127.0.0.1:{port}"
            for path in (
                "/config_dump",
                "/config_dump?include_eds",
                "/stats/prometheus/../config_dump",
                "//config_dump",
            ):
                code, body = _call(base + path)
                assert code != 200 and token.encode() not in body, (port, path, code)
            for path in ("/quitquitquit", "/healthcheck/fail", "/drain_listeners", "/logging?level=trace"):
                assert _call(base + path, "POST")[0] != 200, (port, path)
        assert envoy.proc is not None and envoy.proc.poll() is None, "Envoy still runs"
        code, metrics = _call(f"http://127.0.0.1:{stats}/stats/prometheus")
        assert code == 200 and b"envoy_server_live" in metrics and token.encode() not in metrics
        assert _call(f"http://127.0.0.1:{stats}/ready")[0] == 200

        # The admin itself: for Envoy's user alone. It does hold the token, which is why.
        status, dump = await envoy.admin_async("/config_dump")
        assert status == 200 and token.encode() in dump
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(socket_path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(envoy.config_path).st_mode) == 0o600, "the bootstrap holds the token"
        cmdline = Path(f"/proc/{envoy.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline
        if os.geteuid() == 0:  # only root can become another user to try
            assert connect_as_nobody(socket_path) == errno.EACCES
    finally:
        if envoy is not None:
            await envoy.stop_async()
        await server.stop()


def test_envoy_process_refuses_a_tcp_admin_or_a_socket_others_can_reach(tmp_path):
    from xds_server.envoy_process import EnvoyError

    tcp = envoy_bootstrap("n", "c", "127.0.0.1", 1, tmp_path / "a.sock")
    tcp["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    with pytest.raises(EnvoyError, match="not a Unix socket"):
        EnvoyProcess(tcp, tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    envoy = EnvoyProcess(envoy_bootstrap("n", "c", "127.0.0.1", 1, shared / "admin.sock"), tmp_path)
    with pytest.raises(EnvoyError, match="which others may enter"):
        envoy.start()
    assert envoy.proc is None
