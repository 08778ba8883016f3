"""The tcp transport: a full mesh of authenticated sockets between a group's ranks (works across hosts).

Layer: comm. Collectives come from `algorithms` (ring with pipelined pieces for large messages, direct or
recursive-doubling exchanges for small ones); this module moves their bytes. See `wire` for the frames.

Note: threads of the tcp transport
- One reader thread per peer owns the receiving side of that peer's socket. It reads every frame as it
  arrives, so sends never deadlock (full duplex) and a dead peer is noticed even while this rank is busy
  elsewhere. A collective piece or P2P message whose receive is already posted goes straight into the
  destination tensor's memory; an early one is kept until its receive is posted (see Note: the Exchange
  protocol in `algorithms`).
- The thread running a collective (the group's executor, or the caller inline) sends its pieces itself and
  waits for its posted receives; sends to one peer are serialized by that peer's send lock.
- A P2P isend of a small tensor is sent by the caller; larger ones go to a per-peer sender thread (started
  on first use) so isend returns at once. Both keep the order of sends to a peer.
- During set-up, an accept thread takes connections from higher ranks; each is authenticated in its own
  short-lived thread, so a silent stranger can't hold up the group.

Note: failure
Every collective piece carries its fingerprint; the reader compares it with the receiver's own before a
byte of payload is written anywhere. A mismatch, a lost connection, or an abort of the group on this rank
fails every operation in flight here and sends an ABORT frame with the reason to every peer, which fail
the same way and pass it on, so all ranks raise (a mismatch as CollectiveMismatchError everywhere, naming
both call sites) and a rank's EOF never reaches a peer before the reason it closed.
A peer that left normally (BYE, then EOF) only fails operations that still need it.
"""

from __future__ import annotations

import collections
import json
import socket
import struct
import threading
import time

import torch
from torch import Tensor

from spmd._core import env
from spmd._core.deadline import Deadline
from spmd._core.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupAbortedError,
    PeerLostError,
    SpmdError,
    StoreTimeoutError,
)
from spmd.comm.debug import Fingerprint, mismatch_message
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.transports.base import OpContext, Transport, TransportSpec
from spmd.comm.transports.tcp import algorithms, wire
from spmd.comm.transports.tcp.wire import Kind
from spmd.comm.work import Work

_SOCKET_BUFFER = 4 << 20          # bytes; large buffers keep a ring step's pieces in flight
_SEND_POLL_S = 0.5                # a blocked send wakes this often to check for failure and its deadline
_HANDSHAKE_S = 10.0               # at most this long for one connection's hello/ack
_INLINE_P2P_BYTES = 256 << 10     # isends up to this size are sent by the caller
_SCRATCH_CACHE_BYTES = 256 << 20  # scratch up to this size is kept for the next collective: allocating (and
                                  # faulting in) a fresh 128 MiB temp costs a 256 MiB all_reduce ~30% of its time
_ERROR_TYPES: dict[str, type[SpmdError]] = {
    cls.__name__: cls for cls in (CollectiveMismatchError, PeerLostError, CommTimeoutError, GroupAbortedError)}


class _Slot:
    """A posted receive of a collective piece: where its payload goes."""

    __slots__ = ("done", "element_size", "nbytes", "peer", "view")

    def __init__(self, peer: int, tensor: Tensor) -> None:
        self.peer = peer
        self.view = wire.byte_view(tensor)
        self.nbytes = len(self.view)
        self.element_size = tensor.element_size()
        self.done = False


class _P2PRecv:
    """A posted irecv."""

    __slots__ = ("dtype", "view", "work")

    def __init__(self, tensor: Tensor, work: Work) -> None:
        self.view = wire.byte_view(tensor)
        self.dtype = str(tensor.dtype)
        self.work = work


