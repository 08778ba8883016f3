"""The torch transports: every spmd operation of a group runs over one of torch's own process groups, gloo for
CPU tensors ("torch:gloo") and NCCL for CUDA tensors ("torch:nccl").

Layer: comm. This module and torch_backend.py are the only ones that import torch.distributed. Rendezvous
stays spmd's: the torch group is built directly (ProcessGroupGloo / ProcessGroupNCCL with store, rank, size,
timeout) on `SpmdStoreAdapter`, a torch Store over the group's own prefixed spmd store, so each spmd group
(default, new_group subgroups, DeviceMesh groups) gets its own torch group and no global torch state is made.

Note: what runs where
- Every rank's group executor calls each collective in program order; the method starts the torch op and,
  for gloo, waits for it with the op's deadline (CPU transports finish before they return). For NCCL the
  wait is torch's stream wait: the caller's stream is ordered after the op, and the op's own timeout is
  NCCL's watchdog (spec.timeout), not ctx.deadline.
- isend/irecv start a torch send/recv (tag kept); a thread per message waits for it (with torch's timeout,
  the group's) and completes spmd's Work (gloo's P2P works have no future); an abort here fails them at
  once. A message to this rank itself waits here for its receive (torch's groups don't send to self).
- abort leaves its error's kind and reason under the group's store key "torch_pg/abort", then aborts the torch
  group. gloo's collective waits can't be interrupted, so each runs in slices of _ABORT_POLL_S and looks at
  that key between slices (one store lookup per slice, only for ops that last longer): peers raise the same
  kind of error (timeout, lost peer, mismatch; else GroupAbortedError) naming the rank that aborted.
- dtypes neither backend moves (int16, uint16, uint32) travel widened for reductions and as bytes for every
  other op; bool reduces as uint8 (SUM is MAX, PRODUCT is MIN), so bits agree with the other transports.
- AVG: NCCL averages itself; gloo sums, then divides once by the group size.

Fingerprints are not exchanged: an extra all_gather of a digest before each collective would double the
latency of small ones. A rank whose call differs in shape or dtype is caught by torch's own size checks
only where they apply, or hangs until ctx.deadline (CommTimeoutError); use the tcp or shm transports, which
check fingerprints in-band, to debug a mismatch.
"""

from __future__ import annotations

import abc
import collections
import datetime
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from spmd._core.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupAbortedError,
    PeerLostError,
    StoreError,
    StoreTimeoutError,
    abort_text,
    parse_abort_text,
)
from spmd.comm.reduce_op import ReduceOp, finish_average
from spmd.comm.store.base import Store
from spmd.comm.transports.base import OpContext, P2PStart, Transport, TransportSpec
from spmd.comm.work import Work

_TORCH_OPS: dict[ReduceOp, dist.ReduceOp.RedOpType] = {
    ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR, ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}   # logical or / and on 0 and 1
_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
           torch.int64, torch.bool}
_Options = TypeVar("_Options", dist.AllreduceOptions, dist.ReduceScatterOptions)
_ABORT_KEY = "torch_pg/abort"
_PROPAGATED: dict[str, type[CommError]] = {error.__name__: error for error in (
    CommTimeoutError, PeerLostError, CollectiveMismatchError)}
_ABORT_POLL_S = 0.1      # a wait looks for a peer's abort this often (one store lookup per slice)
_PEER_LOST_MARKS = ("connection closed", "connection reset", "broken pipe", "connection refused", "peer")
_TIMEOUT_MARKS = ("timed out", "timeout")


class SpmdStoreAdapter(dist.Store):
    """A torch Store whose keys live in an spmd Store: torch's groups rendezvous through spmd's store."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._store.multi_set(keys, values)


def _options(options: _Options, op: ReduceOp) -> _Options:
    """torch's options for a reduction with `op` (built once per group and op: each costs a few microseconds)."""
    options.reduceOp = _TORCH_OPS[op]
    return options


