"""The TCPStore server: one daemon thread of the master process serving every client.

Layer: comm. A selectors loop serves every connection (wire format and limits: tcp_wire). A blocking
`get`/`wait` is parked on the server and answered when its keys are set or its deadline passes, so a waiting
client costs nothing and never delays the others. Strangers are kept cheap: a connection is read in small
pieces until it completes the challenge-response handshake, at most MAX_UNAUTHENTICATED of them are kept
(the oldest goes first), at most _ADMITTED_PER_WINDOW unauthenticated connections are accepted per window
(each one that authenticates gives its place back), and running out of file descriptors pauses accepting
instead of spinning. Each listening socket keeps these counts for itself, so a flood on the TCP port, which
anyone may reach, cannot starve the token-named local socket that this machine's ranks connect to.
"""

from __future__ import annotations

import collections
import enum
import errno
import heapq
import hmac
import ipaddress
import itertools
import math
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Sequence

from spmd._core.errors import StoreError
from spmd._core.log import get_logger
from spmd.comm.store import tcp_wire as wire

_log = get_logger(__name__)
_HELLO_TIMEOUT_S = wire.HELLO_TIMEOUT_S   # a connection that has not completed the handshake by then is dropped
_MAX_UNAUTHENTICATED = wire.MAX_UNAUTHENTICATED
_ACCEPT_PAUSE_S = 0.05      # out of file descriptors with no stranger to drop: stop accepting this long
_ACCEPTS_PER_WAKE = 64      # accept at most this many per readiness event, so a flood cannot starve the rest
_ADMIT_WINDOW_S = 0.02      # connections accepted and not yet authenticated are counted per window; at
_ADMITTED_PER_WINDOW = 8    # this many in one, accepting pauses until it ends (at most 400 strangers a second)
_MAX_SELECT_S = 60.0        # the longest the loop sleeps (a far deadline, 1e300 s, must not overflow select)
_FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_HEADER_SIZE = wire.HEADER.size
_warned_open_listener = False


def listen_addresses(host: str) -> list[str]:
    """The addresses a store server named `host` by the job listens on ("" = every interface).

    Loopback (127.0.0.0/8, ::1, "localhost") stays on loopback: 127.0.0.1 and ::1 serve each other's clients,
    another 127.x address only itself. Another literal IP is listened on alone (every interface if it is not
    an address of this machine, e.g. behind NAT). A host name listens on every interface: other nodes may
    reach it by an address this process cannot know.
    """
    if host == "localhost":
        return ["127.0.0.1", "::1"]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return [""]
    if address.is_unspecified:
        return [""]
    if host in ("127.0.0.1", "::1"):
        return [host, "::1" if host == "127.0.0.1" else "127.0.0.1"]
    return [host]


def _is_loopback(address: str) -> bool:
    return address != "" and ipaddress.ip_address(address).is_loopback


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an address or "localhost") is loopback; False for any other name, which may be anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Pause(enum.Enum):
    """Why the listeners are not being selected on."""

    ADMISSIONS = "the window's admissions are spent (a flood of strangers, or many ranks handshaking at once)"
    DESCRIPTORS = "out of file descriptors"


class _Listener:
    """A listening socket and its admissions: the connections it accepted that have not authenticated, the
    current window's admission count, and whether accepting on it is paused."""

    __slots__ = ("admitted", "paused", "paused_until", "sock", "unauthed", "window")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unauthed: dict[_Conn, float] = {}   # connection -> hello deadline, oldest first
        self.paused: _Pause | None = None        # accepting paused, and why
        self.paused_until = 0.0                   # ... until then
        self.window, self.admitted = 0.0, 0       # the current window's start, its unauthenticated admissions


