"""The receiving side of the tcp transport: one reader thread per peer, routing each frame it reads.

Layer: comm. Router holds the state the transport's threads share under one lock (the peers, the posted and
early receives, the failure) and the per-peer reader: a collective piece goes to its posted slot after its
fingerprint is checked, a P2P message to its posted irecv, an early one is kept until its receive is posted;
an ABORT fails this rank too, a BYE marks the peer as left, and its EOF fails what still needs it (see Note:
threads of the tcp transport and Note: failure in `transport`, and Note: the Exchange protocol in `algorithms`).
"""

from __future__ import annotations

import abc
import collections
import socket
import threading
from typing import TYPE_CHECKING

from torch import Tensor

from spmd._core.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupAbortedError,
    PeerLostError,
    SpmdError,
    parse_abort_text,
)
from spmd.comm.debug import Fingerprint, mismatch_message
from spmd.comm.transports.base import Transport, TransportSpec
from spmd.comm.transports.tcp import wire
from spmd.comm.transports.tcp.wire import Kind
from spmd.comm.work import Work

if TYPE_CHECKING:
    from spmd.comm.transports.tcp.transport import TcpExchange

_ERROR_TYPES: dict[str, type[SpmdError]] = {
    cls.__name__: cls for cls in (CollectiveMismatchError, PeerLostError, CommTimeoutError, GroupAbortedError)}


class Slot:
    """A posted receive of a collective piece: where its payload goes."""

    __slots__ = ("done", "element_size", "nbytes", "peer", "view")

    def __init__(self, peer: int, tensor: Tensor) -> None:
        self.peer = peer
        self.view = wire.byte_view(tensor)
        self.nbytes = len(self.view)
        self.element_size = tensor.element_size()
        self.done = False


class P2PRecv:
    """A posted irecv."""

    __slots__ = ("dtype", "view", "work")

    def __init__(self, tensor: Tensor, work: Work) -> None:
        self.view = wire.byte_view(tensor)
        self.dtype = str(tensor.dtype)
        self.work = work


class Peer:
    """The connection to one peer group rank. Mutable fields are guarded by the transport's lock."""

    def __init__(self, group_rank: int, global_rank: int, sock: socket.socket, lock: threading.Lock) -> None:
        self.group_rank = group_rank
        self.global_rank = global_rank
        self.sock = sock
        self.send_lock = threading.Lock()
        self.coll_posted: collections.deque[Slot] = collections.deque()
        self.coll_early: collections.deque[tuple[int, bytes, bytes, bytearray]] = collections.deque()
        self.send_queue: collections.deque[tuple[bytes, memoryview, Work, Tensor]] = collections.deque()
        self.send_ready = threading.Condition(lock)
        self.sending = False
        self.left = False                   # it said BYE: it closed the group normally
        self.reader: threading.Thread | None = None
        self.sender: threading.Thread | None = None