def _as_bytes(tensor: Tensor) -> Tensor:
    """The tensor itself if the backends move its dtype, else its bytes (flat, contiguous: a free view)."""
    return tensor if tensor.dtype in _NATIVE else tensor.view(torch.uint8)


def _deliver(message: Tensor, destination: Tensor, work: Work) -> None:
    if message.numel() != destination.numel() or message.dtype != destination.dtype:
        work.to_failed(CommError(
            f"recv from this rank itself: the message holds {message.numel()} {message.dtype} elements but the "
            f"receive buffer holds {destination.numel()} {destination.dtype}"))
        return
    destination.copy_(message)
    work.to_completed()


class TorchProcessGroupTransport(Transport):
    """One spmd group over one torch process group; see the module docstring."""

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._desc = f"{self.name} transport of group {spec.group_name!r}, rank {spec.global_rank}"
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: set[Work] = set()
        self._self_messages: dict[int, collections.deque[Tensor]] = collections.defaultdict(collections.deque)
        self._self_recvs: dict[int, collections.deque[tuple[Tensor, Work]]] = collections.defaultdict(
            collections.deque)
        self._timeout = datetime.timedelta(seconds=spec.timeout)
        self._all_reduce_options = {op: _options(dist.AllreduceOptions(), op) for op in _TORCH_OPS}
        self._reduce_scatter_options = {op: _options(dist.ReduceScatterOptions(), op) for op in _TORCH_OPS}
        try:
            self._pg = self._create_group(SpmdStoreAdapter(spec.store), self._timeout)
        except Exception as error:
            raise self._translate(error, "connecting the group", spec.timeout) from error

    def allocate_tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """torch's group's own allocator, where its backend has one for `device` (NCCL's; gloo's has none)."""
        if not self._pg.supports_tensor_alloc(device):
            return None
        return self._pg.allocate_tensor(numel, dtype=dtype, device=device)

    @abc.abstractmethod
    def _create_group(self, store: dist.Store, timeout: datetime.timedelta) -> dist.ProcessGroup:
        """Build this rank's torch group on `store` (collective over the group's ranks)."""

    @abc.abstractmethod
    def _wait(self, work: dist.Work, ctx: OpContext) -> None:
        """Wait for a torch op until ctx.deadline; translate its failure into spmd's errors."""

    # -- errors ---------------------------------------------------------------------------------------------

    def _translate(self, error: BaseException, what: str, timeout: float) -> CommError:
        text = str(error)
        lowered = text.lower()
        where = f"{what} on {self._desc}"
        if isinstance(error, StoreTimeoutError | TimeoutError) or any(m in lowered for m in _TIMEOUT_MARKS):
            return CommTimeoutError(f"{where} timed out after {timeout:.1f}s: {text}")
        if any(mark in lowered for mark in _PEER_LOST_MARKS):
            return PeerLostError(f"{where}: a peer was lost: {text}")
        return CommError(f"{where} failed: {text}")

    def _check_alive(self, what: str) -> None:
        if self._error is not None:
            raise GroupAbortedError(f"{what} on {self._desc}: the group was aborted earlier ({self._error})")

    def _run(self, ctx: OpContext, start: Callable[..., dist.Work], *args: object) -> None:
        """Start a torch op (`start(*args)` returns its Work) and wait for it under ctx's deadline."""
        if self._error is not None:
            self._check_alive(f"{ctx.fingerprint.op} #{ctx.fingerprint.seq}")
        try:
            work = start(*args)
        except Exception as error:
            raise self._translate(error, f"{ctx.fingerprint.op} #{ctx.fingerprint.seq}",
                                  ctx.deadline.timeout) from error
        self._wait(work, ctx)

    def _peer_abort(self, what: str) -> CommError | None:
        """The error to raise if a peer has aborted the group, else None: the peer leaves its error's kind and
        text in the store, and a timeout, lost peer or mismatch there is one here too (as on the tcp transport)."""
        try:
            if not self.spec.store.check([_ABORT_KEY]):
                return None
            kind, _, text = self.spec.store.get(_ABORT_KEY).decode().partition(":")
        except (StoreError, OSError):     # the store went away with its rank: there is no news to read
            return None
        error_class = _PROPAGATED.get(kind, GroupAbortedError)
        seen_by, reason = parse_abort_text(text)
        return error_class(f"{what} on {self._desc}: {seen_by} aborted the group: {reason}", reason=reason,
                           seen_by=seen_by)

    def _fail_group(self, error: BaseException) -> None:
        """Remember the first failure, abort the torch group so peers fail fast, fail P2P in flight."""
        with self._lock:
            if self._error is None:
                self._error = error
            pending = list(self._pending) + [work for queue in self._self_recvs.values() for _, work in queue]
            self._pending.clear()
            self._self_recvs.clear()
        for work in pending:
            work.to_failed(error)
        try:
            self._pg.abort()
        except RuntimeError:    # a group already torn down by its own failure has nothing left to abort
            pass

    # -- reductions -----------------------------------------------------------------------------------------

    def _native_avg(self) -> bool:
        return False

    def _reduce_view(self, tensor: Tensor, op: ReduceOp) -> tuple[Tensor, ReduceOp]:
        """The buffer the backend reduces for (tensor, op) and the op it applies: tensor itself, a view of its
        bytes (bool) or a widened copy (see `_write_back`)."""
        if tensor.dtype is torch.bool:
            return tensor.view(torch.uint8), _BOOL_OPS.get(op, op)
        backend_op = ReduceOp.SUM if op is ReduceOp.AVG and not self._native_avg() else op
        wide = _WIDENED.get(tensor.dtype)
        return (tensor.to(wide) if wide is not None else tensor), backend_op

    def _write_back(self, result: Tensor, reduced: Tensor, op: ReduceOp) -> None:
        """result <- the backend's reduction in `reduced` (copied back if it was widened), averaged if needed."""
        if reduced.dtype is not result.dtype and result.dtype is not torch.bool:
            result.copy_(reduced)
        if not self._native_avg():
            finish_average(result, op, self.group_size)

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        reduced, torch_op = self._reduce_view(tensor, op)
        self._run(ctx, self._pg.allreduce, [reduced], self._all_reduce_options[torch_op])
        self._write_back(tensor, reduced, op)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        reduced, torch_op = self._reduce_view(tensor, op)
        is_root = self.group_rank == root
        if not is_root and tensor.dtype not in _WIDENED:
            reduced = reduced.clone()       # the backend may use a non-root's buffer as scratch
        options = dist.ReduceOptions()
        options.reduceOp = _TORCH_OPS[torch_op]
        options.rootRank = root
        self._run(ctx, self._pg.reduce, [reduced], options)
        if is_root:
            self._write_back(tensor, reduced, op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        reduced_in, torch_op = self._reduce_view(input, op)
        reduced_out, _ = self._reduce_view(output, op)
        self._run(ctx, self._pg._reduce_scatter_base, reduced_out, reduced_in, self._reduce_scatter_options[torch_op])
        self._write_back(output, reduced_out, op)

    # -- data movement --------------------------------------------------------------------------------------

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._run(ctx, self._pg.broadcast, [_as_bytes(tensor)], options)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        self._run(ctx, self._pg._allgather_base, _as_bytes(output), _as_bytes(input))

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        options = dist.GatherOptions()
        options.rootRank = root
        outputs = [list(_as_bytes(output).chunk(self.group_size))] if output is not None and output.numel() else (
            [[torch.empty_like(_as_bytes(input)) for _ in range(self.group_size)]] if output is not None else [])
        self._run(ctx, self._pg.gather, outputs, [_as_bytes(input)], options)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        options = dist.ScatterOptions()
        options.rootRank = root
        mine = _as_bytes(output)
        inputs = [] if input is None else [list(_as_bytes(input).split(mine.numel())) if mine.numel() else
                                           [torch.empty_like(mine) for _ in range(self.group_size)]]
        self._run(ctx, self._pg.scatter, [mine], inputs, options)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        out, inp = _as_bytes(output), _as_bytes(input)
        scale = out.element_size() and output.element_size() // out.element_size()
        self._run(ctx, self._pg.alltoall_base, out, inp, [n * scale for n in output_splits],
                  [n * scale for n in input_splits], dist.AllToAllOptions())

    def barrier(self, ctx: OpContext) -> None:
        self._run(ctx, self._pg.barrier, dist.BarrierOptions())

    # -- point to point -------------------------------------------------------------------------------------

    def _track(self, torch_work: dist.Work, works: list[Work], what: str) -> None:
        """Complete `works` (a message's, or a coalesced batch's) from a thread that waits for the torch op
        (gloo's P2P works have no future; one thread per message, so works complete in whatever order their
        peers make them)."""
        with self._lock:
            self._pending.update(works)

        def wait() -> None:
            try:     # no slices here: a gloo send or recv whose wait timed out has failed for good
                torch_work.wait()
            except Exception as error:
                failure = self._error or self._peer_abort(what) or self._translate(error, what, self.spec.timeout)
                for work in works:
                    work.to_failed(failure)
            else:
                for work in works:
                    work.to_completed()
            with self._lock:
                self._pending.difference_update(works)

        threading.Thread(target=wait, name=f"spmd-{self.name}-p2p", daemon=True).start()

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        what = f"send to group rank {dst} (tag {tag})"
        self._check_alive(what)
        if dst == self.group_rank:
            self._send_to_self(tensor, tag, work)
            return
        self._track(self._pg.send([_as_bytes(tensor)], dst, tag), [work], what)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        what = f"recv from group rank {src} (tag {tag})"
        self._check_alive(what)
        if src == self.group_rank:
            self._recv_from_self(tensor, tag, work)
            return
        self._track(self._pg.recv([_as_bytes(tensor)], src, tag), [work], what)

    def start_p2p_batch(self, ops: list[P2PStart]) -> None:
        """A backend that coalesces (NCCL: its large sends wait for their receives) starts the batch's messages
        to other ranks as one group, torch's batch_isend_irecv's way; one that buffers them (gloo) one by one.
        Messages to this rank itself are kept here as ever."""
        if not self._pg.supports_coalescing:
            super().start_p2p_batch(ops)
            return
        to_peers = [(op, tensor, peer, tag, work) for op, tensor, peer, tag, work in ops if peer != self.group_rank]
        for op, tensor, peer, tag, work in ops:
            if peer == self.group_rank:
                (self.isend if op == "isend" else self.irecv)(tensor, peer, tag, work)
        if not to_peers:
            return
        what = f"batch of {len(to_peers)} sends and receives with group ranks {sorted({op[2] for op in to_peers})}"
        self._check_alive(what)
        self._pg._start_coalescing()
        try:
            for op, tensor, peer, tag, _ in to_peers:
                (self._pg.send if op == "isend" else self._pg.recv)([_as_bytes(tensor)], peer, tag)
        finally:
            batch = self._pg._end_coalescing()
        self._track(batch, [op[4] for op in to_peers], what)

    def _send_to_self(self, tensor: Tensor, tag: int, work: Work) -> None:
        """torch's groups don't send to their own rank: a message to self waits here for its receive."""
        with self._lock:
            waiting = self._self_recvs.get(tag)
            receiver = waiting.popleft() if waiting else None
            if receiver is None:
                self._self_messages[tag].append(tensor.clone())
        if receiver is not None:
            _deliver(tensor, *receiver)
        work.to_completed()

    def _recv_from_self(self, tensor: Tensor, tag: int, work: Work) -> None:
        with self._lock:
            box = self._self_messages.get(tag)
            message = box.popleft() if box else None
            if message is None:
                self._self_recvs[tag].append((tensor, work))
        if message is not None:
            _deliver(message, tensor, work)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        """Fail this rank's ops and leave the reason in the group's store, where the peers' waits look."""
        try:     # first: a peer that sees this rank's connections close looks here for the reason
            self.spec.store.compare_set(_ABORT_KEY, "", f"{type(error).__name__}:"
                                                        f"{abort_text(error, self.spec.where(self.group_rank))}")
        except Exception:    # a store that is gone can't carry the news; the peers see a lost peer instead
            pass
        self._fail_group(error)

    def close(self) -> None:
        self._pg.shutdown()


class TorchGlooTransport(TorchProcessGroupTransport):
    """CPU tensors over torch's ProcessGroupGloo."""

    name = "torch:gloo"
    devices = ("cpu",)

    def _create_group(self, store: dist.Store, timeout: datetime.timedelta) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(store, self.group_rank, self.group_size, timeout)

    def _wait(self, work: dist.Work, ctx: OpContext) -> None:
        """Wait in slices of _ABORT_POLL_S until ctx.deadline, looking for a peer's abort between slices (gloo
        has no way to be interrupted: a peer's abort only reaches this rank through the store)."""
        what = f"{ctx.fingerprint.op} #{ctx.fingerprint.seq}"
        while True:
            remaining = ctx.deadline.remaining()
            try:
                work.wait(datetime.timedelta(seconds=max(min(remaining, _ABORT_POLL_S), 1e-3)))
                return
            except Exception as error:
                failure = error
            ended = work.is_completed()
            if ended:
                try:
                    work.wait()     # it ended as the slice ran out: its own outcome counts, not the slice's
                    return
                except Exception as error:
                    failure = error
            translated: CommError | None = self._peer_abort(what)
            if translated is None:
                # an op that ended while the store was asked goes round once more for its own outcome: the
                # slice's timeout is not its failure (it was raised as one, seen as a flaky matrix test)
                if not ended and (work.is_completed() or remaining > _ABORT_POLL_S):
                    continue
                translated = self._translate(failure, what, ctx.deadline.timeout)
            self._fail_group(translated)
            raise translated from failure


class TorchNcclTransport(TorchProcessGroupTransport):
    """Accelerator tensors over torch's ProcessGroupNCCL; ops are enqueued on the device, ordered by streams."""

    name = "torch:nccl"
    devices = ("cuda",)
    matches_by_tag = False     # NCCL ignores tags: a pair of ranks must issue its messages in one order

    def _create_group(self, store: dist.Store, timeout: datetime.timedelta) -> dist.ProcessGroup:
        if not dist.is_nccl_available():
            raise CommError("this build of torch has no NCCL: use torch:gloo for CPU tensors, or a CUDA build")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, self.group_rank, self.group_size, options)

    def _native_avg(self) -> bool:
        return True

    def _track(self, torch_work: dist.Work, works: list[Work], what: str) -> None:
        """Order the caller's stream after the sends and receives (torch's wait on NCCL is a stream wait, made on
        the caller's thread so it is the caller's stream) and complete `works`: the ops are enqueued, as the
        contract for device transports says. A pair of ranks that both isend before they irecv relies on NCCL's
        buffering for small messages; larger ones need batch_isend_irecv (one coalesced group), as with torch's
        own NCCL."""
        try:
            torch_work.wait()
        except Exception as error:
            failure = self._error or self._translate(error, what, self.spec.timeout)
            for work in works:
                work.to_failed(failure)
            return
        for work in works:
            work.to_completed()

    def _wait(self, work: dist.Work, ctx: OpContext) -> None:
        try:
            work.wait()     # a stream wait: the caller's current stream is ordered after the op
        except Exception as error:
            translated = self._translate(error, f"{ctx.fingerprint.op} #{ctx.fingerprint.seq}",
                                         ctx.deadline.timeout)
            self._fail_group(translated)
            raise translated from error
