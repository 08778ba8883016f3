"""TCPStore against strangers and careless callers: binding, the handshake, timeouts, floods and memory bounds.

Every stranger here is a real socket on loopback; floods are bounded in count and time.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import secrets
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from spmd._core.errors import StoreError, StoreTimeoutError
from spmd.comm import world
from spmd.comm.store import tcp, tcp_server
from spmd.comm.store import tcp_wire as wire
from spmd.comm.store.tcp import TCPStore

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPMD_STORE_TOKEN", raising=False)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10, token=TOKEN)
    try:
        yield store
    finally:
        store.close()


def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (no packet is sent), or None."""
    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            candidates.append(probe.getsockname()[0])
    except OSError:
        pass
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for address in candidates:
        parsed = ipaddress.ip_address(address)
        if not parsed.is_loopback and not parsed.is_unspecified:
            return address
    return None


def _read_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    header = _recv_exactly(sock, wire.HEADER.size)
    size, status = wire.HEADER.unpack(header)
    return status, wire.split_fields(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return bytes(data)


def _raw_client(port: int, token: str = TOKEN, timeout: float = 10.0) -> socket.socket:
    """A socket that completed the handshake by hand: a stranger who knows the token, speaking raw frames."""
    key = token.encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        client_nonce = secrets.token_bytes(wire.NONCE_BYTES)
        sock.sendall(wire.frame(wire.HELLO, [wire.MAGIC, client_nonce, b"1"]))
        status, (server_nonce,) = _read_frame(sock)
        assert status == wire.OK
        sock.sendall(wire.frame(wire.AUTH, [wire.proof(key, wire.CLIENT_SIDE, server_nonce, client_nonce)]))
        status, (server_proof,) = _read_frame(sock)
        assert status == wire.OK and server_proof == wire.proof(key, wire.SERVER_SIDE, server_nonce, client_nonce)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(10.0)
    return sock


def _server_cpu_seconds(server: tcp_server.StoreServer) -> float:
    """CPU time the server thread of this process has used so far."""
    with open(f"/proc/self/task/{server._thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Binding.

def test_loopback_master_is_not_reachable_on_other_addresses(master: TCPStore) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert sorted(master._server.addresses) == ["127.0.0.1", "::1"] or master._server.addresses == ["127.0.0.1"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, master.port), timeout=5).close()
    assert TCPStore("127.0.0.1", master.port, timeout=5, token=TOKEN).add("joined", 1) == 1


def test_env_rendezvous_with_loopback_master_addr_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store, rank, world_size = world.rendezvous("env://", 0, 1, 10.0)
    server = store._owner._server     # rank 0's world gets a client of the server it keeps (see world.py)
    try:
        assert (rank, world_size) == (0, 1) and all(ipaddress.ip_address(a).is_loopback for a in server.addresses)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, store.port), timeout=5).close()
    finally:
        store.close()


def test_where_each_host_name_listens() -> None:
    assert tcp_server.listen_addresses("localhost") == ["127.0.0.1", "::1"]
    assert tcp_server.listen_addresses("::1") == ["::1", "127.0.0.1"]
    assert tcp_server.listen_addresses("127.0.0.3") == ["127.0.0.3"]
    assert tcp_server.listen_addresses("10.1.2.3") == ["10.1.2.3"]
    assert tcp_server.listen_addresses("node7.cluster") == [""]
    assert tcp_server.listen_addresses("0.0.0.0") == [""]


def test_open_listener_without_token_warns_once_per_process(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.setattr(tcp_server, "_warned_open_listener", False)
    caplog.set_level(logging.WARNING, logger=tcp_server.__name__)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5),
              TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=5, token=TOKEN)]
    assert not caplog.records   # loopback, or a token: nothing to say
    stores += [TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=5) for _ in range(2)]
    try:
        assert stores[2]._server.addresses == [address]
        warnings = [record.getMessage() for record in caplog.records]
        assert len(warnings) == 1
        assert "anyone who can reach this port can join the job" in warnings[0]
        assert "SPMD_STORE_TOKEN" in warnings[0] and "--rdzv-token" in warnings[0]
        assert stores[2].add("k", 1) == 1   # the master's own client reaches the address it listens on
    finally:
        for store in stores:
            store.close()


