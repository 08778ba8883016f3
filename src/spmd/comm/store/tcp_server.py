"""The TCPStore server: one daemon thread of the master process serving every client.

Layer: comm. A selectors loop serves every connection (wire format: tcp_wire). A blocking `get`/`wait`
is parked on the server and answered when its keys are set or its deadline passes, so a waiting client costs
nothing and never delays the others.
"""

from __future__ import annotations

import collections
import errno
import heapq
import hmac
import itertools
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence

from spmd._core.errors import StoreError
from spmd._core.log import get_logger
from spmd.comm.store import tcp_wire as wire

_log = get_logger(__name__)
_HELLO_TIMEOUT_S = 30.0   # a connection that has not said HELLO by then is dropped (a stranger holding a socket)


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


class StoreServer:
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
        self._handlers = {
            wire.HELLO: self._hello, wire.SET: self._set, wire.GET: self._get, wire.ADD: self._add,
            wire.CAS: self._cas, wire.WAIT: self._wait, wire.CHECK: self._check, wire.DELETE: self._delete,
            wire.NUM_KEYS: self._num_keys, wire.MULTI_GET: self._multi_get, wire.MULTI_SET: self._multi_set,
            wire.WAIT_COUNT: self._wait_count}
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
            data = conn.sock.recv(wire.RECV_CHUNK)
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
        while conn.waiter is None and not conn.closing and len(buf) >= wire.HEADER.size:
            size, op = wire.HEADER.unpack_from(buf)
            if not conn.authed and (op != wire.HELLO or size > wire.MAX_HELLO):
                self._drop(conn)   # a stranger: read nothing more from it
                return
            end = wire.HEADER.size + size
            if len(buf) < end:
                return
            body = bytes(buf[wire.HEADER.size:end])
            del buf[:end]
            handler = self._handlers.get(op)
            try:
                if handler is None:
                    raise ValueError(f"unknown opcode {op}")
                handler(conn, wire.split_fields(body))
            except (ValueError, IndexError) as error:
                if not conn.authed:
                    self._drop(conn)
                    return
                self._reply(conn, wire.ERROR, [f"malformed request: {error}".encode()])
            except Exception as error:   # a server bug must fail one request, not every client's store
                _log.exception("TCPStore server on port %d: request %d failed", self.port, op)
                self._reply(conn, wire.ERROR, [f"server error: {error!r}".encode()])
            if conn not in self._conns:
                return

    def _reply(self, conn: _Conn, status: int, fields: Sequence[bytes] = ()) -> None:
        data = wire.frame(status, fields)
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
        if op != wire.WAIT_COUNT and all(key in data for key in keys):   # the common case: answer at once
            self._reply(conn, wire.OK, [data[key] for key in keys] if op != wire.WAIT else ())
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
        if waiter.op == wire.WAIT_COUNT:
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
        if waiter.op in (wire.GET, wire.MULTI_GET):
            self._reply(waiter.conn, wire.OK, [self._data[key] for key in waiter.keys])
        else:
            self._reply(waiter.conn, wire.OK)
        if parked:
            self._resume.append(waiter.conn)

    def _time_out(self, waiter: _Waiter) -> None:
        parked = waiter.conn.waiter is waiter
        self._unpark(waiter)
        if waiter.op == wire.WAIT_COUNT:
            count = self._data.get(waiter.keys[0], b"0")
            self._reply(waiter.conn, wire.TIMEOUT, [count])
        else:
            self._reply(waiter.conn, wire.TIMEOUT, [key for key in waiter.keys if key not in self._data])
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
            if waiter.op != wire.WAIT_COUNT:
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
        if magic != wire.MAGIC:
            self._drop(conn)
            return
        if self._token is not None and not hmac.compare_digest(token, self._token):
            conn.closing = True
            self._reply(conn, wire.REFUSED, [b"wrong token" if token else b"no token presented"])
            if not conn.outbuf:
                self._drop(conn)
            return
        conn.authed = True
        self._reply(conn, wire.OK)

    def _set(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = fields
        self._data[key] = value
        self._reply(conn, wire.OK)
        self._changed(key)

    def _get(self, conn: _Conn, fields: list[bytes]) -> None:
        key, timeout = fields
        self._park(conn, wire.GET, [key], float(timeout))

    def _add(self, conn: _Conn, fields: list[bytes]) -> None:
        key, amount = fields
        current = self._data.get(key, b"0")
        try:
            value = int(current) + int(amount)
        except ValueError:
            self._reply(conn, wire.BAD_VALUE, [b"the value %r of key %r is not an integer" % (current[:64], key)])
            return
        self._data[key] = str(value).encode()
        self._reply(conn, wire.OK, [self._data[key]])
        self._changed(key)

    def _cas(self, conn: _Conn, fields: list[bytes]) -> None:
        key, expected, desired = fields
        current = self._data.get(key)
        if current is None and expected:
            self._reply(conn, wire.OK, [expected])   # torch's quirk: absent key, non-empty expected -> expected
            return
        if current is None or current == expected:
            self._data[key] = desired
            self._reply(conn, wire.OK, [desired])
            self._changed(key)
            return
        self._reply(conn, wire.OK, [current])

    def _wait(self, conn: _Conn, fields: list[bytes]) -> None:
        self._park(conn, wire.WAIT, fields[1:], float(fields[0]))

    def _check(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, wire.OK, [b"1" if all(key in self._data for key in fields) else b"0"])

    def _delete(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = fields
        self._reply(conn, wire.OK, [b"1" if self._data.pop(key, None) is not None else b"0"])

    def _num_keys(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, wire.OK, [str(len(self._data)).encode()])

    def _multi_get(self, conn: _Conn, fields: list[bytes]) -> None:
        self._park(conn, wire.MULTI_GET, fields[1:], float(fields[0]))

    def _multi_set(self, conn: _Conn, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ValueError("multi_set needs key/value pairs")
        pairs = list(zip(fields[::2], fields[1::2]))
        self._data.update(pairs)
        self._reply(conn, wire.OK)
        for key, _ in pairs:
            self._changed(key)

    def _wait_count(self, conn: _Conn, fields: list[bytes]) -> None:
        key, target, timeout = fields
        self._park(conn, wire.WAIT_COUNT, [key], float(timeout), int(target))
