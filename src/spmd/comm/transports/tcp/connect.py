"""Connection set-up of the tcp transport: the listener, dialing, the challenge-response handshake, the full mesh.

Layer: comm. A Connector builds this rank's half of a group's full mesh of authenticated sockets: it
listens and publishes its address in the group's store, connects to every lower rank and accepts every
higher one, and hands each authenticated, tuned socket to the transport (`register`). See `wire` (Note:
handshake) for the frames, and Note: threads of the tcp transport in `transport` for the set-up threads.
"""

from __future__ import annotations

import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence

from spmd._core import env
from spmd._core.deadline import Deadline
from spmd._core.errors import CommError, CommTimeoutError, PeerLostError, PeerUnreachableError, StoreTimeoutError
from spmd.comm.transports.base import TransportSpec
from spmd.comm.transports.tcp import address, wire

SOCKET_BUFFER = 4 << 20           # bytes; large buffers keep a ring step's pieces in flight
SEND_POLL_S = 0.5                 # a blocked send wakes this often to check for failure and its deadline
HANDSHAKE_S = 10.0                # at most this long for one connection's handshake
REACH_S = 10.0                    # a peer's published address that refuses or drops connections this long is wrong
                                  # (SPMD_CONNECT_RETRY_S overrides it)
CONNECT_ATTEMPT_S = 3.0           # one connection attempt (a dropped SYN is retried by the next one)


