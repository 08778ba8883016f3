"""The address a rank publishes for ranks on other hosts to connect to, and how it was chosen.

Layer: comm. Clusters rarely make a node's hostname resolve to its cluster address, so a name is never
published: the choice is, in order, SPMD_SOCKET_ADDR (spmdrun sets it to its --local-addr or its own choice),
SPMD_SOCKET_IFNAME (that interface's IPv4 address), the local address of the route towards the store's host
(the interface that demonstrably reaches the job), else the first non-loopback IPv4 address of an interface.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import socket
import struct

from spmd._core import env
from spmd.comm.store.tcp_server import is_loopback_host

SIOCGIFADDR = 0x8915          # Linux ioctl: an interface's IPv4 address
OVERRIDES = "SPMD_SOCKET_ADDR=<address> or SPMD_SOCKET_IFNAME=<interface> (spmdrun: --local-addr <address>)"


@dataclasses.dataclass(frozen=True)
class AddressChoice:
    """An IPv4 address of this host and where it came from ("SPMD_SOCKET_ADDR", "the route to 10.0.0.1", ...)."""

    address: str
    source: str


def choose_address(toward: str | None) -> AddressChoice:
    """The address this host's listeners publish; `toward` is the store's host (None when unknown).

    ValueError when an override names nothing usable: a wrong override must not be papered over by a guess.
    """
    given = env.socket_address()
    if given is not None:
        return AddressChoice(_resolve(given, "SPMD_SOCKET_ADDR"), env.socket_address_source() or "SPMD_SOCKET_ADDR")
    ifname = env.socket_ifname()
    if ifname is not None:
        address = interface_address(ifname)
        if address is None:
            raise ValueError(f"spmd: SPMD_SOCKET_IFNAME={ifname!r} names no interface with an IPv4 address on "
                             f"{socket.gethostname()} (it has {', '.join(interfaces()) or 'none'})")
        return AddressChoice(address, f"SPMD_SOCKET_IFNAME={ifname}")
    if toward is not None:
        address = route_address(toward)
        # a loopback route is right only for a loopback store, which only this machine's ranks reach
        if address is not None and (not _is_loopback(address) or is_loopback_host(toward)):
            return AddressChoice(address, f"the route to the store at {toward}")
    for name, address in interfaces().items():
        if not _is_loopback(address):
            return AddressChoice(address, f"interface {name}")
    return AddressChoice("127.0.0.1", "loopback (this host has no other IPv4 address)")


def route_address(host: str) -> str | None:
    """The local address of the route towards `host` (a UDP connect picks a route and sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of interface `ifname`, or None if it has none (or does not exist)."""
    if not ifname or len(ifname.encode()) > 15 or "\0" in ifname:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def interfaces() -> dict[str, str]:
    """Every interface with an IPv4 address, name -> address, in the kernel's order."""
    found = {}
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address is not None:
            found[name] = address
    return found


def _resolve(value: str, variable: str) -> str:
    """`value` as an IPv4 address (a name is resolved here, once, so peers never have to)."""
    try:
        return socket.gethostbyname(value)
    except OSError as error:
        raise ValueError(f"spmd: {variable}={value!r} is not an address and does not resolve on "
                         f"{socket.gethostname()} ({error}); give an IPv4 address of this host") from None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
