"""Ports for the processes tests and benchmarks start: below the kernel's ephemeral range (where nothing
binds implicitly), bindable when handed out, and never the same one twice in a process."""

from __future__ import annotations

import socket

from sie_testing import ports


def test_a_port_below_the_ephemeral_range_that_binds():
    low, _high = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50, "never the same port twice"
    assert all(ports.LOWEST <= p < low for p in picked), picked
    for port in picked[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out (nothing else here took it since)


def test_a_busy_port_is_never_handed_out(monkeypatch):
    holders = []
    try:
        for port in range(ports.LOWEST, ports.LOWEST + 20):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            holders.append(sock)
        busy = {s.getsockname()[1] for s in holders}
        choices = iter(sorted(busy) + [ports.LOWEST + 500])
        monkeypatch.setattr(ports._random, "randrange", lambda a, b: next(choices))
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() == ports.LOWEST + 500
    finally:
        for sock in holders:
            sock.close()


def test_the_kernel_picks_when_there_is_no_room_below_the_range(monkeypatch):
    low, high = ports.ephemeral_range()
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 500, high))
    port = ports.free_port()
    assert low <= port <= high, "bound to port 0: the kernel's choice, from its range"


def test_the_range_falls_back_to_linuxs_default(tmp_path):
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
    odd = tmp_path / "odd"
    odd.write_text("not numbers")
    assert ports.ephemeral_range(odd) == (32768, 60999)
    ok = tmp_path / "ok"
    ok.write_text("40000\t50000\n")
    assert ports.ephemeral_range(ok) == (40000, 50000)
