"""torch's elastic `utils.data` path: ElasticDistributedSampler (a sampler that resumes mid-epoch) and
CyclingIterator (epochs of a loader, one after another)."""

from spmd.elastic.utils.data.cycling_iterator import CyclingIterator
from spmd.elastic.utils.data.elastic_distributed_sampler import ElasticDistributedSampler

__all__ = ["CyclingIterator", "ElasticDistributedSampler"]
