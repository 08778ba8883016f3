"""TCPStore: the rendezvous store served over TCP by a thread of the master process.

Layer: comm. The master (rank 0, or the launcher's agent) runs a `_StoreServer`: one daemon thread with a
selectors loop that serves every client. A blocking `get`/`wait` is parked on the server and answered when its
keys are set or its deadline passes, so a waiting client costs nothing and never delays the others. Every
TCPStore instance, the master's included, is a client holding one connection; its calls are serialised by a lock.

Wire format (nothing is ever pickled): a frame is a header (u32 body length, u8 opcode or reply status) and a
body made of fields, each a u32 length and that many bytes; numbers travel as decimal text. The first frame of
a connection is HELLO(magic, token). A server with a token refuses a client presenting another one and drops
the connection before reading anything else; before that HELLO it accepts no frame larger than 4 KiB.
"""

from __future__ import annotations

import collections
import datetime
import errno
import heapq
import hmac
import itertools
import os
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence

from spmd._core import env
from spmd._core.deadline import Deadline, as_seconds
from spmd._core.errors import StoreError
from spmd._core.log import get_logger
from spmd.comm.store import Store, Value, missing_keys_error, to_bytes

_log = get_logger(__name__)
_HEADER = struct.Struct("!IB")
_LEN = struct.Struct("!I")
_MAGIC = b"spmd-store/1"
_MAX_HELLO = 4096
_HELLO_TIMEOUT_S = 30.0   # a connection that has not said HELLO by then is dropped (a stranger holding a socket)
_RECV_CHUNK = 1 << 18
_REPLY_GRACE_S = 10.0     # how much longer than a blocking call's own timeout a client waits for its reply
_JOIN_KEY = "spmd_store/joined"   # counts the clients that joined, for wait_for_workers (torch keeps one too)

# Opcodes (client -> server).
_HELLO, _SET, _GET, _ADD, _CAS, _WAIT, _CHECK, _DELETE, _NUM_KEYS, _MULTI_GET, _MULTI_SET, _WAIT_COUNT = range(1, 13)
_OP_NAMES = {_SET: "set", _GET: "get", _ADD: "add", _CAS: "compare_set", _WAIT: "wait", _CHECK: "check",
             _DELETE: "delete_key", _NUM_KEYS: "num_keys", _MULTI_GET: "multi_get", _MULTI_SET: "multi_set",
             _WAIT_COUNT: "wait_for_workers", _HELLO: "connect"}
# Reply statuses (server -> client).
_OK, _TIMEOUT, _ERROR, _BAD_VALUE, _REFUSED = range(5)


def _frame(code: int, fields: Sequence[bytes]) -> bytes:
    parts = [b""]
    size = 0
    for field in fields:
        parts.append(_LEN.pack(len(field)))
        parts.append(field)
        size += 4 + len(field)
    parts[0] = _HEADER.pack(size, code)
    return b"".join(parts)


def _split_fields(body: bytes) -> list[bytes]:
    fields = []
    pos, end = 0, len(body)
    while pos < end:
        if pos + 4 > end:
            raise ValueError("truncated field length")
        (size,) = _LEN.unpack_from(body, pos)
        pos += 4
        if pos + size > end:
            raise ValueError("truncated field")
        fields.append(body[pos:pos + size])
        pos += size
    return fields


def _seconds_field(seconds: float) -> bytes:
    return repr(float(seconds)).encode()


class _Conn:
    """The server's state for one client connection."""

    __slots__ = ("authed", "closing", "inbuf", "outbuf", "sock", "waiter")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = False
        self.closing = False          # a refusal is being flushed; read nothing more
        self.waiter: _Waiter | None = None


class _Waiter:
    """A blocking request parked on the server until its keys exist (or a counter reaches `target`)."""

    __slots__ = ("conn", "done", "keys", "missing", "op", "target")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes], target: int) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.target = target
        self.missing: set[bytes] = set()   # the keys it is watching: those absent when last checked
        self.done = False


