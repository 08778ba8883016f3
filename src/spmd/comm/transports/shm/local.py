"""The shm transport inside one host: every collective through one shared segment.

Layer: comm. All ranks of the group run on one host and map one Segment (see segment's Notes: segment
layout, phases). Data moves by torch copies into and out of shared memory; only 8-byte phase counters
synchronise. Large messages are cut into chunks of at most one staging slot (SLOT_BYTES) per rank and
pipelined (see Note: pipelines), so the memory in use is fixed and a chunk is still in cache when the
next step reads it.

Note: pipelines
Every collective is a short list of stages applied to items (chunks, rounds). Stage s handles item t in
phase start + t + s*LAG: it writes the buffers of its own phase and reads what the previous stage wrote
LAG phases earlier (the only reads Note: phases allows). all_reduce, for instance, is [copy chunk t but
my slice into my staging slot, reduce my slice of chunk t, copy the others' slices of chunk t out of the
result slot], so in one phase a rank copies chunk t in, reduces chunk t-LAG and copies chunk t-2*LAG out.
Views of the chunks are made once per call (a slice costs about a microsecond, a phase a few). Every rank
runs the same stages and phases whatever its role (a stage that has nothing to do on a rank is None
there), so all counters advance alike.

Note: sliced reduction
For all_reduce and reduce, chunk t is split into group_size slices; rank r reduces slice r only, reading
every rank's copy of it in rank order (its own straight from its tensor, which it never copies in). The
result goes into its tensor and into the shared result slot, from which the others copy it out. Ranks 0
and 1 reduce in place in their tensor (their slice is one of the first two operands, read before it is
written) and then copy it to the slot; that writes lines the reduction just read, and measured 5-15%
faster than reducing into the slot and copying the whole chunk out. Every rank does 1/n of the
arithmetic, every element is reduced exactly once, in rank order, so all ranks get bit-identical results.
reduce_scatter is the same without the copy-out: the owner reduces straight into its output.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._core.deadline import Deadline
from spmd._core.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    PeerLostError,
    StoreTimeoutError,
    abort_text,
)
from spmd.comm.debug import Fingerprint, mismatch_message
from spmd.comm.reduce_op import ReduceOp, reduce_into
from spmd.comm.transports.base import OpContext, Transport, TransportSpec
from spmd.comm.transports.shm.p2p import P2PEngine
from spmd.comm.transports.shm.segment import (
    ABORT_OTHER,
    ABORT_PEER_LOST,
    FP_BYTES,
    SHM_DIR,
    Segment,
    fingerprint_digest,
)
from spmd.comm.work import Work

SMALL_BYTES = 32 << 10      # (all_)reduce up to this size: one chunk, and every rank reduces the whole tensor
ALIGN_BYTES = 64            # slice boundaries fall on cache lines, so vectorized kernels see aligned data

def _columns(flat: Tensor, chunk: int, lo: int, hi: int) -> list[Tensor]:
    """flat[c * chunk + lo:c * chunk + hi] for every whole chunk c of `flat`, by one view op (slicing each
    would cost a microsecond apiece)."""
    full = flat.numel() // chunk
    return list(flat[:full * chunk].view(full, chunk)[:, lo:hi].unbind(0))


def _pieces(flat: Tensor, chunk: int) -> list[Tensor]:
    """`flat` as consecutive views of `chunk` elements (the last may be shorter) by one split; one empty view
    when `flat` is empty, so that every collective runs its phases."""
    return list(flat.split(chunk)) if flat.numel() else [flat]


class _Views:
    """The segment's slots viewed as one dtype: staging[rank][index] and result[index]."""

    def __init__(self, segment: Segment, dtype: torch.dtype) -> None:
        layout = segment.layout
        size = layout.slot_bytes
        raw = segment.bytes
        self.staging = [[raw[layout.slot(rank, index):layout.slot(rank, index) + size].view(dtype)
                         for index in range(layout.buffers)] for rank in range(layout.group_size)]
        self.result = [raw[layout.result(index):layout.result(index) + size].view(dtype)
                       for index in range(layout.buffers)]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.capacity = size // itemsize                                   # elements per slot
        self.align = max(1, ALIGN_BYTES // itemsize)
        self.region = (size // layout.group_size) // itemsize // self.align * self.align   # per-peer region
        self._heads: dict[int, list[list[Tensor]]] = {}
        self._sliced: dict[tuple[int, int], _SlicedSlots] = {}
        self._regions: dict[int, list[list[list[Tensor]]]] = {}

    def heads(self, n: int) -> list[list[Tensor]]:
        """staging[rank][index][:n], cached: slicing costs more than a small collective's copy."""
        heads = self._heads.get(n)
        if heads is None:
            if len(self._heads) >= 64:
                self._heads.clear()
            with torch.inference_mode(False):      # kept for later ops: never inference tensors
                heads = self._heads[n] = [[slot[:n] for slot in slots] for slots in self.staging]
        return heads

    def regions(self, length: int) -> list[list[list[Tensor]]]:
        """staging[rank][index] cut into per-peer regions, each's first `length` elements: [rank][index][peer],
        cached."""
        regions = self._regions.get(length)
        if regions is None:
            if len(self._regions) >= 64:
                self._regions.clear()
            count, region = len(self.staging), self.region
            with torch.inference_mode(False):
                regions = self._regions[length] = [[[slot[peer * region:peer * region + length]
                                                     for peer in range(count)] for slot in slots]
                                                   for slots in self.staging]
        return regions

    def sliced(self, length: int, me: int) -> _SlicedSlots:
        """The slot views a sliced reduction of a chunk of `length` elements uses on rank `me`, cached."""
        key = (length, me)
        sliced = self._sliced.get(key)
        if sliced is None:
            if len(self._sliced) >= 64:
                self._sliced.clear()
            with torch.inference_mode(False):
                sliced = self._sliced[key] = _SlicedSlots(self, length, me)
        return sliced


def _slice_bounds(length: int, parts: int, align: int) -> list[int]:
    """Boundaries of `parts` slices of `length` elements, each starting on a multiple of `align`."""
    return [min(length, (length * i // parts + align - 1) // align * align) for i in range(parts)] + [length]


class _SlicedSlots:
    """Per phase buffer, the views of Note: sliced reduction for one chunk length on one rank: the pieces of
    the rank's staging slot around its own slice, every rank's staged copy of its slice, and the result."""

    def __init__(self, views: _Views, length: int, me: int) -> None:
        size = len(views.staging)
        self.bounds = bounds = _slice_bounds(length, size, views.align)
        lo, hi = bounds[me], bounds[me + 1]
        buffers = range(len(views.result))
        self.before = [views.staging[me][index][:lo] for index in buffers] if lo > 0 else None
        self.after = [views.staging[me][index][hi:length] for index in buffers] if hi < length else None
        self.peers = [[None if rank == me else views.staging[rank][index][lo:hi] for rank in range(size)]
                      for index in buffers]
        self.result_mine = [views.result[index][lo:hi] for index in buffers]
        self.result_before = [views.result[index][:lo] for index in buffers]
        self.result_after = [views.result[index][hi:length] for index in buffers]
        self.reduces = hi > lo


_SlicedChunk = tuple[_SlicedSlots, Tensor, Tensor | None, Tensor | None]   # slots, my slice, before it, after it
Stage = Callable[[int, int, int], None] | None   # stage(item, write index, read index); None: nothing here


class LocalShmTransport(Transport):
    """Collectives and P2P among ranks of one host through one shared segment."""

    name = "shm"
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        self._phase = 0
        self._views: dict[torch.dtype, _Views] = {}
        self._pending_ctx: OpContext | None = None    # whose fingerprints still need checking ...
        self._pending_phase = 0                       # ... once this rank reaches this phase
        self._fp_cache: dict[tuple, tuple[bytes, bytes]] = {}
        self._closed = False
        self.segment: Segment | None = None
        if self.group_size > 1:
            self.segment = self._connect(spec)
            self.segment.global_ranks = list(spec.global_ranks)
        self._p2p = P2PEngine(self.segment, self.group_rank, self.group_size, spec)

    def _connect(self, spec: TransportSpec) -> Segment:
        """Collective set-up: once every rank has arrived, rank 0 creates the segment, all map it, then everybody
        unlinks its name. Creating only then keeps the name's window (see segment) to the attaches: a peer that
        never starts leaves no name behind."""
        deadline = Deadline(spec.timeout)
        what = f"shm transport set-up of group '{spec.group_name}' on rank {spec.global_rank}"
        epoch = (spec.store.add("shm/joins", 1) - 1) // self.group_size   # a fresh segment per incarnation
        key = f"shm/segment/{epoch}"
        if self.group_rank == 0:
            self._await_arrivals(spec, epoch, deadline, what)
            segment = Segment.create(self.group_size)
            spec.store.set(key, segment.name)
        else:
            spec.store.set(f"shm/arrived/{epoch}/{self.group_rank}", b"1")
            spec.store.wait([key], timeout=deadline.remaining())
            name = spec.store.get(key).decode()
            try:
                segment = Segment.attach(name, self.group_rank, self.group_size)
            except FileNotFoundError:
                raise RuntimeError(
                    f"{what}: segment {name} of group rank 0 (rank {spec.global_ranks[0]}) is not in this "
                    f"process's {SHM_DIR}, although both have host identity {spec.hosts[0]!r} (SPMD_HOST_ID, "
                    f"else hostname, boot id, {SHM_DIR} mount and namespaces). Ranks that don't share memory "
                    f"need different identities: give each its own SPMD_HOST_ID (any label, never resolved), or "
                    f"use backend='tcp'.") from None
        try:
            segment.announce()
            segment.await_attached(deadline, what)
        except BaseException:
            segment.close()
            raise
        segment.unlink_name()
        return segment

    def _await_arrivals(self, spec: TransportSpec, epoch: int, deadline: Deadline, what: str) -> None:
        """Wait until every other rank of the group has reached its set-up (group rank 0, before creating)."""
        keys = {peer: f"shm/arrived/{epoch}/{peer}" for peer in range(1, self.group_size)}
        try:
            spec.store.wait(list(keys.values()), timeout=deadline.remaining())
        except StoreTimeoutError:
            missing = [peer for peer, key in keys.items() if not spec.store.check([key])]
            raise CommTimeoutError(f"{what}: group rank(s) {missing} did not reach the set-up within "
                                   f"{deadline.timeout:.1f}s, so no shared segment was made") from None

    # -- phases ---------------------------------------------------------------------------------------------

    def _describe(self, ctx: OpContext) -> str:
        return f"{ctx.fingerprint.op} #{ctx.fingerprint.seq} on {ctx.group_desc}, rank {self.spec.global_rank}"

    def _begin(self, ctx: OpContext) -> Segment:
        """Publish this op's fingerprint in the current phase's buffer; it is checked LAG phases later."""
        segment = self.segment
        assert segment is not None
        if segment.aborted():
            raise segment.abort_error(self._describe(ctx))
        fp = ctx.fingerprint
        digest, encoded = self._encoded(fp)
        offset = segment.fp_offset(self.group_rank, self._phase % segment.layout.buffers)
        segment.write_bytes(offset, digest)
        segment.write_word(offset + 16, fp.seq)
        segment.write_word(offset + 24, len(encoded))
        segment.write_bytes(offset + 32, encoded)
        self._pending_ctx = ctx
        self._pending_phase = self._phase + segment.layout.lag
        return segment

    def _sync(self, ctx: OpContext, steps: int) -> None:
        """Move this rank `steps` phases on and wait until every peer is at most LAG - 1 phases behind."""
        segment = self.segment
        assert segment is not None
        self._phase += steps
        segment.end_phase(self._phase)
        segment.wait_phase(self._phase - segment.layout.lag + 1, ctx.deadline, lambda: self._describe(ctx))
        if self._pending_ctx is not None and self._phase >= self._pending_phase:
            self._pending_ctx = None
            self._check_fingerprints(segment, ctx, (self._pending_phase - segment.layout.lag) % segment.layout.buffers)

    def _encoded(self, fp: Fingerprint) -> tuple[bytes, bytes]:
        """The digest of everything ranks must agree on but the sequence number, and the fingerprint encoded
        with seq 0 (the seq travels in its own word), cached: a training loop repeats a few call sites."""
        cache_key = (fp.op, fp.shape, fp.dtype, fp.reduce_op, fp.root, fp.call_site)
        cached = self._fp_cache.get(cache_key)
        if cached is None:
            if len(self._fp_cache) >= 1024:
                self._fp_cache.clear()
            same = dataclasses.replace(fp, seq=0)
            cached = self._fp_cache[cache_key] = (fingerprint_digest(same.key()), same.encode()[:FP_BYTES - 32])
        return cached

    def _check_fingerprints(self, segment: Segment, ctx: OpContext, index: int) -> None:
        mine = segment.read_bytes(segment.fp_offset(self.group_rank, index), 24)    # digest and seq
        for peer in range(self.group_size):
            offset = segment.fp_offset(peer, index)
            if segment.read_bytes(offset, 24) != mine:
                encoded = segment.read_bytes(offset + 32, segment.word(offset + 24))
                try:
                    theirs = dataclasses.replace(Fingerprint.decode(encoded), seq=segment.word(offset + 16))
                except ValueError:    # cut short (an absurdly long shape or call site)
                    theirs = Fingerprint("<unreadable fingerprint>", segment.word(offset + 16), None, "?")
                raise CollectiveMismatchError(mismatch_message(
                    ctx.group_desc, ctx.fingerprint, self.spec.global_rank, theirs, self.spec.global_ranks[peer]))

    def _pipeline(self, ctx: OpContext, count: int, stages: list[Stage]) -> None:
        """Run stage s on item t in phase start + t + s*LAG, for t < count (see Note: pipelines)."""
        segment = self.segment
        assert segment is not None
        lag, buffers = segment.layout.lag, segment.layout.buffers
        spans = [(s * lag, s * lag + count) for s in range(len(stages))]    # intervals in which stage s works
        t, last = 0, spans[-1][1] - 1
        while True:
            write, read = self._phase % buffers, (self._phase - lag) % buffers
            for s, stage in enumerate(stages):              # any order: one phase's stages touch disjoint buffers
                if stage is not None and spans[s][0] <= t < spans[s][1]:
                    stage(t - spans[s][0], write, read)
            if t == last:
                return
            following = min(t + 1 if start <= t + 1 < end else start for start, end in spans if end > t + 1)
            self._sync(ctx, following - t)
            t = following

    def _views_of(self, dtype: torch.dtype) -> _Views:
        views = self._views.get(dtype)
        if views is None:
            assert self.segment is not None
            with torch.inference_mode(False):
                views = self._views[dtype] = _Views(self.segment, dtype)
        return views

    def _sliced_chunks(self, flat: Tensor, views: _Views) -> list[_SlicedChunk]:
        """Per chunk of `flat`, its slot views and its tensor views (see Note: sliced reduction): made once
        per call, whole chunks by one view op per kind, so no phase pays for slicing."""
        me, capacity, numel = self.group_rank, views.capacity, flat.numel()
        full, rest = divmod(numel, capacity)
        items: list[_SlicedChunk] = []
        if full:
            sliced = views.sliced(capacity, me)
            lo, hi = sliced.bounds[me], sliced.bounds[me + 1]
            mines = _columns(flat, capacity, lo, hi)
            befores = _columns(flat, capacity, 0, lo) if lo > 0 else [None] * full
            afters = _columns(flat, capacity, hi, capacity) if hi < capacity else [None] * full
            items = [(sliced, *views_of_chunk) for views_of_chunk in zip(mines, befores, afters)]
        if rest:
            sliced, base = views.sliced(rest, me), full * capacity
            lo, hi = sliced.bounds[me], sliced.bounds[me + 1]
            items.append((sliced, flat[base + lo:base + hi], flat[base:base + lo] if lo > 0 else None,
                          flat[base + hi:] if hi < rest else None))
        return items

    # -- reductions -----------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size > 1:
            self._reduce(tensor, op, ctx, root=None)

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size > 1:
            self._reduce(tensor, op, ctx, root=root)

    def _reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext, root: int | None) -> None:
        """all_reduce (root None) or reduce to `root`. Small tensors: every rank stages all of it and the
        receivers reduce every copy in rank order. Larger: see Note: sliced reduction."""
        me, size = self.group_rank, self.group_size
        views = self._views_of(tensor.dtype)
        receives = root is None or root == me
        self._begin(ctx)
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            heads = views.heads(tensor.numel())

            def stage_all(t: int, write: int, read: int) -> None:
                heads[me][write].copy_(tensor)

            def reduce_all(t: int, write: int, read: int) -> None:
                reduce_into(tensor, [heads[rank][read] for rank in range(size)], op)

            self._pipeline(ctx, 1, [stage_all, reduce_all if receives else None])
            return
        items = self._sliced_chunks(tensor, views)

        def stage_others(t: int, write: int, read: int) -> None:       # chunk t, but for my own slice
            sliced, _, before, after = items[t]
            if before is not None:
                sliced.before[write].copy_(before)
            if after is not None:
                sliced.after[write].copy_(after)

        in_place = receives and me < 2     # my slice is one of the first two operands: read before written

        def reduce_mine(t: int, write: int, read: int) -> None:   # my slice of chunk t -> my tensor, result slot
            sliced, mine, _, _ = items[t]
            if not sliced.reduces:
                return
            sources = list(sliced.peers[read])
            sources[me] = mine
            result = sliced.result_mine[write]
            reduce_into(mine if in_place else result, sources, op)
            if in_place:
                result.copy_(mine)
            elif receives:
                mine.copy_(result)

        def copy_out(t: int, write: int, read: int) -> None:             # the others' slices of chunk t
            sliced, _, before, after = items[t]
            if before is not None:
                before.copy_(sliced.result_before[read])
            if after is not None:
                after.copy_(sliced.result_after[read])

        self._pipeline(ctx, len(items), [stage_others, reduce_mine, copy_out if receives else None])

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        if self.group_size == 1:
            output.copy_(input)
            return
        me, size, m = self.group_rank, self.group_size, output.numel()
        views = self._views_of(output.dtype)
        outs = _pieces(output, views.region)
        blocks = [_pieces(input[rank * m:(rank + 1) * m], views.region) for rank in range(size)]

        def stage_blocks(t: int, write: int, read: int) -> None:          # chunk t of every other block -> slot
            regions = views.regions(outs[t].numel())[me][write]
            for rank in range(size):
                if rank != me:
                    regions[rank].copy_(blocks[rank][t])

        def reduce_mine(t: int, write: int, read: int) -> None:          # chunk t of my block -> output
            out = outs[t]
            regions = views.regions(out.numel())
            sources = [blocks[me][t] if rank == me else regions[rank][read][me] for rank in range(size)]
            reduce_into(out, sources, op)

        self._begin(ctx)
        self._pipeline(ctx, len(outs), [stage_blocks, reduce_mine])

    # -- data movement --------------------------------------------------------------------------------------

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        if self.group_size == 1:
            return
        views = self._views_of(tensor.dtype)
        pieces = _pieces(tensor, views.capacity)

        def stage(t: int, write: int, read: int) -> None:               # the root's own staging slot
            views.heads(pieces[t].numel())[root][write].copy_(pieces[t])

        def copy_out(t: int, write: int, read: int) -> None:
            pieces[t].copy_(views.heads(pieces[t].numel())[root][read])

        is_root = self.group_rank == root
        self._begin(ctx)
        self._pipeline(ctx, len(pieces), [stage if is_root else None, None if is_root else copy_out])

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        self._gather(output, input, None, ctx)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        self._gather(output, input, root, ctx)

    def _gather(self, output: Tensor | None, input: Tensor, root: int | None, ctx: OpContext) -> None:
        """all_gather (root None) or gather to `root`: each rank stages its chunk, the receivers copy out."""
        me, size, m = self.group_rank, self.group_size, input.numel()
        own = (output[me * m:(me + 1) * m] if output is not None
               and output.data_ptr() + me * m * output.element_size() != input.data_ptr() else None)
        if own is not None and (size == 1 or root == me):
            own.copy_(input)
            own = None
        if size == 1:
            return
        views = self._views_of(input.dtype)
        ins = _pieces(input, views.capacity)
        owns = None if own is None else _pieces(own, views.capacity)
        outs = [None if output is None or rank == me else _pieces(output[rank * m:(rank + 1) * m], views.capacity)
                for rank in range(size)]

        def stage(t: int, write: int, read: int) -> None:    # my own chunk goes out from the slot, still in cache
            slot = views.heads(ins[t].numel())[me][write]
            slot.copy_(ins[t])
            if owns is not None:
                owns[t].copy_(slot)

        def copy_out(t: int, write: int, read: int) -> None:
            heads = views.heads(ins[t].numel())
            for rank, pieces in enumerate(outs):
                if pieces is not None:
                    pieces[t].copy_(heads[rank][read])

        receives = root is None or root == me
        self._begin(ctx)
        self._pipeline(ctx, len(ins), [None if root == me else stage, copy_out if receives else None])

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        me, size, m = self.group_rank, self.group_size, output.numel()
        if me == root:
            assert input is not None
            output.copy_(input[me * m:(me + 1) * m])
        if size == 1:
            return
        views = self._views_of(output.dtype)
        outs = _pieces(output, views.region)
        blocks = ([_pieces(input[rank * m:(rank + 1) * m], views.region) for rank in range(size)]
                  if input is not None else [])

        def stage_blocks(t: int, write: int, read: int) -> None:
            regions = views.regions(outs[t].numel())[me][write]
            for rank in range(size):
                if rank != me:
                    regions[rank].copy_(blocks[rank][t])

        def copy_out(t: int, write: int, read: int) -> None:
            outs[t].copy_(views.regions(outs[t].numel())[root][read][me])

        self._begin(ctx)
        self._pipeline(ctx, len(outs), [stage_blocks if me == root else None, None if me == root else copy_out])

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        """Every rank first publishes its split sizes (all check the whole matrix and agree on the number of
        rounds), then the blocks move in rounds of one region per pair of ranks."""
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
        segment = self._begin(ctx)
        words = segment.words
        ins, outs = [], []

        def publish(t: int, write: int, read: int) -> None:
            base = segment.splits_offset(me, write) >> 3
            for rank in range(size):
                words[base + rank] = input_splits[rank]
                words[base + size + rank] = output_splits[rank]

        def collect(t: int, write: int, read: int) -> None:
            for rank in range(size):
                base = segment.splits_offset(rank, read) >> 3
                ins.append(list(words[base:base + size]))
                outs.append(list(words[base + size:base + 2 * size]))

        self._pipeline(ctx, 1, [publish, collect])
        self._check_splits(ins, outs, ctx)
        longest = max(ins[src][dst] for src in range(size) for dst in range(size) if src != dst)

        def stage_round(t: int, write: int, read: int) -> None:
            lo, slot = t * region, views.staging[me][write]
            for rank in range(size):
                count = min(region, input_splits[rank] - lo)
                if rank != me and count > 0:
                    slot[rank * region:rank * region + count].copy_(
                        input[in_offsets[rank] + lo:in_offsets[rank] + lo + count])

        def copy_round(t: int, write: int, read: int) -> None:
            lo = t * region
            for rank in range(size):
                count = min(region, output_splits[rank] - lo)
                if rank != me and count > 0:
                    output[out_offsets[rank] + lo:out_offsets[rank] + lo + count].copy_(
                        views.staging[rank][read][me * region:me * region + count])

        if longest > 0:
            self._pipeline(ctx, -(-longest // region), [stage_round, copy_round])

    def _check_splits(self, ins: list[list[int]], outs: list[list[int]], ctx: OpContext) -> None:
        for src, row in enumerate(ins):
            for dst, count in enumerate(row):
                if outs[dst][src] != count:
                    raise CollectiveMismatchError(
                        f"all_to_all #{ctx.fingerprint.seq} on {ctx.group_desc}: rank "
                        f"{self.spec.global_ranks[dst]} expects {outs[dst][src]} elements from rank "
                        f"{self.spec.global_ranks[src]}, which sends {count}")

    def barrier(self, ctx: OpContext) -> None:
        if self.group_size > 1:
            self._begin(ctx)
            self._pipeline(ctx, 1, [None, None])

    # -- point to point -------------------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        self._p2p.isend(tensor, dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        self._p2p.irecv(tensor, src, tag, work)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        if self.segment is not None:
            kind = ABORT_PEER_LOST if isinstance(error, PeerLostError) else ABORT_OTHER
            self.segment.set_abort(kind, abort_text(error, self.spec.where(self.group_rank)))
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
