"""The load balancers of context parallelism (torch's `_load_balancer`): the deal of a sequence's positions
over the ranks of a context-parallel mesh.

Layer: tensor.
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from spmd.tensor.ring_attention import cp_options


class _LoadBalancer(abc.ABC):
    """A deal of a sequence's positions over the ranks (torch's base class): `x[:, indices]` with the indices
    it generates puts each rank's positions together, rank by rank, so that an even split balances the work."""

    @abc.abstractmethod
    def _generate_indices(self, restore: bool = False) -> Tensor | None:
        """(1, L) or (B, L) indices that deal the sequence out, or with `restore` put a dealt one back."""


class _HeadTailLoadBalancer(_LoadBalancer):
    """The head-tail deal of a sequence of `seq_length` over `world_size` ranks (torch's name and indices):
    cut into 2 * world_size chunks, rank r holds chunk r followed by chunk 2 * world_size - 1 - r."""

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device) -> None:
        if seq_length % (2 * world_size):
            raise ValueError(f"spmd: a head-tail deal of {seq_length} positions over {world_size} ranks needs a "
                             f"length divisible by {2 * world_size}")
        self.seq_length, self.world_size, self.device = seq_length, world_size, device

    def _generate_indices(self, restore: bool = False) -> Tensor:
        """(1, seq_length) indices: `x[:, indices]` deals x out (restore=False) or puts a dealt x back in order."""
        chunk = self.seq_length // (2 * self.world_size)
        order = [c for rank in range(self.world_size) for c in (rank, 2 * self.world_size - 1 - rank)]
        dealt = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=self.device) for c in order])
        indices = torch.argsort(dealt) if restore else dealt
        return indices.unsqueeze(0)


