"""ElasticDistributedSampler (torch's elastic path): a DistributedSampler that skips the first `start_index`
samples of the dataset, so a job restarted mid-epoch (with any number of replicas) goes on where it stopped.

Layer: run (elastic). The replicas and this rank default to spmd's world (so thread ranks need no torch group).
Each epoch's order is a permutation of the remaining samples seeded by the epoch (the same on every rank, as
torch's: the same indices for the same dataset, replicas, rank, start and epoch), padded by wrapping around to a
multiple of the replicas (as often as needed: torch's fails an assertion when fewer samples remain than half the
replicas), and dealt round-robin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Dataset, DistributedSampler

from spmd.comm.world import get_rank, get_world_size, is_initialized


class ElasticDistributedSampler(DistributedSampler):
    """DistributedSampler over dataset[start_index:] (the samples an interrupted epoch had not reached)."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 start_index: int = 0) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError("ElasticDistributedSampler: the dataset must have a length")
        if num_replicas is None or rank is None:
            if not is_initialized():
                raise RuntimeError("ElasticDistributedSampler: pass num_replicas and rank, or initialise spmd's "
                                   "process group first")
            num_replicas = get_world_size() if num_replicas is None else num_replicas
            rank = get_rank() if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank)
        if not 0 <= start_index < len(dataset):
            raise ValueError(f"ElasticDistributedSampler: start_index={start_index} is outside the dataset's "
                             f"{len(dataset)} samples")
        self.start_index = start_index
        self.num_samples = math.ceil((len(dataset) - start_index) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        remaining = len(self.dataset) - self.start_index      # type: ignore[arg-type]
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        order = (torch.randperm(remaining, generator=generator) + self.start_index).tolist()
        while len(order) < self.total_size:         # fewer samples left than replicas: wrap around as often as needed
            order.extend(order[:self.total_size - len(order)])
        return iter(order[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
