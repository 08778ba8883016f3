"""The threads transport: every rank is a thread of one process, and tensors are exchanged by reference.

Layer: comm. For fast tests, notebooks, and stepping through a distributed program in one debugger.

Each collective is two phases over a shared board: every rank posts its fingerprint and tensors and waits
for the others (phase 1), computes its own result by reading the posted tensors, then waits until
everyone has finished reading (phase 2) before writing over anything another rank might still read.
Reductions combine inputs in rank order, so every rank gets bit-identical results.
"""

from __future__ import annotations

import collections
import threading
import uuid
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CollectiveMismatchError, CommError, CommTimeoutError, GroupAbortedError
from spmd.comm.debug import Fingerprint, mismatch_message
from spmd.comm.reduce_op import ReduceOp, reduce_into
from spmd.comm.transports.base import OpContext, Transport, TransportSpec, deliver_into
from spmd.comm.work import Work

_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


class _Barrier:
    """A reusable barrier whose passing can't be undone by a later abort (unlike threading.Barrier, where an
    abort between the release and a waiter's wake-up breaks that waiter too)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = 0
        self.generation = 0
        self.broken = False
        self.cond = threading.Condition()

    def wait(self, timeout: float) -> bool:
        """True once all parties arrived; False on timeout or abort (the caller then fails the hub)."""
        with self.cond:
            if self.broken:
                return False
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.parties:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return True
            self.cond.wait_for(lambda: self.generation != generation or self.broken, timeout)
            return self.generation != generation

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class _Hub:
    """State shared by the threads of one group: the board, a barrier, and the P2P mailboxes."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.board: list[tuple[Fingerprint, Any] | None] = [None] * group_size
        self.barrier = _Barrier(group_size)
        self.error: BaseException | None = None
        self.joined = 0      # ranks that ever attached; the hub is dropped only after all attached and left
        self.users = 0
        self.mail_lock = threading.Lock()
        self.mailboxes: dict[tuple[int, int, int], collections.deque[Tensor]] = collections.defaultdict(
            collections.deque)
        self.waiting_recvs: dict[tuple[int, int, int], collections.deque[tuple[Tensor, Work]]] = (
            collections.defaultdict(collections.deque))

    def fail(self, error: BaseException) -> None:
        with self.barrier.cond:
            if self.error is None:
                self.error = error
        self.barrier.abort()
        with self.mail_lock:
            pending = [item for queue in self.waiting_recvs.values() for item in queue]
            self.waiting_recvs.clear()
        for _, work in pending:
            work.to_failed(error)


