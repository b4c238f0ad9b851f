"""sie.telemetry's address checks: the one place a registered or reported `ip:port` is read (EDS, telemetry,
the status views, xds_server.resources)."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sie.errors import SpecError
from sie.telemetry import TelemetryRecord, address_problem, ip_literal_problem, parse_port, split_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("9000", 9000),
        ("65535", 65535),
        ("09000", 9000),
        ("0", None),
        ("65536", None),
        ("000065535", None),
        ("", None),
        ("+80", None),
        ("-1", None),
        (" 80", None),
        ("80 ", None),
        ("8_0", None),
        ("x", None),
        ("\u00b2", None),  # superscript two: isdigit() says yes, int() raises
        ("9\u00b9", None),
        ("\u0663", None),  # Arabic-Indic three: isdigit() says yes, int() reads 3
        ("\uff18\uff10", None),  # fullwidth 80
        ("\U0001d7d6", None),  # mathematical bold digit eight
    ],
)
def test_a_port_is_ascii_digits_in_range(text, expected):
    assert parse_port(text) == expected


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("[::1]:9000", ("::1", 9000)),
        ("10.0.0.7:1", ("10.0.0.7", 1)),
        ("127.0.0.1:\u00b2", "port must be a number 1..65535"),
        ("127.0.0.1:\u0663", "port must be a number 1..65535"),
        ("127.0.0.1:0", "port must be a number 1..65535"),
        ("127.0.0.1:70000", "port must be a number 1..65535"),
        ("127.0.0.1:", "port must be a number 1..65535"),
        ("127.0.0.1", "is not host:port"),
        ("localhost:9000", "must be an IP literal"),
        ("[::1]", "must be an IP literal"),
        ("", "is not host:port"),
        # An IPv6 zone names an interface of one machine: Envoy NACKs one its own host lacks ("malformed
        # IP address"), and takes another only where Envoy runs on a machine that has it.
        ("[fe80::1%nosuchif]:9004", "zone id"),
        ("[fe80::1%lo]:9004", "zone id"),
        ("[fe80::1%1]:9004", "zone id"),
        ("fe80::1%eth0:9004", "zone id"),
        ("[fe80::1%25eth0]:9004", "zone id"),
        ("01.2.3.4:9000", "must be an IP literal"),  # Envoy wants the dotted quad that prints back the same
        ("1.2.3:9000", "must be an IP literal"),
        ("[::ffff:10.0.0.7]:9000", ("::ffff:10.0.0.7", 9000)),
        ("[fe80::1]:9000", ("fe80::1", 9000)),
    ],
)
def test_split_address_and_address_problem_agree(address, expected):
    if isinstance(expected, tuple):
        assert split_address(address) == expected
        assert address_problem(address) is None
    else:
        with pytest.raises(ValueError, match=expected):
            split_address(address)
        assert expected in (address_problem(address) or "")


def test_a_telemetry_record_with_a_unicode_digit_port_is_refused_naming_the_field():
    doc = {
        "instance_id": "a-0",
        "model_id": "a",
        "version": "1",
        "address": "127.0.0.1:\u00b2",
        "node": "n1",
        "state": "ready",
    }
    with pytest.raises(SpecError) as info:
        TelemetryRecord.from_json(doc)
    assert [p.path for p in info.value.problems] == ["address"]


@given(st.one_of(st.text(max_size=40), st.text(max_size=8).map(lambda port: f"127.0.0.1:{port}")))
def test_the_checks_raise_only_value_error_and_take_only_ascii_ports(address):
    problem = address_problem(address)
    try:
        _, port = split_address(address)
    except ValueError:
        assert problem is not None
        return
    text = address.rpartition(":")[2]
    assert problem is None and text.isascii() and int(text) == port and 0 < port < 65536


def _envoy_takes(host: str) -> bool:
    """Envoy 1.40's own reading of SocketAddress.address (source/common/network/ip_address_parsing.cc), with
    the same libc call: getaddrinfo(AI_NUMERICHOST), IPv4 then IPv6, an IPv4 address only if it prints back
    the same. A zone it takes only if this machine has that interface."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            info = socket.getaddrinfo(host, None, family, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        except (socket.gaierror, UnicodeError, ValueError):
            continue
        if family == socket.AF_INET6 or info[0][4][0] == host:
            return True
    return False


_HOSTS = st.one_of(
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda ip: ip.exploded),
    st.ip_addresses(v=4).map(lambda ip: f"::ffff:{ip}"),
    st.tuples(st.ip_addresses(v=6), st.text("abcdefghlnostuvwxyz0123456789", min_size=1, max_size=9)).map(
        lambda pair: f"{pair[0]}%{pair[1]}"
    ),
    st.text("0123456789abcdef:.%x", max_size=24),
)


@given(_HOSTS)
def test_every_host_the_rule_accepts_envoy_takes_on_any_machine(host):
    """The rule is Envoy's, less what depends on the machine Envoy runs on (a zone id)."""
    if ip_literal_problem(host) is None:
        assert _envoy_takes(host) and "%" not in host
        assert address_problem(f"[{host}]:9000" if ":" in host else f"{host}:9000") is None


def test_the_rule_refuses_a_zone_even_where_this_machine_has_the_interface():
    assert _envoy_takes("fe80::1%lo")  # here, yes; on Envoy's machine, only if it has `lo`
    assert "zone id" in (ip_literal_problem("fe80::1%lo") or "")
    assert ipaddress.ip_address("fe80::1%lo")  # what split_address took before it asked ip_literal_problem