def test_local_clients_with_a_token_use_the_unix_socket_and_tcp_still_serves(monkeypatch: pytest.MonkeyPatch,
                                                                             master: TCPStore) -> None:
    if sys.platform != "linux":
        pytest.skip("abstract Unix sockets are Linux's")
    local = TCPStore("localhost", master.port, timeout=5, token=TOKEN)
    monkeypatch.setattr(tcp, "_LOCAL_SOCKETS", False)
    remote = TCPStore("127.0.0.1", master.port, timeout=5, token=TOKEN)
    try:
        assert local._client._sock.family == socket.AF_UNIX and remote._client._sock.family == socket.AF_INET
        local.set("k", "over unix")
        assert remote.get("k") == b"over unix"
        assert wire.local_name(master.port, b"other") != wire.local_name(master.port, TOKEN.encode())
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:   # the name is not a way around
            stranger.settimeout(10)
            stranger.connect(wire.local_name(master.port, TOKEN.encode()))
            client_nonce = secrets.token_bytes(wire.NONCE_BYTES)
            stranger.sendall(wire.frame(wire.HELLO, [wire.MAGIC, client_nonce, b"1"]))
            status, (server_nonce,) = _read_frame(stranger)
            assert status == wire.OK
            guess = wire.proof(b"guess", wire.CLIENT_SIDE, server_nonce, client_nonce)
            stranger.sendall(wire.frame(wire.AUTH, [guess]))
            assert _read_frame(stranger) == (wire.REFUSED, [b"wrong token"])
    finally:
        local.close()
        remote.close()


# The handshake.

def _fake_server(received: bytearray) -> tuple[socket.socket, threading.Thread]:
    """A listener that records every byte and answers every frame with OK and a plausible nonce."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            while True:
                try:
                    header = conn.recv(wire.HEADER.size, socket.MSG_WAITALL)
                    if len(header) < wire.HEADER.size:
                        return
                    size, _ = wire.HEADER.unpack(header)
                    body = conn.recv(size, socket.MSG_WAITALL) if size else b""
                except OSError:
                    return
                received.extend(header + body)
                conn.sendall(wire.frame(wire.OK, [secrets.token_bytes(wire.NONCE_BYTES)]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_fake_server_learns_no_token_and_gets_no_request() -> None:
    received = bytearray()
    listener, thread = _fake_server(received)
    try:
        with pytest.raises(StoreError, match="could not prove it knows the token: it is not the job's store"):
            TCPStore("127.0.0.1", listener.getsockname()[1], timeout=5, token=TOKEN)
        thread.join(timeout=10)
    finally:
        listener.close()
    assert received and TOKEN.encode() not in bytes(received)
    opcodes, pos = [], 0
    while pos < len(received):
        size, op = wire.HEADER.unpack_from(received, pos)
        opcodes.append(op)
        pos += wire.HEADER.size + size
    assert opcodes == [wire.HELLO, wire.AUTH]   # the constructor's add() never left the client


def test_wrong_token_either_way_is_refused_naming_the_side(master: TCPStore) -> None:
    with pytest.raises(StoreError, match="refused this client: wrong token"):
        TCPStore("127.0.0.1", master.port, timeout=5, token="guess")
    tokenless = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        with pytest.raises(StoreError, match="refused this client: this server has no token"):
            TCPStore("127.0.0.1", tokenless.port, timeout=5, token=TOKEN)
        plain = TCPStore("127.0.0.1", tokenless.port, timeout=5)   # no token on either side still works
        plain.set("k", "v")
        assert tokenless.get("k") == b"v"
        plain.close()
    finally:
        tokenless.close()


def test_old_wire_version_is_refused_with_a_reason(master: TCPStore) -> None:
    with socket.create_connection(("127.0.0.1", master.port), timeout=5) as old:
        old.sendall(wire.frame(wire.HELLO, [b"spmd-store/1", TOKEN.encode()]))
        status, (reason,) = _read_frame(old)
        assert status == wire.REFUSED and b"wire version" in reason and wire.MAGIC in reason


# Timeouts.

def test_malformed_timeouts_get_an_error_and_keep_other_deadlines(master: TCPStore) -> None:
    client = TCPStore("127.0.0.1", master.port, timeout=1.0, token=TOKEN)
    with _raw_client(master.port) as stranger:
        requests = [(wire.GET, [b"never", b"nan"]), (wire.WAIT, [b"nan", b"never"]),
                    (wire.MULTI_GET, [b"-1", b"never"]), (wire.WAIT_COUNT, [b"never", b"3", b"NaN"]),
                    (wire.GET, [b"never", b"soon"])]
        for op, fields in requests:
            stranger.sendall(wire.frame(op, fields))
            status, (message,) = _read_frame(stranger)
            assert status == wire.ERROR and b"malformed request" in message
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="never"):
            client.get("never")
        assert 0.9 < time.monotonic() - start < 3.0
        stranger.sendall(wire.frame(wire.NUM_KEYS, []))
        assert _read_frame(stranger)[0] == wire.OK   # the stranger's connection survived its bad requests
    client.close()


def _silent_server(answered: int) -> tuple[socket.socket, threading.Thread]:
    """A tokenless listener that completes the handshake, answers `answered` requests with OK, then only reads."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                _, (_, client_nonce, _) = _read_frame(conn)
                server_nonce = secrets.token_bytes(wire.NONCE_BYTES)
                conn.sendall(wire.frame(wire.OK, [server_nonce]))
                _read_frame(conn)
                conn.sendall(wire.frame(wire.OK, [wire.proof(b"", wire.SERVER_SIDE, server_nonce, client_nonce)]))
                for _ in range(answered):
                    _read_frame(conn)
                    conn.sendall(wire.frame(wire.OK, [b"1"]))
                while conn.recv(4096):
                    pass
            except (OSError, AssertionError):
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_server_that_stops_answering_fails_the_call_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "_REPLY_GRACE_S", 0.3)
    listener, thread = _silent_server(answered=1)   # the constructor's join add() is answered
    try:
        client = TCPStore("127.0.0.1", listener.getsockname()[1], timeout=0.2)
        start = time.monotonic()
        with pytest.raises(StoreError, match=r"no reply to add\(k\) within 0\.5s; the store server is not"):
            client.add("k", 1)
        assert 0.4 < time.monotonic() - start < 3.0
        with pytest.raises(StoreError, match="its connection was lost earlier"):
            client.add("k", 1)   # the stream may hold a late reply: the connection is not reused
        client.close()
    finally:
        listener.close()
        thread.join(timeout=10)


