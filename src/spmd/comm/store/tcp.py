"""TCPStore: the rendezvous store served over TCP by a thread of the master process.

Layer: comm. The master (rank 0, or the launcher's agent) runs a `StoreServer` (tcp_server): one
daemon thread with a selectors loop that serves every client and parks blocking `get`/`wait` calls until
their keys are set or their deadline passes. Every TCPStore instance, the master's included, is a client
holding one connection; its calls are serialised by a lock. The wire format, its handshake (each side proves
it knows the token without sending it) and its size limits are tcp_wire's.
"""

from __future__ import annotations

import datetime
import hmac
import os
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Sequence

from spmd._core import env
from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import StoreAuthError, StoreError
from spmd.comm.store import tcp_wire as wire
from spmd.comm.store.base import Store, Value, missing_keys_error, queue_empty_error, queue_timeout_error, to_bytes
from spmd.comm.store.tcp_server import StoreServer, is_loopback_host

_REPLY_GRACE_S = 10.0     # how much longer than a blocking call's own timeout a client waits for its reply
_FOREVER_S = 1e7          # a socket timeout at least this long (116 days; inf, 1e300) is no timeout at all
_JOIN_KEY = "spmd_store/joined"   # counts the clients that joined, for wait_for_workers (torch keeps one too)
_TIMEVAL = struct.Struct("@ll")   # struct timeval, for the kernel's socket timeouts
_LOCAL_SOCKETS = sys.platform == "linux"   # a client with a token tries a loopback server's Unix socket first


_forks = 0   # how many forks led to this process (counted in each child), to tell a forked child's store


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


class _Refused(Exception):
    """The server refused this client's token."""


class _Impostor(Exception):
    """The server answered the handshake but could not prove it knows the token."""


