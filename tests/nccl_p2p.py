"""NCCL's point-to-point semantics on thread ranks, so code that sends and receives is checked on the CPU against
what a GPU run would do: spmd's own transports buffer sends and match messages by tag, NCCL does neither.

NcclP2PThreadsTransport (registered as "nccl-p2p-threads") is the threads transport whose sends and receives
behave as over torch's NCCL: tags are ignored, the k-th send from rank a to rank b pairs with the k-th receive
at b from a (a size or dtype that differs fails both, as it would corrupt or hang on a GPU); a rank's operations
with one peer run in the order issued, each only once the one before it has completed (a large NCCL send waits
for its receive, and the ops with one peer share a stream), except the messages of one batch_isend_irecv, which
start together (one coalesced NCCL group). So two ranks that each send before they receive, where the sends are
not one batch, never complete (the GPUs would hang): the caller's Work times out. Messages to the rank itself
stay buffered, as the torch:nccl transport keeps them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
from torch import Tensor

from spmd._core.errors import CommError, GroupAbortedError
from spmd.comm.transports import base
from spmd.comm.transports.base import P2PStart, TransportSpec, deliver_into
from spmd.comm.transports.threads import ThreadsTransport
from spmd.comm.work import Work


@dataclasses.dataclass(eq=False)
class _Op:
    kind: str                # "isend" or "irecv"
    rank: int                # the rank that issued it
    peer: int
    tensor: Tensor
    work: Work
    done: bool = False


class _Channels:
    """The pending point-to-point operations of one group's ranks (shared by its threads, under `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int], collections.deque[list[_Op]]] = collections.defaultdict(collections.deque)
        self.sends: dict[tuple[int, int], collections.deque[_Op]] = collections.defaultdict(collections.deque)
        self.recvs: dict[tuple[int, int], collections.deque[_Op]] = collections.defaultdict(collections.deque)
        self.sent: dict[tuple[int, int], int] = collections.defaultdict(int)
        self.error: BaseException | None = None

    def issue(self, entry: list[_Op]) -> list[tuple[_Op, BaseException | None]]:
        """Queue `entry` (ops of one rank with one peer that start together); the ops it let finish."""
        finished: list[tuple[_Op, BaseException | None]] = []
        queue = self.queues[(entry[0].rank, entry[0].peer)]
        queue.append(entry)
        if len(queue) == 1:
            self._activate(entry, finished)
        return finished

    def _activate(self, entry: list[_Op], finished: list) -> None:
        for op in entry:
            if op.kind == "isend":
                self.sends[(op.rank, op.peer)].append(op)
                self._match((op.rank, op.peer), finished)
            else:
                self.recvs[(op.peer, op.rank)].append(op)
                self._match((op.peer, op.rank), finished)

    def _match(self, direction: tuple[int, int], finished: list) -> None:
        sends, recvs = self.sends[direction], self.recvs[direction]
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            self.sent[direction] += 1
            error = None
            if send.tensor.numel() != recv.tensor.numel() or send.tensor.dtype != recv.tensor.dtype:
                error = CommError(
                    f"NCCL pairs send #{self.sent[direction]} from rank {direction[0]} to rank {direction[1]} "
                    f"({send.tensor.numel()} {send.tensor.dtype}) with that rank's receive #{self.sent[direction]} "
                    f"from it ({recv.tensor.numel()} {recv.tensor.dtype}): tags are ignored, order is all")
            else:
                deliver_into(recv.tensor, send.tensor)
            for op in (send, recv):
                op.done = True
                finished.append((op, error))
                self._retire((op.rank, op.peer), finished)

    def _retire(self, queue_key: tuple[int, int], finished: list) -> None:
        queue = self.queues[queue_key]
        while queue and all(op.done for op in queue[0]):
            queue.popleft()
            if queue:
                self._activate(queue[0], finished)

    def fail(self, error: BaseException) -> list[_Op]:
        if self.error is None:
            self.error = error
        pending = [op for queue in self.queues.values() for entry in queue for op in entry if not op.done]
        self.queues.clear()
        self.sends.clear()
        self.recvs.clear()
        return pending


_CHANNELS: dict[str, _Channels] = {}
_CHANNELS_LOCK = threading.Lock()


class NcclP2PThreadsTransport(ThreadsTransport):
    """The threads transport with NCCL's point-to-point semantics (see the module docstring)."""

    name = "nccl-p2p-threads"
    matches_by_tag = False

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        with _CHANNELS_LOCK:
            self._channels = _CHANNELS.setdefault(self._key, _Channels())

    def _issue(self, entry: list[_Op]) -> None:
        with self._channels.lock:
            if self._channels.error is not None:
                raise GroupAbortedError(f"send or recv: the group was aborted ({self._channels.error})")
            finished = self._channels.issue(entry)
        for op, error in finished:
            if error is None:
                op.work.to_completed()
            else:
                op.work.to_failed(error)

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        if dst == self.group_rank:
            super().isend(tensor, dst, tag, work)
        else:
            self._issue([_Op("isend", self.group_rank, dst, tensor, work)])

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        if src == self.group_rank:
            super().irecv(tensor, src, tag, work)
        else:
            self._issue([_Op("irecv", self.group_rank, src, tensor, work)])

    def start_p2p_batch(self, ops: list[P2PStart]) -> None:
        by_peer: dict[int, list[_Op]] = {}
        for kind, tensor, peer, tag, work in ops:
            if peer == self.group_rank:
                (super().isend if kind == "isend" else super().irecv)(tensor, peer, tag, work)
            else:
                by_peer.setdefault(peer, []).append(_Op(kind, self.group_rank, peer, tensor, work))
        for entry in by_peer.values():
            self._issue(entry)

    def abort(self, error: BaseException) -> None:
        with self._channels.lock:
            pending = self._channels.fail(error)
        for op in pending:
            op.work.to_failed(error)
        super().abort(error)

    def close(self) -> None:
        key = self._key
        super().close()
        with _CHANNELS_LOCK:
            if key not in _hubs():
                _CHANNELS.pop(key, None)


def _hubs() -> dict:
    from spmd.comm.transports import threads

    return threads._HUBS


def register_nccl_p2p_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(base._TRANSPORTS, NcclP2PThreadsTransport.name, f"{__name__}:NcclP2PThreadsTransport")