class Connector:
    """Set-up of one group's connections on this rank; `cond` is the transport's (its lock guards everything).

    `peers` is the transport's table of registered peers (read here, filled by `register`), `closing` says
    under the lock whether the transport is closing, and `register(peer, sock)` takes an authenticated socket.
    With `local_sockets`, a group on one Linux host connects over Unix sockets (in the abstract namespace: no
    file left behind) instead of TCP over loopback, which moves bytes about twice as fast; the same handshake
    authenticates them.
    """

    def __init__(self, spec: TransportSpec, desc: str, cond: threading.Condition, peers: Sequence[object | None],
                 closing: Callable[[], bool], register: Callable[[int, socket.socket], None],
                 local_sockets: bool = False) -> None:
        self.spec = spec
        self.group_rank = spec.group_rank
        self.group_size = spec.group_size
        self._desc = desc
        self._cond = cond
        self._peers = peers
        self._closing = closing
        self._register_peer = register
        self._local_sockets = local_sockets and sys.platform.startswith("linux")
        self._listener: socket.socket | None = None
        self._setup_threads: list[threading.Thread] = []
        self._handshaking: set[socket.socket] = set()

    def connect(self, deadline: Deadline) -> None:
        """Collective over the group: listen, publish host:port, connect to lower ranks, accept higher ones."""
        r = self.group_rank
        me = self.spec.where(r)
        one_host = len(set(self.spec.hosts)) == 1
        if one_host and self._local_sockets:
            published, choice = self._listen_locally(me)
        else:
            published, choice = self._listen(one_host, me)
        self.spec.store.set(f"tcp/source/{r}", choice.source)
        self.spec.store.set(f"tcp/addr/{r}", published)
        if r < self.group_size - 1:
            self._start_thread(self._accept_loop, f"spmd-tcp-accept-{self.spec.group_name}-r{r}", deadline)
        for peer in range(r):
            self._connect_to(peer, deadline)
        with self._cond:
            while not all(p is not None for i, p in enumerate(self._peers) if i != r):
                if deadline.expired():
                    missing = [self.spec.where(i) for i, p in enumerate(self._peers) if p is None and i != r]
                    raise CommTimeoutError(
                        f"tcp transport of {self._desc}, {me}: {', '.join(missing)} did not connect within "
                        f"{deadline.timeout:.1f}s (they never created this group, or can't reach "
                        f"{published}, chosen from {choice.source})")
                self._cond.wait(deadline.remaining())
        self._close_listener()

    def _listen(self, one_host: bool, me: str) -> tuple[str, address.AddressChoice]:
        """Listen on TCP; the host:port to publish, and why that address."""
        if one_host:
            bind_host, choice = "127.0.0.1", address.AddressChoice("127.0.0.1", "one host")
        else:
            try:
                bind_host, choice = "0.0.0.0", address.choose_address(self.spec.store.server_host())
            except ValueError as error:
                raise CommError(f"tcp transport of {self._desc}, {me}: {error}") from None
        try:
            self._listener = socket.create_server((bind_host, 0), backlog=max(16, 2 * self.group_size))
        except OSError as error:
            raise CommError(f"tcp transport of {self._desc}, {me}: can't listen on {bind_host} ({error})") from None
        return f"{choice.address}:{self._listener.getsockname()[1]}", choice

    def _listen_locally(self, me: str) -> tuple[str, address.AddressChoice]:
        """Listen on a Unix socket of a random abstract name; the name to publish."""
        name = f"spmd-{self.spec.group_name}-{self.group_rank}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen(max(16, 2 * self.group_size))
        except OSError as error:
            listener.close()
            raise CommError(f"tcp transport of {self._desc}, {me}: can't listen on a Unix socket ({error})") \
                from None
        self._listener = listener
        return _UNIX + name, address.AddressChoice(_UNIX + name, "one host, Unix sockets")

    def _connect_to(self, peer: int, deadline: Deadline) -> None:
        me, them = self.spec.where(self.group_rank), self.spec.where(peer)
        key = f"tcp/addr/{peer}"
        try:
            self.spec.store.wait([key], timeout=deadline.remaining())
        except StoreTimeoutError:
            raise CommTimeoutError(
                f"tcp transport of {self._desc}, {me}: {them} did not publish its address within "
                f"{deadline.timeout:.1f}s (it never created this group)") from None
        target = self.spec.store.get(key).decode()
        hello = wire.hello_frame(self.group_rank, self.spec.group_name, secrets.token_bytes(wire.NONCE_BYTES))
        reach_s = env.connect_retry_seconds(REACH_S)
        reach_by = time.monotonic() + reach_s
        while True:
            try:
                sock = _dial(target, max(0.01, min(CONNECT_ATTEMPT_S, deadline.remaining())))
                break
            except OSError as error:
                if deadline.expired():
                    raise CommTimeoutError(
                        f"tcp transport of {self._desc}, {me}: can't connect to {them} at {target} within "
                        f"{deadline.timeout:.1f}s ({error})") from None
                if time.monotonic() >= reach_by:
                    raise PeerUnreachableError(self._unreachable(peer, target, error, reach_s)) from None
                time.sleep(0.05)
        try:
            sock.settimeout(max(0.01, min(deadline.remaining(), HANDSHAKE_S)))
            sock.sendall(hello)
            challenge = wire.recv_bytes(sock, wire.CHALLENGE_LEN)
            their_nonce = wire.check_challenge(challenge, self.spec.token, hello)
            if their_nonce is None:
                sock.close()
                raise CommError(f"tcp transport of {self._desc}, {me}: the process at {target} is not "
                                f"{them} of this group (it could not prove it holds the group's token)")
            sock.sendall(wire.proof_frame(self.spec.token, hello, their_nonce))
        except (OSError, wire.PeerClosed) as error:
            sock.close()
            raise PeerLostError(f"tcp transport of {self._desc}, {me}: handshake with {them} at {target} "
                                f"failed ({error})") from None
        self._register(peer, sock)

    def _unreachable(self, peer: int, target: str, error: OSError, reach_s: float) -> str:
        """Why `peer`'s published address can't be used from here, and the override that fixes it."""
        source_key = f"tcp/source/{peer}"
        source = self.spec.store.get(source_key).decode() if self.spec.store.check([source_key]) else "unknown"
        names = self.spec.host_names
        their_host = names[peer] if names else "its host"
        my_host = names[self.group_rank] if names else "this host"
        return (f"tcp transport of {self._desc}: {self.spec.where(self.group_rank)} can't reach "
                f"{self.spec.where(peer)} at {target} within {reach_s:g}s ({error}); {their_host} chose that "
                f"address from {source}. On {their_host}, give an address of it that {my_host} can reach: "
                f"{address.OVERRIDES}")

    def _accept_loop(self, deadline: Deadline) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return   # the listener was closed: set-up is over
            name = f"spmd-tcp-handshake-{self.spec.group_name}-r{self.group_rank}"
            self._start_thread(self._handshake, name, conn, deadline)

    def _handshake(self, conn: socket.socket, deadline: Deadline) -> None:
        """Authenticate one incoming connection; a stranger is dropped before anything of it is used."""
        with self._cond:
            if self._closing():
                conn.close()
                return
            self._handshaking.add(conn)
        try:
            conn.settimeout(max(0.01, min(deadline.remaining(), HANDSHAKE_S)))
            hello = wire.read_hello(conn, self.spec.group_name)
            if hello is not None:
                peer, raw = hello
                with self._cond:
                    valid = self.group_rank < peer < self.group_size and self._peers[peer] is None
                if valid:
                    nonce = secrets.token_bytes(wire.NONCE_BYTES)
                    conn.sendall(wire.challenge_frame(self.spec.token, raw, nonce))
                    proof = wire.recv_bytes(conn, wire.PROOF_LEN)
                    with self._cond:
                        still_free = self._peers[peer] is None
                    if still_free and wire.check_proof(proof, self.spec.token, raw, nonce):
                        self._register(peer, conn)
                        return
        except (OSError, wire.PeerClosed, ValueError):
            pass
        with self._cond:
            self._handshaking.discard(conn)
        conn.close()

    def _register(self, peer: int, sock: socket.socket) -> None:
        """Hand an authenticated socket to the transport, which from now on closes it as a peer's connection."""
        _tune(sock)
        with self._cond:
            self._handshaking.discard(sock)
        self._register_peer(peer, sock)

    def _start_thread(self, target, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._setup_threads.append(thread)
        thread.start()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)    # wakes the accept thread
            except OSError:
                pass
            listener.close()

    def close(self) -> None:
        """Stop set-up (the transport is closing): close the listener, drop handshakes, join the set-up threads."""
        self._close_listener()
        with self._cond:
            handshaking = list(self._handshaking)
        for conn in handshaking:
            try:
                conn.shutdown(socket.SHUT_RDWR)    # wakes a handshake still waiting for a silent stranger
            except OSError:
                pass
        for thread in self._setup_threads:
            thread.join(timeout=HANDSHAKE_S)


_UNIX = "unix:"     # a published address naming an abstract Unix socket


def _dial(target: str, timeout: float) -> socket.socket:
    """A connection to a published address: host:port, or unix:name."""
    if target.startswith(_UNIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + target[len(_UNIX):])
        except OSError:
            sock.close()
            raise
        return sock
    host, port = target.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _tune(sock: socket.socket) -> None:
    """Latency and throughput settings for a peer connection, and the send timeout send_frame relies on."""
    sock.settimeout(None)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    seconds = int(SEND_POLL_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", seconds, int((SEND_POLL_S - seconds) * 1e6)))
    if sock.family == socket.AF_UNIX:
        return               # a dead local peer's socket ends at once: no keepalive needed
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)