class _Client:
    """One connection to the server; `call` sends a request and reads its reply under a lock."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float) -> None:
        self.address = f"{host}:{port}"
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._scratch = memoryview(bytearray(wire.RECV_CHUNK))   # every recv lands here: no allocation per read
        self._sock_timeout: float | None = -1.0
        self._closed = False
        self._forks_at_start = _forks   # a forked child sees a later count: the connection is its parent's
        self._sock: socket.socket | None = self._connect(host, port, b"" if token is None else token.encode(),
                                                         timeout)

    def _connect(self, host: str, port: int, token: bytes, timeout: float) -> socket.socket:
        """Connect and say HELLO, retrying until `timeout` while nothing accepts (the master may start later)."""
        deadline = Deadline(timeout)
        delay = 0.01
        while True:
            try:
                sock = self._open(host, port, token, max(0.05, min(deadline.remaining(), 10.0)))
            except OSError as error:
                last_error: BaseException = error
            else:
                try:
                    sock.settimeout(max(0.05, min(deadline.remaining(), 10.0)))
                    self._handshake(sock, token)
                    sock.settimeout(None)   # blocking from now on: calls bound their waits with _bound_waits
                    return sock
                except _Refused as refusal:
                    sock.close()
                    hint = "set SPMD_STORE_TOKEN or pass token=" if not token else "check SPMD_STORE_TOKEN / token="
                    raise StoreAuthError(f"TCPStore: the store server at {self.address} refused this client: "
                                     f"{refusal} ({hint} to the job's token)") from None
                except _Impostor:
                    sock.close()
                    raise StoreAuthError(f"TCPStore: the server at {self.address} could not prove it knows the token: "
                                         f"it is not the job's store, or it was started with a different token "
                                     f"(check SPMD_STORE_TOKEN / token= and MASTER_ADDR/MASTER_PORT). Nothing was "
                                     f"sent to it.") from None
                except OSError as error:
                    sock.close()
                    last_error = error
            if deadline.expired():
                raise StoreError(f"TCPStore: could not connect to the store server at {self.address} within "
                                 f"{timeout:.1f}s (last error: {last_error}). Check MASTER_ADDR/MASTER_PORT and that "
                                 f"the master (rank 0 or the launcher) is running.")
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, 0.5)

    @staticmethod
    def _open(host: str, port: int, token: bytes, timeout: float) -> socket.socket:
        """A socket connected to the server: its Unix socket (tcp_wire's note) if there is a token, `host` is
        loopback and the server has one, else TCP."""
        if _LOCAL_SOCKETS and token and is_loopback_host(host):
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(timeout)
            try:
                local.connect(wire.local_name(port, token))
                return local
            except OSError:   # none: the server is elsewhere, or could not listen on it
                local.close()
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket, token: bytes) -> None:
        """Prove the token to the server and check its proof (tcp_wire's handshake); raises before any request."""
        client_nonce = secrets.token_bytes(wire.NONCE_BYTES)
        self._buf.clear()
        sock.sendall(wire.frame(wire.HELLO, [wire.MAGIC, client_nonce, b"1" if token else b"0"]))
        status, fields = self._read_reply(sock, wire.MAX_HELLO)
        if status == wire.REFUSED:
            raise _Refused(fields[0].decode(errors="replace") if fields else "refused")
        if status != wire.OK or len(fields) != 1 or len(fields[0]) != wire.NONCE_BYTES:
            raise ConnectionError(f"unexpected handshake reply (status {status}); is {self.address} an spmd store?")
        server_nonce = fields[0]
        sock.sendall(wire.frame(wire.AUTH, [wire.proof(token, wire.CLIENT_SIDE, server_nonce, client_nonce)]))
        status, fields = self._read_reply(sock, wire.MAX_HELLO)
        if status == wire.REFUSED:
            raise _Refused(fields[0].decode(errors="replace") if fields else "refused")
        expected = wire.proof(token, wire.SERVER_SIDE, server_nonce, client_nonce)
        if status != wire.OK or len(fields) != 1 or not hmac.compare_digest(fields[0], expected):
            raise _Impostor()

    def _read_reply(self, sock: socket.socket, max_size: int = wire.MAX_FRAME) -> tuple[int, list[bytes]]:
        buf = self._buf
        while len(buf) < wire.HEADER.size:
            self._recv_more(sock)
        size, status = wire.HEADER.unpack_from(buf)
        if size > max_size:
            raise ConnectionError(f"a {size}-byte reply, over the limit of {max_size}; is {self.address} an spmd "
                                  f"store?")
        end = wire.HEADER.size + size
        while len(buf) < end:
            self._recv_more(sock)
        body = bytes(buf[wire.HEADER.size:end])
        del buf[:end]
        return status, wire.split_fields(body)

    def _recv_more(self, sock: socket.socket) -> None:
        size = sock.recv_into(self._scratch)
        if not size:
            raise ConnectionError("the server closed the connection")
        self._buf += self._scratch[:size]

    def call(self, op: int, fields: Sequence[bytes], reply_within: float | None, what: str) -> tuple[int, list[bytes]]:
        """Send one request and return (status, fields); StoreError if the connection fails or stays silent.

        An UNANSWERED request (set, multi_set) returns (OK, []) once it is sent; if it fails on the server, a
        later call reads the failure ahead of its own reply and raises it. A request over tcp_wire.MAX_FRAME is
        a ValueError raised before anything is sent.
        """
        try:
            frame = wire.frame(op, fields)
        except wire.FrameTooLarge as error:
            raise ValueError(f"TCPStore {self.address}: {wire.OP_NAMES[op]}({what[:200]}) would send {error.size} "
                             f"bytes, over the store's limit of {wire.MAX_FRAME} bytes (tcp_wire.MAX_FRAME); keep "
                             f"large data out of the store (write a file and store its path)") from None
        if self._forks_at_start != _forks:
            raise StoreError(f"TCPStore {self.address}: this process was forked from the one that made the store and "
                             f"shares its connection; create a new TCPStore (or clone()) in the child")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreError(f"TCPStore {self.address}: {wire.OP_NAMES[op]}({what}) on a closed store "
                                 f"{'(close() was called)' if self._closed else '(its connection was lost earlier)'}")
            try:
                if reply_within != self._sock_timeout:
                    self._bound_waits(sock, reply_within)
                    self._sock_timeout = reply_within
                sock.sendall(frame)
                if op in wire.UNANSWERED:
                    return wire.OK, []
                status, reply = self._read_reply(sock)
                failures = []
                while status == wire.QUIET_FAILED:   # an earlier set's failure, ahead of this request's reply
                    failures.append(reply[0].decode(errors="replace") if reply else "failed")
                    status, reply = self._read_reply(sock)
            except (TimeoutError, BlockingIOError):   # BlockingIOError: a kernel timeout of _bound_waits ran out
                self._break()
                raise StoreError(f"TCPStore {self.address}: no reply to {wire.OP_NAMES[op]}({what}) within "
                                 f"{reply_within:.1f}s; the store server is not responding") from None
            except (OSError, ValueError) as error:
                self._break()
                if self._closed:
                    raise StoreError(f"TCPStore {self.address}: {wire.OP_NAMES[op]}({what}) interrupted because "
                                     f"close() was called") from None
                raise StoreError(f"TCPStore: lost the connection to the store server at {self.address} during "
                                 f"{wire.OP_NAMES[op]}({what}): {error}. The server's process (the master rank or the "
                                 f"launcher agent) has probably exited.") from None
            except BaseException:
                self._break()   # interrupted (KeyboardInterrupt) between request and reply: the stream is unusable
                raise
        if failures:
            raise StoreError(f"TCPStore {self.address}: an earlier request on this connection failed on the server: "
                             f"{'; '.join(failures)} (reported by {wire.OP_NAMES[op]}({what}), which was served)")
        return status, reply

    @staticmethod
    def _bound_waits(sock: socket.socket, seconds: float | None) -> None:
        """Bound each send and recv on the blocking `sock` by `seconds` (None: unbounded) in the kernel.

        SO_RCVTIMEO/SO_SNDTIMEO rather than a Python socket timeout, which polls before every send and recv: two
        more system calls per request.
        """
        whole, fraction = divmod(seconds or 0.0, 1.0)   # a zero timeval is no bound
        timeval = _TIMEVAL.pack(int(whole), int(fraction * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def _break(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection; a call blocked in another thread fails at once."""
        self._closed = True
        if self._forks_at_start != _forks:   # a forked child: drop its copy of the socket, leave the parent's be
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            return
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._lock.acquire(timeout=10.0):
            try:
                self._break()
            finally:
                self._lock.release()


def _shutdown(client: _Client, server: StoreServer | None) -> None:
    client.close()
    if server is not None:
        server.stop()


class TCPStore(Store):
    """A store served over TCP: the master runs the server in a daemon thread, every instance is a client.

    `port=0` on the master lets the OS pick a free port (read it back from `.port`). With `wait_for_workers`
    the master's constructor returns only when `world_size` clients (itself included) have joined. A token
    (argument, else env SPMD_STORE_TOKEN) makes the server refuse clients that cannot prove they know it, and
    clients refuse a server that cannot; the token itself never crosses the wire. Like torch's, a fresh store
    holds one key, the join counter, so `num_keys()` starts at 1.

    Where the master listens follows `host_name` (tcp_server.listen_addresses): a loopback address or
    "localhost" keeps the store on loopback (127.0.0.1 and ::1), a literal IP of this machine is listened on
    alone, a host name (or an address not on this machine) listens on every interface. Listening beyond
    loopback without a token logs a warning. With a token, a client of a loopback address talks to the server
    over its Unix socket where it has one (Linux; tcp_wire's note). Timeouts are non-negative seconds; inf
    waits forever.

    `set` and `multi_set` return once their request is sent, without waiting for an answer (as torch's set):
    this store's later calls see the write, another client sees it once the server has read it (a blocking
    get or wait there is answered when it lands), and a failure on the server is raised by this store's next
    call.
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: float | datetime.timedelta | None = 300, wait_for_workers: bool = True,
                 token: str | None = None) -> None:
        super().__init__(timeout)
        if world_size is not None and world_size < 1:
            raise ValueError(f"TCPStore: world_size must be >= 1 or None, got {world_size}")
        if not 0 <= port < 65536:
            raise ValueError(f"TCPStore: port must be in [0, 65535], got {port}")
        if port == 0 and not is_master:
            raise ValueError("TCPStore: a client needs the server's port; port 0 is only for the master")
        self.host = host_name
        self.port = port
        self.world_size = world_size
        self.is_master = is_master
        self._token = token if token is not None else env.store_token()
        self._owner: TCPStore | None = None   # a clone keeps its origin (and so the server) alive
        server = StoreServer(host_name, port, self._token) if is_master else None
        self._server = server
        self.port = server.port if server is not None else port
        self._connect_host = server.local_host if server is not None else host_name
        try:
            self._client = _Client(self._connect_host, self.port, self._token, self.timeout)
        except BaseException:
            if server is not None:
                server.stop()
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._client, server)
        try:
            self.add(_JOIN_KEY, 1)
            if is_master and wait_for_workers and world_size is not None:
                self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    def _wait_for_workers(self, world_size: int) -> None:
        timeout = self.timeout
        status, fields = self._client.call(
            wire.WAIT_COUNT, [_JOIN_KEY.encode(), str(world_size).encode(), wire.seconds_field(timeout)],
            self._reply_within(timeout), "world_size")
        if status == wire.TIMEOUT:
            joined = int(fields[0]) if fields else 0
            raise StoreError(f"TCPStore master {self.host}:{self.port}: only {joined} of {world_size} clients "
                             f"joined within {timeout:.1f}s; the other ranks did not start or cannot reach "
                             f"this address")
        self._check(status, fields, "wait_for_workers", "")

    def has_extended_api(self) -> bool:
        return True

    def __repr__(self) -> str:
        role = "master" if self.is_master else "client"
        return f"TCPStore({self.host}:{self.port}, {role}, world_size={self.world_size})"

    def server_host(self) -> str | None:
        return self.host

    def clone(self) -> TCPStore:
        """A new client connection to the same server (for another thread); its close() leaves the server up."""
        clone = TCPStore.__new__(TCPStore)
        Store.__init__(clone, self.timeout)
        clone.host, clone.port, clone.world_size, clone.is_master = self.host, self.port, self.world_size, False
        clone._token = self._token
        clone._owner = self._owner or self
        clone._server = None
        clone._connect_host = self._connect_host
        clone._client = _Client(clone._connect_host, self.port, self._token, self.timeout)
        clone._finalizer = weakref.finalize(clone, _shutdown, clone._client, None)
        return clone

    def close(self) -> None:
        """Close this client's connection; the master's close also stops the server (other clients then fail)."""
        self._finalizer()

    # The Store API.

    def _reply_within(self, timeout: float) -> float | None:
        total = timeout + _REPLY_GRACE_S
        return None if total >= _FOREVER_S else total

    def _request(self, op: int, fields: Sequence[bytes], what: str, blocking_for: float | None = None) -> list[bytes]:
        limit = self._reply_within(self.timeout if blocking_for is None else max(blocking_for, 0.0))
        status, reply = self._client.call(op, fields, limit, what)
        if status == wire.TIMEOUT:
            waited = self.timeout if blocking_for is None else blocking_for
            raise missing_keys_error(f"TCPStore {self.host}:{self.port}", [key.decode() for key in reply], waited)
        self._check(status, reply, wire.OP_NAMES[op], what)
        return reply

    def _check(self, status: int, fields: list[bytes], op: str, what: str) -> None:
        if status == wire.OK:
            return
        message = fields[0].decode(errors="replace") if fields else f"status {status}"
        if status == wire.BAD_VALUE:
            raise ValueError(f"TCPStore {self.host}:{self.port}: {op}({what}): {message}")
        raise StoreError(f"TCPStore {self.host}:{self.port}: {op}({what}) failed: {message}")

    def set(self, key: str, value: Value) -> None:
        self._request(wire.SET, [key.encode(), to_bytes(value)], key)

    def get(self, key: str) -> bytes:
        timeout = self.timeout
        return self._request(wire.GET, [key.encode(), wire.seconds_field(timeout)], key, timeout)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._request(wire.ADD, [key.encode(), str(int(amount)).encode()], key)[0])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._request(wire.CAS, [key.encode(), to_bytes(expected), to_bytes(desired)], key)[0]

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        seconds = as_seconds(timeout, self.timeout, "TCPStore.wait: timeout")
        self._request(wire.WAIT, [wire.seconds_field(seconds), *(key.encode() for key in keys)], ", ".join(keys),
                      seconds)

    def check(self, keys: list[str]) -> bool:
        return self._request(wire.CHECK, [key.encode() for key in keys], ", ".join(keys))[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._request(wire.DELETE, [key.encode()], key)[0] == b"1"

    def num_keys(self) -> int:
        return int(self._request(wire.NUM_KEYS, [], "")[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        timeout = self.timeout
        return self._request(wire.MULTI_GET, [wire.seconds_field(timeout), *(key.encode() for key in keys)],
                             ", ".join(keys), timeout)

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"TCPStore.multi_set: {len(keys)} keys but {len(values)} values")
        fields: list[bytes] = []
        for key, value in zip(keys, values):
            fields += (key.encode(), to_bytes(value))
        self._request(wire.MULTI_SET, fields, ", ".join(keys))

    def append(self, key: str, value: Value) -> None:
        self._request(wire.APPEND, [key.encode(), to_bytes(value)], key)

    def list_keys(self) -> list[str]:
        return [key.decode() for key in self._request(wire.LIST_KEYS, [], "")]

    def queue_push(self, key: str, value: Value) -> None:
        self._request(wire.QUEUE_PUSH, [key.encode(), to_bytes(value)], key)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        timeout = self.timeout
        status, reply = self._client.call(
            wire.QUEUE_POP, [key.encode(), b"1" if block else b"0", wire.seconds_field(timeout)],
            self._reply_within(timeout), key)
        if status == wire.EMPTY:
            raise queue_empty_error(f"TCPStore {self.host}:{self.port}", key)
        if status == wire.TIMEOUT:
            raise queue_timeout_error(f"TCPStore {self.host}:{self.port}", key, timeout)
        self._check(status, reply, "queue_pop", key)
        return reply[0]

    def queue_len(self, key: str) -> int:
        return int(self._request(wire.QUEUE_LEN, [key.encode()], key)[0])
