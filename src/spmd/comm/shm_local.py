"""The intra-host engine of the shm transport: every collective through one shared segment.

Layer: comm. All ranks of the group run on one host and map one Segment (see shm_segment's Notes: segment
layout, phases). Data moves by torch copies into and out of shared memory; only 8-byte phase counters
synchronise. Large messages are cut into chunks of at most one staging slot (SLOT_BYTES) per rank and
pipelined: in one phase a rank copies chunk t in, reduces its slice of chunk t-1 and copies chunk t-2 out,
so the memory in use is fixed and the chunks stay in cache between those three steps.

Note: sliced reduction
For all_reduce and reduce, chunk t is split into group_size slices; rank r reduces slice r only, reading
every rank's copy of it in rank order (its own straight from its tensor, which it never copies in) and
writing the result into the shared result slot, from which every rank copies the whole chunk out. Every
rank does 1/n of the arithmetic, every element is reduced exactly once, and all ranks get bit-identical
results. reduce_scatter is the same without the copy-out: the owner reduces straight into its output.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from spmd._core.deadline import Deadline
from spmd._core.errors import CollectiveMismatchError, CommError, GroupAbortedError, PeerLostError
from spmd.comm.debug import Fingerprint, mismatch_message
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.shm_p2p import P2PEngine
from spmd.comm.shm_segment import (
    ABORT_OTHER,
    ABORT_PEER_LOST,
    FP_BYTES,
    SHM_DIR,
    Segment,
    fingerprint_digest,
)
from spmd.comm.transport import OpContext, Transport, TransportSpec
from spmd.comm.work import Work

SMALL_BYTES = 32 << 10      # all_reduce up to this size: one phase, every rank reduces the whole tensor
ALIGN_BYTES = 64            # slice boundaries fall on cache lines, so vectorized kernels see aligned data

_BINARY = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum, ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor,
}
_BOOL_BINARY = {ReduceOp.SUM: torch.logical_or, ReduceOp.PRODUCT: torch.logical_and}


def reduce_into(dst: Tensor, sources: list[Tensor], op: ReduceOp) -> None:
    """dst <- op over `sources` (at least two) in list order, with torch's vectorized out= kernels."""
    fn = (_BOOL_BINARY.get(op) if dst.dtype is torch.bool else None) or _BINARY[op]
    fn(sources[0], sources[1], out=dst)
    for source in sources[2:]:
        fn(dst, source, out=dst)


