"""PortReservations hold a child's port between its restarts: the child binds it beside the reservation,
a connect while the child is down is refused at once, and a released port is free again."""

from __future__ import annotations

import socket

import pytest

from node_host.process import PortReservations


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp and uvicorn bind
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def test_a_child_binds_a_reserved_port_and_a_restarted_child_binds_it_again():
    ports = PortReservations()
    try:
        port = ports.take()
        for _ in range(2):  # the first child, then its restart
            child = _listen(port)
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            child.close()
            with pytest.raises(ConnectionRefusedError):  # the child is down: refused, not queued
                socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        ports.close()


def test_a_reserved_port_is_not_given_to_another_plain_bind():
    ports = PortReservations()
    try:
        port = ports.take()
        other = socket.socket()  # no SO_REUSEADDR, like the source port of an outgoing connection
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        other.close()
        ports.release(port)
        assert port not in ports.held()
        free = socket.socket()
        free.bind(("127.0.0.1", port))
        free.close()
    finally:
        ports.close()


def test_ports_are_distinct_while_held():
    ports = PortReservations()
    try:
        taken = [ports.take() for _ in range(20)]
        assert len(set(taken)) == 20 and ports.held() == set(taken)
    finally:
        ports.close()
    assert ports.held() == set()
