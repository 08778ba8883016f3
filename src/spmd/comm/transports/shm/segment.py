"""Shared-memory segments of the shm transport: layout, lifecycle, control words, liveness and waits.

Layer: comm. One segment per group (and host). It is a file in /dev/shm that group rank 0 creates and
every rank maps; once all ranks have mapped it, every rank unlinks the name, so the memory lives exactly as
long as some rank still maps it: a group destroyed, a process exiting normally and a process killed with
SIGKILL all leave nothing behind in /dev/shm. Only the short set-up window (create -> all attached) holds
a name; a process that exits normally in that window unlinks it (atexit), and `remove_orphan_segments`
(names.py), which every new segment runs first and spmdrun's agent runs whenever its workers have stopped,
removes names whose creating process died (SIGKILL in that window).

Note: segment layout
All offsets are multiples of 64 (a cache line), so words written by different ranks never share one.
P = 2 * LAG is the number of phase buffers of each kind (see Note: phases).

    header       HEADER_BYTES: magic, layout (group size, slot bytes, ring bytes, lag), the abort word, the
                 abort kind, the length of the abort message, and the message itself
    control      one CTRL block per rank: its phase counter, pid, start time, attached and sleeping flags,
                 and per phase buffer its fingerprint digest, its encoded fingerprint and its all_to_all
                 split sizes
    slots        P staging slots of SLOT bytes per rank (rank r writes only its own), then P shared
                 result slots (each rank writes only its own slice of them)
    rings        one P2P ring per ordered pair of ranks: a write position (sender's cache line), a read
                 position (receiver's cache line) and RING bytes of data

The total is fixed by the group size, never by the tensors: HEADER + n*CTRL + (n+1)*P*SLOT + n*n*(128+RING)
(SLOT = 1 MiB, LAG = 1 so P = 2, RING = 1 MiB by default; RING shrinks for large groups): 10 MiB for 2
ranks, 26 MiB for 4, 82 MiB for 8. tmpfs allocates a page only when it is first touched, so rings of pairs
that never exchange messages cost nothing.

Note: phases
Each rank has one phase counter, only ever increased by itself. Ending phase q-1 (entering phase q) a rank
publishes q, then waits until every peer's counter is at least q - LAG + 1: ranks run at most LAG - 1
phases apart. LAG = 1 (lockstep) measured fastest, quiet or loaded: a larger LAG lets a rank that has the
CPU run ahead of a descheduled peer, but its extra buffers push the chunks out of cache before the next
stage reads them (benchmarks/shm_notes.md). Rule of every algorithm here: in phase
q a rank writes only buffers with index q % P (its own staging slot, its own slice of the result slot,
its own fingerprint and splits) and reads only buffers the others wrote in phase q - LAG, index
(q - LAG) % P. A rank in phase q knows every peer has finished phase q - LAG, so what it reads is
complete; and a buffer written in phase w is read in phase w + LAG and next overwritten in phase w + 2*LAG,
when the writer knows every peer has finished phase w + LAG. No other handshake is needed: a collective
costs one counter update per chunk, and waits only when a peer is more than LAG - 1 chunks behind.
Phases with no work are skipped in one step (a counter may jump by several phases).
Ordering relies on x86-64's total store order (data stores become visible before the counter store).

Note: waiting
A wait first polls the peer's counter (when both ranks have a core, that is the fastest hand-off there
is). How long it polls adapts: a wait that the polling satisfied doubles the next one's budget (up to about
500 us), a wait that had to block halves it (down to about 20 us), so ranks with a core each hand phases
over without system calls, and ranks that share cores soon stop burning the core their peer needs. Then
it sets its SLEEPING word, polls once more, and blocks on its own wake
socket (an abstract-namespace unix datagram socket, named after the segment and the rank, so it needs no
cleanup). A rank that ends a phase sends one byte to every peer whose SLEEPING word is set. Blocking
matters on a loaded machine: the kernel runs the waiter exactly when its peer has made progress, and the
waiter's core is free for the peer meanwhile, instead of being burnt by spinning. A wake that races with
the SLEEPING store can be missed; the blocking receive times out after WAKE_TIMEOUT_S, which bounds the
damage and also paces the checks of the abort word, the deadline and the peers' liveness.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._core.deadline import Deadline
from spmd._core.errors import CommTimeoutError, GroupAbortedError, PeerLostError, parse_abort_text
from spmd.comm.transports.shm.names import (
    NAME_PREFIX,
    SHM_DIR,
    new_segment_name,
    process_start_time,
    remove_orphan_segments,
)

SLOT_BYTES = 1 << 20          # one staging slot; a chunk of a large collective is at most this per rank
LAG = 1                       # ranks may run up to LAG - 1 phases apart (see Note: phases)
RING_BYTES = 1 << 20          # P2P ring per ordered pair of ranks (shrunk for large groups, see ring_bytes_for)
HEADER_BYTES = 4096
FP_BYTES = 2048               # per buffer: digest of Fingerprint.key() less seq (16 bytes), seq, length, encoded
CACHELINE = 64
MAGIC = 0x73706D6473686D31    # "spmdshm1"

# header words (byte offsets)
_H_MAGIC, _H_SIZE, _H_SLOT, _H_RING, _H_LAG, _H_ABORT, _H_ABORT_KIND, _H_ABORT_LEN = 0, 8, 16, 24, 32, 64, 72, 80
_H_ABORT_MSG, _ABORT_MSG_BYTES = 128, HEADER_BYTES - 128
# control block words (byte offsets inside a rank's block); _C_SLEEPING is set while the rank blocks on its
# wake socket, so that a rank ending a phase knows whom to wake (see Note: waiting)
# and _C_P2P_SLEEPING likewise for its P2P progress thread; _C_P2P_POLLING is set while a thread of the
# rank waiting for a send or receive moves ring data itself (see p2p)
_C_PHASE, _C_PID, _C_START, _C_ATTACHED, _C_SLEEPING, _C_P2P_SLEEPING, _C_P2P_POLLING, _C_FP = (
    0, 64, 72, 80, 96, 104, 112, 128)

ABORT_OTHER, ABORT_PEER_LOST = 1, 2
SPIN_POLLS = (300, 8000)      # least and most counter polls (about 20 us and 500 us) before a wait blocks
WAKE_TIMEOUT_S = 0.01         # a blocked wait re-checks its counter, the abort word, the deadline this often
LIVENESS_S = 0.05             # how often a wait checks that its peers' processes are alive

DescribeFn = Callable[[], str]   # builds the "op #seq on group, rank r" prefix of an error, only when needed

_linked: set[str] = set()     # names this process created and has not unlinked yet (the set-up window)
_linked_lock = threading.Lock()


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ring_bytes_for(group_size: int) -> int:
    """P2P ring size: RING_BYTES, shrunk so that all n*(n-1) rings together stay under 64 MiB."""
    pairs = max(1, group_size * (group_size - 1))
    return min(RING_BYTES, max(64 << 10, (64 << 20) // pairs // 4096 * 4096))


class Layout:
    """Byte offsets of every region of a segment (see Note: segment layout)."""

    def __init__(self, group_size: int, slot_bytes: int, ring_bytes: int, lag: int) -> None:
        self.group_size = group_size
        self.slot_bytes = slot_bytes
        self.ring_bytes = ring_bytes
        self.lag = lag
        self.buffers = 2 * lag                                            # P: buffers of each kind
        self.splits_offset = _C_FP + self.buffers * FP_BYTES              # per buffer: 2n int64 split sizes
        self.ctrl_bytes = _round_up(self.splits_offset + self.buffers * 2 * group_size * 8, 4096)
        self.ctrl_offset = HEADER_BYTES
        self.slots_offset = self.ctrl_offset + group_size * self.ctrl_bytes
        self.result_offset = self.slots_offset + self.buffers * group_size * slot_bytes
        self.rings_offset = self.result_offset + self.buffers * slot_bytes
        self.ring_stride = 2 * CACHELINE + ring_bytes
        self.total = self.rings_offset + group_size * group_size * self.ring_stride

    def ctrl(self, rank: int) -> int:
        return self.ctrl_offset + rank * self.ctrl_bytes

    def slot(self, rank: int, index: int) -> int:
        return self.slots_offset + (self.buffers * rank + index) * self.slot_bytes

    def result(self, index: int) -> int:
        return self.result_offset + index * self.slot_bytes

    def ring(self, src: int, dst: int) -> int:
        """Offset of the ring src -> dst: write position, then read position one cache line later, then data."""
        return self.rings_offset + (src * self.group_size + dst) * self.ring_stride


def _unlink(name: str) -> None:
    with _linked_lock:
        _linked.discard(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


@atexit.register
def _unlink_at_exit() -> None:
    with _linked_lock:
        names = list(_linked)
    for name in names:
        _unlink(name)


class Segment:
    """One mapped segment: a uint8 tensor over all of it, int64 control words, and waits on peers."""

    def __init__(self, name: str, fd: int, layout: Layout, rank: int) -> None:
        self.name = name
        self.layout = layout
        self.rank = rank
        self.size = layout.group_size
        self._mmap = mmap.mmap(fd, layout.total)
        os.close(fd)
        self.bytes: Tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.words = memoryview(self._mmap).cast("q")
        self.pids = [0] * self.size
        self.start_times = [0] * self.size
        self.global_ranks = list(range(self.size))   # for messages; the transport sets the real ones
        self.same_process = True           # every peer is a thread of this process (run_ranks over shm)
        self.spin_least, self.spin_most = SPIN_POLLS
        self.spin = self.spin_least      # adapts between the two (see Note: waiting)
        self._wake = wake_socket(self._wake_address(rank))
        self._wake_peers = [self._wake_address(peer) for peer in range(self.size)]

    # -- creation -------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, group_size: int) -> Segment:
        """Create and map a new segment (group rank 0). Its name stays linked until `unlink_name`.

        The layout comes from the module's SLOT_BYTES, RING_BYTES and LAG at creation; it is written into
        the header, and the other ranks read it from there. Names that jobs killed in their set-up window
        left behind are swept first, so none outlives the next set-up on the machine.
        """
        remove_orphan_segments()
        layout = Layout(group_size, SLOT_BYTES, ring_bytes_for(group_size), LAG)
        name = new_segment_name()
        with _linked_lock:
            _linked.add(name)
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, layout.total)
            except OSError:
                os.close(fd)
                raise
            segment = cls(name, fd, layout, 0)
        except BaseException:
            _unlink(name)
            raise
        segment.write_word(_H_SIZE, group_size)
        segment.write_word(_H_SLOT, layout.slot_bytes)
        segment.write_word(_H_RING, layout.ring_bytes)
        segment.write_word(_H_LAG, layout.lag)
        segment.write_word(_H_MAGIC, MAGIC)
        return segment

    @classmethod
    def attach(cls, name: str, rank: int, group_size: int) -> Segment:
        """Map the segment group rank 0 created (every other rank)."""
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ValueError(f"shm transport: refusing segment name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        with open(fd, "rb", closefd=False) as f:
            header = f.read(40)
        magic, size, slot_bytes, ring_bytes, lag = (int.from_bytes(header[i:i + 8], "little") for i in range(0, 40, 8))
        if magic != MAGIC or size != group_size:
            os.close(fd)
            raise RuntimeError(f"shm transport: segment {name} is not a segment of this {group_size}-rank group")
        return cls(name, fd, Layout(size, slot_bytes, ring_bytes, lag), rank)

    def announce(self) -> None:
        """Publish this rank's pid and start time, then mark it attached."""
        pid = os.getpid()
        base = self.layout.ctrl(self.rank)
        self.write_word(base + _C_PID, pid)
        self.write_word(base + _C_START, process_start_time(pid) or 0)
        self.write_word(base + _C_ATTACHED, 1)

    def await_attached(self, deadline: Deadline, what: str) -> None:
        """Wait until every rank has announced itself, then learn their pids (during group set-up)."""
        for peer in range(self.size):
            base = self.layout.ctrl(peer)
            while self.word(base + _C_ATTACHED) != 1:
                if deadline.expired():
                    raise CommTimeoutError(f"{what}: group rank {peer} did not map the shared segment within "
                                           f"{deadline.timeout:.1f}s")
                time.sleep(0.001)
            self.pids[peer] = self.word(base + _C_PID)
            self.start_times[peer] = self.word(base + _C_START)
        self.same_process = all(pid == os.getpid() for pid in self.pids)
        if self.same_process:
            self.spin = self.spin_least = self.spin_most = 0   # peers are threads that need this thread's GIL

    def _wake_address(self, rank: int) -> bytes:
        """The abstract unix socket address of `rank`'s wake socket (a leading NUL: no file, no cleanup)."""
        return f"\0{self.name}-{rank}".encode()

    def p2p_wake_address(self, rank: int) -> bytes:
        """The address of the wake socket `rank`'s P2P progress thread blocks on."""
        return f"\0{self.name}-{rank}-p2p".encode()

    def p2p_polling_index(self, rank: int) -> int:
        """Index into `words` of the flag a waiting thread of `rank` sets while it polls the rings."""
        return (self.layout.ctrl(rank) + _C_P2P_POLLING) >> 3

    def p2p_sleeping_index(self, rank: int) -> int:
        """Index into `words` of the flag `rank`'s P2P progress thread sets while it blocks."""
        return (self.layout.ctrl(rank) + _C_P2P_SLEEPING) >> 3

    def unlink_name(self) -> None:
        """Remove the segment's name (idempotent); the mapping stays valid until every rank closes it."""
        _unlink(self.name)

    def close(self) -> None:
        """Unmap (once nothing else views the memory; otherwise garbage collection unmaps it later)."""
        self.unlink_name()
        self._wake.close()
        self.words.release()
        del self.bytes
        with contextlib.suppress(BufferError):
            self._mmap.close()

    # -- words ----------------------------------------------------------------------------------------------

    def word(self, offset: int) -> int:
        return self.words[offset >> 3]

    def write_word(self, offset: int, value: int) -> None:
        self.words[offset >> 3] = value

    def write_bytes(self, offset: int, data: bytes) -> None:
        self._mmap[offset:offset + len(data)] = data

    def read_bytes(self, offset: int, length: int) -> bytes:
        return self._mmap[offset:offset + length]

    def phase_index(self, rank: int) -> int:
        """Index into `words` of `rank`'s phase counter."""
        return (self.layout.ctrl(rank) + _C_PHASE) >> 3

    def fp_offset(self, rank: int, index: int) -> int:
        return self.layout.ctrl(rank) + _C_FP + index * FP_BYTES

    def splits_offset(self, rank: int, index: int) -> int:
        return self.layout.ctrl(rank) + self.layout.splits_offset + index * 2 * self.size * 8

    # -- abort ----------------------------------------------------------------------------------------------

    def set_abort(self, kind: int, message: str) -> None:
        """Record the first failure for every rank's waits to see (later aborts keep the first message)."""
        if self.word(_H_ABORT):
            return
        data = message.encode(errors="replace")[:_ABORT_MSG_BYTES]
        self.write_bytes(_H_ABORT_MSG, data)
        self.write_word(_H_ABORT_LEN, len(data))
        self.write_word(_H_ABORT_KIND, kind)
        self.write_word(_H_ABORT, self.rank + 1)
        self.wake_peers(force=True)

    def aborted(self) -> bool:
        return self.words[_H_ABORT >> 3] != 0

    def abort_error(self, what: str) -> Exception:
        """The error a wait raises once some rank aborted the group (call only when `aborted()`)."""
        aborter = self.word(_H_ABORT)
        text = self.read_bytes(_H_ABORT_MSG, self.word(_H_ABORT_LEN)).decode(errors="replace")
        seen_by, reason = parse_abort_text(text)
        seen_by = seen_by or f"group rank {aborter - 1}"
        if self.word(_H_ABORT_KIND) == ABORT_PEER_LOST:
            return PeerLostError(f"{what}: {reason} (seen first by {seen_by})", reason=reason, seen_by=seen_by)
        return GroupAbortedError(f"{what}: {seen_by} aborted the group: {reason}", reason=reason, seen_by=seen_by)

    def dead_peer(self, peers: list[int] | range) -> int | None:
        """The first rank in `peers` whose process has exited (checked through /proc), or None."""
        for peer in peers:
            pid = self.pids[peer]
            if pid and pid != os.getpid() and process_start_time(pid) != self.start_times[peer]:
                return peer
        return None

    # -- waits ----------------------------------------------------------------------------------------------

    def end_phase(self, phase: int) -> None:
        """Publish that this rank has ended `phase` - 1 (its counter becomes `phase`) and wake sleeping peers."""
        self.words[self.phase_index(self.rank)] = phase
        self.wake_peers()

    def wake_peers(self, force: bool = False) -> None:
        """Send a wake byte to every peer blocked on its wake socket (every peer with `force`)."""
        words, layout = self.words, self.layout
        for peer in range(self.size):
            if peer != self.rank and (force or words[(layout.ctrl(peer) + _C_SLEEPING) >> 3]):
                with contextlib.suppress(OSError):      # the peer is gone or already has a wake queued
                    self._wake.sendto(b"w", socket.MSG_DONTWAIT, self._wake_peers[peer])

    def wait_phase(self, target: int, deadline: Deadline, describe: DescribeFn) -> None:
        """Wait until every peer's phase counter is at least `target` (see Note: phases)."""
        words = self.words
        for peer in range(self.size):
            index = self.phase_index(peer)
            if words[index] < target:
                self.wait_word(index, target, peer, deadline, describe)

    def wait_word(self, index: int, target: int, peer: int, deadline: Deadline, describe: DescribeFn) -> None:
        """Wait until words[index] >= target: poll, then block on the wake socket (see Note: waiting).

        Every wake-up checks the abort word and the deadline; every LIVENESS_S it checks that the peer
        processes are alive, so a dead peer is reported within a fraction of a second.
        """
        words = self.words
        for _ in range(self.spin):
            if words[index] >= target:
                self.spin = min(self.spin_most, 2 * self.spin)
                return
        self.spin = max(self.spin_least, self.spin // 2)
        sleeping = (self.layout.ctrl(self.rank) + _C_SLEEPING) >> 3
        next_liveness = time.monotonic() + LIVENESS_S
        while True:
            words[sleeping] = 1
            if words[index] >= target:
                words[sleeping] = 0
                return
            if self.aborted():
                words[sleeping] = 0
                raise self.abort_error(describe())
            now = time.monotonic()
            if now >= deadline.at:
                words[sleeping] = 0
                raise CommTimeoutError(f"{describe()}: timed out after {deadline.timeout:.1f}s waiting for "
                                       f"group rank {peer}")
            if now >= next_liveness:       # only the awaited peer: others may have finished and exited
                next_liveness = now + LIVENESS_S
                dead = self.dead_peer([peer])
                if dead is not None:
                    words[sleeping] = 0
                    lost = self.peer_lost_message(dead)
                    raise PeerLostError(f"{describe()}: {lost}", reason=lost)
            with contextlib.suppress(BlockingIOError, InterruptedError):   # BlockingIOError: SO_RCVTIMEO passed
                self._wake.recv(16)
            words[sleeping] = 0
            if words[index] >= target:
                return

    def peer_lost_message(self, peer: int) -> str:
        return (f"rank {self.global_ranks[peer]} on {socket.gethostname()} (group rank {peer}, pid "
                f"{self.pids[peer]}) died; the group can't continue")


def wake_socket(address: bytes) -> socket.socket:
    """A blocking datagram socket bound to `address` whose recv gives up after WAKE_TIMEOUT_S.

    The kernel's SO_RCVTIMEO bounds the wait (recv then raises BlockingIOError), so a wait costs one
    system call; Python's own socket timeout would add a poll() before every recv.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    seconds = int(WAKE_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", seconds, int((WAKE_TIMEOUT_S - seconds) * 1e6)))
    return sock


def fingerprint_digest(key: tuple) -> bytes:
    """A 16-byte digest of Fingerprint.key(), equal across processes (Python's hash() is salted)."""
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