def test_infinite_timeout_parks_without_a_deadline(master: TCPStore) -> None:
    with _raw_client(master.port) as waiter:
        waiter.sendall(wire.frame(wire.GET, [b"later", b"inf"]))
        _until(lambda: b"later" in master._server._watchers)
        assert not master._server._deadlines
        master.set("later", "v")
        assert _read_frame(waiter) == (wire.OK, [b"v"])


def test_client_timeouts_validated_before_sending(master: TCPStore) -> None:
    client = TCPStore("127.0.0.1", master.port, timeout=5, token=TOKEN)
    for bad in (math.nan, -1.0):
        with pytest.raises(ValueError, match=r"TCPStore\.wait: timeout must be a non-negative"):
            client.wait(["k"], timeout=bad)
        with pytest.raises(ValueError, match=r"TCPStore\.set_timeout: timeout must be a non-negative"):
            client.set_timeout(bad)
        with pytest.raises(ValueError, match="TCPStore: timeout must be a non-negative"):
            TCPStore("127.0.0.1", master.port, timeout=bad, token=TOKEN)
    client.set("k", "v")   # the connection is still usable
    for forever in (math.inf, 1e300):
        client.set_timeout(forever)
        assert client.get("k") == b"v" and client.multi_get(["k"]) == [b"v"]
        client.wait(["k"], timeout=forever)
    setter = threading.Timer(0.2, lambda: master.set("late", "w"))
    setter.start()
    assert client.get("late") == b"w"   # an infinite get is answered when the key comes
    setter.join()
    client.close()


# Floods.