class Router(Transport):
    """The tcp transport's shared state and its per-peer readers; TcpTransport adds the sending side."""

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._desc = f"group '{spec.group_name}' (ranks {list(spec.global_ranks)})"
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)      # collective waiters, set-up progress
        self._peers: list[Peer | None] = [None] * self.group_size
        self._p2p_posted: list[dict[int, collections.deque[P2PRecv]]] = [{} for _ in range(self.group_size)]
        self._p2p_early: list[dict[int, collections.deque[tuple[str, bytearray]]]] = [
            {} for _ in range(self.group_size)]
        self._current: TcpExchange | None = None
        self._error: SpmdError | None = None
        self._closing = False

    @abc.abstractmethod
    def _fail(self, error: SpmdError, origin: int | None = None) -> None:
        """Fail everything in flight on this rank with `error`, and send every peer an ABORT frame."""

    def _register(self, peer: int, sock: socket.socket) -> None:
        """Take an authenticated connection (from the Connector) and start its reader."""
        link = Peer(peer, self.spec.global_ranks[peer], sock, self._lock)
        with self._cond:
            if self._closing:
                sock.close()
                return
            self._peers[peer] = link
            self._cond.notify_all()
        link.reader = threading.Thread(target=self._read_loop, args=(link,), daemon=True,
                                       name=f"spmd-tcp-reader-{self.spec.group_name}-r{self.group_rank}-p{peer}")
        link.reader.start()

    def _read_loop(self, peer: Peer) -> None:
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
                    seen_by, reason = parse_abort_text(wire.recv_bytes(sock, nbytes).decode(errors="replace"))
                    seen_by = seen_by or f"rank {seq}"
                    error_type = _ERROR_TYPES.get(key.decode(errors="replace"), GroupAbortedError)
                    self._fail(error_type(f"{seen_by} aborted {self._desc}: {reason}", reason=reason,
                                          seen_by=seen_by), origin=seq)
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

    def _on_disconnect(self, peer: Peer, error: BaseException) -> None:
        with self._cond:
            if self._closing:
                return
            left = peer.left
            peer.left = True
            stranded = self._take_p2p_recvs(peer.group_rank)
            self._cond.notify_all()
        lost = self._left_error(peer) if left else PeerLostError(
            f"lost the connection to {self.spec.where(peer.group_rank)} of {self._desc}: its process died or the "
            f"connection broke ({type(error).__name__}: {error})")
        for work in stranded:
            work.to_failed(copy_error(lost))
        if not left:
            self._fail(lost)

    def _left_error(self, peer: Peer) -> PeerLostError:
        return PeerLostError(f"{self.spec.where(peer.group_rank)} has left {self._desc} (it destroyed the group) "
                             f"while {self.spec.where(self.group_rank)} still needs it")

    def _on_piece(self, peer: Peer, seq: int, key: bytes, site: bytes, nbytes: int) -> None:
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

    def _match_piece(self, peer: Peer, seq: int, key: bytes, site: bytes,
                     nbytes: int) -> tuple[Slot | None, SpmdError | None]:
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

    def _check_piece(self, ex: TcpExchange, peer: Peer, key: bytes, site: bytes, nbytes: int,
                     slot: Slot | None) -> SpmdError | None:
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

    def _on_message(self, peer: Peer, tag: int, dtype: str, nbytes: int) -> None:
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
        complete_p2p(posted, dtype, data, self.spec.global_ranks[src])

    def _pop_p2p_recv(self, src: int, tag: int) -> P2PRecv | None:
        queue = self._p2p_posted[src].get(tag)
        return queue.popleft() if queue else None

    def _take_p2p_recvs(self, src: int) -> list[Work]:
        works = [posted.work for queue in self._p2p_posted[src].values() for posted in queue]
        self._p2p_posted[src].clear()
        return works


def _decode_fingerprint(key: bytes, site: bytes) -> Fingerprint:
    """The sender's fingerprint, from the frame's site field (see wire, Note: frame layout)."""
    try:
        return Fingerprint.decode(site)
    except (ValueError, TypeError):
        return Fingerprint(f"<unreadable {key[:60]!r}>", -1, None, "?", call_site=site[:200].decode(errors="replace"))


def copy_error(error: SpmdError) -> SpmdError:
    """A fresh instance to raise on this thread (one exception object raised on many threads mixes tracebacks)."""
    return type(error)(str(error), reason=error.reason, seen_by=error.seen_by)


def _p2p_problem(posted: P2PRecv, dtype: str, nbytes: int, src: int) -> CommError | None:
    if dtype == posted.dtype and nbytes == len(posted.view):
        return None
    return CommError(f"recv from rank {src}: the message holds {nbytes} bytes of {dtype}, but the receive buffer "
                     f"holds {len(posted.view)} bytes of {posted.dtype}; sender and receiver must agree on dtype "
                     f"and size")


def complete_p2p(posted: P2PRecv, dtype: str, data: bytearray, src: int) -> None:
    problem = _p2p_problem(posted, dtype, len(data), src)
    if problem is not None:
        posted.work.to_failed(problem)
        return
    posted.view[:] = data
    posted.work.to_completed()
