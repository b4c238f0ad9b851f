"""Free loopback ports for the processes tests and benchmarks start (pure apart from the bind check).

    free_port() -> int

A port picked by binding port 0 and closing is free only for a moment, and it comes from the kernel's
ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 here): the same range every other
bind to port 0 and every outgoing connection draw from. So a child that binds its picked port a few
seconds later (Envoy's listener, once its LDS arrives) can find it taken by a worker or sidecar that
bound port 0 meanwhile, and requests meant for it reach that process instead (a CI run saw the ingress
answered by an aiohttp server's 401). `free_port` picks below the ephemeral range, where nothing is
handed out implicitly, at random, checks that it binds, and never hands the same port out twice in one
process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # below: ports services commonly use
_handed_out: set[int] = set()
_random = random.SystemRandom()


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's ephemeral port range, or Linux's default when it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that binds now, below the ephemeral range, not handed out before by this process."""
    low, _high = ephemeral_range()
    if low - LOWEST >= 1000:
        for _ in range(200):
            port = _random.randrange(LOWEST, low)
            if port not in _handed_out and _binds(host, port):
                _handed_out.add(port)
                return port
    while True:  # no room below the ephemeral range (or all tried ports busy): let the kernel pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