def test_flood_of_silent_strangers_is_capped_and_lets_ranks_in(master: TCPStore) -> None:
    server = master._server
    flood = [socket.create_connection(("127.0.0.1", master.port), timeout=10)
             for _ in range(wire.MAX_UNAUTHENTICATED + 44)]
    try:
        _until(lambda: len(server._conns) >= wire.MAX_UNAUTHENTICATED)
        assert server.unauthenticated() <= wire.MAX_UNAUTHENTICATED
        assert flood[0].recv(1) == b""   # the oldest strangers made room for the newest
        start = time.monotonic()
        client = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
        for i in range(100):
            client.set(f"k{i}", str(i))
            assert client.get(f"k{i}") == str(i).encode()
        assert time.monotonic() - start < 5.0
        cpu = _server_cpu_seconds(server)
        time.sleep(1.0)   # a measurement window: the held flood must cost the server nothing
        assert _server_cpu_seconds(server) - cpu < 0.3
        client.close()
    finally:
        for sock in flood:
            sock.close()


def test_flood_of_strangers_that_leave_pauses_accepting_and_loses_no_rank(master: TCPStore) -> None:
    """Strangers that connect and leave (or send garbage) cost the server's thread a bounded share: at
    tcp_server._ADMITTED_PER_WINDOW unauthenticated admissions in one window, accepting pauses until the window
    ends, the kernel queueing newcomers meanwhile; a rank connecting during the flood still gets in and is served."""
    server = master._server
    count = 5 * tcp_server._ADMITTED_PER_WINDOW
    for index in range(count):
        with socket.create_connection(("127.0.0.1", master.port), timeout=10) as stranger:
            if index % 2:
                stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
    client = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
    for i in range(20):
        client.set(f"k{i}", str(i))
        assert client.get(f"k{i}") == str(i).encode()
    client.close()
    _until(lambda: not server.unauthenticated())
    assert server.admission_pauses >= 1



def test_a_flood_on_the_tcp_port_does_not_hold_up_clients_of_the_local_socket(master: TCPStore) -> None:
    """Each listening socket has its own admissions: while strangers keep the TCP port's admissions spent, a
    client on this machine connects over the token-named local socket at once and is served (they used to share
    one pause, and the TCP port, always ready, went first: local ranks waited as long as the flood lasted)."""
    if sys.platform != "linux":
        pytest.skip("abstract Unix sockets are Linux's")
    server = master._server
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", master.port), timeout=0.5).close()
            except OSError:
                pass

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    client = None
    try:
        _until(lambda: server.admission_pauses >= 3)
        pauses = server.admission_pauses
        start = time.monotonic()
        client = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
        for i in range(20):
            client.set(f"k{i}", str(i))
            assert client.get(f"k{i}") == str(i).encode()
        assert time.monotonic() - start < 5.0    # about 0.1 s here; the starved socket never let it in
        assert client._client._sock.family == socket.AF_UNIX
        _until(lambda: server.admission_pauses > pauses)   # and the flood still spends the TCP port's admissions
    finally:
        stop.set()
        flooder.join(timeout=10)
        if client is not None:
            client.close()


def test_strangers_that_stay_silent_spend_admissions_too(master: TCPStore) -> None:
    """Admissions count connections accepted and not yet authenticated, so strangers that hold their sockets
    open pause accepting as surely as those that leave; the ranks already in are served throughout."""
    server = master._server
    client = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
    flood = [socket.create_connection(("127.0.0.1", master.port), timeout=10)
             for _ in range(4 * tcp_server._ADMITTED_PER_WINDOW)]
    try:
        _until(lambda: server.unauthenticated() == len(flood))
        assert server.admission_pauses >= 1
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        for sock in flood:
            sock.close()
        client.close()


def test_ranks_handshaking_at_once_give_their_admissions_back(master: TCPStore) -> None:
    """Many ranks connecting at once all get in: each one that authenticates returns its admission, so the
    window's budget bounds the handshakes in flight, not how many ranks may join."""
    ranks = 4 * tcp_server._ADMITTED_PER_WINDOW
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            store = TCPStore("127.0.0.1", master.port, timeout=10, token=TOKEN)
            store.set(f"rank{rank}", str(rank))
            store.close()
        except BaseException as error:   # reported below, with the rank
            errors.append(error)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert all(master.get(f"rank{rank}") == str(rank).encode() for rank in range(ranks))
    assert all(listener.admitted < tcp_server._ADMITTED_PER_WINDOW for listener in master._server._listeners)


