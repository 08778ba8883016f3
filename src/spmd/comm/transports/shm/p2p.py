"""Point-to-point messages of the shm transport: one byte ring per ordered pair of ranks, one progress thread.

Layer: comm. isend/irecv only queue work; a progress thread (started at the first P2P call of the group)
streams queued sends into the ring to each peer and drains the rings from each peer, so large messages
move in ring-sized pieces and both ranks of a pair may isend (or even send) before they receive.
When it can make no progress the thread blocks on its own wake socket (as collective waits do, see
segment's Note: waiting) with its P2P_SLEEPING flag set; a peer that fills or drains a ring it shares
with this rank, and a local isend/irecv, ring it. The wait times out after WAKE_TIMEOUT_S, which bounds a
missed wake and paces the checks for a dead peer or an aborted group.

Note: ring framing
A ring is RING bytes of data plus two 8-byte positions, the total bytes ever written (by the sender) and
ever consumed (by the receiver), each on its own cache line. A message is a 64-byte header (tag, payload
bytes, element count, dtype code) followed by the payload padded to 64 bytes, so positions stay multiples
of 64 and a header never wraps. The sender publishes a piece by advancing its write position after the
copy; the receiver frees space by advancing the read position after its copy. The word after the write
position says the sender found the ring too full to go on; only then does the receiver, freeing space,
ring the sender's progress thread (otherwise a sender whose messages fit would be woken for nothing).

Note: waiting threads
A thread that waits for a pending send or receive (Work.wait) first moves the data itself: it takes the
ring's lock (the progress thread takes the same one) and pushes or pulls until its operation completes,
for at most 1 ms when the host has a core for every rank of the group (50 us when it has fewer: then the
poller would burn the core its peer needs). That spares the thread wake-ups of a hand-off to the progress
thread and back, and the two threads' fight for the GIL: most of a small message's latency. While it
polls, its P2P_POLLING word tells peers not to ring the progress thread; a receive posted with polling
possible does not ring it either. When the progress thread holds the lock, or the budget runs out, the
waiter rings its progress thread (covering whatever arrived while no bell rang) and blocks as before.
Threads-as-ranks groups don't poll: their peers need the GIL the poller would hold.

Note: matching
Messages from one peer arrive in the order sent. At a message's header the engine takes the oldest irecv
posted for that (peer, tag) and copies the payload straight into it; with none posted it receives into a
private buffer, queued as unexpected. irecv takes the oldest unexpected message of its (peer, tag) first,
so messages of one (peer, tag) are always received in order whatever the interleaving with other tags.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._core.errors import CommError, GroupAbortedError, PeerLostError
from spmd.comm.transports.base import TransportSpec
from spmd.comm.transports.shm.segment import CACHELINE, Segment, wake_socket
from spmd.comm.work import Work

HEADER = 64
LIVENESS_S = 0.05      # with operations pending, peers' liveness is checked this often
INLINE_BYTES = 256 << 10   # an isend this small, with nothing queued before it, is written by the caller
POLL_S = (1e-3, 50e-6)     # how long a waiting thread moves data itself: ranks with a core each, or fewer
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _pad(nbytes: int) -> int:
    return (nbytes + CACHELINE - 1) // CACHELINE * CACHELINE


@dataclasses.dataclass(eq=False)
class _Send:
    data: Tensor          # the tensor's bytes
    tag: int
    numel: int
    dtype_code: int
    work: Work
    sent: int = -1        # payload bytes written so far; -1 until the header is written


@dataclasses.dataclass(eq=False)
class _Recv:
    tensor: Tensor
    work: Work


@dataclasses.dataclass(eq=False)
class _Message:
    """A message being received or received: its header and where its payload goes."""

    src: int
    tag: int
    nbytes: int
    numel: int
    dtype_code: int
    target: Tensor | None       # the receiving tensor's bytes, a private buffer, or None to discard
    recv: _Recv | None = None   # the irecv it completes; None while unexpected
    received: int = 0


class P2PEngine:
    """Queues and the progress thread of one transport's point-to-point traffic."""

    def __init__(self, segment: Segment | None, rank: int, size: int, spec: TransportSpec) -> None:
        self._segment = segment
        self._rank = rank
        self._size = size
        self._spec = spec
        self._lock = threading.Lock()
        self._sends: dict[int, collections.deque[_Send]] = collections.defaultdict(collections.deque)
        self._posted: dict[tuple[int, int], collections.deque[_Recv]] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque[_Message]] = collections.defaultdict(
            collections.deque)
        self._incoming: dict[int, _Message] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._send_locks = [threading.Lock() for _ in range(size)]   # one writer at a time into a ring
        self._pull_locks = [threading.Lock() for _ in range(size)]   # one reader at a time out of a ring
        self._polls = segment is not None and segment.spin_most > 0   # not when peers are threads (the GIL)
        self._poll_s = POLL_S[0] if len(os.sched_getaffinity(0)) >= size else POLL_S[1]
        self._sock: socket.socket | None = None
        if segment is not None:
            self._sock = wake_socket(segment.p2p_wake_address(rank))
            self._addresses = [segment.p2p_wake_address(peer) for peer in range(size)]

    # -- posting (caller threads) ---------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        code = _dtype_code(tensor.dtype)
        with self._lock:
            self._raise_if_failed(f"send to group rank {dst}")
            if dst != self._rank:
                send = _Send(_as_bytes(tensor), tag, tensor.numel(), code, work)
                queue = self._sends[dst]
                queue.append(send)
                self._start_locked()
                inline = len(queue) == 1 and send.data.numel() <= INLINE_BYTES
        if dst != self._rank:
            if inline:      # nothing queued before it: the caller writes it now, saving a thread hand-off
                with self._send_locks[dst]:
                    if queue and queue[0] is send:
                        self._push(dst)
            if not work.is_completed():
                if self._polls:
                    work.poll = functools.partial(self._poll, self._send_locks[dst], self._push_all, dst, work)
                self._ring_bell(self._rank)
            return
        with self._lock:
            message = _Message(dst, tag, tensor.numel() * tensor.element_size(), tensor.numel(), code, None)
            waiting = self._posted.get((dst, tag))
            message.recv = waiting.popleft() if waiting else None
            if message.recv is None:
                message.target = _as_bytes(tensor).clone()
                self._unexpected[(dst, tag)].append(message)
        if message.recv is not None:
            self._deliver(message, _as_bytes(tensor))
        work.to_completed()

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        with self._lock:
            self._raise_if_failed(f"recv from group rank {src}")
            queue = self._unexpected.get((src, tag))
            message = queue.popleft() if queue else None
            if message is None:
                self._posted[(src, tag)].append(_Recv(tensor, work))
                if src != self._rank:
                    self._start_locked()
                    if self._polls:     # the waiter pulls, or rings the progress thread when it stops
                        work.poll = functools.partial(self._poll, self._pull_locks[src], self._pull, src, work)
                    else:
                        self._ring_bell(self._rank)
                return
        message.recv = _Recv(tensor, work)
        assert message.target is not None
        self._deliver(message, message.target)

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            raise GroupAbortedError(f"{what}: the group was aborted ({self._error})")
        if self._closed:
            raise GroupAbortedError(f"{what}: the group was destroyed")

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._progress, daemon=True,
                                            name=f"spmd-shm-p2p-{self._spec.group_name}-rank{self._spec.global_rank}")
            self._thread.start()

    def _deliver(self, message: _Message, payload: Tensor | None) -> None:
        """Complete `message.recv` with the payload, or fail it when sizes or dtypes differ."""
        recv = message.recv
        assert recv is not None
        if not self._fits(message, recv):
            recv.work.to_failed(self._size_error(message, recv))
            return
        if payload is not None and payload.data_ptr() != _as_bytes(recv.tensor).data_ptr():
            _as_bytes(recv.tensor).copy_(payload)
        recv.work.to_completed()

    @staticmethod
    def _fits(message: _Message, recv: _Recv) -> bool:
        return message.numel == recv.tensor.numel() and message.dtype_code == _dtype_code(recv.tensor.dtype)

    def _size_error(self, message: _Message, recv: _Recv) -> CommError:
        sent = _DTYPES[message.dtype_code] if 0 <= message.dtype_code < len(_DTYPES) else "unknown dtype"
        return CommError(f"recv from rank {self._spec.global_ranks[message.src]} (tag {message.tag}) on rank "
                         f"{self._spec.global_rank}: the message holds {message.numel} {sent} elements but the "
                         f"receive buffer holds {recv.tensor.numel()} {recv.tensor.dtype}")

    # -- progress thread ------------------------------------------------------------------------------------

    def _progress(self) -> None:
        assert self._segment is not None and self._sock is not None
        words, sleeping = self._segment.words, self._segment.p2p_sleeping_index(self._rank)
        next_liveness = time.monotonic() + LIVENESS_S
        while True:
            with self._lock:
                if self._closed or self._error is not None:
                    return
                busy = bool(self._incoming) or any(self._sends.values()) or any(self._posted.values())
            try:
                if self._step():
                    continue
                words[sleeping] = 1          # announce the sleep, then look once more (see Note: waiting)
                if self._step():
                    words[sleeping] = 0
                    continue
            except BaseException as error:   # a failed copy fails every pending operation, never the thread
                self.fail(error)
                return
            now = time.monotonic()
            if busy and now >= next_liveness:
                next_liveness = now + LIVENESS_S
                self._check_peers()
            with contextlib.suppress(BlockingIOError, InterruptedError):   # BlockingIOError: SO_RCVTIMEO passed
                self._sock.recv(16)
            words[sleeping] = 0

    def _step(self) -> bool:
        """One pass over every queued send and every incoming ring; True if anything moved."""
        progressed = False
        for dst in range(self._size):
            if self._sends.get(dst):
                with self._send_locks[dst]:
                    progressed |= self._push_all(dst)
        for src in range(self._size):
            if src != self._rank:
                with self._pull_locks[src]:
                    progressed |= self._pull(src)
        return progressed

    def _push_all(self, dst: int) -> bool:
        """`_push` if anything is queued for `dst` (call with its send lock held)."""
        return bool(self._sends[dst]) and self._push(dst)

    def _poll(self, lock: threading.Lock, move: Callable[[int], bool], peer: int, work: Work) -> None:
        """Work.poll of a pending send or receive: move data through the ring to or from `peer` on the
        waiting thread until `work` completes or the time budget runs out (see Note: waiting threads)."""
        segment = self._segment
        assert segment is not None
        polling = segment.p2p_polling_index(self._rank)
        deadline = time.perf_counter() + self._poll_s
        segment.words[polling] = 1       # peers need not wake the progress thread meanwhile
        try:
            while not work.is_completed():
                if not lock.acquire(blocking=False):
                    return               # the progress thread is moving this ring's data: leave it to it
                try:
                    while move(peer) and not work.is_completed():
                        pass
                finally:
                    lock.release()
                if time.perf_counter() >= deadline:
                    return
        except BaseException as error:   # as on the progress thread: fail every pending operation
            self.fail(error)
        finally:
            segment.words[polling] = 0
            if not work.is_completed():  # data that came while polling rang no bell: hand over
                self._ring_bell(self._rank, force=True)

    def _ring_bell(self, rank: int, force: bool = False) -> None:
        """Wake `rank`'s progress thread if it is blocked (always with `force`)."""
        segment, sock = self._segment, self._sock
        if segment is None or sock is None:
            return
        words = segment.words
        if force or (words[segment.p2p_sleeping_index(rank)] and not words[segment.p2p_polling_index(rank)]):
            with contextlib.suppress(OSError):       # gone, or a wake is already queued
                sock.sendto(b"w", socket.MSG_DONTWAIT, self._addresses[rank])

    def _check_peers(self) -> None:
        segment = self._segment
        assert segment is not None
        error: Exception | None = None
        if segment.aborted():
            error = segment.abort_error(f"point-to-point on rank {self._spec.global_rank}")
        else:
            with self._lock:     # only peers with operations pending: others may have finished and exited
                involved = {dst for dst, queue in self._sends.items() if queue}
                involved |= {src for (src, _), queue in self._posted.items() if queue} | set(self._incoming)
            dead = segment.dead_peer(sorted(involved))
            if dead is not None:
                error = PeerLostError(f"point-to-point on rank {self._spec.global_rank}: "
                                      f"{segment.peer_lost_message(dead)}")
        if error is not None:
            self.fail(error)

    def _ring(self, src: int, dst: int) -> tuple[int, int, int]:
        """Indices of the write and read position words, and the byte offset of the data, of ring src->dst."""
        assert self._segment is not None
        base = self._segment.layout.ring(src, dst)
        return base >> 3, (base + CACHELINE) >> 3, base + 2 * CACHELINE

    def _push(self, dst: int) -> bool:
        """Write as much of the oldest send to `dst` as the ring has room for."""
        segment = self._segment
        assert segment is not None
        send = self._sends[dst][0]
        words, capacity = segment.words, segment.layout.ring_bytes
        w_index, r_index, data = self._ring(self._rank, dst)
        written, free = words[w_index], capacity - (words[w_index] - words[r_index])
        progressed = False
        if send.sent < 0:
            if free < HEADER:
                words[w_index + 1] = 1           # full: the receiver rings when it frees space
                return False
            at = data + written % capacity
            segment.write_word(at, send.tag)
            segment.write_word(at + 8, send.data.numel())
            segment.write_word(at + 16, send.numel)
            segment.write_word(at + 24, send.dtype_code)
            send.sent = 0
            written += HEADER
            free -= HEADER
            words[w_index] = written
            progressed = True
        remaining = send.data.numel() - send.sent
        index = written % capacity
        piece = min(remaining, free, capacity - index)
        if piece < remaining:
            piece = piece // CACHELINE * CACHELINE
        if piece > 0:
            segment.bytes[data + index:data + index + piece].copy_(send.data[send.sent:send.sent + piece])
            send.sent += piece
            words[w_index] = written + _pad(piece)
            progressed = True
        if progressed:
            self._ring_bell(dst)
        if send.sent < send.data.numel():
            if not progressed:
                words[w_index + 1] = 1
            return progressed
        with self._lock:
            self._sends[dst].popleft()
        send.work.to_completed()
        return True

    def _pull(self, src: int) -> bool:
        """Receive the next header or payload piece from `src`, if the ring holds one."""
        segment = self._segment
        assert segment is not None
        words, capacity = segment.words, segment.layout.ring_bytes
        w_index, r_index, data = self._ring(src, self._rank)
        consumed, available = words[r_index], words[w_index] - words[r_index]
        if available <= 0:
            return False
        message = self._incoming.get(src)
        if message is None:
            at = data + consumed % capacity
            tag, nbytes, numel, code = (segment.word(at + offset) for offset in (0, 8, 16, 24))
            words[r_index] = consumed + HEADER
            self._space_freed(src, w_index)
            message = self._incoming[src] = self._match(src, tag, nbytes, numel, code)
            if nbytes > 0:
                return True
        else:
            index = consumed % capacity
            piece = min(_pad(message.nbytes - message.received), available, capacity - index)
            useful = min(piece, message.nbytes - message.received)
            if message.target is not None:
                message.target[message.received:message.received + useful].copy_(
                    segment.bytes[data + index:data + index + useful])
            message.received += useful
            words[r_index] = consumed + piece
            self._space_freed(src, w_index)
            if message.received < message.nbytes:
                return True
        del self._incoming[src]
        self._complete(message)
        return True

    def _space_freed(self, src: int, w_index: int) -> None:
        """Ring `src` if it found the ring src -> this rank full (see Note: ring framing)."""
        assert self._segment is not None
        words = self._segment.words
        if words[w_index + 1]:
            words[w_index + 1] = 0
            self._ring_bell(src)

    def _match(self, src: int, tag: int, nbytes: int, numel: int, code: int) -> _Message:
        """Pick the destination of a message whose header just arrived (see Note: matching)."""
        with self._lock:
            waiting = self._posted.get((src, tag))
            recv = waiting.popleft() if waiting else None
        message = _Message(src, tag, nbytes, numel, code, None, recv)
        if recv is None:
            message.target = torch.empty(nbytes, dtype=torch.uint8)
        elif self._fits(message, recv):
            message.target = _as_bytes(recv.tensor)
        return message

    def _complete(self, message: _Message) -> None:
        if message.recv is not None:
            self._deliver(message, message.target)
            return
        with self._lock:
            waiting = self._posted.get((message.src, message.tag))
            message.recv = waiting.popleft() if waiting else None
            if message.recv is None:
                self._unexpected[(message.src, message.tag)].append(message)
        if message.recv is not None:
            self._deliver(message, message.target)

    # -- lifetime -------------------------------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Fail every pending operation with `error`; later posts raise GroupAbortedError."""
        with self._lock:
            if self._error is None:
                self._error = error
            works = [send.work for queue in self._sends.values() for send in queue]
            works += [recv.work for queue in self._posted.values() for recv in queue]
            works += [message.recv.work for message in self._incoming.values() if message.recv is not None]
            self._sends.clear()
            self._posted.clear()
        self._ring_bell(self._rank, force=True)
        for work in works:
            work.to_failed(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._ring_bell(self._rank, force=True)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self.fail(GroupAbortedError(f"rank {self._spec.global_rank}: the group was destroyed with point-to-point "
                                    f"operations still pending"))
        if self._sock is not None:
            self._sock.close()