class _Conn:
    """The server's state for one client connection, accepted on `listener`."""

    __slots__ = ("authed", "client_nonce", "closing", "events", "held", "inbuf", "listener", "outbuf",
                 "server_nonce", "sock", "waiter")

    def __init__(self, sock: socket.socket, listener: _Listener) -> None:
        self.sock = sock
        self.listener = listener
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = False
        self.server_nonce: bytes | None = None   # set once HELLO is answered; AUTH must follow
        self.client_nonce = b""
        self.closing = False          # a refusal is being flushed; read nothing more
        self.held = False             # over MAX_BUFFERED_REPLY: read nothing until the client reads its replies
        self.events = selectors.EVENT_READ
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
    """The key/value server: one thread, one selector, every client; parked waiters are woken by writes.

    It listens where `listen_addresses(host)` says; `local_host` is the address a client in this process
    connects to. Listening beyond loopback without a token logs one warning per process.
    """

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self._token = None if token is None else token.encode()
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, collections.deque[bytes]] = {}   # only queues that hold a value
        self._watchers: dict[bytes, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._conns: set[_Conn] = set()
        self._resume: list[_Conn] = []
        self._warned_fds = False
        self.admission_pauses = 0    # how often spent admissions paused accepting
        self._stopping = False
        self._pid = os.getpid()
        sockets, self.local_host = self._bind(host, port)
        self._listeners = [_Listener(sock) for sock in sockets]
        self.port: int = sockets[0].getsockname()[1]
        self.addresses = [sock.getsockname()[0] for sock in sockets]
        if sys.platform == "linux" and self._token is not None and any(
                _is_loopback(address) or ipaddress.ip_address(address).is_unspecified for address in self.addresses):
            self._listen_local(wire.local_name(self.port, self._token))   # reachable on loopback: faster there
        self._scratch = memoryview(bytearray(wire.RECV_CHUNK))   # every recv lands here: no allocation per read
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        for listener in self._listeners:
            self._selector.register(listener.sock, selectors.EVENT_READ, listener)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._handshake = {wire.HELLO: self._hello, wire.AUTH: self._auth}
        self._handlers = {
            wire.SET: self._set, wire.GET: self._get, wire.ADD: self._add,
            wire.CAS: self._cas, wire.WAIT: self._wait, wire.CHECK: self._check, wire.DELETE: self._delete,
            wire.NUM_KEYS: self._num_keys, wire.MULTI_GET: self._multi_get, wire.MULTI_SET: self._multi_set,
            wire.WAIT_COUNT: self._wait_count, wire.APPEND: self._append, wire.LIST_KEYS: self._list_keys,
            wire.QUEUE_PUSH: self._queue_push, wire.QUEUE_POP: self._queue_pop, wire.QUEUE_LEN: self._queue_len}
        if self._token is None and not all(_is_loopback(address) for address in self.addresses):
            _warn_open_listener(host, self.port)
        self._thread = threading.Thread(target=self._serve, name=f"spmd-tcpstore-server:{self.port}", daemon=True)
        self._thread.start()

    @classmethod
    def _bind(cls, host: str, port: int) -> tuple[list[socket.socket], str]:
        """The listening sockets for `host` (see listen_addresses) and the address to reach them from here."""
        addresses = listen_addresses(host)
        listeners: list[socket.socket] = []
        bound: list[str] = []
        for address in addresses:
            try:
                listeners.append(cls._listen(address, listeners[0].getsockname()[1] if listeners else port))
                bound.append(address)
            except (OSError, StoreError) as error:
                if listeners:   # the other loopback family: best effort
                    _log.debug("TCPStore: not listening on [%s] too: %s", address, error)
                    continue
                if isinstance(error, StoreError):
                    raise
                if error.errno != errno.EADDRNOTAVAIL:
                    raise StoreError(f"TCPStore: could not listen on {host}:{port}: {error}") from error
                if _is_loopback(address):
                    continue    # e.g. ::1 on a host without IPv6: the next loopback address
                _log.info("TCPStore: %s is not an address of this machine; listening on every interface", host)
                listeners.append(cls._listen("", port))
                bound.append("")
        if not listeners:
            raise StoreError(f"TCPStore: could not listen on {host}:{port}: no loopback address is usable")
        return listeners, bound[0] or "127.0.0.1"

    @staticmethod
    def _listen(address: str, port: int) -> socket.socket:
        """A non-blocking listener on `address` ("" = every interface, IPv4 and IPv6 where the host has both)."""
        if address:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            candidates = [(family, False)]
        elif socket.has_dualstack_ipv6():
            candidates = [(socket.AF_INET6, True), (socket.AF_INET, False)]
        else:
            candidates = [(socket.AF_INET, False)]
        shown = f"[{address}]" if ":" in address else address or "0.0.0.0"
        failure: OSError | None = None
        for family, dualstack in candidates:
            try:
                listener = socket.create_server((address, port), family=family, backlog=4096,
                                                dualstack_ipv6=dualstack)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise StoreError(f"TCPStore: port {port} on {shown} is already in use; pick another MASTER_PORT "
                                     f"or use port 0 (the OS picks a free one)") from None
                failure = error   # e.g. IPv6 present but unusable here: try IPv4 only
                continue
            listener.setblocking(False)
            return listener
        assert failure is not None
        raise failure

    def _listen_local(self, name: str) -> None:
        """Also accept on the abstract Unix socket `name`, for clients on this machine (see tcp_wire)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(name)
            listener.listen(4096)
        except OSError as error:   # this machine's clients then use TCP
            listener.close()
            _log.debug("TCPStore: no local socket for port %d: %s", self.port, error)
            return
        listener.setblocking(False)
        self._listeners.append(_Listener(listener))

    def stop(self) -> None:
        """Close every connection and the listening sockets; clients see their connection end."""
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
                    if type(key.data) is _Listener:
                        self._accept(key.data)
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
            for listener in self._listeners:
                listener.sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_deadline_in(self) -> float:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        times = [self._deadlines[0][0]] if self._deadlines else []
        for listener in self._listeners:
            if listener.unauthed:
                times.append(next(iter(listener.unauthed.values())))
            if listener.paused is not None:
                times.append(listener.paused_until)
        return min(_MAX_SELECT_S, max(0.0, min(times) - time.monotonic())) if times else _MAX_SELECT_S

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self, listener: _Listener) -> None:
        for attempt in range(_ACCEPTS_PER_WAKE):
            if listener.paused is not None:
                return     # admissions spent, or a stranger's descriptor could not be had, in this very loop
            try:
                sock, _ = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno not in _FD_EXHAUSTED:
                    continue   # e.g. ECONNABORTED: that one connection is gone, the next may be fine
                if attempt:
                    return     # accept fails so even with nobody queued; the selector says if anyone is
                stranger = next(iter(listener.unauthed), None) or next(
                    (conn for other in self._listeners for conn in other.unauthed), None)
                if stranger is not None:
                    self._drop(stranger)   # a stranger's descriptor for a newcomer (this listener's first)
                    continue
                self._out_of_descriptors(listener)
                return
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(listener.unauthed) >= _MAX_UNAUTHENTICATED:
                self._drop(next(iter(listener.unauthed)))   # the oldest stranger goes; a newcomer may be a rank
            conn = _Conn(sock, listener)
            self._conns.add(conn)
            listener.unauthed[conn] = time.monotonic() + _HELLO_TIMEOUT_S
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._admit(listener)

    def _admit(self, listener: _Listener) -> None:
        """Count one unauthenticated connection against the listener's window of admissions; when they are spent,
        accepting on it pauses until the window ends or one of them authenticates. A flood of strangers then
        costs the server's thread a bounded share whatever the strangers do, and its clients keep their latency;
        ranks that connect at once are slowed only to _ADMITTED_PER_WINDOW handshakes in flight."""
        now = time.monotonic()
        if now - listener.window >= _ADMIT_WINDOW_S:
            listener.window, listener.admitted = now, 0
        listener.admitted += 1
        if listener.admitted >= _ADMITTED_PER_WINDOW and listener.paused is None:
            self.admission_pauses += 1
            self._pause_accepting(listener, _Pause.ADMISSIONS, listener.window + _ADMIT_WINDOW_S)

    def _authenticated(self, listener: _Listener) -> None:
        """A connection accepted on `listener` authenticated: its admission is given back, and accepting resumes
        if it waited for one."""
        listener.admitted = max(0, listener.admitted - 1)
        if listener.paused is _Pause.ADMISSIONS:
            self._resume_accepting(listener)

    def _pause_accepting(self, listener: _Listener, reason: _Pause, until: float) -> None:
        """Stop selecting on `listener` until `until` (the kernel queues its connections meanwhile)."""
        if listener.paused is None:
            self._selector.unregister(listener.sock)
            listener.paused, listener.paused_until = reason, until

    def _out_of_descriptors(self, listener: _Listener) -> None:
        """Out of file descriptors and no stranger to drop: pause accepting on `listener` for a moment."""
        if not self._warned_fds:
            self._warned_fds = True
            _log.warning("TCPStore server on port %d: out of file descriptors; accepts pause until some are free "
                         "(raise `ulimit -n` if clients fail to connect)", self.port)
        self._pause_accepting(listener, _Pause.DESCRIPTORS, time.monotonic() + _ACCEPT_PAUSE_S)

    def _resume_accepting(self, listener: _Listener) -> None:
        listener.paused = None
        self._selector.register(listener.sock, selectors.EVENT_READ, listener)

    def unauthenticated(self) -> int:
        """How many connections have not completed the handshake (on every listener)."""
        return sum(len(listener.unauthed) for listener in self._listeners)

    def _read(self, conn: _Conn) -> None:
        try:
            size = conn.sock.recv_into(self._scratch, wire.RECV_CHUNK if conn.authed else wire.MAX_HELLO)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            size = 0
        if not size:
            self._drop(conn)
            return
        conn.inbuf += self._scratch[:size]
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Run the complete frames buffered on `conn`, in order; stop while one is parked or replies pile up."""
        buf = conn.inbuf
        pos = 0   # the frames before it are run; they leave the buffer in one cut at the end
        try:
            while conn.waiter is None and not conn.closing and len(buf) - pos >= _HEADER_SIZE:
                if len(conn.outbuf) > wire.MAX_BUFFERED_REPLY:
                    conn.held = True    # back-pressure: _flush resumes once the client has read its replies
                    self._update_events(conn)
                    return
                size, op = wire.HEADER.unpack_from(buf, pos)
                if not conn.authed:
                    expected = wire.HELLO if conn.server_nonce is None else wire.AUTH
                    if op != expected or size > wire.MAX_HELLO:
                        self._drop(conn)   # a stranger: read nothing more from it
                        return
                elif size > wire.MAX_FRAME:
                    conn.closing = True   # its body cannot be skipped without reading it: answer, then close
                    self._reply(conn, wire.ERROR, [f"a {size}-byte request is over the store's limit of "
                                                   f"{wire.MAX_FRAME} bytes".encode()])
                    self._update_events(conn)
                    return
                start = pos + _HEADER_SIZE
                end = start + size
                if len(buf) < end:
                    return
                body = bytes(buf[start:end])
                pos = end
                handler = (self._handlers if conn.authed else self._handshake).get(op)
                try:
                    if handler is None:
                        raise ValueError(f"unknown opcode {op}")
                    handler(conn, wire.split_fields(body))
                except (ValueError, IndexError) as error:
                    if not conn.authed:
                        self._drop(conn)
                        return
                    self._fail(conn, op, f"malformed request: {error}")
                except Exception as error:   # a server bug must fail one request, not every client's store
                    _log.exception("TCPStore server on port %d: request %d failed", self.port, op)
                    self._fail(conn, op, f"server error: {error!r}")
                if conn not in self._conns:
                    return
        finally:
            del buf[:pos]

    def _fail(self, conn: _Conn, op: int, message: str) -> None:
        """Answer a request that failed; an UNANSWERED one says which request it was, for its client reads it
        ahead of a later request's reply."""
        if op in wire.UNANSWERED:
            self._reply(conn, wire.QUIET_FAILED, [f"{wire.OP_NAMES[op]} failed: {message}".encode()])
        else:
            self._reply(conn, wire.ERROR, [message.encode()])

    def _reply(self, conn: _Conn, status: int, fields: Sequence[bytes] = ()) -> None:
        try:
            data = wire.frame(status, fields)
        except wire.FrameTooLarge as error:
            data = wire.frame(wire.ERROR, [f"the reply would be {error.size} bytes, over the store's limit of "
                                           f"{wire.MAX_FRAME}; ask for fewer keys at once".encode()])
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
            conn.outbuf += memoryview(data)[sent:]
            self._update_events(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        del conn.outbuf[:sent]
        if conn.closing and not conn.outbuf:
            self._drop(conn)
            return
        if conn.held and len(conn.outbuf) <= wire.MAX_BUFFERED_REPLY:
            conn.held = False
            self._resume.append(conn)   # run the requests it had already sent
        self._update_events(conn)

    def _update_events(self, conn: _Conn) -> None:
        """Select on what `conn` needs now: reads unless held or closing, writes while replies are queued."""
        events = 0 if conn.held or conn.closing else selectors.EVENT_READ
        if conn.outbuf:
            events |= selectors.EVENT_WRITE
        if not events:
            self._drop(conn)   # closing, and its last reply is sent
        elif events != conn.events and conn in self._conns:
            conn.events = events
            self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        conn.listener.unauthed.pop(conn, None)
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
        if op in (wire.GET, wire.MULTI_GET) and all(key in data for key in keys):   # the common case: answer now
            self._reply(conn, wire.OK, [data[key] for key in keys])
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
        at = time.monotonic() + timeout
        if math.isinf(at):
            return   # waits forever: no deadline to keep
        if len(self._deadlines) > 64 and len(self._deadlines) > 4 * len(self._conns):
            # Answered waiters leave their entries behind until they reach the top; drop them in one pass.
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (at, next(self._seq), waiter))

    def _ready(self, waiter: _Waiter) -> bool:
        """Whether `waiter` can be answered now; sets `waiter.missing` to the keys it must still watch."""
        if waiter.op == wire.WAIT_COUNT:
            waiter.missing = {waiter.keys[0]}
            value = self._data.get(waiter.keys[0], b"")
            return value.lstrip(b"-").isdigit() and int(value) >= waiter.target
        if waiter.op == wire.WAIT:   # a wait sees queues holding a value too
            waiter.missing = {key for key in waiter.keys if key not in self._data and key not in self._queues}
        elif waiter.op == wire.QUEUE_POP:
            waiter.missing = {key for key in waiter.keys if key not in self._queues}
        else:
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
        elif waiter.op == wire.QUEUE_POP:
            self._reply(waiter.conn, wire.OK, [self._pop(waiter.keys[0])])
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
            self._ready(waiter)
            self._reply(waiter.conn, wire.TIMEOUT, [key for key in waiter.keys if key in waiter.missing])
        if parked:
            self._resume.append(waiter.conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for listener in self._listeners:
            while listener.unauthed:
                conn, deadline = next(iter(listener.unauthed.items()))
                if deadline > now:
                    break
                self._drop(conn)
            if listener.paused is not None and listener.paused_until <= now:
                self._resume_accepting(listener)
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
        popping = 0   # values of this queue promised to the poppers finished below
        for waiter in list(watching):
            if waiter.op != wire.WAIT_COUNT:
                waiter.missing.discard(key)
                watching.discard(waiter)
                if waiter.missing:
                    continue
            if waiter.op == wire.QUEUE_POP and len(self._queues.get(key, ())) > popping:   # one value each
                popping += 1
                finished.append(waiter)
            elif waiter.op != wire.QUEUE_POP and self._ready(waiter):   # re-checks every key: one may have
                finished.append(waiter)                                   # been deleted since it was seen
            else:
                if waiter.op == wire.QUEUE_POP:
                    waiter.missing = {key}
                self._watch(waiter)
        if not watching and self._watchers.get(key) is watching:
            del self._watchers[key]
        for waiter in finished:       # answered last, so a client that sees its answer sees the tidy state
            self._finish(waiter)

    # Handlers: one per opcode; `fields` are the request's fields. Each answers its request, except those in
    # wire.UNANSWERED, which are answered only when they fail.

    def _hello(self, conn: _Conn, fields: list[bytes]) -> None:
        magic = fields[0]
        if magic != wire.MAGIC:
            if magic.startswith(b"spmd-store/"):
                self._refuse(conn, b"wire version %s, but this server speaks %s: run the same spmd version on "
                                   b"every node" % (magic[:32], wire.MAGIC))
            else:
                self._drop(conn)
            return
        _, client_nonce, has_token = fields
        if not wire.NONCE_BYTES <= len(client_nonce) <= 64 or has_token not in (b"0", b"1"):
            raise ValueError("malformed hello")
        if has_token == b"0" and self._token is not None:
            self._refuse(conn, b"no token presented")
            return
        if has_token == b"1" and self._token is None:
            self._refuse(conn, b"this server has no token but the client presented one")
            return
        conn.client_nonce = client_nonce
        conn.server_nonce = secrets.token_bytes(wire.NONCE_BYTES)
        self._reply(conn, wire.OK, [conn.server_nonce])

    def _auth(self, conn: _Conn, fields: list[bytes]) -> None:
        (client_proof,) = fields
        token, nonces = self._token or b"", (conn.server_nonce or b"", conn.client_nonce)
        if not hmac.compare_digest(client_proof, wire.proof(token, wire.CLIENT_SIDE, *nonces)):
            self._refuse(conn, b"wrong token")
            return
        conn.authed = True
        del conn.listener.unauthed[conn]
        self._authenticated(conn.listener)
        self._reply(conn, wire.OK, [wire.proof(token, wire.SERVER_SIDE, *nonces)])

    def _refuse(self, conn: _Conn, reason: bytes) -> None:
        """Tell a client why it may not join, then close its connection once the reason is sent."""
        conn.closing = True
        self._reply(conn, wire.REFUSED, [reason])
        self._update_events(conn)

    def _set(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = fields
        self._data[key] = value
        self._changed(key)

    def _get(self, conn: _Conn, fields: list[bytes]) -> None:
        key, timeout = fields
        seconds = wire.parse_seconds(timeout)
        value = self._data.get(key)
        if value is not None:   # the common case, answered without parking
            self._reply(conn, wire.OK, (value,))
            return
        self._park(conn, wire.GET, [key], seconds)

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
        self._park(conn, wire.WAIT, fields[1:], wire.parse_seconds(fields[0]))

    def _check(self, conn: _Conn, fields: list[bytes]) -> None:
        present = all(key in self._data or key in self._queues for key in fields)
        self._reply(conn, wire.OK, [b"1" if present else b"0"])

    def _delete(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = fields
        self._reply(conn, wire.OK, [b"1" if self._data.pop(key, None) is not None else b"0"])

    def _num_keys(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, wire.OK, [str(len(self._data)).encode()])

    def _multi_get(self, conn: _Conn, fields: list[bytes]) -> None:
        self._park(conn, wire.MULTI_GET, fields[1:], wire.parse_seconds(fields[0]))

    def _multi_set(self, conn: _Conn, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ValueError("multi_set needs key/value pairs")
        pairs = list(zip(fields[::2], fields[1::2]))
        self._data.update(pairs)
        for key, _ in pairs:
            self._changed(key)

    def _wait_count(self, conn: _Conn, fields: list[bytes]) -> None:
        key, target, timeout = fields
        self._park(conn, wire.WAIT_COUNT, [key], wire.parse_seconds(timeout), int(target))

    def _append(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = fields
        self._data[key] = self._data.get(key, b"") + value
        self._changed(key)

    def _list_keys(self, conn: _Conn, fields: list[bytes]) -> None:
        self._reply(conn, wire.OK, list(self._data))

    def _queue_push(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = fields
        self._queues.setdefault(key, collections.deque()).append(value)
        self._changed(key)

    def _pop(self, key: bytes) -> bytes:
        queue = self._queues[key]
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        return value

    def _queue_pop(self, conn: _Conn, fields: list[bytes]) -> None:
        key, block, timeout = fields
        if key in self._queues:
            self._reply(conn, wire.OK, [self._pop(key)])
        elif block == b"0":
            self._reply(conn, wire.EMPTY)
        else:
            self._park(conn, wire.QUEUE_POP, [key], wire.parse_seconds(timeout))

    def _queue_len(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = fields
        self._reply(conn, wire.OK, [str(len(self._queues.get(key, ()))).encode()])


def _warn_open_listener(host: str, port: int) -> None:
    """Say once per process that a tokenless store is reachable from other machines."""
    global _warned_open_listener
    if _warned_open_listener:
        return
    _warned_open_listener = True
    _log.warning(
        "TCPStore server for %r listens on port %d beyond loopback WITHOUT A TOKEN: anyone who can reach this "
        "port can join the job and read or overwrite its keys. Set SPMD_STORE_TOKEN to the same secret on every "
        "node (spmdrun: --rdzv-token), or use a loopback MASTER_ADDR for a single-host job.", host, port)
