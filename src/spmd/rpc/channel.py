"""The RPC agent's connections: one authenticated socket per pair of workers, written and read directly by the
agent's own threads.

Layer: rpc (over comm). The sockets are made like the tcp transport's (its Connector: every worker listens,
publishes its address in the group's store, connects to lower ranks and accepts higher ones, each connection
proving it holds the group's token before any byte of it is used), under a store prefix of their own; Unix
sockets when every worker is on one host (twice the bandwidth of TCP over loopback). A message
is written by the thread that sends it and read by the peer's receiver thread, with no transport thread in
between: a point-to-point op of the group would cost two thread hand-offs on each side, most of a small call's
time (see README: Performance, RPC).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading

from spmd._core.deadline import Deadline
from spmd.comm.group import ProcessGroup
from spmd.comm.store import PrefixStore
from spmd.comm.transports.tcp.connect import Connector
from spmd.comm.transports.tcp.wire import recv_into


class Channels:
    """This worker's socket to every other worker of `group`; built collectively (every worker constructs it)."""

    def __init__(self, group: ProcessGroup, timeout: float) -> None:
        spec = group.transport.spec
        spec = dataclasses.replace(spec, store=PrefixStore("rpc-channel", spec.store),
                                   group_name=f"{spec.group_name}-rpc")
        self.rank = spec.group_rank
        self._cond = threading.Condition()
        self._closing = False
        self.sockets: list[socket.socket | None] = [None] * spec.group_size
        connector = Connector(spec, f"the RPC agent of {group.description}", self._cond, self.sockets,
                              lambda: self._closing, self._register, local_sockets=True)
        try:
            connector.connect(Deadline(timeout))
        except BaseException:
            self.close()
            connector.close()
            raise
        connector.close()

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
