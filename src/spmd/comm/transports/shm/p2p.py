"""Point-to-point messages of the shm transport: one byte ring per ordered pair of ranks, one progress thread.

Layer: comm. isend/irecv only queue work; a progress thread (started at the first P2P call of the group)
streams queued sends into the ring to each peer and drains the rings from each peer, so large messages
move in ring-sized pieces and both ranks of a pair may isend (or even send) before they receive.
When it can make no progress the thread blocks on its own wake socket (as collective waits do, see
segment's Note: waiting) with its P2P_SLEEPING flag set; a peer that fills or drains a ring it shares
with this rank, and a local isend/irecv, ring it. The wait times out after WAKE_TIMEOUT_S, which bounds a
missed wake and paces the checks for a dead peer or an aborted group.

Note: ring framing
A ring is RING bytes of data plus two cache lines of words: the sender's (the total bytes ever written, the
ring-full flag, the address of this very word in the sender's memory) and the receiver's (the total bytes
ever consumed, the count of rendezvous messages copied, whether it may read the sender's memory). A message
is a 64-byte header (tag, payload bytes, element count, dtype code, kind, the payload's address in the
sender) followed, for an eager message, by the payload padded to 64 bytes, so positions stay multiples of
64 and a header never wraps. The sender publishes a piece by advancing its write position after the
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

Note: rendezvous
A message of RENDEZVOUS_BYTES or more, to a peer that may read this process's memory, is only a header in
the ring: the receiver copies the payload straight out of the sender's tensor into its own (process_vm_readv,
see peer_memory), one copy at memcpy speed where the ring costs two in ring-sized pieces. The sender's Work
completes when the receiver has copied it: the receiver then advances the ring's rendezvous count (and rings
the sender, as for space freed), and rendezvous messages of one ring are copied in ring order, so a count
is enough. A message nobody has posted a receive for yet is copied into a private buffer at once, as an eager
one would be, so both ranks may still send before they receive. Whether the receiver may read the sender is
learnt once per ordered pair: at the first large eager message from a peer the receiver reads the word the
peer wrote its own address into, and publishes the answer where the sender reads it; until then, and where
the kernel refuses (ptrace rules, seccomp, SPMD_SHM_ONE_COPY=0), messages go through the ring. A group being
aborted may free a sender's tensor while it is read: the receiver checks the abort word after each copy and
fails the receive instead of completing it with what it read.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import enum
import functools
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._core.errors import CommError, GroupAbortedError, PeerLostError
from spmd.comm.transports.base import TransportSpec, deliver_into
from spmd.comm.transports.shm import peer_memory
from spmd.comm.transports.shm.segment import CACHELINE, Segment, wake_socket
from spmd.comm.work import Work

HEADER = 64
LIVENESS_S = 0.05      # with operations pending, peers' liveness is checked this often
INLINE_BYTES = 256 << 10       # an isend this small, with nothing queued before it, is written by the caller
RENDEZVOUS_BYTES = 128 << 10   # a message this large is copied out of the sender's memory where allowed
POLL_S = (1e-3, 50e-6)     # how long a waiting thread moves data itself: ranks with a core each, or fewer
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)

# Words of a ring's two cache lines, from the first word of each (see Note: ring framing).
_W_POSITION, _W_FULL, _W_ADDRESS = 0, 1, 2          # the sender's line
_R_POSITION, _R_COPIED, _R_PEER_READ = 0, 1, 2      # the receiver's line


class _Kind(enum.IntEnum):
    EAGER = 0          # the payload follows the header in the ring
    RENDEZVOUS = 1     # the receiver copies the payload out of the sender's memory


class _PeerRead(enum.IntEnum):
    UNKNOWN = 0        # not asked yet: large messages go through the ring
    ALLOWED = 1
    REFUSED = 2


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _pad(nbytes: int) -> int:
    return (nbytes + CACHELINE - 1) // CACHELINE * CACHELINE


@dataclasses.dataclass(eq=False, slots=True)
class _Send:
    tensor: Tensor        # kept alive until the payload is written, or copied by the receiver
    address: int          # of its first byte
    nbytes: int
    tag: int
    numel: int
    dtype_code: int
    work: Work
    sent: int = -1        # payload bytes written so far; -1 until the header is written
    ticket: int = 0       # rendezvous: the ring's copied count once the receiver has copied this one


@dataclasses.dataclass(eq=False, slots=True)
class _Recv:
    tensor: Tensor
    work: Work


@dataclasses.dataclass(eq=False, slots=True)
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
    address: int = 0            # of target's first byte


class P2PEngine:
    """Queues and the progress thread of one transport's point-to-point traffic."""

    def __init__(self, segment: Segment | None, rank: int, size: int, spec: TransportSpec) -> None:
        self._segment = segment
        self._rank = rank
        self._size = size
        self._spec = spec
        self._lock = threading.Lock()
        self._sends: list[collections.deque[_Send]] = [collections.deque() for _ in range(size)]
        self._unacked: list[collections.deque[_Send]] = [collections.deque() for _ in range(size)]
        self._tickets = [0] * size            # rendezvous messages written into the ring to each peer
        self._posted: dict[tuple[int, int], collections.deque[_Recv]] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque[_Message]] = collections.defaultdict(
            collections.deque)
        self._incoming: list[_Message | None] = [None] * size
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
            self._words, self._capacity = segment.words, segment.layout.ring_bytes
            self._base = segment.bytes.data_ptr()
            self._out = [self._ring(rank, peer) for peer in range(size)]
            self._in = [self._ring(peer, rank) for peer in range(size)]
            for peer in range(size):      # what a receiver reads to learn whether it may read this process
                index = self._out[peer][0] + _W_ADDRESS
                self._words[index] = self._base + index * 8

    # -- posting (caller threads) ---------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        self._raise_if_failed(f"send to group rank {dst}")
        send = _Send(tensor, tensor.data_ptr(), tensor.nbytes, tag, tensor.numel(), _dtype_code(tensor.dtype), work)
        if dst == self._rank:
            self._send_to_self(send)
            return
        queue, lock = self._sends[dst], self._send_locks[dst]
        if not queue and (send.nbytes <= INLINE_BYTES or self._by_rendezvous(dst, send.nbytes)) \
                and lock.acquire(blocking=False):
            try:            # nothing queued before it: the caller writes it now, saving a thread hand-off
                if not queue:
                    self._write(dst, send)
                if not self._written(send):
                    with self._lock:
                        queue.append(send)
            finally:
                lock.release()
            if self._written(send) and not send.ticket:
                work.to_completed()
                return
        else:
            with self._lock:
                queue.append(send)
        with self._lock:
            self._start_locked()
        if not work.is_completed():
            if self._polls:
                work.poll = functools.partial(self._poll, lock, self._advance, dst, work)
            if not send.ticket:     # queued: the progress thread writes it; a rendezvous waits for the receiver,
                self._ring_bell(self._rank)   # whose copy rings this progress thread if nobody polls meanwhile

    def _send_to_self(self, send: _Send) -> None:
        tensor = send.tensor
        with self._lock:
            message = _Message(self._rank, send.tag, send.nbytes, send.numel, send.dtype_code, None)
            waiting = self._posted.get((self._rank, send.tag))
            message.recv = waiting.popleft() if waiting else None
            if message.recv is None:
                message.target = _as_bytes(tensor).clone()
                self._unexpected[(self._rank, send.tag)].append(message)
        if message.recv is not None:
            self._deliver(message, _as_bytes(tensor))
        send.work.to_completed()

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
        if payload is not None and payload.data_ptr() != recv.tensor.data_ptr():
            deliver_into(_as_bytes(recv.tensor), payload)
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
        words, sleeping = self._words, self._segment.p2p_sleeping_index(self._rank)
        next_liveness = time.monotonic() + LIVENESS_S
        while True:
            with self._lock:
                if self._closed or self._error is not None:
                    return
                busy = (any(message is not None for message in self._incoming) or any(self._sends)
                        or any(self._unacked) or any(self._posted.values()))
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
        """One pass over every queued or unacknowledged send and every incoming ring; True if anything moved."""
        progressed = False
        for dst in range(self._size):
            if self._sends[dst] or self._unacked[dst]:
                with self._send_locks[dst]:
                    progressed |= self._advance(dst)
        for src in range(self._size):
            if src != self._rank:
                with self._pull_locks[src]:
                    progressed |= self._pull(src)
        return progressed

    def _advance(self, dst: int) -> bool:
        """Complete the sends to `dst` the receiver has copied, then write what is queued for it (call with its
        send lock held); True if anything moved."""
        progressed = self._collect(dst)
        if self._sends[dst]:
            progressed |= self._push(dst)
        return progressed

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
                involved = {dst for dst in range(self._size) if self._sends[dst] or self._unacked[dst]}
                involved |= {src for (src, _), queue in self._posted.items() if queue}
                involved |= {src for src, message in enumerate(self._incoming) if message is not None}
            dead = segment.dead_peer(sorted(involved))
            if dead is not None:
                lost = segment.peer_lost_message(dead)
                error = PeerLostError(f"point-to-point on rank {self._spec.global_rank}: {lost}", reason=lost)
        if error is not None:
            self.fail(error)

    def _ring(self, src: int, dst: int) -> tuple[int, int, int]:
        """Indices of the first words of the sender's and the receiver's line, and the byte offset of the
        data, of ring src->dst."""
        assert self._segment is not None
        base = self._segment.layout.ring(src, dst)
        return base >> 3, (base + CACHELINE) >> 3, base + 2 * CACHELINE

    # -- sending --------------------------------------------------------------------------------------------

    def _by_rendezvous(self, dst: int, nbytes: int) -> bool:
        """Whether a message of `nbytes` to `dst` goes by rendezvous (see Note: rendezvous)."""
        return nbytes >= RENDEZVOUS_BYTES and self._words[self._out[dst][1] + _R_PEER_READ] == _PeerRead.ALLOWED

    @staticmethod
    def _written(send: _Send) -> bool:
        """Whether nothing of `send` remains to be written into the ring."""
        return send.ticket > 0 or send.sent == send.nbytes

    def _write(self, dst: int, send: _Send) -> bool:
        """Write the header and as much of the payload of `send` as the ring to `dst` has room for (call with
        its send lock held); True if anything moved."""
        words, capacity = self._words, self._capacity
        w, r, data = self._out[dst]
        written = words[w + _W_POSITION]
        free = capacity - (written - words[r + _R_POSITION])
        start = written
        if send.sent < 0:
            if free < HEADER:
                words[w + _W_FULL] = 1       # full: the receiver rings when it frees space
                return False
            kind = _Kind.RENDEZVOUS if self._by_rendezvous(dst, send.nbytes) else _Kind.EAGER
            at = (data + written % capacity) >> 3
            words[at], words[at + 1], words[at + 2] = send.tag, send.nbytes, send.numel
            words[at + 3], words[at + 4], words[at + 5] = send.dtype_code, kind, send.address
            written += HEADER
            free -= HEADER
            if kind is _Kind.RENDEZVOUS:     # counted and kept before the receiver can see it
                self._tickets[dst] += 1
                send.ticket, send.sent = self._tickets[dst], send.nbytes
                self._unacked[dst].append(send)
            else:
                send.sent = 0
        remaining = send.nbytes - send.sent
        if remaining > 0:
            index = written % capacity
            piece = min(remaining, free, capacity - index)
            if piece < remaining:
                piece = piece // CACHELINE * CACHELINE
            if piece > 0:
                ctypes.memmove(self._base + data + index, send.address + send.sent, piece)
                send.sent += piece
                written += _pad(piece)
            elif written == start:
                words[w + _W_FULL] = 1
        if written == start:
            return False
        words[w + _W_POSITION] = written     # publish header and payload at once
        self._ring_bell(dst)
        return True

    def _push(self, dst: int) -> bool:
        """Write as much of the oldest send queued for `dst` as the ring has room for (send lock held)."""
        queue = self._sends[dst]
        send = queue[0]
        progressed = self._write(dst, send)
        if self._written(send):
            with self._lock:
                queue.popleft()
            if not send.ticket:
                send.work.to_completed()
        return progressed

    def _collect(self, dst: int) -> bool:
        """Complete the rendezvous sends to `dst` that the receiver has copied (send lock held)."""
        unacked = self._unacked[dst]
        if not unacked:
            return False
        copied = self._words[self._out[dst][1] + _R_COPIED]
        progressed = False
        while unacked and unacked[0].ticket <= copied:
            unacked.popleft().work.to_completed()
            progressed = True
        return progressed

    # -- receiving ------------------------------------------------------------------------------------------

    def _pull(self, src: int) -> bool:
        """Receive the next header or payload piece from `src`, if the ring holds one (pull lock held)."""
        words, capacity = self._words, self._capacity
        w, r, data = self._in[src]
        consumed = words[r + _R_POSITION]
        available = words[w + _W_POSITION] - consumed
        if available <= 0:
            return False
        message = self._incoming[src]
        if message is None:
            at = (data + consumed % capacity) >> 3
            tag, nbytes, numel, code, kind, address = words[at:at + 6].tolist()
            consumed += HEADER
            available -= HEADER
            message = self._match(src, tag, nbytes, numel, code)
            if kind == _Kind.RENDEZVOUS:
                words[r + _R_POSITION] = consumed
                self._space_freed(src, w)
                self._copy_from_sender(src, message, address)
                self._complete(message)
                return True
            if nbytes >= RENDEZVOUS_BYTES and words[r + _R_PEER_READ] == _PeerRead.UNKNOWN:
                self._probe(src)
        if available > 0 and message.received < message.nbytes:
            index = consumed % capacity
            piece = min(_pad(message.nbytes - message.received), available, capacity - index)
            useful = min(piece, message.nbytes - message.received)
            if message.address:
                ctypes.memmove(message.address + message.received, self._base + data + index, useful)
            message.received += useful
            consumed += piece
        words[r + _R_POSITION] = consumed
        self._space_freed(src, w)
        if message.received < message.nbytes:
            self._incoming[src] = message
            return True
        self._incoming[src] = None
        self._complete(message)
        return True

    def _copy_from_sender(self, src: int, message: _Message, address: int) -> None:
        """Copy a rendezvous payload out of `src`'s memory, then tell `src` (see Note: rendezvous)."""
        segment = self._segment
        assert segment is not None
        if message.address:
            try:
                peer_memory.read(segment.pids[src], address, message.address, message.nbytes)
            except OSError as error:
                if segment.dead_peer([src]) is not None:
                    lost = segment.peer_lost_message(src)
                    raise PeerLostError(f"point-to-point on rank {self._spec.global_rank}: {lost}",
                                        reason=lost) from error
                raise CommError(f"recv from rank {self._spec.global_ranks[src]} on rank {self._spec.global_rank}: "
                                f"copying {message.nbytes} bytes out of its memory failed: {error}") from error
            if segment.aborted():
                raise segment.abort_error(f"point-to-point on rank {self._spec.global_rank}")
        message.received = message.nbytes
        index = self._in[src][1] + _R_COPIED
        self._words[index] += 1
        self._ring_bell(src)

    def _probe(self, src: int) -> None:
        """Learn whether this rank may read `src`'s memory and publish it for `src` (see Note: rendezvous)."""
        segment = self._segment
        assert segment is not None
        w, r, _ = self._in[src]
        allowed = peer_memory.can_read(segment.pids[src], self._words[w + _W_ADDRESS])
        self._words[r + _R_PEER_READ] = _PeerRead.ALLOWED if allowed else _PeerRead.REFUSED

    def _space_freed(self, src: int, w: int) -> None:
        """Ring `src` if it found the ring src -> this rank full (see Note: ring framing)."""
        words = self._words
        if words[w + _W_FULL]:
            words[w + _W_FULL] = 0
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
            message.target = recv.tensor
        if message.target is not None:
            message.address = message.target.data_ptr()
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
            works = [send.work for queue in self._sends + self._unacked for send in queue]
            works += [recv.work for queue in self._posted.values() for recv in queue]
            works += [message.recv.work for message in self._incoming
                      if message is not None and message.recv is not None]
            for queue in self._sends + self._unacked:
                queue.clear()
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