_LOW_FD_SERVER = textwrap.dedent("""
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from spmd.comm.store.tcp import TCPStore
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30, token=sys.argv[2])
    stat = os.open(f"/proc/self/task/{master._server._thread.native_id}/stat", os.O_RDONLY)  # before fds run out
    print(master.port, len(os.listdir("/proc/self/fd")), flush=True)
    for _ in sys.stdin:
        fields = os.pread(stat, 4096, 0).rsplit(b")", 1)[1].split()
        print((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), flush=True)
""")


def test_out_of_file_descriptors_neither_spins_nor_locks_ranks_out() -> None:
    limit = 96
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _LOW_FD_SERVER, str(limit), TOKEN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    held: list[socket.socket] = []
    try:
        assert child.stdin is not None and child.stdout is not None
        port, used = map(int, child.stdout.readline().split())
        assert used < limit - 20

        def server_cpu() -> float:
            child.stdin.write("\n")
            child.stdin.flush()
            return float(child.stdout.readline())

        # Ranks that completed the handshake take every descriptor the server has left; strangers queue behind.
        while len(held) < limit:
            try:
                held.append(_raw_client(port, timeout=1.0))
            except TimeoutError:
                break   # the server is out of descriptors: this one was not accepted
        assert len(held) < limit
        held += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        cpu = server_cpu()
        time.sleep(1.0)   # a measurement window: out of descriptors, the server must not spin
        assert server_cpu() - cpu < 0.3
        for sock in held[:8]:
            sock.close()
        start = time.monotonic()
        client = TCPStore("127.0.0.1", port, timeout=15, token=TOKEN)
        client.set("after", "flood")
        assert client.get("after") == b"flood"
        assert time.monotonic() - start < 10.0
        client.close()
    finally:
        for sock in held:
            sock.close()
        child.kill()
        child.wait(timeout=10)


# Memory.

def test_oversized_frame_is_answered_and_closed_without_buffering(master: TCPStore) -> None:
    with _raw_client(master.port) as stranger:
        stranger.sendall(struct.pack("!IB", (4 << 30) - 1, wire.SET))
        status, (message,) = _read_frame(stranger)
        assert status == wire.ERROR and b"over the store's limit" in message
        assert stranger.recv(1) == b""
    assert all(len(conn.inbuf) < (1 << 20) for conn in master._server._conns)
    assert master.add("served", 1) == 1


def test_client_refuses_to_send_a_frame_over_the_limit(master: TCPStore) -> None:
    limit = wire.MAX_FRAME
    with pytest.raises(ValueError, match=rf"set\(big\) would send \d+ bytes, over the store's limit of {limit}"):
        master.set("big", b"\0" * wire.MAX_FRAME)
    master.set("fits", b"\0" * (1 << 20))
    assert len(master.get("fits")) == 1 << 20   # the connection was not touched


def test_a_reply_over_the_limit_is_an_error_and_the_connection_serves_on(master: TCPStore,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_FRAME", 1 << 20)   # each value fits in a request, the two together do not
    half = b"\0" * (600 << 10)
    master.set("a", half)
    master.set("b", half)
    with pytest.raises(StoreError, match=r"the reply would be \d+ bytes, over the store's limit .* fewer keys"):
        master.multi_get(["a", "b"])
    assert master.multi_get(["a"]) == [half]


def test_unread_replies_apply_back_pressure_not_unbounded_buffers(master: TCPStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_BUFFERED_REPLY", 8 << 20)
    value = secrets.token_bytes(1 << 20)
    master.set("big", value)
    count = 200
    with _raw_client(master.port) as greedy:
        greedy.sendall(wire.frame(wire.GET, [b"big", b"5"]) * count)
        conns = [conn for conn in master._server._conns if conn.sock.getpeername() == greedy.getsockname()]
        _until(lambda: conns[0].held)
        assert len(conns[0].outbuf) <= (8 << 20) + (2 << 20)
        assert master.add("served", 1) == 1   # others are served meanwhile
        greedy.settimeout(30)
        for _ in range(count):
            assert _read_frame(greedy) == (wire.OK, [value])   # every reply comes, none dropped
