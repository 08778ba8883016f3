"""spmd.elastic.utils.data: ElasticDistributedSampler deals the same indices as torch's for every replica count,
rank, start and epoch (and wraps around where torch's fails, fewer samples left than half the replicas), and takes its
replicas from spmd's world; CyclingIterator runs its epochs in turn, as torch's does."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.elastic.utils.data import CyclingIterator as TorchCyclingIterator
from torch.distributed.elastic.utils.data import ElasticDistributedSampler as TorchSampler

from spmd.elastic.utils.data import CyclingIterator, ElasticDistributedSampler
from spmd.testing import run_ranks

DATASET = list(range(23))


@pytest.mark.parametrize("replicas, start", [(1, 0), (2, 5), (3, 21), (4, 7)])
def test_the_sampler_deals_torchs_indices(replicas: int, start: int) -> None:
    for rank in range(replicas):
        ours = ElasticDistributedSampler(DATASET, num_replicas=replicas, rank=rank, start_index=start)
        theirs = TorchSampler(DATASET, num_replicas=replicas, rank=rank, start_index=start)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_the_sampler_takes_its_replicas_from_the_world_and_refuses_a_start_past_the_end() -> None:
    got = run_ranks(lambda rank, size: list(ElasticDistributedSampler(DATASET, start_index=3)), world_size=2,
                    timeout=30)
    assert got == [list(TorchSampler(DATASET, num_replicas=2, rank=r, start_index=3)) for r in range(2)]
    # one sample left for three replicas: each gets it (torch's fails an assertion here)
    assert [list(ElasticDistributedSampler(DATASET, num_replicas=3, rank=r, start_index=22)) for r in range(3)] == \
        [[22], [22], [22]]
    with pytest.raises(ValueError, match="start_index=23 is outside the dataset's 23 samples"):
        ElasticDistributedSampler(DATASET, num_replicas=2, rank=0, start_index=23)
    with pytest.raises(RuntimeError, match="pass num_replicas and rank"):
        ElasticDistributedSampler(DATASET)


def test_the_cycling_iterator_runs_its_epochs_in_turn_as_torchs() -> None:
    def make(epoch: int) -> iter:
        return iter(torch.arange(3).add(10 * epoch).tolist())

    assert list(CyclingIterator(4, make, start_epoch=1)) == list(TorchCyclingIterator(4, make, start_epoch=1)) == \
        [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert list(CyclingIterator(1, make, start_epoch=2)) == list(TorchCyclingIterator(1, make, start_epoch=2)) == \
        [20, 21, 22]
