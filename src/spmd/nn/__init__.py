"""torch's `nn` module path of its distributed package: collectives autograd differentiates (functional.py) and
RemoteModule (api/remote_module.py)."""

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

__all__ = ["RemoteModule", "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather",
           "reduce", "reduce_scatter", "scatter"]