class _Peer:
    """The connection to one peer group rank. Mutable fields are guarded by the transport's lock."""

    def __init__(self, group_rank: int, global_rank: int, sock: socket.socket, lock: threading.Lock) -> None:
        self.group_rank = group_rank
        self.global_rank = global_rank
        self.sock = sock
        self.send_lock = threading.Lock()
        self.coll_posted: collections.deque[_Slot] = collections.deque()
        self.coll_early: collections.deque[tuple[int, bytes, bytes, bytearray]] = collections.deque()
        self.send_queue: collections.deque[tuple[bytes, memoryview, Work, Tensor]] = collections.deque()
        self.send_ready = threading.Condition(lock)
        self.sending = False
        self.left = False                   # it said BYE: it closed the group normally
        self.reader: threading.Thread | None = None
        self.sender: threading.Thread | None = None


class _TcpExchange(algorithms.Exchange):
    """One collective's view of the transport (see Note: the Exchange protocol in `algorithms`)."""

    def __init__(self, transport: TcpTransport, ctx: OpContext) -> None:
        fp = ctx.fingerprint
        self.transport = transport
        self.group_rank = transport.group_rank
        self.group_size = transport.group_size
        self.ctx = ctx
        self.seq = fp.seq
        self.key = json.dumps(fp.key()).encode()
        self.meta = self.key + fp.call_site.encode()
        self.scratch_used = False

    def post(self, recvs: list[tuple[int, Tensor]]) -> list[_Slot]:
        return self.transport._post(self, recvs)

    def send(self, peer: int, tensor: Tensor) -> None:
        self.transport._send_piece(self, peer, tensor)

    def wait(self, handle: _Slot) -> None:
        if not handle.done:
            self.transport._wait(self, handle)

    def scratch(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.transport._scratch(self, numel, dtype)


class TcpTransport(Transport):
    """Sockets between the group's ranks; see the module docstring."""

    name = "tcp"
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._desc = f"group '{spec.group_name}' (ranks {list(spec.global_ranks)})"
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)      # collective waiters, set-up progress
        self._peers: list[_Peer | None] = [None] * self.group_size
        self._p2p_posted: list[dict[int, collections.deque[_P2PRecv]]] = [{} for _ in range(self.group_size)]
        self._p2p_early: list[dict[int, collections.deque[tuple[str, bytearray]]]] = [
            {} for _ in range(self.group_size)]
        self._current: _TcpExchange | None = None
        self._error: SpmdError | None = None
        self._abort_sent = False
        self._abort_sending = threading.Lock()           # held while ABORT frames go out; close() waits for it
        self._closing = False
        self._scratch_buffer = torch.empty(0, dtype=torch.uint8)
        self._listener: socket.socket | None = None
        self._setup_threads: list[threading.Thread] = []
        self._handshaking: set[socket.socket] = set()
        try:
            self._connect(Deadline(spec.timeout))
        except BaseException:
            self.close()
            raise

    # -- connection set-up ------------------------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        """Collective over the group: listen, publish host:port, connect to lower ranks, accept higher ones."""
        r = self.group_rank
        one_host = len(set(self.spec.hosts)) == 1
        if one_host:
            bind_host, public_host = "127.0.0.1", "127.0.0.1"
        else:
            bind_host, public_host = "0.0.0.0", env.socket_address() or _public_host(self.spec.hosts, r)
        try:
            self._listener = socket.create_server((bind_host, 0), backlog=max(16, 2 * self.group_size))
        except OSError as error:
            raise CommError(f"tcp transport of {self._desc}, rank {self.spec.global_rank}: can't listen on "
                            f"{bind_host} ({error})") from None
        port = self._listener.getsockname()[1]
        self.spec.store.set(f"tcp/addr/{r}", f"{public_host}:{port}")
        if r < self.group_size - 1:
            self._start_thread(self._accept_loop, f"spmd-tcp-accept-{self.spec.group_name}-r{r}", deadline)
        for peer in range(r):
            self._connect_to(peer, deadline)
        with self._cond:
            while not all(p is not None for i, p in enumerate(self._peers) if i != r):
                if deadline.expired():
                    missing = [self.spec.global_ranks[i] for i, p in enumerate(self._peers) if p is None and i != r]
                    raise CommTimeoutError(
                        f"tcp transport of {self._desc}, rank {self.spec.global_rank}: ranks {missing} did not "
                        f"connect within {deadline.timeout:.1f}s (they never created this group, or can't "
                        f"reach {public_host}:{port})")
                self._cond.wait(deadline.remaining())
        self._close_listener()

    def _connect_to(self, peer: int, deadline: Deadline) -> None:
        global_rank = self.spec.global_ranks[peer]
        key = f"tcp/addr/{peer}"
        try:
            self.spec.store.wait([key], timeout=deadline.remaining())
        except StoreTimeoutError:
            raise CommTimeoutError(
                f"tcp transport of {self._desc}, rank {self.spec.global_rank}: rank {global_rank} did not "
                f"publish its address within {deadline.timeout:.1f}s (it never created this group)") from None
        host, port = self.spec.store.get(key).decode().rsplit(":", 1)
        hello = wire.hello_frame(self.spec.token, self.group_rank, self.spec.group_name)
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=max(0.01, deadline.remaining()))
                break
            except OSError as error:
                if deadline.expired():
                    raise CommTimeoutError(
                        f"tcp transport of {self._desc}, rank {self.spec.global_rank}: can't connect to rank "
                        f"{global_rank} at {host}:{port} within {deadline.timeout:.1f}s ({error})") from None
                time.sleep(0.05)
        try:
            sock.settimeout(max(0.01, min(deadline.remaining(), _HANDSHAKE_S)))
            sock.sendall(hello)
            ack = wire.recv_bytes(sock, wire.ACK_LEN)
        except (OSError, wire.PeerClosed) as error:
            sock.close()
            raise PeerLostError(f"tcp transport of {self._desc}, rank {self.spec.global_rank}: handshake with "
                                f"rank {global_rank} at {host}:{port} failed ({error})") from None
        if not wire.check_ack(ack, self.spec.token, hello):
            sock.close()
            raise CommError(f"tcp transport of {self._desc}, rank {self.spec.global_rank}: the process at "
                            f"{host}:{port} is not rank {global_rank} of this group (wrong token in its answer)")
        self._register(peer, sock)

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
        with self._lock:
            if self._closing:
                conn.close()
                return
            self._handshaking.add(conn)
        try:
            conn.settimeout(max(0.01, min(deadline.remaining(), _HANDSHAKE_S)))
            hello = wire.read_hello(conn, self.spec.token, self.spec.group_name)
            if hello is not None:
                peer, raw = hello
                with self._lock:
                    valid = self.group_rank < peer < self.group_size and self._peers[peer] is None
                if valid:
                    conn.sendall(wire.ack_frame(self.spec.token, raw))
                    self._register(peer, conn)
                    return
        except (OSError, wire.PeerClosed, ValueError):
            pass
        with self._lock:
            self._handshaking.discard(conn)
        conn.close()

    def _register(self, peer: int, sock: socket.socket) -> None:
        _tune(sock)
        link = _Peer(peer, self.spec.global_ranks[peer], sock, self._lock)
        with self._cond:
            self._handshaking.discard(sock)     # from now on close() shuts it down as a peer's connection
            if self._closing:
                sock.close()
                return
            self._peers[peer] = link
            self._cond.notify_all()
        link.reader = threading.Thread(target=self._read_loop, args=(link,), daemon=True,
                                       name=f"spmd-tcp-reader-{self.spec.group_name}-r{self.group_rank}-p{peer}")
        link.reader.start()

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

    # -- the reader ---------------------------------------------------------------------------------------------

    def _read_loop(self, peer: _Peer) -> None:
        sock = peer.sock
        header = bytearray(wire.HEADER.size)
        view = memoryview(header)
        try:
            while True:
                wire.recv_into(sock, view)
                kind, _, key_len, site_len, seq, nbytes = wire.HEADER.unpack(header)
                key = wire.recv_bytes(sock, key_len)
                site = wire.recv_bytes(sock, site_len)
                if kind == Kind.COLL:
                    self._on_piece(peer, seq, key, site, nbytes)
                elif kind == Kind.P2P:
                    self._on_message(peer, seq, key.decode(), nbytes)
                elif kind == Kind.ABORT and nbytes <= wire.MAX_ABORT_REASON:
                    reason = wire.recv_bytes(sock, nbytes).decode(errors="replace")
                    error_type = _ERROR_TYPES.get(key.decode(errors="replace"), GroupAbortedError)
                    self._fail(error_type(f"rank {seq} aborted {self._desc}: {reason}"), origin=seq, reason=reason)
                elif kind == Kind.BYE:
                    with self._lock:
                        peer.left = True
                else:
                    raise ConnectionError(f"malformed frame (kind {kind}, {nbytes} bytes)")
        except (OSError, wire.PeerClosed) as error:
            self._on_disconnect(peer, error)
        except Exception as error:   # a bug or a corrupt stream: fail the group rather than lose the reader
            self._fail(CommError(f"the reader of rank {self.spec.global_rank}'s connection to rank "
                                 f"{peer.global_rank} in {self._desc} failed: {type(error).__name__}: {error}"))

    def _on_disconnect(self, peer: _Peer, error: BaseException) -> None:
        with self._cond:
            if self._closing:
                return
            left = peer.left
            peer.left = True
            stranded = self._take_p2p_recvs(peer.group_rank)
            self._cond.notify_all()
        lost = self._left_error(peer) if left else PeerLostError(
            f"lost the connection to rank {peer.global_rank} of {self._desc}: its process died or the connection "
            f"broke ({type(error).__name__}: {error})")
        for work in stranded:
            work.to_failed(_copy(lost))
        if not left:
            self._fail(lost)

    def _left_error(self, peer: _Peer) -> PeerLostError:
        return PeerLostError(f"rank {peer.global_rank} has left {self._desc} (it destroyed the group) while "
                             f"rank {self.spec.global_rank} still needs it")

    def _on_piece(self, peer: _Peer, seq: int, key: bytes, site: bytes, nbytes: int) -> None:
        """A collective piece arrived: receive it into its posted slot, or keep it until one is posted."""
        with self._lock:
            slot, error = self._match_piece(peer, seq, key, site, nbytes)
        if slot is not None:
            if nbytes:
                wire.recv_into(peer.sock, slot.view)
            with self._cond:
                slot.done = True
                self._cond.notify_all()
            return
        if error is not None or self._error is not None:
            wire.discard(peer.sock, nbytes)
            if error is not None:
                self._fail(error)
            return
        data = bytearray(nbytes)
        if nbytes:
            wire.recv_into(peer.sock, memoryview(data))
        with self._cond:
            slot, error = self._match_piece(peer, seq, key, site, nbytes)   # a receive may be posted by now
            if slot is not None:
                slot.view[:] = data
                slot.done = True
                self._cond.notify_all()
            elif error is None:
                peer.coll_early.append((seq, key, site, data))
        if error is not None:
            self._fail(error)

    def _match_piece(self, peer: _Peer, seq: int, key: bytes, site: bytes,
                     nbytes: int) -> tuple[_Slot | None, SpmdError | None]:
        """Under the lock: the posted slot this piece fills, or the mismatch it shows, or (None, None): keep it."""
        current = self._current
        if peer.coll_posted:
            assert current is not None
            slot = peer.coll_posted[0]
            error = self._check_piece(current, peer, key, site, nbytes, slot)
            if error is None:
                peer.coll_posted.popleft()
                return slot, None
            return None, error
        if current is not None and seq <= current.seq:
            # A piece of a collective this rank is in (or finished) that it never asked this peer for.
            return None, self._check_piece(current, peer, key, site, nbytes, None)
        return None, None

    def _check_piece(self, ex: _TcpExchange, peer: _Peer, key: bytes, site: bytes, nbytes: int,
                     slot: _Slot | None) -> SpmdError | None:
        mine = ex.ctx.fingerprint
        if key != ex.key or slot is None:
            theirs = _decode_fingerprint(key, site)
            if key == ex.key:
                return CollectiveMismatchError(
                    f"{mine.op} #{mine.seq} on {self._desc}: rank {peer.global_rank} sent rank "
                    f"{self.spec.global_rank} more data than this collective exchanges between them (called at "
                    f"{theirs.call_site} there and {mine.call_site} here)")
            return CollectiveMismatchError(mismatch_message(self._desc, mine, self.spec.global_rank, theirs,
                                                            peer.global_rank))
        if nbytes != slot.nbytes:
            size = slot.element_size
            return CollectiveMismatchError(
                f"{mine.op} #{mine.seq} on {self._desc}: rank {self.spec.global_rank} expects {slot.nbytes // size} "
                f"elements from rank {peer.global_rank}, which sends {nbytes // size} (called at "
                f"{_decode_fingerprint(key, site).call_site} there and {mine.call_site} here)")
        return None

    def _on_message(self, peer: _Peer, tag: int, dtype: str, nbytes: int) -> None:
        """A P2P message arrived: deliver it to the first irecv posted for its tag, or keep it."""
        with self._lock:
            posted = self._pop_p2p_recv(peer.group_rank, tag)
        if posted is not None:
            problem = _p2p_problem(posted, dtype, nbytes, peer.global_rank)
            if problem is None:
                if nbytes:
                    wire.recv_into(peer.sock, posted.view)
                posted.work.to_completed()
            else:
                wire.discard(peer.sock, nbytes)
                posted.work.to_failed(problem)
            return
        data = bytearray(nbytes)
        if nbytes:
            wire.recv_into(peer.sock, memoryview(data))
        self._deliver_p2p(peer.group_rank, tag, dtype, data)

    def _deliver_p2p(self, src: int, tag: int, dtype: str, data: bytearray) -> None:
        with self._lock:
            posted = self._pop_p2p_recv(src, tag)
            if posted is None:
                self._p2p_early[src].setdefault(tag, collections.deque()).append((dtype, data))
                return
        _complete_p2p(posted, dtype, data, self.spec.global_ranks[src])

    def _pop_p2p_recv(self, src: int, tag: int) -> _P2PRecv | None:
        queue = self._p2p_posted[src].get(tag)
        return queue.popleft() if queue else None

    def _take_p2p_recvs(self, src: int) -> list[Work]:
        works = [posted.work for queue in self._p2p_posted[src].values() for posted in queue]
        self._p2p_posted[src].clear()
        return works

    # -- collectives: the Exchange primitives -----------------------------------------------------------------

    def _post(self, ex: _TcpExchange, recvs: list[tuple[int, Tensor]]) -> list[_Slot]:
        slots = [_Slot(peer, tensor) for peer, tensor in recvs]
        error: SpmdError | None = None
        with self._lock:
            self._raise_if_failed()
            self._current = ex
            for slot in slots:
                peer = self._peers[slot.peer]
                assert peer is not None
                if peer.left:
                    error = self._left_error(peer)
                    break
                if peer.coll_early:
                    seq, key, site, data = peer.coll_early.popleft()
                    error = self._check_piece(ex, peer, key, site, len(data), slot if seq == ex.seq else None)
                    if error is not None:
                        break
                    slot.view[:] = data
                    slot.done = True
                else:
                    peer.coll_posted.append(slot)
            if error is None:
                for peer in self._peers:
                    if peer is not None and peer.coll_early and peer.coll_early[0][0] <= ex.seq:
                        seq, key, site, data = peer.coll_early[0]
                        error = self._check_piece(ex, peer, key, site, len(data), None)
                        break
        if error is not None:
            self._fail(error)
            raise _copy(error)
        return slots

    def _send_piece(self, ex: _TcpExchange, peer_rank: int, tensor: Tensor) -> None:
        view = wire.byte_view(tensor)
        header = wire.HEADER.pack(Kind.COLL, 0, len(ex.key), len(ex.meta) - len(ex.key), ex.seq, len(view)) + ex.meta
        peer = self._peers[peer_rank]
        assert peer is not None
        if self._error is not None:
            raise _copy(self._error)
        if peer.left:
            raise self._left_error(peer)
        with peer.send_lock:
            try:
                wire.send_frame(peer.sock, header, view, ex.ctx.deadline.at, self._is_failed)
            except TimeoutError:
                raise CommTimeoutError(
                    f"{ex.ctx.fingerprint.op} #{ex.seq} on {self._desc}: rank {peer.global_rank} stopped "
                    f"receiving; sending to it did not finish within {ex.ctx.deadline.timeout:.1f}s") from None
            except OSError as error:
                if self._error is not None:
                    raise _copy(self._error) from None
                lost = PeerLostError(f"lost the connection to rank {peer.global_rank} of {self._desc} while "
                                     f"sending ({type(error).__name__}: {error})")
                self._fail(lost)
                raise _copy(lost) from None

    def _wait(self, ex: _TcpExchange, slot: _Slot) -> None:
        with self._cond:
            while not slot.done:
                if self._error is not None:
                    raise _copy(self._error)
                peer = self._peers[slot.peer]
                assert peer is not None
                if peer.left:
                    raise self._left_error(peer)
                remaining = ex.ctx.deadline.remaining()
                if remaining <= 0:
                    fp = ex.ctx.fingerprint
                    raise CommTimeoutError(
                        f"{fp.op} #{fp.seq} on {self._desc}: rank {self.spec.global_rank} got no data from rank "
                        f"{peer.global_rank} within {ex.ctx.deadline.timeout:.1f}s")
                self._cond.wait(remaining)

    def _scratch(self, ex: _TcpExchange, numel: int, dtype: torch.dtype) -> Tensor:
        nbytes = numel * dtype.itemsize
        if ex.scratch_used or nbytes > _SCRATCH_CACHE_BYTES:
            return torch.empty(numel, dtype=dtype)
        ex.scratch_used = True
        if self._scratch_buffer.numel() < nbytes:
            self._scratch_buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buffer[:nbytes].view(dtype)

    def _is_failed(self) -> bool:
        return self._error is not None or self._closing

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise _copy(self._error)
        if self._closing:
            raise GroupAbortedError(f"{self._desc} was destroyed on rank {self.spec.global_rank}")

    # -- collectives --------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.all_reduce(_TcpExchange(self, ctx), tensor, op)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        algorithms.broadcast(_TcpExchange(self, ctx), tensor, root)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.reduce(_TcpExchange(self, ctx), tensor, root, op)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        algorithms.all_gather(_TcpExchange(self, ctx), output, input)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.reduce_scatter(_TcpExchange(self, ctx), output, input, op)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        algorithms.gather(_TcpExchange(self, ctx), output, input, root)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        algorithms.scatter(_TcpExchange(self, ctx), output, input, root)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        algorithms.all_to_all(_TcpExchange(self, ctx), output, input, output_splits, input_splits, self._desc,
                              self.spec.global_ranks)

    def barrier(self, ctx: OpContext) -> None:
        algorithms.barrier(_TcpExchange(self, ctx))

    # -- point to point -----------------------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        if dst == self.group_rank:
            self._raise_if_failed()
            data = bytearray(wire.byte_view(tensor))
            self._deliver_p2p(dst, tag, str(tensor.dtype), data)
            work.to_completed()
            return
        peer = self._peers[dst]
        assert peer is not None
        view = wire.byte_view(tensor)
        header = wire.pack_header(Kind.P2P, tag, len(view), str(tensor.dtype).encode())
        with self._lock:
            self._raise_if_failed()
            if peer.left:
                raise self._left_error(peer)
            inline = not peer.send_queue and not peer.sending and len(view) <= _INLINE_P2P_BYTES
            if inline:
                peer.sending = True
            else:
                peer.send_queue.append((header, view, work, tensor))
                if peer.sender is None:
                    peer.sender = threading.Thread(
                        target=self._send_loop, args=(peer,), daemon=True,
                        name=f"spmd-tcp-sender-{self.spec.group_name}-r{self.group_rank}-p{dst}")
                    peer.sender.start()
                peer.send_ready.notify()
        if inline:
            try:
                self._send_message(peer, header, view, work)
            finally:
                with self._lock:
                    peer.sending = False
                    if peer.send_queue:
                        peer.send_ready.notify()

    def _send_loop(self, peer: _Peer) -> None:
        while True:
            with self._lock:
                while not peer.send_queue or peer.sending:
                    if self._closing or self._error is not None:
                        return
                    peer.send_ready.wait()
                header, view, work, _ = peer.send_queue.popleft()
                peer.sending = True
            try:
                self._send_message(peer, header, view, work)
            finally:
                with self._lock:
                    peer.sending = False

    def _send_message(self, peer: _Peer, header: bytes, view: memoryview, work: Work) -> None:
        try:
            with peer.send_lock:
                wire.send_frame(peer.sock, header, view, None, self._is_failed)
        except OSError as error:
            failure = self._error or PeerLostError(
                f"send to rank {peer.global_rank} of {self._desc} failed ({type(error).__name__}: {error})")
            work.to_failed(_copy(failure))
            self._fail(failure)
            return
        work.to_completed()

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        posted = _P2PRecv(tensor, work)
        with self._lock:
            self._raise_if_failed()
            early = self._p2p_early[src].get(tag)
            if early:
                dtype, data = early.popleft()
            else:
                peer = self._peers[src]
                if peer is not None and peer.left:
                    raise self._left_error(peer)
                self._p2p_posted[src].setdefault(tag, collections.deque()).append(posted)
                return
        _complete_p2p(posted, dtype, data, self.spec.global_ranks[src])

    # -- lifetime -----------------------------------------------------------------------------------------------

    def _fail(self, error: SpmdError, origin: int | None = None, reason: str | None = None) -> None:
        """Fail everything in flight on this rank with `error`, and send every peer an ABORT frame.

        An abort received from a peer is passed on too (with its `origin` rank and `reason`), so a peer that
        next sees this rank's connection close has already read why.
        """
        with self._cond:
            if self._error is None:
                self._error = error
            error = self._error
            stranded = [work for src in range(self.group_size) for work in self._take_p2p_recvs(src)]
            for peer in self._peers:
                if peer is not None:
                    stranded.extend(item[2] for item in peer.send_queue)
                    peer.send_queue.clear()
                    peer.send_ready.notify_all()
            send_aborts = not self._abort_sent and not self._closing
            if send_aborts:
                # Taken before the error is visible: a thread that sees it and closes the group waits for
                # the ABORT frames, so no peer reads this rank's EOF before the reason.
                self._abort_sending.acquire()
            self._abort_sent = True
            self._cond.notify_all()
        for work in stranded:
            work.to_failed(_copy(error))
        if send_aborts:
            try:
                text = (str(error) if reason is None else reason).encode()[:wire.MAX_ABORT_REASON]
                origin = self.spec.global_rank if origin is None else origin
                self._send_to_all(wire.pack_header(Kind.ABORT, origin, len(text), type(error).__name__.encode()),
                                  text)
            finally:
                self._abort_sending.release()

    def _send_to_all(self, header: bytes, payload: bytes) -> None:
        """Best effort, bounded: a control frame to every connected peer (abort, bye)."""
        for peer in self._peers:
            if peer is None or not peer.send_lock.acquire(timeout=2 * _SEND_POLL_S + 1):
                continue
            try:
                wire.send_frame(peer.sock, header, memoryview(payload), time.monotonic() + 2.0, lambda: False)
            except (OSError, TimeoutError):
                pass
            finally:
                peer.send_lock.release()

    def abort(self, error: BaseException) -> None:
        failure = error if isinstance(error, SpmdError) else GroupAbortedError(f"{type(error).__name__}: {error}")
        self._fail(failure)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            stranded = [work for src in range(self.group_size) for work in self._take_p2p_recvs(src)]
            for peer in self._peers:
                if peer is not None:
                    peer.send_ready.notify_all()
            self._cond.notify_all()
        for work in stranded:
            work.to_failed(GroupAbortedError(f"{self._desc} was destroyed on rank {self.spec.global_rank} "
                                             f"before this receive completed"))
        self._close_listener()
        with self._lock:
            handshaking = list(self._handshaking)
        for conn in handshaking:
            try:
                conn.shutdown(socket.SHUT_RDWR)    # wakes a handshake still waiting for a silent stranger
            except OSError:
                pass
        for thread in self._setup_threads:
            thread.join(timeout=_HANDSHAKE_S)
        peers = [peer for peer in self._peers if peer is not None]
        for peer in peers:
            if peer.sender is not None:
                peer.sender.join(timeout=2 * _SEND_POLL_S + 1)
        with self._abort_sending:
            if self._error is None:
                self._send_to_all(wire.pack_header(Kind.BYE, 0, 0), b"")
        for peer in peers:
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)   # wakes the reader
            except OSError:
                pass
        for peer in peers:
            if peer.reader is not None and peer.reader is not threading.current_thread():
                peer.reader.join(timeout=5.0)
            peer.sock.close()