class _PerDocumentHeadTailLoadBalancer(_LoadBalancer):
    """The head-tail deal done inside each document of packed sequences (torch's name), for document-causal
    masks: with `seq_length_per_doc` one list of document lengths per batch row (or one list for all rows),
    each document is cut into 2 * world_size chunks and rank r holds, document by document, chunk r and chunk
    2 * world_size - 1 - r.

    The indices list rank 0's chunks first, as torch's docstring draws the deal; torch 2.13's own indices list
    them document by document instead, so that an even split hands rank 0 the first documents whole."""

    def __init__(self, seq_length_per_doc: list[list[int]], world_size: int, device: str | torch.device) -> None:
        for row in seq_length_per_doc:
            uneven = [length for length in row if length % (2 * world_size)]
            if uneven:
                raise ValueError(f"spmd: a per-document head-tail deal over {world_size} ranks needs document "
                                 f"lengths divisible by {2 * world_size}; got {uneven} in {row}")
            if sum(row) != sum(seq_length_per_doc[0]):
                raise ValueError(f"spmd: the batch rows' documents cover different lengths: "
                                 f"{[sum(r) for r in seq_length_per_doc]}")
        self.seq_length_per_doc, self.world_size, self.device = seq_length_per_doc, world_size, device

    def _generate_indices(self, restore: bool = False) -> Tensor:
        """(rows, L) indices, one row per list of document lengths: `x[:, indices]` deals x out
        (restore=False) or puts a dealt x back in order."""
        return torch.stack([self._row(lengths, restore) for lengths in self.seq_length_per_doc])

    def _row(self, lengths: list[int], restore: bool) -> Tensor:
        chunks = 2 * self.world_size
        starts = [sum(lengths[:d]) for d in range(len(lengths))]
        pieces = [torch.arange(start + c * (length // chunks), start + (c + 1) * (length // chunks),
                               device=self.device)
                  for rank in range(self.world_size)
                  for start, length in zip(starts, lengths, strict=True)
                  for c in (rank, chunks - 1 - rank)]
        dealt = torch.cat(pieces)
        return torch.argsort(dealt) if restore else dealt


class _PTRRLoadBalancer(_LoadBalancer):
    """Processing-time round robin (torch's name), for flex_attention: the query blocks of `block_mask`
    (shape (B or 1, 1, L, L)) are dealt out by their work, the number of key blocks each attends to, largest
    first, snaking over the `world_size` ranks (0..W-1, then W-1..0) so each rank gets a like share."""

    def __init__(self, block_mask: BlockMask, world_size: int) -> None:
        q_block, kv_block = block_mask.BLOCK_SIZE
        if q_block != kv_block:
            raise ValueError(f"spmd: _PTRRLoadBalancer deals query and key blocks alike; the block mask's blocks "
                             f"are {q_block} x {kv_block}")
        if block_mask.seq_lengths[0] % q_block:
            raise ValueError(f"spmd: _PTRRLoadBalancer moves whole blocks; a sequence of {block_mask.seq_lengths[0]} "
                             f"is not a whole number of {q_block}-blocks")
        if block_mask.kv_num_blocks.shape[1] != 1:
            raise ValueError(f"spmd: _PTRRLoadBalancer needs one mask for all heads (H = 1); the block mask has "
                             f"H = {block_mask.kv_num_blocks.shape[1]}")
        self.block_mask, self.world_size = block_mask, world_size

    @staticmethod
    def ptrr_scheduling(process_time: Tensor, group_size: int) -> Tensor:
        """(group_size, n / group_size) task numbers, each group's in ascending order: the n tasks of
        `process_time` dealt longest first, snaking over the groups."""
        if process_time.dim() != 1 or process_time.numel() % group_size:
            raise ValueError(f"spmd: ptrr_scheduling deals a 1-D list of tasks evenly; got {tuple(process_time.shape)}"
                             f" over {group_size} groups")
        order = torch.sort(process_time, descending=True, stable=True).indices.view(-1, group_size)
        order[1::2] = order[1::2].flip(1)          # odd rounds deal from the last group back to the first
        return order.t().sort(dim=1).values

    def _generate_indices(self, restore: bool = False) -> Tensor:
        """(B or 1, L) indices moving whole blocks: `x[:, indices]` deals x out (restore=False) or puts a dealt x
        back in order."""
        mask = self.block_mask
        work = mask.kv_num_blocks if mask.full_kv_num_blocks is None else mask.kv_num_blocks + mask.full_kv_num_blocks
        work = work[:, 0]                                                     # (B, query blocks)
        block = mask.BLOCK_SIZE[0]
        rows = []
        for row_work in work:
            blocks = self.ptrr_scheduling(row_work, self.world_size).reshape(-1)
            rows.append((blocks.unsqueeze(1) * block + torch.arange(block, device=blocks.device)).reshape(-1))
        indices = torch.stack(rows)
        return torch.argsort(indices, dim=1) if restore else indices


def rearrange(buffer: Tensor, seq_dim: int, indices: Tensor) -> Tensor:
    """`buffer` with its positions along `seq_dim` reordered by `indices` ((1, L) for every batch row, or (B, L)
    one row per batch row, dim 0 being the batch)."""
    if indices.shape[0] == 1 or seq_dim == 0:
        return buffer.index_select(seq_dim, indices[0].to(buffer.device))
    if indices.shape[0] != buffer.shape[0]:
        raise ValueError(f"spmd: context parallelism: the load balancer's indices are {tuple(indices.shape)} "
                         f"but a buffer is {tuple(buffer.shape)} (one row of indices per batch row, dim 0)")
    shape = [indices.shape[0]] + [1] * (seq_dim - 1) + [indices.shape[1]] + [1] * (buffer.dim() - seq_dim - 1)
    return buffer.gather(seq_dim, indices.to(buffer.device).view(shape).expand(buffer.shape))


def _default_load_balancer(seq_length: int, world_size: int,
                           device: str | torch.device) -> _HeadTailLoadBalancer | None:
    """torch's rule: head-tail when load balancing is on and the length divides into 2 * world_size chunks."""
    if cp_options.enable_load_balance and seq_length % (2 * world_size) == 0:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None