class ThreadsTransport(Transport):
    """Ranks as threads; see the module docstring for the protocol."""

    name = "threads"
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._key = spec.store.compare_set("threads_hub", "", uuid.uuid4().hex).decode()
        with _HUBS_LOCK:
            hub = _HUBS.get(self._key)
            if hub is None:
                hub = _HUBS[self._key] = _Hub(spec.group_size)
            hub.joined += 1
            hub.users += 1
        self._hub = hub

    # -- phases ---------------------------------------------------------------------------------------------

    def _wait_all(self, ctx: OpContext) -> None:
        hub = self._hub
        if not hub.barrier.wait(timeout=ctx.deadline.remaining()):
            if hub.error is None:
                hub.fail(CommTimeoutError(
                    f"{ctx.fingerprint.op} #{ctx.fingerprint.seq} on {ctx.group_desc} timed out after "
                    f"{ctx.deadline.timeout:.1f}s on group rank {self.group_rank}"))
            error = hub.error
            if isinstance(error, CommTimeoutError):
                raise CommTimeoutError(str(error)) from None
            raise GroupAbortedError(
                f"{ctx.fingerprint.op} #{ctx.fingerprint.seq} on {ctx.group_desc}: the group was aborted "
                f"({error})") from error

    def _post(self, payload: Any, ctx: OpContext) -> list[Any]:
        """Phase 1: publish this rank's payload, wait for all, check fingerprints; return every payload."""
        hub = self._hub
        if hub.error is not None:
            raise GroupAbortedError(f"{ctx.group_desc} was aborted earlier: {hub.error}")
        hub.board[self.group_rank] = (ctx.fingerprint, payload)
        self._wait_all(ctx)
        posted = list(hub.board)
        mine = ctx.fingerprint.key()
        for rank, entry in enumerate(posted):
            assert entry is not None
            if entry[0].key() != mine:
                raise CollectiveMismatchError(
                    mismatch_message(ctx.group_desc, ctx.fingerprint, self.spec.global_rank, entry[0],
                                     self.spec.global_ranks[rank]))
        return [entry[1] for entry in posted]

    def _finish(self, ctx: OpContext) -> None:
        """Phase 2: wait until every rank has read the board, then take this rank's payload off it (its tensors
        must not live on until the next op)."""
        self._wait_all(ctx)
        self._hub.board[self.group_rank] = None

    # -- collectives ----------------------------------------------------------------------------------------

    def _reduced(self, inputs: list[Tensor], op: ReduceOp) -> Tensor:
        """A new tensor holding op over the posted inputs in rank order (they stay readable by every rank)."""
        return reduce_into(torch.empty_like(inputs[0]), inputs, op)

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        result = self._reduced(self._post(tensor, ctx), op)
        self._finish(ctx)
        tensor.copy_(result)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        inputs = self._post(tensor, ctx)
        if self.group_rank != root:
            tensor.copy_(inputs[root])
        self._finish(ctx)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        inputs = self._post(tensor, ctx)
        result = self._reduced(inputs, op) if self.group_rank == root else None
        self._finish(ctx)
        if result is not None:
            tensor.copy_(result)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        inputs = self._post(input, ctx)
        for block, part in zip(output.chunk(self.group_size) if output.numel() else [], inputs, strict=False):
            block.copy_(part)
        self._finish(ctx)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        n = output.numel()
        start = self.group_rank * n
        inputs = self._post(input, ctx)
        result = self._reduced([t[start:start + n] for t in inputs], op)
        self._finish(ctx)
        output.copy_(result)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        inputs = self._post(input, ctx)
        if output is not None:
            n = input.numel()
            for rank, part in enumerate(inputs):
                output[rank * n:(rank + 1) * n].copy_(part)
        self._finish(ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        inputs = self._post(input, ctx)
        n = output.numel()
        output.copy_(inputs[root][self.group_rank * n:(self.group_rank + 1) * n])
        self._finish(ctx)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        posted = self._post((input, input_splits), ctx)
        me = self.group_rank
        offset = 0
        for rank, (their_input, their_splits) in enumerate(posted):
            if their_splits[me] != output_splits[rank]:
                raise CollectiveMismatchError(
                    f"all_to_all #{ctx.fingerprint.seq} on {ctx.group_desc}: rank {self.spec.global_rank} "
                    f"expects {output_splits[rank]} elements from rank {self.spec.global_ranks[rank]}, which "
                    f"sends {their_splits[me]}")
            start = sum(their_splits[:me])
            output[offset:offset + output_splits[rank]].copy_(their_input[start:start + their_splits[me]])
            offset += output_splits[rank]
        self._finish(ctx)

    def barrier(self, ctx: OpContext) -> None:
        self._post(None, ctx)
        self._finish(ctx)

    # -- point to point -------------------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        hub = self._hub
        key = (self.group_rank, dst, tag)
        with hub.mail_lock:
            if hub.error is not None:
                raise GroupAbortedError(f"send to group rank {dst}: the group was aborted ({hub.error})")
            waiting = hub.waiting_recvs.get(key)
            receiver = waiting.popleft() if waiting else None
            if receiver is None:
                hub.mailboxes[key].append(tensor.clone())
        if receiver is not None:
            _deliver(tensor, *receiver, src=self.group_rank)
        work.to_completed()

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        hub = self._hub
        key = (src, self.group_rank, tag)
        with hub.mail_lock:
            if hub.error is not None:
                raise GroupAbortedError(f"recv from group rank {src}: the group was aborted ({hub.error})")
            box = hub.mailboxes.get(key)
            message = box.popleft() if box else None
            if message is None:
                hub.waiting_recvs[key].append((tensor, work))
        if message is not None:
            _deliver(message, tensor, work, src=src)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        self._hub.fail(error)

    def close(self) -> None:
        with _HUBS_LOCK:
            self._hub.users -= 1
            if self._hub.users == 0 and self._hub.joined == self._hub.group_size:
                _HUBS.pop(self._key, None)


def _deliver(message: Tensor, destination: Tensor, work: Work, src: int) -> None:
    if message.numel() != destination.numel() or message.dtype != destination.dtype:
        work.to_failed(CommError(
            f"recv from group rank {src}: the message holds {message.numel()} {message.dtype} elements but the "
            f"receive buffer holds {destination.numel()} {destination.dtype}"))
        return
    deliver_into(destination, message)
    work.to_completed()
