"""torch's `nn` module path of its distributed package: collectives autograd differentiates (functional.py) and
RemoteModule (api/remote_module.py); and SyncBatchNorm (sync_batchnorm.py), which torch keeps in torch.nn."""

from spmd.nn.api.remote_module import RemoteModule
from spmd.nn.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from spmd.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["RemoteModule", "SyncBatchNorm", "all_gather", "all_reduce", "all_to_all", "all_to_all_single",
           "broadcast", "gather", "reduce", "reduce_scatter", "scatter"]
