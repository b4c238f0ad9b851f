"""Where the processes of one `sie up` are reached, and by what names: the URLs this machine's own
processes call (a wildcard host: on loopback), the URL `sie join` on another machine is told to call
(a wildcard host: this machine's name, or an address of it when the name is no DNS name), and the names
and addresses the admin API's certificate carries, which always include both (sie.auth.tls pins the
clients to the CA that signs it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass

from sie.cluster import certificate_name


@dataclass(frozen=True)
class Machine:
    """What this machine is called, as far as it knows: the names and addresses the admin API's certificate
    may carry (admin_certificate_names) and `sie join` may be told to call (Endpoints.join_url)."""

    name: str  # socket.gethostname()
    fqdn: str  # socket.getfqdn()
    addresses: tuple[str, ...]  # the one its default route leaves from first, then those its name resolves to

    @classmethod
    def here(cls) -> Machine:
        name = socket.gethostname()
        found: list[str] = []
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a UDP connect sends nothing, it picks the route
            found.append(probe.getsockname()[0])
        with contextlib.suppress(OSError):
            found += [
                str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
            ]
        return cls(name, socket.getfqdn(), tuple(dict.fromkeys(found)))

    def reachable(self) -> tuple[str, str | None]:
        """The host another machine should call this one by, one a certificate can carry: its name when that
        is a DNS name, else the first of its addresses another machine can reach (which the certificate of
        a wildcard host names); and, when it is not the name, a note saying why."""
        try:
            return certificate_name(self.name), None
        except ValueError:
            pass
        for text in self.addresses:
            ip = ipaddress.ip_address(text)
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return str(ip), (
                    f"this machine's name {self.name[:64]!r} is not a DNS name, so no certificate can carry it: "
                    f"its address {ip} instead (admin_tls_names adds a name other machines know it by)"
                )
        return "127.0.0.1", (
            f"this machine's name {self.name[:64]!r} is not a DNS name and it has no address other machines "
            "could reach: set host to one, or add the name they know it by to admin_tls_names"
        )


@dataclass(frozen=True)
class Endpoints:
    host: str
    envoy_port: int
    envoy_admin_port: int
    admin_port: int
    xds_port: int
    admin_tls: bool = False  # the admin API serves HTTPS (ClusterSettings.serves_tls)
    # What this machine is called (a wildcard host's join_url); None: looked up when asked.
    machine: Machine | None = None

    @property
    def admin_url(self) -> str:
        """The admin API as this machine's own processes call it (a wildcard host: on loopback, which the
        certificate names)."""
        return f"{'https' if self.admin_tls else 'http'}://{_url_host(_local_host(self.host))}:{self.admin_port}"

    def _join_host(self) -> tuple[str, str | None]:
        if not is_wildcard(self.host):
            return self.host, None
        return (self.machine or Machine.here()).reachable()

    @property
    def join_url(self) -> str:
        """The admin API as `sie join` on another machine would call it (a wildcard host: this machine's
        name, or an address of it when the name is no DNS name: what the certificate names)."""
        return f"{'https' if self.admin_tls else 'http'}://{_url_host(self._join_host()[0])}:{self.admin_port}"

    @property
    def join_note(self) -> str | None:
        """Why join_url does not name this machine by its name, or None."""
        return self._join_host()[1]

    @property
    def envoy_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.envoy_port}"

    @property
    def envoy_stats_url(self) -> str:
        """Envoy's stats listener (envoy_admin_port, loopback only): GET /ready and /stats/prometheus of its
        admin interface. The rest of the admin is envoy_admin_socket(run_dir), for this user only."""
        return f"http://127.0.0.1:{self.envoy_admin_port}"


def is_wildcard(host: str) -> bool:
    """Whether binding `host` binds every address: "0.0.0.0", "::" and each other spelling of them ("::0")."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _local_host(host: str) -> str:
    """Where a process of this machine reaches a service bound to `host`."""
    return ("::1" if ":" in host else "127.0.0.1") if is_wildcard(host) else host


def _url_host(host: str) -> str:
    """`host` as a URL writes it: an IP address in its one canonical form (IPv6 in brackets), the form the
    certificate carries (admin_certificate_names) and a client checks its name against."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    return f"[{ip}]" if ip.version == 6 else str(ip)


def admin_certificate_names(host: str, extra: list[str], machine: Machine | None = None) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) the admin API's certificate is for: loopback and this machine's name
    always (when it is a DNS name), the bound host (a wildcard: this machine's addresses, as its name
    resolves and as its default route leaves), and the Cluster's admin_tls_names (a NAT address, a load
    balancer's name). Whatever Endpoints.join_url names is among them."""
    machine = machine or Machine.here()
    dns: list[str] = []
    ips: list[str] = []

    def add(name: str) -> None:
        try:
            ip = str(ipaddress.ip_address(name))
        except ValueError:
            with contextlib.suppress(ValueError):  # a machine name no certificate may carry: join_url avoids it
                if name not in dns:
                    dns.append(certificate_name(name))
            return
        if ip not in ips and not ipaddress.ip_address(ip).is_unspecified:  # 0.0.0.0 names no server
            ips.append(ip)

    for name in ["localhost", "127.0.0.1", "::1", machine.name, machine.fqdn, host, *extra]:
        add(name)
    if is_wildcard(host):
        for address in machine.addresses:
            add(address)
    return dns, ips
