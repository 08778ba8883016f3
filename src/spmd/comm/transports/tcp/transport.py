"""The tcp transport: a full mesh of authenticated sockets between a group's ranks (works across hosts).

Layer: comm. Collectives come from `algorithms` (ring with pipelined pieces for large messages, direct or
recursive-doubling exchanges for small ones); this module moves their bytes: TcpTransport holds the
collective entry points, the Exchange primitives (post, send, wait, scratch), P2P send/recv, failure and
close. `connect` builds the mesh of sockets, `reader` runs the per-peer readers, `wire` has the frames.

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
import threading
import time

import torch
from torch import Tensor

from spmd._core.deadline import Deadline
from spmd._core.errors import CommTimeoutError, GroupAbortedError, PeerLostError, SpmdError, abort_text
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.transports.base import OpContext, TransportSpec
from spmd.comm.transports.tcp import algorithms, wire
from spmd.comm.transports.tcp.connect import SEND_POLL_S, Connector
from spmd.comm.transports.tcp.reader import P2PRecv, Peer, Router, Slot, complete_p2p, copy_error
from spmd.comm.transports.tcp.wire import Kind
from spmd.comm.work import Work

_INLINE_P2P_BYTES = 256 << 10     # isends up to this size are sent by the caller
_SCRATCH_CACHE_BYTES = 256 << 20  # scratch up to this size is kept for the next collective: allocating (and
                                  # faulting in) a fresh 128 MiB temp costs a 256 MiB all_reduce ~30% of its time


class TcpExchange(algorithms.Exchange):
    """One collective's view of the transport (see Note: the Exchange protocol in `algorithms`)."""

    def __init__(self, transport: TcpTransport, ctx: OpContext) -> None:
        fp = ctx.fingerprint
        self.transport = transport
        self.group_rank = transport.group_rank
        self.group_size = transport.group_size
        self.ctx = ctx
        self.seq = fp.seq
        self.key = json.dumps(fp.key()).encode()
        self.meta = self.key + fp.encode()         # the whole fingerprint, for a mismatch's message
        self.scratch_used = False

    def post(self, recvs: list[tuple[int, Tensor]]) -> list[Slot]:
        return self.transport._post(self, recvs)

    def send(self, peer: int, tensor: Tensor) -> None:
        self.transport._send_piece(self, peer, tensor)

    def wait(self, handle: Slot) -> None:
        if not handle.done:
            self.transport._wait(self, handle)

    def scratch(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.transport._scratch(self, numel, dtype)


class TcpTransport(Router):
    """Sockets between the group's ranks; see the module docstring."""

    name = "tcp"
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._abort_sent = False
        self._abort_sending = threading.Lock()           # held while ABORT frames go out; close() waits for it
        self._scratch_buffer = torch.empty(0, dtype=torch.uint8)
        self._connector = Connector(spec, self._desc, self._cond, self._peers, lambda: self._closing, self._register)
        try:
            self._connector.connect(Deadline(spec.timeout))
        except BaseException:
            self.close()
            raise

    # -- collectives: the Exchange primitives -----------------------------------------------------------------

    def _post(self, ex: TcpExchange, recvs: list[tuple[int, Tensor]]) -> list[Slot]:
        slots = [Slot(peer, tensor) for peer, tensor in recvs]
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
            raise copy_error(error)
        return slots

    def _send_piece(self, ex: TcpExchange, peer_rank: int, tensor: Tensor) -> None:
        view = wire.byte_view(tensor)
        header = wire.HEADER.pack(Kind.COLL, 0, len(ex.key), len(ex.meta) - len(ex.key), ex.seq, len(view)) + ex.meta
        peer = self._peers[peer_rank]
        assert peer is not None
        if self._error is not None:
            raise copy_error(self._error)
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
                    raise copy_error(self._error) from None
                lost = PeerLostError(f"lost the connection to {self.spec.where(peer.group_rank)} of {self._desc} "
                                     f"while sending ({type(error).__name__}: {error})")
                self._fail(lost)
                raise copy_error(lost) from None

    def _wait(self, ex: TcpExchange, slot: Slot) -> None:
        with self._cond:
            while not slot.done:
                if self._error is not None:
                    raise copy_error(self._error)
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

    def _scratch(self, ex: TcpExchange, numel: int, dtype: torch.dtype) -> Tensor:
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
            raise copy_error(self._error)
        if self._closing:
            raise GroupAbortedError(f"{self._desc} was destroyed on rank {self.spec.global_rank}")

    # -- collectives --------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.all_reduce(TcpExchange(self, ctx), tensor, op)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        algorithms.broadcast(TcpExchange(self, ctx), tensor, root)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.reduce(TcpExchange(self, ctx), tensor, root, op)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        algorithms.all_gather(TcpExchange(self, ctx), output, input)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        algorithms.reduce_scatter(TcpExchange(self, ctx), output, input, op)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        algorithms.gather(TcpExchange(self, ctx), output, input, root)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        algorithms.scatter(TcpExchange(self, ctx), output, input, root)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        algorithms.all_to_all(TcpExchange(self, ctx), output, input, output_splits, input_splits, self._desc,
                              self.spec.global_ranks)

    def barrier(self, ctx: OpContext) -> None:
        algorithms.barrier(TcpExchange(self, ctx))

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

    def _send_loop(self, peer: Peer) -> None:
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

    def _send_message(self, peer: Peer, header: bytes, view: memoryview, work: Work) -> None:
        try:
            with peer.send_lock:
                wire.send_frame(peer.sock, header, view, None, self._is_failed)
        except OSError as error:
            failure = self._error or PeerLostError(
                f"send to {self.spec.where(peer.group_rank)} of {self._desc} failed ({type(error).__name__}: "
                f"{error})")
            work.to_failed(copy_error(failure))
            self._fail(failure)
            return
        work.to_completed()

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        posted = P2PRecv(tensor, work)
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
        complete_p2p(posted, dtype, data, self.spec.global_ranks[src])

    # -- lifetime -----------------------------------------------------------------------------------------------

    def _fail(self, error: SpmdError, origin: int | None = None) -> None:
        """Fail everything in flight on this rank with `error`, and send every peer an ABORT frame.

        An abort received from a peer is passed on too (with its `origin` rank, and the rank that saw the
        failure first inside the frame: errors.abort_text), so a peer that next sees this rank's connection
        close has already read why.
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
            work.to_failed(copy_error(error))
        if send_aborts:
            try:
                text = abort_text(error, self.spec.where(self.group_rank)).encode()[:wire.MAX_ABORT_REASON]
                origin = self.spec.global_rank if origin is None else origin
                self._send_to_all(wire.pack_header(Kind.ABORT, origin, len(text), type(error).__name__.encode()),
                                  text)
            finally:
                self._abort_sending.release()

    def _send_to_all(self, header: bytes, payload: bytes) -> None:
        """Best effort, bounded: a control frame to every connected peer (abort, bye)."""
        for peer in self._peers:
            if peer is None or not peer.send_lock.acquire(timeout=2 * SEND_POLL_S + 1):
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
        self._connector.close()
        peers = [peer for peer in self._peers if peer is not None]
        for peer in peers:
            if peer.sender is not None:
                peer.sender.join(timeout=2 * SEND_POLL_S + 1)
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