class _StoreServer:
    """The key/value server: one thread, one selector, every client; parked waiters are woken by writes."""

    def __init__(self, port: int, token: str | None) -> None:
        self._token = None if token is None else token.encode()
        self._data: dict[bytes, bytes] = {}
        self._watchers: dict[bytes, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._conns: set[_Conn] = set()
        self._resume: list[_Conn] = []
        self._unauthed: collections.deque[tuple[float, _Conn]] = collections.deque()
        self._stopping = False
        self._pid = os.getpid()
        self._listener = self._bind(port)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._handlers = {_HELLO: self._hello, _SET: self._set, _GET: self._get, _ADD: self._add, _CAS: self._cas,
                          _WAIT: self._wait, _CHECK: self._check, _DELETE: self._delete, _NUM_KEYS: self._num_keys,
                          _MULTI_GET: self._multi_get, _MULTI_SET: self._multi_set, _WAIT_COUNT: self._wait_count}
        self._thread = threading.Thread(target=self._serve, name=f"spmd-tcpstore-server:{self.port}", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(port: int) -> socket.socket:
        """Listen on every interface: IPv4 and IPv6 where the host has both, else IPv4 only."""
        families = [socket.AF_INET6, socket.AF_INET] if socket.has_dualstack_ipv6() else [socket.AF_INET]
        failure: OSError | None = None
        for family in families:
            try:
                listener = socket.create_server(("", port), family=family, backlog=4096,
                                                dualstack_ipv6=family == socket.AF_INET6)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise StoreError(f"TCPStore: port {port} on 0.0.0.0 is already in use; pick another MASTER_PORT "
                                     f"or use port 0 (the OS picks a free one)") from None
                failure = error   # e.g. IPv6 present but unusable here: try IPv4 only
                continue
            listener.setblocking(False)
            return listener
        raise StoreError(f"TCPStore: could not listen on 0.0.0.0:{port}: {failure}") from failure

    def stop(self) -> None:
        """Close every connection and the listening socket; clients see their connection end."""
        if os.getpid() != self._pid:
            return   # a forked child: the server thread lives in the parent only
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    # The loop.

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._next_deadline_in()):
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        self._drain_wake()
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and conn in self._conns:
                            self._read(conn)
                self._expire()
                while self._resume:
                    conn = self._resume.pop()
                    if conn in self._conns:
                        self._process(conn)
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_deadline_in(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        while self._unauthed and (self._unauthed[0][1].authed or self._unauthed[0][1] not in self._conns):
            self._unauthed.popleft()
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self._unauthed:
            times.append(self._unauthed[0][0])
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return   # e.g. out of file descriptors; the client retries
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._unauthed.append((time.monotonic() + _HELLO_TIMEOUT_S, conn))
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.inbuf += data
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Run the complete frames buffered on `conn`, in order; stop while one of them is parked."""
        buf = conn.inbuf
        while conn.waiter is None and not conn.closing and len(buf) >= _HEADER.size:
            size, op = _HEADER.unpack_from(buf)
            if not conn.authed and (op != _HELLO or size > _MAX_HELLO):
                self._drop(conn)   # a stranger: read nothing more from it
                return
            end = _HEADER.size + size
            if len(buf) < end:
                return
            body = bytes(buf[_HEADER.size:end])
            del buf[:end]
            handler = self._handlers.get(op)
            try:
                if handler is None:
                    raise ValueError(f"unknown opcode {op}")
                handler(conn, _split_fields(body))
            except (ValueError, IndexError) as error:
                if not conn.authed:
                    self._drop(conn)
                    return
                self._reply(conn, _ERROR, [f"malformed request: {error}".encode()])
            except Exception as error:   # a server bug must fail one request, not every client's store
                _log.exception("TCPStore server on port %d: request %d failed", self.port, op)
                self._reply(conn, _ERROR, [f"server error: {error!r}".encode()])
            if conn not in self._conns:
                return

    def _reply(self, conn: _Conn, status: int, fields: Sequence[bytes] = ()) -> None:
        data = _frame(status, fields)
        if conn.outbuf:
            conn.outbuf += data
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        if sent < len(data):
            conn.outbuf += data[sent:]
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:
            if conn.closing:
                self._drop(conn)
            else:
                self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if conn.waiter is not None:
            self._unpark(conn.waiter)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # Parked requests.

    def _park(self, conn: _Conn, op: int, keys: list[bytes], timeout: float, target: int = 0) -> None:
        data = self._data
        if op != _WAIT_COUNT and all(key in data for key in keys):   # the common case: answer at once
            self._reply(conn, _OK, [data[key] for key in keys] if op != _WAIT else ())
            return
        waiter = _Waiter(conn, op, keys, target)
        if self._ready(waiter):
            self._finish(waiter)
            return
        if timeout <= 0:
            self._time_out(waiter)
            return
        conn.waiter = waiter
        self._watch(waiter)
        if len(self._deadlines) > 64 and len(self._deadlines) > 4 * len(self._conns):
            # Answered waiters leave their entries behind until they reach the top; drop them in one pass.
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (time.monotonic() + timeout, next(self._seq), waiter))

    def _ready(self, waiter: _Waiter) -> bool:
        """Whether `waiter` can be answered now; sets `waiter.missing` to the keys it must still watch."""
        if waiter.op == _WAIT_COUNT:
            waiter.missing = {waiter.keys[0]}
            value = self._data.get(waiter.keys[0], b"")
            return value.lstrip(b"-").isdigit() and int(value) >= waiter.target
        waiter.missing = {key for key in waiter.keys if key not in self._data}
        return not waiter.missing

    def _watch(self, waiter: _Waiter) -> None:
        for key in waiter.missing:
            self._watchers.setdefault(key, set()).add(waiter)

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        waiter.conn.waiter = None
        for key in waiter.missing:
            watching = self._watchers.get(key)
            if watching is not None:
                watching.discard(waiter)
                if not watching:
                    del self._watchers[key]

    def _finish(self, waiter: _Waiter) -> None:
        """Answer a waiter whose keys are all present."""
        parked = waiter.conn.waiter is waiter
        self._unpark(waiter)
        if waiter.op in (_GET, _MULTI_GET):
            self._reply(waiter.conn, _OK, [self._data[key] for key in waiter.keys])
        else:
            self._reply(waiter.conn, _OK)
        if parked:
            self._resume.append(waiter.conn)

    def _time_out(self, waiter: _Waiter) -> None:
        parked = waiter.conn.waiter is waiter
        self._unpark(waiter)
        if waiter.op == _WAIT_COUNT:
            count = self._data.get(waiter.keys[0], b"0")
            self._reply(waiter.conn, _TIMEOUT, [count])
        else:
            self._reply(waiter.conn, _TIMEOUT, [key for key in waiter.keys if key not in self._data])
        if parked:
            self._resume.append(waiter.conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._unauthed and self._unauthed[0][0] <= now:
            _, conn = self._unauthed.popleft()
            if not conn.authed:
                self._drop(conn)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if not waiter.done:
                self._time_out(waiter)

    def _changed(self, key: bytes) -> None:
        """`key` was just written: answer the waiters it completes (O(1) each until their last key arrives)."""
        watching = self._watchers.get(key)
        if not watching:
            return
        finished = []
        for waiter in list(watching):
            if waiter.op != _WAIT_COUNT:
                waiter.missing.discard(key)
                watching.discard(waiter)
                if waiter.missing:
                    continue
            if self._ready(waiter):   # re-checks every key: one may have been deleted since it was seen
                finished.append(waiter)
            else:
                self._watch(waiter)
        if not watching and self._watchers.get(key) is watching:
            del self._watchers[key]
        for waiter in finished:       # answered last, so a client that sees its answer sees the tidy state
            self._finish(waiter)

    # Handlers: one per opcode; `fields` are the request's fields.

    def _hello(self, conn: _Conn, fields: list[bytes]) -> None:
        magic, token = fields
        if magic != _MAGIC:
            self._drop(conn)
            return
        if self._token is not None and not hmac.compare_digest(token, self._token):
            conn.closing = True
            self._reply(conn, _REFUSED, [b"wrong token" if token else b"no token presented"])
            if not conn.outbuf:
                self._drop(conn)
            return
        conn.authed = True
        self._reply(conn, _OK)

    def _set(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = fields
        self._data[key] = value
        self._reply(conn, _OK)
        self._changed(key)

    def _get(self, conn: _Conn, fields: list[bytes]) -> None:
        key, timeout = fields
        self._park(conn, _GET, [key], float(timeout))

    def _add(self, conn: _Conn, fields: list[bytes]) -> None:
        key, amount = fields
        current = self._data.get(key, b"0")
        try:
            value = int(current) + int(amount)
        except ValueError:
            self._reply(conn, _BAD_VALUE, [b"the value %r of key %r is not an integer" % (current[:64], key)])
            return
        self._data[key] = str(value).encode()
        self._reply(conn, _OK, [self._data[key]])
        self._changed(key)

    def _cas(self, conn: _Conn, fields: list[bytes]) -> None:
        key, expected, desired = fields
        current = self._data.get(key)
        if current is None and expected:
            self._reply(conn, _OK, [expected])   # torch's quirk: absent key, non-empty expected -> expected
            return
        if current is None or current == expected:
            self._data[key] = desired
            self._reply(conn, _OK, [desired])
            self._changed(key)
            return
        self._reply(conn, _OK, [current])

    def _wait(self, conn: _Conn, fields: list[bytes]) -> None:
        self._park(conn, _WAIT, fields[1:], float(fields[0]))

    def _check(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, _OK, [b"1" if all(key in self._data for key in fields) else b"0"])

    def _delete(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = fields
        self._reply(conn, _OK, [b"1" if self._data.pop(key, None) is not None else b"0"])

    def _num_keys(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, _OK, [str(len(self._data)).encode()])

    def _multi_get(self, conn: _Conn, fields: list[bytes]) -> None:
        self._park(conn, _MULTI_GET, fields[1:], float(fields[0]))

    def _multi_set(self, conn: _Conn, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ValueError("multi_set needs key/value pairs")
        pairs = list(zip(fields[::2], fields[1::2]))
        self._data.update(pairs)
        self._reply(conn, _OK)
        for key, _ in pairs:
            self._changed(key)

    def _wait_count(self, conn: _Conn, fields: list[bytes]) -> None:
        key, target, timeout = fields
        self._park(conn, _WAIT_COUNT, [key], float(timeout), int(target))


class _Refused(Exception):
    """The server refused this client's token."""


class _Client:
    """One connection to the server; `call` sends a request and reads its reply under a lock."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float) -> None:
        self.address = f"{host}:{port}"
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._sock_timeout: float | None = -1.0
        self._closed = False
        self._pid = os.getpid()
        self._sock: socket.socket | None = self._connect(host, port, b"" if token is None else token.encode(),
                                                         timeout)

    def _connect(self, host: str, port: int, token: bytes, timeout: float) -> socket.socket:
        """Connect and say HELLO, retrying until `timeout` while nothing accepts (the master may start later)."""
        deadline = Deadline(timeout)
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.05, min(deadline.remaining(), 10.0)))
            except OSError as error:
                last_error: BaseException = error
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.settimeout(max(0.05, min(deadline.remaining(), 10.0)))
                    sock.sendall(_frame(_HELLO, [_MAGIC, token]))
                    self._buf.clear()
                    status, fields = self._read_reply(sock, max_size=_MAX_HELLO)
                    if status == _REFUSED:
                        raise _Refused(fields[0].decode(errors="replace") if fields else "refused")
                    if status != _OK:
                        raise ConnectionError(f"unexpected handshake reply (status {status}); is {self.address} "
                                              f"an spmd store?")
                    return sock
                except _Refused as refusal:
                    sock.close()
                    hint = "set SPMD_STORE_TOKEN or pass token=" if not token else "check SPMD_STORE_TOKEN / token="
                    raise StoreError(f"TCPStore: the store server at {self.address} refused this client: "
                                     f"{refusal} ({hint} to the job's token)") from None
                except OSError as error:
                    sock.close()
                    last_error = error
            if deadline.expired():
                raise StoreError(f"TCPStore: could not connect to the store server at {self.address} within "
                                 f"{timeout:.1f}s (last error: {last_error}). Check MASTER_ADDR/MASTER_PORT and that "
                                 f"the master (rank 0 or the launcher) is running.")
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, 0.5)

    def _read_reply(self, sock: socket.socket, max_size: int | None = None) -> tuple[int, list[bytes]]:
        buf = self._buf
        while len(buf) < _HEADER.size:
            self._recv_more(sock, buf)
        size, status = _HEADER.unpack_from(buf)
        if max_size is not None and size > max_size:
            raise ConnectionError(f"a {size}-byte handshake reply; is {self.address} an spmd store?")
        end = _HEADER.size + size
        while len(buf) < end:
            self._recv_more(sock, buf)
        body = bytes(buf[_HEADER.size:end])
        del buf[:end]
        return status, _split_fields(body)

    @staticmethod
    def _recv_more(sock: socket.socket, buf: bytearray) -> None:
        chunk = sock.recv(_RECV_CHUNK)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk

    def call(self, op: int, fields: Sequence[bytes], reply_within: float | None, what: str) -> tuple[int, list[bytes]]:
        """Send one request and return (status, fields); StoreError if the connection fails or stays silent."""
        if os.getpid() != self._pid:
            raise StoreError(f"TCPStore {self.address}: this process was forked from the one that made the store and "
                             f"shares its connection; create a new TCPStore (or clone()) in the child")
        frame = _frame(op, fields)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreError(f"TCPStore {self.address}: {_OP_NAMES[op]}({what}) on a closed store "
                                 f"{'(close() was called)' if self._closed else '(its connection was lost earlier)'}")
            try:
                if reply_within != self._sock_timeout:
                    sock.settimeout(reply_within)
                    self._sock_timeout = reply_within
                sock.sendall(frame)
                return self._read_reply(sock)
            except TimeoutError:
                self._break()
                raise StoreError(f"TCPStore {self.address}: no reply to {_OP_NAMES[op]}({what}) within "
                                 f"{reply_within:.1f}s; the store server is not responding") from None
            except (OSError, ValueError) as error:
                self._break()
                if self._closed:
                    raise StoreError(f"TCPStore {self.address}: {_OP_NAMES[op]}({what}) interrupted because "
                                     f"close() was called") from None
                raise StoreError(f"TCPStore: lost the connection to the store server at {self.address} during "
                                 f"{_OP_NAMES[op]}({what}): {error}. The server's process (the master rank or the "
                                 f"launcher agent) has probably exited.") from None
            except BaseException:
                self._break()   # interrupted (KeyboardInterrupt) between request and reply: the stream is unusable
                raise

    def _break(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection; a call blocked in another thread fails at once."""
        self._closed = True
        if os.getpid() != self._pid:   # a forked child: drop its copy of the parent's socket, leave the parent's be
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


def _shutdown(client: _Client, server: _StoreServer | None) -> None:
    client.close()
    if server is not None:
        server.stop()


class TCPStore(Store):
    """A store served over TCP: the master runs the server in a daemon thread, every instance is a client.

    `port=0` on the master lets the OS pick a free port (read it back from `.port`). With `wait_for_workers`
    the master's constructor returns only when `world_size` clients (itself included) have joined. A token
    (argument, else env SPMD_STORE_TOKEN) makes the server refuse clients that do not present it. Like
    torch's, a fresh store holds one key, the join counter, so `num_keys()` starts at 1.
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
        server = _StoreServer(port, self._token) if is_master else None
        self._server = server
        self.port = server.port if server is not None else port
        try:
            # The master reaches its own server on loopback: it listens on every interface.
            self._client = _Client("127.0.0.1" if is_master else host_name, self.port, self._token, self.timeout)
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
            _WAIT_COUNT, [_JOIN_KEY.encode(), str(world_size).encode(), _seconds_field(timeout)],
            self._reply_within(timeout), "world_size")
        if status == _TIMEOUT:
            joined = int(fields[0]) if fields else 0
            raise StoreError(f"TCPStore master {self.host}:{self.port}: only {joined} of {world_size} clients "
                             f"joined within {timeout:.1f}s; the other ranks did not start or cannot reach "
                             f"this address")
        self._check(status, fields, "wait_for_workers", "")

    def __repr__(self) -> str:
        role = "master" if self.is_master else "client"
        return f"TCPStore({self.host}:{self.port}, {role}, world_size={self.world_size})"

    def clone(self) -> TCPStore:
        """A new client connection to the same server (for another thread); its close() leaves the server up."""
        clone = TCPStore.__new__(TCPStore)
        Store.__init__(clone, self.timeout)
        clone.host, clone.port, clone.world_size, clone.is_master = self.host, self.port, self.world_size, False
        clone._token = self._token
        clone._owner = self._owner or self
        clone._server = None
        clone._client = _Client("127.0.0.1" if self.is_master else self.host, self.port, self._token, self.timeout)
        clone._finalizer = weakref.finalize(clone, _shutdown, clone._client, None)
        return clone

    def close(self) -> None:
        """Close this client's connection; the master's close also stops the server (other clients then fail)."""
        self._finalizer()

    # The Store API.

    def _reply_within(self, timeout: float) -> float | None:
        total = timeout + _REPLY_GRACE_S
        return None if total == float("inf") else total

    def _request(self, op: int, fields: Sequence[bytes], what: str, blocking_for: float | None = None) -> list[bytes]:
        limit = self._reply_within(self.timeout if blocking_for is None else max(blocking_for, 0.0))
        status, reply = self._client.call(op, fields, limit, what)
        if status == _TIMEOUT:
            waited = self.timeout if blocking_for is None else blocking_for
            raise missing_keys_error(f"TCPStore {self.host}:{self.port}", [key.decode() for key in reply], waited)
        self._check(status, reply, _OP_NAMES[op], what)
        return reply

    def _check(self, status: int, fields: list[bytes], op: str, what: str) -> None:
        if status == _OK:
            return
        message = fields[0].decode(errors="replace") if fields else f"status {status}"
        if status == _BAD_VALUE:
            raise ValueError(f"TCPStore {self.host}:{self.port}: {op}({what}): {message}")
        raise StoreError(f"TCPStore {self.host}:{self.port}: {op}({what}) failed: {message}")

    def set(self, key: str, value: Value) -> None:
        self._request(_SET, [key.encode(), to_bytes(value)], key)

    def get(self, key: str) -> bytes:
        timeout = self.timeout
        return self._request(_GET, [key.encode(), _seconds_field(timeout)], key, timeout)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._request(_ADD, [key.encode(), str(int(amount)).encode()], key)[0])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._request(_CAS, [key.encode(), to_bytes(expected), to_bytes(desired)], key)[0]

    def wait(self, keys: list[str], timeout: float | datetime.timedelta | None = None) -> None:
        seconds = as_seconds(timeout, self.timeout)
        self._request(_WAIT, [_seconds_field(seconds), *(key.encode() for key in keys)], ", ".join(keys), seconds)

    def check(self, keys: list[str]) -> bool:
        return self._request(_CHECK, [key.encode() for key in keys], ", ".join(keys))[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._request(_DELETE, [key.encode()], key)[0] == b"1"

    def num_keys(self) -> int:
        return int(self._request(_NUM_KEYS, [], "")[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        timeout = self.timeout
        return self._request(_MULTI_GET, [_seconds_field(timeout), *(key.encode() for key in keys)],
                             ", ".join(keys), timeout)

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"TCPStore.multi_set: {len(keys)} keys but {len(values)} values")
        fields: list[bytes] = []
        for key, value in zip(keys, values):
            fields += (key.encode(), to_bytes(value))
        self._request(_MULTI_SET, fields, ", ".join(keys))