# -- helpers ------------------------------------------------------------------------------------------------------


def _tune(sock: socket.socket) -> None:
    """Latency and throughput settings for a peer connection, and the send timeout send_frame relies on."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _SOCKET_BUFFER:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    seconds = int(_SEND_POLL_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", seconds, int((_SEND_POLL_S - seconds) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _public_host(hosts: tuple[str, ...], me: int) -> str:
    """An address of this host that the other hosts can reach (SPMD_SOCKET_ADDR overrides this guess).

    The local address of the route towards another rank's host (a UDP connect sends nothing), else the
    address of this host's name, unless that is a loopback address, else the name itself.
    """
    for host in hosts:
        if host == hosts[me]:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(host), 9))
                address = probe.getsockname()[0]
            if not address.startswith("127."):
                return address
        except OSError:
            continue
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return socket.gethostname()


def _decode_fingerprint(key: bytes, site: bytes) -> Fingerprint:
    try:
        op, seq, shape, dtype, reduce_op, root = json.loads(key)
        return Fingerprint(op, seq, None if shape is None else tuple(shape), dtype, reduce_op, root,
                           site.decode(errors="replace"))
    except (ValueError, TypeError):
        return Fingerprint(f"<unreadable {key[:60]!r}>", -1, None, "?", call_site=site.decode(errors="replace"))


def _copy(error: SpmdError) -> SpmdError:
    """A fresh instance to raise on this thread (one exception object raised on many threads mixes tracebacks)."""
    return type(error)(str(error))


def _p2p_problem(posted: _P2PRecv, dtype: str, nbytes: int, src: int) -> CommError | None:
    if dtype == posted.dtype and nbytes == len(posted.view):
        return None
    return CommError(f"recv from rank {src}: the message holds {nbytes} bytes of {dtype}, but the receive buffer "
                     f"holds {len(posted.view)} bytes of {posted.dtype}; sender and receiver must agree on dtype "
                     f"and size")


def _complete_p2p(posted: _P2PRecv, dtype: str, data: bytearray, src: int) -> None:
    problem = _p2p_problem(posted, dtype, len(data), src)
    if problem is not None:
        posted.work.to_failed(problem)
        return
    posted.view[:] = data
    posted.work.to_completed()
