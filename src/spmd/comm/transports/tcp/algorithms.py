"""Collective algorithms written once against a small point-to-point interface (Exchange).

Layer: comm. A transport that can send a flat tensor to a peer and receive into a flat tensor supplies an
Exchange per collective and gets every collective from here: ring reduce-scatter + all-gather with
pipelined pieces for large messages, recursive doubling or direct exchange for small ones.

Note: the Exchange protocol
One Exchange serves one collective on one rank. The algorithm calls, in this order:
  1. `post(recvs)` once, with every receive the collective will make on this rank, in the order each
     peer sends them (the transport matches messages from a peer to its posted receives first in, first out);
  2. `send(peer, tensor)` and `wait(handle)` in any interleaving. Receives from one peer complete in the
     order they were posted, so waiting for the last of them waits for all. `send` returns once `tensor` may be
     reused; a transport must keep receiving while it sends (full duplex), so ranks that send to each
     other at the same time never deadlock.
Posting everything first lets the transport tell a message that belongs to a later collective (keep it)
from one this rank will never ask for (a mismatched call: fail), and lets it receive straight into the
destination tensors.

Note: rooted collectives are confirmed
In broadcast, scatter, gather and reduce most ranks talk only to the root, so a rank that agrees with the
root could finish while another rank called something else, and two ranks that both believe they are the
root would wait for each other forever. So a rooted collective starts with a handshake through the root:
the root sends every rank an empty "hello", and every rank sends the root its hello (broadcast, scatter) or
its data (gather, reduce). Two would-be roots thus receive each other's hello where they expected a
non-root's message, and fail. The root sends data (broadcast, scatter) or an empty "ack" (gather, reduce)
only after every rank's message arrived with a matching fingerprint, so a rooted collective completes on a
rank only after the root has checked every rank, and a mismatch fails it everywhere.

Reductions combine in a fixed order for each element (rank order at a root, ring order around the ring,
and pairwise-commutative steps in recursive doubling), so every rank ends with bit-identical results.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CollectiveMismatchError
from spmd.comm.reduce_op import ReduceOp, finish_average, partial_op, reduce_into

SMALL_BYTES = 64 * 1024       # at or below: latency-optimal exchanges; above: ring with pipelined pieces
DOUBLING_BYTES = 4 << 20      # all_reduce on 2^k ranks: pipelined recursive doubling up to this size (one hop
                              # per round beats the ring's two phases until the extra reduction work dominates)
PIECE_BYTES = 256 * 1024      # smallest pipelined piece of a ring step
MAX_PIECE_BYTES = 512 * 1024  # largest piece: bigger ones overlap less (measured on 2 ranks, 32 MiB)
PIECES_PER_BLOCK = 16         # enough pieces to overlap receiving, reducing and forwarding
_EMPTY = torch.empty(0, dtype=torch.uint8)


class Exchange(abc.ABC):
    """The point-to-point primitives of one collective on one rank (see Note: the Exchange protocol)."""

    group_rank: int
    group_size: int

    @abc.abstractmethod
    def post(self, recvs: list[tuple[int, Tensor]]) -> list[Any]:
        """Register every receive of this collective: (peer group rank, flat destination); one handle each."""

    @abc.abstractmethod
    def send(self, peer: int, tensor: Tensor) -> None:
        """Send a flat tensor's bytes to `peer`; returns once the tensor may be reused."""

    @abc.abstractmethod
    def wait(self, handle: Any) -> None:
        """Block until the receive `handle` has filled its destination."""

    @abc.abstractmethod
    def scratch(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A flat temporary of `numel` elements, valid until the collective returns."""


def split(numel: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of `parts` contiguous blocks covering `numel` elements; lengths differ by at most 1."""
    base, extra = divmod(numel, parts)
    blocks, start = [], 0
    for index in range(parts):
        length = base + (index < extra)
        blocks.append((start, length))
        start += length
    return blocks


def _pieces(start: int, length: int, element_size: int) -> list[tuple[int, int]]:
    """Split [start, start+length) into pipelined pieces: about PIECES_PER_BLOCK of them, each between
    PIECE_BYTES and MAX_PIECE_BYTES (sender and receiver split a block identically)."""
    piece_bytes = min(MAX_PIECE_BYTES, max(PIECE_BYTES, length * element_size // PIECES_PER_BLOCK))
    step = max(1, piece_bytes // element_size)
    return [(s, min(step, start + length - s)) for s in range(start, start + length, step)]


def _wait_last(ex: Exchange, handles: list[Any]) -> None:
    if handles:
        ex.wait(handles[-1])


def _is_small(tensor: Tensor) -> bool:
    return tensor.numel() * tensor.element_size() <= SMALL_BYTES


# -- all_reduce ------------------------------------------------------------------------------------------------


def all_reduce(ex: Exchange, tensor: Tensor, op: ReduceOp) -> None:
    """tensor <- op over ranks, in place, identical bits on every rank."""
    n = ex.group_size
    if n == 1:
        return
    nbytes = tensor.numel() * tensor.element_size()
    partial = partial_op(op)      # every algorithm combines pairwise, so AVG sums and divides once at the end
    if n & (n - 1) == 0 and (nbytes <= DOUBLING_BYTES or tensor.numel() < n):
        _all_reduce_recursive_doubling(ex, tensor, partial)
    elif _is_small(tensor) or tensor.numel() < n:
        _all_reduce_via_root(ex, tensor, partial)
    else:
        _all_reduce_ring(ex, tensor, partial)
    finish_average(tensor, op, n)


def _all_reduce_recursive_doubling(ex: Exchange, tensor: Tensor, op: ReduceOp) -> None:
    # Round k pairs rank r with r ^ 2^k; each pair combines two equal partial results, so both partners
    # compute a op b and b op a, which are the same bits for every ReduceOp (all are commutative). Pieces
    # are pipelined: piece p goes to the next round's partner as soon as this round has combined it.
    r, n = ex.group_rank, ex.group_size
    rounds = n.bit_length() - 1
    numel = tensor.numel()
    temp = ex.scratch(rounds * numel, tensor.dtype).view(rounds, numel)
    partners = [r ^ (1 << k) for k in range(rounds)]
    pieces = _pieces(0, numel, tensor.element_size()) or [(0, 0)]
    handles = iter(ex.post([(partners[k], temp[k][a:a + length]) for k in range(rounds) for a, length in pieces]))
    for a, length in pieces:
        ex.send(partners[0], tensor[a:a + length])
    for k in range(rounds):
        for a, length in pieces:
            ex.wait(next(handles))
            mine = tensor[a:a + length]
            reduce_into(mine, (mine, temp[k][a:a + length]), op)
            if k + 1 < rounds:
                ex.send(partners[k + 1], mine)


def _all_reduce_via_root(ex: Exchange, tensor: Tensor, op: ReduceOp) -> None:
    r, n = ex.group_rank, ex.group_size
    if r == 0:
        temp = ex.scratch((n - 1) * tensor.numel(), tensor.dtype).view(n - 1, tensor.numel())
        handles = ex.post([(peer, temp[peer - 1]) for peer in range(1, n)])
        for peer in range(1, n):
            ex.wait(handles[peer - 1])
            reduce_into(tensor, (tensor, temp[peer - 1]), op)
        for peer in range(1, n):
            ex.send(peer, tensor)
    else:
        (handle,) = ex.post([(0, tensor)])
        ex.send(0, tensor)
        ex.wait(handle)


def _all_reduce_ring(ex: Exchange, tensor: Tensor, op: ReduceOp) -> None:
    # Reduce-scatter then all-gather around the ring r -> r+1, as 2(n-1) steps of P pieces. Message M(s, k)
    # is piece k of the block a rank sends at step s: block (r-s-1). At a reduce-scatter step the receiver
    # combines its own piece into the partial and sends it on as M(s+1, k); after n-1 steps block r is
    # complete on rank r, and the all-gather steps pass complete pieces on.
    # Every rank sends its messages in one fixed order that interleaves steps (see _ring_order), so it
    # combines and forwards early pieces between sending later ones instead of first pushing a whole block;
    # the receiver posts its receives in that same order, which is the order they arrive in.
    r, n = ex.group_rank, ex.group_size
    prev, nxt = (r - 1) % n, (r + 1) % n
    blocks = split(tensor.numel(), n)
    count = len(_pieces(0, max(length for _, length in blocks), tensor.element_size()))
    grid = [[(start + a, length) for a, length in split(block_length, count)] for start, block_length in blocks]
    steps = 2 * (n - 1)
    rs_blocks = [(r - s - 2) % n for s in range(n - 1)]      # block received at reduce-scatter step s
    temp = ex.scratch(sum(blocks[b][1] for b in rs_blocks), tensor.dtype)
    temp_at = [sum(blocks[b][1] for b in rs_blocks[:s]) for s in range(n - 1)]

    def received(s: int, k: int) -> Tensor:
        """Where M(s, k) from prev lands: scratch during reduce-scatter, the tensor itself during all-gather."""
        start, length = grid[(r - s - 2) % n][k]
        if s < n - 1:
            offset = temp_at[s] + start - blocks[rs_blocks[s]][0]
            return temp[offset:offset + length]
        return tensor[start:start + length]

    order = _ring_order(steps, count)
    handles = dict(zip(order, ex.post([(prev, received(s, k)) for s, k in order])))
    for s, k in order:
        start, length = grid[(r - s - 1) % n][k]
        mine = tensor[start:start + length]
        if s > 0:
            ex.wait(handles[(s - 1, k)])
            if s - 1 < n - 1:
                reduce_into(mine, (mine, received(s - 1, k)), op)
        ex.send(nxt, mine)
    for k in range(count):
        ex.wait(handles[(steps - 1, k)])


def _ring_order(steps: int, count: int, lag: int = 2) -> list[tuple[int, int]]:
    """The order of a rank's ring messages (step, piece): M(s, k) after M(s-1, k), `lag` pieces behind it."""
    return sorted(((s, k) for s in range(steps) for k in range(count)), key=lambda m: (m[1] + lag * m[0], -m[0]))


# -- all_gather / reduce_scatter ------------------------------------------------------------------------------


def all_gather(ex: Exchange, output: Tensor, input: Tensor) -> None:
    """output <- every rank's input in rank order."""
    r, n = ex.group_rank, ex.group_size
    m = input.numel()
    if n == 1:
        output.copy_(input)
        return
    # The receives are posted before this rank copies its own block, which takes as long as receiving one: a
    # peer's block arriving before its receive is posted is read into a buffer of its own and copied again.
    if n == 2 or _is_small(output):
        peers = [(r + k) % n for k in range(1, n)]
        handles = ex.post([(p, output[p * m:(p + 1) * m]) for p in peers])
        output[r * m:(r + 1) * m].copy_(input)
        for p in peers:
            ex.send(p, input)
        for handle in handles:
            ex.wait(handle)
        return
    prev, nxt = (r - 1) % n, (r + 1) % n
    size = input.element_size()
    steps = [_pieces(b * m, m, size) for b in ((r - s - 1) % n for s in range(n - 1))]
    handles = iter(ex.post([(prev, output[a:a + length]) for pieces in steps for a, length in pieces]))
    output[r * m:(r + 1) * m].copy_(input)
    for a, length in _pieces(r * m, m, size):
        ex.send(nxt, output[a:a + length])
    for step, pieces in enumerate(steps):
        if step == n - 2:    # nothing to forward: wait for the last piece (a peer's pieces arrive in order)
            _wait_last(ex, list(handles))
            break
        for a, length in pieces:
            ex.wait(next(handles))
            ex.send(nxt, output[a:a + length])


def reduce_scatter(ex: Exchange, output: Tensor, input: Tensor, op: ReduceOp) -> None:
    """output <- op over ranks of block `group_rank` of input (equal blocks); input is left unchanged."""
    n = ex.group_size
    if n == 1:
        output.copy_(input)
        return
    if _is_small(input):
        _reduce_scatter_direct(ex, output, input, partial_op(op))
    else:
        _reduce_scatter_ring(ex, output, input, partial_op(op))
    finish_average(output, op, n)


def _reduce_scatter_direct(ex: Exchange, output: Tensor, input: Tensor, op: ReduceOp) -> None:
    r, n = ex.group_rank, ex.group_size
    m = output.numel()
    temp = ex.scratch(n * m, input.dtype).view(n, m)
    peers = [(r + k) % n for k in range(1, n)]
    handles = ex.post([(p, temp[p]) for p in peers])
    for p in peers:
        ex.send(p, input[p * m:(p + 1) * m])
    for handle in handles:
        ex.wait(handle)
    temp[r].copy_(input[r * m:(r + 1) * m])
    reduce_into(output, temp.unbind(0), op)


def _reduce_scatter_ring(ex: Exchange, output: Tensor, input: Tensor, op: ReduceOp) -> None:
    # As the reduce-scatter half of _all_reduce_ring, but partials live in scratch (input is read-only)
    # and the last step lands in output.
    r, n = ex.group_rank, ex.group_size
    m = output.numel()
    prev, nxt = (r - 1) % n, (r + 1) % n
    size = output.element_size()
    temp = ex.scratch((n - 2) * m, output.dtype)
    dests = [temp[s * m:(s + 1) * m] for s in range(n - 2)] + [output]
    local = [_pieces(0, m, size)] * (n - 1)
    handles = iter(ex.post([(prev, dests[s][a:a + length]) for s in range(n - 1) for a, length in local[s]]))
    first = (r - 1) % n
    for a, length in local[0]:
        ex.send(nxt, input[first * m + a:first * m + a + length])
    for s in range(n - 1):
        block = (r - s - 2) % n
        for a, length in local[s]:
            ex.wait(next(handles))
            partial = dests[s][a:a + length]
            reduce_into(partial, (partial, input[block * m + a:block * m + a + length]), op)
            if s < n - 2:
                ex.send(nxt, partial)


# -- rooted collectives (see Note: rooted collectives are confirmed) -------------------------------------------


def broadcast(ex: Exchange, tensor: Tensor, root: int) -> None:
    """tensor <- root's tensor."""
    r, n = ex.group_rank, ex.group_size
    if n == 1:
        return
    chain = n > 2 and not _is_small(tensor)
    pieces = _pieces(0, tensor.numel(), tensor.element_size()) if chain else [(0, tensor.numel())]
    if r == root:
        hellos = ex.post([(p, _EMPTY) for p in range(n) if p != root])
        _greet_all(ex, root)
        _wait_all(ex, hellos)
        if chain:       # pipelined chain root -> root+1 -> ...: every link carries the tensor once
            for a, length in pieces:
                ex.send((r + 1) % n, tensor[a:a + length])
        else:
            for k in range(1, n):
                ex.send((root + k) % n, tensor)
        return
    source = (r - 1) % n if chain else root
    hello, *handles = ex.post([(root, _EMPTY)] + [(source, tensor[a:a + length]) for a, length in pieces])
    ex.send(root, _EMPTY)
    forward = chain and (r - root) % n < n - 1
    for (a, length), handle in zip(pieces, handles):
        ex.wait(handle)
        if forward:
            ex.send((r + 1) % n, tensor[a:a + length])
    ex.wait(hello)


def scatter(ex: Exchange, output: Tensor, input: Tensor | None, root: int) -> None:
    """output <- block `group_rank` of root's input."""
    r, n = ex.group_rank, ex.group_size
    m = output.numel()
    if r != root:
        _, data = ex.post([(root, _EMPTY), (root, output)])
        ex.send(root, _EMPTY)
        ex.wait(data)
        return
    assert input is not None
    peers = [(root + k) % n for k in range(1, n)]
    hellos = ex.post([(p, _EMPTY) for p in peers])
    _greet_all(ex, root)
    _wait_all(ex, hellos)
    for p in peers:
        ex.send(p, input[p * m:(p + 1) * m])
    output.copy_(input[r * m:(r + 1) * m])


def gather(ex: Exchange, output: Tensor | None, input: Tensor, root: int) -> None:
    """On root, output <- every rank's input in rank order."""
    r, n = ex.group_rank, ex.group_size
    m = input.numel()
    if r != root:
        _, ack = ex.post([(root, _EMPTY), (root, _EMPTY)])
        ex.send(root, input)
        ex.wait(ack)
        return
    assert output is not None
    output[r * m:(r + 1) * m].copy_(input)
    handles = ex.post([(p, output[p * m:(p + 1) * m]) for p in range(n) if p != root])
    _greet_all(ex, root)
    _wait_all(ex, handles)
    _greet_all(ex, root)     # the ack


def reduce(ex: Exchange, tensor: Tensor, root: int, op: ReduceOp) -> None:
    """On root, tensor <- op over ranks; other ranks' tensors are unchanged."""
    r, n = ex.group_rank, ex.group_size
    if n == 1:
        return
    if n == 2 or _is_small(tensor):
        _reduce_direct(ex, tensor, root, partial_op(op))
    else:
        _reduce_chain(ex, tensor, root, partial_op(op))
    if r == root:
        finish_average(tensor, op, n)
        _greet_all(ex, root)     # the ack


def _reduce_direct(ex: Exchange, tensor: Tensor, root: int, op: ReduceOp) -> None:
    r, n = ex.group_rank, ex.group_size
    if r != root:
        _, ack = ex.post([(root, _EMPTY), (root, _EMPTY)])
        ex.send(root, tensor)
        ex.wait(ack)
        return
    m = tensor.numel()
    temp = ex.scratch(n * m, tensor.dtype).view(n, m)
    handles = ex.post([(p, temp[p]) for p in range(n) if p != root])
    _greet_all(ex, root)
    _wait_all(ex, handles)
    temp[root].copy_(tensor)
    reduce_into(tensor, temp.unbind(0), op)


def _reduce_chain(ex: Exchange, tensor: Tensor, root: int, op: ReduceOp) -> None:
    # Pipelined chain root+n-1 -> ... -> root+1 -> root; each link adds its own piece to the partial.
    r, n = ex.group_rank, ex.group_size
    position = (r - root) % n
    downstream = (r - 1) % n
    pieces = _pieces(0, tensor.numel(), tensor.element_size())
    if position == n - 1:
        _, ack = ex.post([(root, _EMPTY), (root, _EMPTY)])
        for a, length in pieces:
            ex.send(downstream, tensor[a:a + length])
        ex.wait(ack)
        return
    temp = ex.scratch(tensor.numel(), tensor.dtype)
    recvs = [((r + 1) % n, temp[a:a + length]) for a, length in pieces]
    if position == 0:
        handles = ex.post(recvs)
        _greet_all(ex, root)
    else:
        _, *handles, ack = ex.post([(root, _EMPTY), *recvs, (root, _EMPTY)])
    for (a, length), handle in zip(pieces, handles):
        ex.wait(handle)
        if position == 0:
            mine = tensor[a:a + length]
            reduce_into(mine, (mine, temp[a:a + length]), op)
        else:
            partial = temp[a:a + length]
            reduce_into(partial, (partial, tensor[a:a + length]), op)
            ex.send(downstream, partial)
    if position != 0:
        ex.wait(ack)


def _greet_all(ex: Exchange, root: int) -> None:
    """The root sends every other rank an empty message (its hello, or its ack)."""
    for k in range(1, ex.group_size):
        ex.send((root + k) % ex.group_size, _EMPTY)


def _wait_all(ex: Exchange, handles: list[Any]) -> None:
    for handle in handles:
        ex.wait(handle)


# -- all_to_all and barrier ----------------------------------------------------------------------------------------


def all_to_all(ex: Exchange, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
               group_desc: str, rank_names: tuple[int, ...]) -> None:
    """Rank j's output block i <- rank i's input block j (uneven blocks; splits in elements)."""
    r, n = ex.group_rank, ex.group_size
    if output_splits[r] != input_splits[r]:
        raise CollectiveMismatchError(
            f"all_to_all on {group_desc}: rank {rank_names[r]} sends itself {input_splits[r]} elements but "
            f"expects {output_splits[r]} from itself; output and input split sizes disagree")
    out_at = [sum(output_splits[:i]) for i in range(n)]
    in_at = [sum(input_splits[:i]) for i in range(n)]
    peers = [(r + k) % n for k in range(1, n)]
    handles = ex.post([(p, output[out_at[p]:out_at[p] + output_splits[p]]) for p in peers])
    output[out_at[r]:out_at[r] + output_splits[r]].copy_(input[in_at[r]:in_at[r] + input_splits[r]])  # as all_gather
    for p in peers:
        ex.send(p, input[in_at[p]:in_at[p] + input_splits[p]])
    for handle in handles:
        ex.wait(handle)


def barrier(ex: Exchange) -> None:
    """Return once every rank has entered: everyone greets everyone (one round, n-1 empty messages)."""
    r, n = ex.group_rank, ex.group_size
    peers = [(r + k) % n for k in range(1, n)]
    handles = ex.post([(p, _EMPTY) for p in peers])
    for p in peers:
        ex.send(p, _EMPTY)
    for handle in handles:
        ex.wait(handle)
