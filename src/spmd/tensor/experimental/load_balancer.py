"""The load balancers of context parallelism (torch's `_load_balancer`): the deal of a sequence's positions
over the ranks of a context-parallel mesh.

Layer: tensor.
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor

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


def rearrange(buffer: Tensor, seq_dim: int, indices: Tensor) -> Tensor:
    """`buffer` with its positions along `seq_dim` reordered by `indices` ((1, L) for every batch row, or (B, L)
    one row per batch row, dim 0 being the batch)."""
    if indices.shape[0] == 1 or seq_dim == 0:
        return buffer.index_select(seq_dim, indices[0].to(buffer.device))
    if indices.shape[0] != buffer.shape[0]:
        raise ValueError(f"spmd: _context_parallel_shard: the load balancer's indices are {tuple(indices.shape)} "
                         f"but a buffer is {tuple(buffer.shape)} (one row of indices per batch row, dim 0)")
    shape = [indices.shape[0]] + [1] * (seq_dim - 1) + [indices.shape[1]] + [1] * (buffer.dim() - seq_dim - 1)
    return buffer.gather(seq_dim, indices.to(buffer.device).view(shape).expand(buffer.shape))


def _default_load_balancer(seq_length: int, world_size: int,
                           device: str | torch.device) -> _HeadTailLoadBalancer | None:
    """torch's rule: head-tail when load balancing is on and the length divides into 2 * world_size chunks."""
    if cp_options.enable_load_balance and seq_length % (2 * world_size) == 0:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None
