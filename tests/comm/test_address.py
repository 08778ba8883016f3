"""Which address a rank publishes for peers on other hosts (spmd.comm.transports.tcp.address), and how set-up
fails when a peer's published address can't be reached: within seconds, naming both hosts and the override.

The two-host runs themselves (network namespaces, hostnames that resolve nowhere) are in
tests/run/test_multihost.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from spmd._core import env
from spmd._core.errors import PeerUnreachableError
from spmd.comm.store.base import HashStore, PrefixStore
from spmd.comm.store.tcp import TCPStore
from spmd.comm.transports.base import TransportSpec
from spmd.comm.transports.tcp import address, connect
from spmd.comm.transports.tcp.transport import TcpTransport


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPMD_SOCKET_ADDR", raising=False)
    monkeypatch.delenv("SPMD_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("SPMD_SOCKET_ADDR_FROM", raising=False)


def test_the_loopback_interface_is_found_by_name() -> None:
    assert address.interface_address("lo") == "127.0.0.1"
    assert address.interfaces()["lo"] == "127.0.0.1"
    assert address.interface_address("no-such-if0") is None
    assert address.interface_address("x" * 40) is None


def test_a_store_on_loopback_gives_loopback() -> None:
    assert address.choose_address("127.0.0.1") == address.AddressChoice("127.0.0.1", "the route to the store at "
                                                                        "127.0.0.1")


def test_the_route_to_the_store_wins_over_the_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(address, "route_address", lambda host: "10.1.2.3" if host == "store-host" else None)
    monkeypatch.setattr(address, "interfaces", lambda: {"lo": "127.0.0.1", "eth9": "192.0.2.77"})
    assert address.choose_address("store-host") == address.AddressChoice("10.1.2.3", "the route to the store at "
                                                                         "store-host")
    # no route (the store's name does not resolve here) or no store host: the first non-loopback interface
    assert address.choose_address("elsewhere") == address.AddressChoice("192.0.2.77", "interface eth9")
    assert address.choose_address(None) == address.AddressChoice("192.0.2.77", "interface eth9")


def test_a_loopback_route_to_a_store_elsewhere_is_not_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(address, "route_address", lambda host: "127.0.0.1")
    monkeypatch.setattr(address, "interfaces", lambda: {"lo": "127.0.0.1", "eth9": "192.0.2.77"})
    assert address.choose_address("0.0.0.0").address == "192.0.2.77"
    monkeypatch.setattr(address, "interfaces", lambda: {"lo": "127.0.0.1"})
    assert address.choose_address("0.0.0.0").source == "loopback (this host has no other IPv4 address)"


def test_the_overrides_come_first_and_a_name_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(address, "route_address", lambda host: "10.1.2.3")
    monkeypatch.setenv("SPMD_SOCKET_IFNAME", "lo")
    assert address.choose_address("store-host") == address.AddressChoice("127.0.0.1", "SPMD_SOCKET_IFNAME=lo")
    monkeypatch.setenv("SPMD_SOCKET_ADDR", "localhost")          # wins over the interface; published resolved
    assert address.choose_address("store-host") == address.AddressChoice("127.0.0.1", "SPMD_SOCKET_ADDR")
    monkeypatch.setenv("SPMD_SOCKET_ADDR_FROM", "spmdrun --local-addr localhost")   # spmdrun says why
    assert address.choose_address("store-host").source == "spmdrun --local-addr localhost"
    monkeypatch.delenv("SPMD_SOCKET_ADDR_FROM")


def test_an_override_that_names_nothing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(ValueError, match=r"SPMD_SOCKET_IFNAME='no-such-if0' names no interface .*\(it has lo"):
        address.choose_address(None)
    monkeypatch.setenv("SPMD_SOCKET_ADDR", "no-such-host.invalid")
    with pytest.raises(ValueError, match=r"SPMD_SOCKET_ADDR='no-such-host.invalid' is not an address"):
        address.choose_address(None)


def test_stores_name_their_server_host() -> None:
    assert HashStore().server_host() is None
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10, token="t")
    try:
        assert PrefixStore("g", store).server_host() == "127.0.0.1"
    finally:
        store.close()


def test_an_unreachable_peer_address_fails_within_seconds_naming_both_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_CONNECT_RETRY_S", "1")    # instead of connect.REACH_S, 10 s
    # A port held bound but not listening: connections to it are refused, and no other test process can take it
    # (a port merely closed again could be reused by a parallel test's listener).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        store = HashStore(timeout=20)
        store.set("g/tcp/addr/0", f"127.0.0.1:{port}")
        store.set("g/tcp/source/0", "the route to the store at 10.9.9.9")
        spec = TransportSpec(store=PrefixStore("g", store), group_name="g", group_rank=1, global_ranks=(0, 2),
                             hosts=("key-a", "key-b"), timeout=60.0, token=b"t" * 16, host_names=("hostA", "hostB"))
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError) as caught:
            TcpTransport(spec)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert f"rank 2 on hostB can't reach rank 0 on hostA at 127.0.0.1:{port} within 1s" in message
    assert "hostA chose that address from the route to the store at 10.9.9.9" in message
    assert message.endswith("On hostA, give an address of it that hostB can reach: SPMD_SOCKET_ADDR=<address> or "
                            "SPMD_SOCKET_IFNAME=<interface> (spmdrun: --local-addr <address>)")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_connect_retry_that_is_not_a_positive_number_of_seconds_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                             value: str) -> None:
    monkeypatch.setenv("SPMD_CONNECT_RETRY_S", value)
    with pytest.raises(ValueError, match=rf"SPMD_CONNECT_RETRY_S={value!r} is not a positive number of seconds"):
        env.connect_retry_seconds(connect.REACH_S)