def _chunks(count: int, cap: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most `cap` elements covering `count`; one empty piece when count is 0."""
    return [(start, min(count, start + cap)) for start in range(0, count, cap)] or [(0, 0)]


class _Views:
    """The segment's slots viewed as one dtype: staging[rank][parity] and result[parity]."""

    def __init__(self, segment: Segment, dtype: torch.dtype) -> None:
        layout = segment.layout
        size = layout.slot_bytes
        raw = segment.bytes
        self.staging = [[raw[layout.slot(rank, parity):layout.slot(rank, parity) + size].view(dtype)
                         for parity in (0, 1)] for rank in range(layout.group_size)]
        self.result = [raw[layout.result(parity):layout.result(parity) + size].view(dtype) for parity in (0, 1)]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.capacity = size // itemsize                                   # elements per slot
        self.align = max(1, ALIGN_BYTES // itemsize)
        self.region = (size // layout.group_size) // itemsize // self.align * self.align   # per-peer region


class LocalShmTransport(Transport):
    """Collectives and P2P among ranks of one host through one shared segment."""

    name = "shm"

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._phase = 0
        self._views: dict[torch.dtype, _Views] = {}
        self._pending_ctx: OpContext | None = None
        self._closed = False
        self.segment: Segment | None = None
        if self.group_size > 1:
            self.segment = self._connect(spec)
            self.segment.global_ranks = list(spec.global_ranks)
        self._p2p = P2PEngine(self.segment, self.group_rank, self.group_size, spec)

    def _connect(self, spec: TransportSpec) -> Segment:
        """Collective set-up: rank 0 creates the segment, all map it, then everybody unlinks its name."""
        deadline = Deadline(spec.timeout)
        what = f"shm transport set-up of group '{spec.group_name}' on rank {spec.global_rank}"
        epoch = (spec.store.add("shm/joins", 1) - 1) // self.group_size   # a fresh segment per incarnation
        key = f"shm/segment/{epoch}"
        if self.group_rank == 0:
            segment = Segment.create(self.group_size)
            spec.store.set(key, segment.name)
        else:
            spec.store.wait([key], timeout=deadline.remaining())
            name = spec.store.get(key).decode()
            try:
                segment = Segment.attach(name, self.group_rank, self.group_size)
            except FileNotFoundError:
                raise RuntimeError(
                    f"{what}: segment {name} of group rank 0 (rank {spec.global_ranks[0]}) is not in this "
                    f"process's {SHM_DIR}, although both report host {spec.hosts[0]!r}. Ranks in "
                    f"separate containers don't share memory: give each container its own SPMD_HOST_ID, or "
                    f"use backend='tcp'.") from None
        try:
            segment.announce()
            segment.await_attached(deadline, what)
        except BaseException:
            segment.close()
            raise
        segment.unlink_name()
        return segment

    # -- phases ---------------------------------------------------------------------------------------------

    def _describe(self, ctx: OpContext) -> str:
        return f"{ctx.fingerprint.op} #{ctx.fingerprint.seq} on {ctx.group_desc}, rank {self.spec.global_rank}"

    def _begin(self, ctx: OpContext) -> tuple[Segment, int]:
        """Publish this op's fingerprint for the current phase; returns the segment and this phase's parity."""
        segment = self.segment
        assert segment is not None
        if segment.aborted():
            raise segment.abort_error(self._describe(ctx))
        parity = self._phase & 1
        encoded = ctx.fingerprint.encode()[:FP_BYTES - 24]    # cut only for absurd shapes: then shown unreadable
        offset = segment.fp_offset(self.group_rank, parity)
        segment.write_bytes(offset, fingerprint_digest(ctx.fingerprint.key()))
        segment.write_word(offset + 16, len(encoded))
        segment.write_bytes(offset + 24, encoded)
        self._pending_ctx = ctx
        return segment, parity

    def _sync(self, ctx: OpContext) -> int:
        """End the current phase on this rank, wait for every peer to end it too; returns the new parity."""
        segment = self.segment
        assert segment is not None
        self._phase += 1
        segment.end_phase(self._phase)
        segment.wait_phase(self._phase, ctx.deadline, lambda: self._describe(ctx))
        if self._pending_ctx is not None:
            self._pending_ctx = None
            self._check_fingerprints(segment, ctx)
        return self._phase & 1

    def _check_fingerprints(self, segment: Segment, ctx: OpContext) -> None:
        parity = (self._phase - 1) & 1
        mine = segment.read_bytes(segment.fp_offset(self.group_rank, parity), 16)
        for peer in range(self.group_size):
            offset = segment.fp_offset(peer, parity)
            if segment.read_bytes(offset, 16) != mine:
                encoded = segment.read_bytes(offset + 24, segment.word(offset + 16))
                try:
                    theirs = Fingerprint.decode(encoded)
                except ValueError:
                    theirs = Fingerprint("<unreadable fingerprint>", -1, None, "?")
                raise CollectiveMismatchError(mismatch_message(
                    ctx.group_desc, ctx.fingerprint, self.spec.global_rank, theirs, self.spec.global_ranks[peer]))

    def _views_of(self, dtype: torch.dtype) -> _Views:
        views = self._views.get(dtype)
        if views is None:
            assert self.segment is not None
            views = self._views[dtype] = _Views(self.segment, dtype)
        return views

    def _slices(self, length: int, views: _Views) -> list[int]:
        """Boundaries of the group_size slices of a chunk of `length` elements (cache-line aligned)."""
        n, align = self.group_size, views.align
        return [min(length, (length * i // n + align - 1) // align * align) for i in range(n)] + [length]

    # -- reductions -----------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size == 1:
            return
        views = self._views_of(tensor.dtype)
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            self._all_reduce_small(tensor, op, ctx, views)
        else:
            self._reduce_sliced(tensor, op, ctx, views, root=None)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size == 1:
            return
        views = self._views_of(tensor.dtype)
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            self._all_reduce_small(tensor, op, ctx, views, root)
        else:
            self._reduce_sliced(tensor, op, ctx, views, root=root)

    def _all_reduce_small(self, tensor: Tensor, op: ReduceOp, ctx: OpContext, views: _Views,
                          root: int | None = None) -> None:
        """One phase: everyone copies its tensor in, then every rank (or only `root`) reduces all copies in
        rank order, so all ranks compute bit-identical results."""
        n = tensor.numel()
        _, parity = self._begin(ctx)
        views.staging[self.group_rank][parity][:n].copy_(tensor)
        parity = self._sync(ctx) ^ 1
        if root is None or root == self.group_rank:
            reduce_into(tensor, [views.staging[rank][parity][:n] for rank in range(self.group_size)], op)
            if op is ReduceOp.AVG:
                tensor.div_(self.group_size)

    def _reduce_sliced(self, tensor: Tensor, op: ReduceOp, ctx: OpContext, views: _Views, root: int | None) -> None:
        """all_reduce (root None) or reduce to `root`, pipelined in chunks; see Note: sliced reduction."""
        me, size = self.group_rank, self.group_size
        chunks = _chunks(tensor.numel(), views.capacity)
        copy_out = root is None or root == me
        _, parity = self._begin(ctx)
        for t in range(len(chunks) + 2):
            if t >= 2 and copy_out:                                   # chunk t-2: result slot -> tensor
                start, end = chunks[t - 2]
                tensor[start:end].copy_(views.result[parity ^ 1][:end - start])
            if 1 <= t <= len(chunks):                                 # chunk t-1: reduce my slice
                start, end = chunks[t - 1]
                bounds = self._slices(end - start, views)
                lo, hi = bounds[me], bounds[me + 1]
                if hi > lo:
                    sources = [tensor[start + lo:start + hi] if rank == me else views.staging[rank][parity ^ 1][lo:hi]
                               for rank in range(size)]
                    dst = views.result[parity][lo:hi]
                    reduce_into(dst, sources, op)
                    if op is ReduceOp.AVG:
                        dst.div_(size)
            if t < len(chunks):                                       # chunk t: tensor -> my staging slot
                start, end = chunks[t]
                bounds = self._slices(end - start, views)
                slot = views.staging[me][parity]
                lo, hi = bounds[me], bounds[me + 1]
                if lo > 0:
                    slot[:lo].copy_(tensor[start:start + lo])
                if end - start > hi:
                    slot[hi:end - start].copy_(tensor[start + hi:end])
            if t <= len(chunks):
                parity = self._sync(ctx)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size == 1:
            output.copy_(input)
            return
        me, size = self.group_rank, self.group_size
        views = self._views_of(output.dtype)
        m, region = output.numel(), views.region
        chunks = _chunks(m, region)
        _, parity = self._begin(ctx)
        for t in range(len(chunks) + 1):
            if t >= 1:                                                # chunk t-1: reduce my block into output
                start, end = chunks[t - 1]
                if end > start:
                    sources = [input[me * m + start:me * m + end] if rank == me
                               else views.staging[rank][parity ^ 1][me * region:me * region + end - start]
                               for rank in range(size)]
                    reduce_into(output[start:end], sources, op)
                    if op is ReduceOp.AVG:
                        output[start:end].div_(size)
            if t < len(chunks):                                       # chunk t of every other block -> slot
                start, end = chunks[t]
                slot = views.staging[me][parity]
                for rank in range(size):
                    if rank != me and end > start:
                        slot[rank * region:rank * region + end - start].copy_(input[rank * m + start:rank * m + end])
                parity = self._sync(ctx)

    # -- data movement --------------------------------------------------------------------------------------

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        if self.group_size == 1:
            return
        views = self._views_of(tensor.dtype)
        chunks = _chunks(tensor.numel(), views.capacity)
        is_root = self.group_rank == root
        _, parity = self._begin(ctx)
        for t in range(len(chunks) + 1):
            if t >= 1 and not is_root:
                start, end = chunks[t - 1]
                tensor[start:end].copy_(views.result[parity ^ 1][:end - start])
            if t < len(chunks):
                if is_root:
                    start, end = chunks[t]
                    views.result[parity][:end - start].copy_(tensor[start:end])
                parity = self._sync(ctx)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        self._gather(output, input, None, ctx)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        self._gather(output, input, root, ctx)

    def _gather(self, output: Tensor | None, input: Tensor, root: int | None, ctx: OpContext) -> None:
        """all_gather (root None) or gather to `root`: each rank stages its chunk, the receivers copy out."""
        me, size, m = self.group_rank, self.group_size, input.numel()
        if output is not None and output.data_ptr() + me * m * output.element_size() != input.data_ptr():
            output[me * m:(me + 1) * m].copy_(input)
        if size == 1:
            return
        views = self._views_of(input.dtype)
        chunks = _chunks(m, views.capacity)
        receives = root is None or root == me
        _, parity = self._begin(ctx)
        for t in range(len(chunks) + 1):
            if t >= 1 and receives and output is not None:
                start, end = chunks[t - 1]
                for rank in range(size):
                    if rank != me:
                        output[rank * m + start:rank * m + end].copy_(views.staging[rank][parity ^ 1][:end - start])
            if t < len(chunks):
                if root != me:
                    start, end = chunks[t]
                    views.staging[me][parity][:end - start].copy_(input[start:end])
                parity = self._sync(ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        me, size, m = self.group_rank, self.group_size, output.numel()
        if me == root:
            assert input is not None
            output.copy_(input[me * m:(me + 1) * m])
        if size == 1:
            return
        views = self._views_of(output.dtype)
        region = views.region
        chunks = _chunks(m, region)
        _, parity = self._begin(ctx)
        for t in range(len(chunks) + 1):
            if t >= 1 and me != root:
                start, end = chunks[t - 1]
                output[start:end].copy_(views.staging[root][parity ^ 1][me * region:me * region + end - start])
            if t < len(chunks):
                if me == root:
                    assert input is not None
                    start, end = chunks[t]
                    slot = views.staging[me][parity]
                    for rank in range(size):
                        if rank != me:
                            slot[rank * region:rank * region + end - start].copy_(
                                input[rank * m + start:rank * m + end])
                parity = self._sync(ctx)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        me, size = self.group_rank, self.group_size
        in_offsets = [sum(input_splits[:rank]) for rank in range(size)]
        out_offsets = [sum(output_splits[:rank]) for rank in range(size)]
        if size == 1:
            self._check_splits([input_splits], [output_splits], ctx)
            output.copy_(input)
            return
        own = input_splits[me]
        output[out_offsets[me]:out_offsets[me] + own].copy_(input[in_offsets[me]:in_offsets[me] + own])
        views = self._views_of(input.dtype)
        region = views.region
        segment, parity = self._begin(ctx)
        words, base = segment.words, segment.splits_offset(me, parity) >> 3
        for rank in range(size):
            words[base + rank] = input_splits[rank]
            words[base + size + rank] = output_splits[rank]
        self._stage_round(0, input, input_splits, in_offsets, views.staging[me][parity], region)
        parity = self._sync(ctx)
        ins, outs = [], []
        for rank in range(size):
            base = segment.splits_offset(rank, parity ^ 1) >> 3
            ins.append(list(words[base:base + size]))
            outs.append(list(words[base + size:base + 2 * size]))
        self._check_splits(ins, outs, ctx)
        longest = max(ins[src][dst] for src in range(size) for dst in range(size) if src != dst)
        rounds = max(1, -(-longest // region))
        for t in range(1, rounds + 1):
            lo = (t - 1) * region
            for rank in range(size):
                count = min(region, output_splits[rank] - lo)
                if rank != me and count > 0:
                    output[out_offsets[rank] + lo:out_offsets[rank] + lo + count].copy_(
                        views.staging[rank][parity ^ 1][me * region:me * region + count])
            if t < rounds:
                self._stage_round(t, input, input_splits, in_offsets, views.staging[me][parity], region)
                parity = self._sync(ctx)

    def _stage_round(self, t: int, input: Tensor, splits: list[int], offsets: list[int], slot: Tensor,
                     region: int) -> None:
        """Copy round t of every outgoing all_to_all block into its region of this rank's slot."""
        lo = t * region
        for rank in range(self.group_size):
            count = min(region, splits[rank] - lo)
            if rank != self.group_rank and count > 0:
                slot[rank * region:rank * region + count].copy_(input[offsets[rank] + lo:offsets[rank] + lo + count])

    def _check_splits(self, ins: list[list[int]], outs: list[list[int]], ctx: OpContext) -> None:
        for src, row in enumerate(ins):
            for dst, count in enumerate(row):
                if outs[dst][src] != count:
                    raise CollectiveMismatchError(
                        f"all_to_all #{ctx.fingerprint.seq} on {ctx.group_desc}: rank "
                        f"{self.spec.global_ranks[dst]} expects {outs[dst][src]} elements from rank "
                        f"{self.spec.global_ranks[src]}, which sends {count}")

    def barrier(self, ctx: OpContext) -> None:
        if self.group_size == 1:
            return
        self._begin(ctx)
        self._sync(ctx)

    # -- point to point -------------------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        self._p2p.isend(tensor, dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        self._p2p.irecv(tensor, src, tag, work)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        if self.segment is not None:
            kind = ABORT_PEER_LOST if isinstance(error, PeerLostError) else ABORT_OTHER
            self.segment.set_abort(kind, str(error) if isinstance(error, (CommError, GroupAbortedError))
                                   else f"{type(error).__name__}: {error}")
        self._p2p.fail(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._p2p.close()
        self._views.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def __repr__(self) -> str:
        return (f"LocalShmTransport(group={self.spec.group_name!r}, rank={self.group_rank}/{self.group_size}, "
                f"pid={os.getpid()})")
