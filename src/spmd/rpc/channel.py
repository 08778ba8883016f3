"""The RPC agent's connections: one authenticated socket per pair of workers, written and read directly by the
agent's own threads.

Layer: rpc (over comm). The sockets are made like the tcp transport's (its Connector: every worker listens,
publishes its address in the group's store, connects to lower ranks and accepts higher ones, each connection
proving it holds the group's token before any byte of it is used), under a store prefix of their own; Unix
sockets when every worker is on one host (twice the bandwidth of TCP over loopback). A message
is written by the thread that sends it and read by the peer's receiver thread, with no transport thread in
between: a point-to-point op of the group would cost two thread hand-offs on each side, most of a small call's
time (see README: Performance, RPC).

Note: large tensors by reference
A socket copies a message's bytes twice (into the kernel, out of it). Between two workers of one host where the
receiver may read the sender's memory (peer_memory.can_read, checked once per pair at set-up), a tensor of at
least ONE_COPY_BYTES goes by reference instead: the sender writes its address, the receiver copies it straight
into its own tensor (one copy), then acknowledges, and only then does the sender let go of it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import select
import socket
import struct
import threading
import time

from spmd._core.deadline import Deadline
from spmd.comm.store import PrefixStore
from spmd.comm.transports.base import TransportSpec
from spmd.comm.transports.shm import peer_memory
from spmd.comm.transports.tcp.connect import Connector
from spmd.comm.transports.tcp.wire import recv_into

ONE_COPY_BYTES = 1 << 20      # tensors from this size go by reference where the receiver can read the sender


class Channels:
    """This worker's socket to every other worker `spec` names; built collectively (every worker constructs it)."""

    def __init__(self, spec: TransportSpec, timeout: float) -> None:
        spec = dataclasses.replace(spec, store=PrefixStore("rpc-channel", spec.store),
                                   group_name=f"{spec.group_name}-rpc")
        self.rank = spec.group_rank
        self.pids: dict[int, int] = {}              # the process of each peer on this host
        self.reads_me: set[int] = set()             # the peers that may read this process's memory
        self._cond = threading.Condition()
        self._closing = False
        self.sockets: list[socket.socket | None] = [None] * spec.group_size
        connector = Connector(spec, f"the RPC agent of ranks {list(spec.global_ranks)}", self._cond, self.sockets,
                              lambda: self._closing, self._register, local_sockets=True)
        try:
            connector.connect(Deadline(timeout))
        except BaseException:
            self.close()
            connector.close()
            raise
        connector.close()
        self._learn_who_reads_whom(spec, timeout)

    def _learn_who_reads_whom(self, spec: TransportSpec, timeout: float) -> None:
        """Collective: each worker tries reading each peer of its host once (see Note: large tensors by
        reference) and publishes whom it can read; `reads_me` becomes the peers that can read this worker."""
        store, hosts, rank = spec.store, spec.hosts, spec.group_rank
        self._probe = ctypes.c_int64(0)           # a word holding its own address, for peers to read
        self._probe.value = ctypes.addressof(self._probe)
        store.set(f"memory/{rank}", f"{os.getpid()}:{self._probe.value}")
        local = [peer for peer in range(len(hosts)) if peer != rank and hosts[peer] == hosts[rank]]
        store.wait([f"memory/{peer}" for peer in local], timeout=timeout)
        readable = []
        for peer in local:
            pid, address = (int(part) for part in store.get(f"memory/{peer}").decode().split(":"))
            self.pids[peer] = pid
            if peer_memory.can_read(pid, address):
                readable.append(peer)
        store.set(f"reads/{rank}", ",".join(map(str, readable)))
        store.wait([f"reads/{peer}" for peer in local], timeout=timeout)
        for peer in local:
            their = store.get(f"reads/{peer}").decode()
            if their and rank in {int(part) for part in their.split(",")}:
                self.reads_me.add(peer)

    def read(self, peer: int, address: int, into: int, nbytes: int) -> None:
        """Copy `nbytes` at `address` in `peer`'s memory to address `into` here; OSError if `peer` is gone."""
        peer_memory.read(self.pids[peer], address, into, nbytes)

    def _register(self, peer: int, sock: socket.socket) -> None:
        # a send blocks for as long as its peer takes to read (no send timeout: a dead peer ends the socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        with self._cond:
            self.sockets[peer] = sock
            self._cond.notify_all()

    def send(self, peer: int, *pieces: bytes | memoryview) -> None:
        """Write `pieces` to `peer`, in order, on the calling thread (one sender per peer at a time: the caller
        holds the peer's lock); OSError if the peer is gone."""
        sock = self.sockets[peer]
        assert sock is not None
        for piece in pieces:
            sock.sendall(piece)

    def send_until(self, peer: int, pieces: list[bytes | memoryview], deadline: float) -> list[memoryview]:
        """Write `pieces` to `peer` as `send` does, but only until `deadline` (time.monotonic()): the bytes not yet
        written, as views into `pieces` (empty once all are), for the caller to finish; OSError if the peer is
        gone."""
        sock = self.sockets[peer]
        assert sock is not None
        pending = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
        while pending:
            try:                 # first as much as the socket takes now: a small message never waits
                sent = sock.send(pending[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return pending
                select.select([], [sock], [], remaining)
                continue
            pending[0] = pending[0][sent:]
            if not len(pending[0]):
                pending.pop(0)
        return []

    def receive_into(self, peer: int, view: memoryview) -> None:
        """Fill `view` with the next bytes from `peer` (blocking); an error at its end of stream."""
        sock = self.sockets[peer]
        assert sock is not None
        if len(view):
            recv_into(sock, view)

    def wake_receivers(self) -> None:
        """Shut every socket down: a receiver blocked reading wakes (end of stream); nothing more is sent."""
        for sock in self.sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._cond:
            self._closing = True
        for sock in self.sockets:
            if sock is not None:
                sock.close()
