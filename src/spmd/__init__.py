"""spmd: distributed training for PyTorch, with torch.distributed's API names.

`import spmd as dist` gives the communication API (init_process_group, all_reduce, ...);
`spmd.DistributedDataParallel` wraps a module for data-parallel training. This facade holds no logic.
"""

from spmd.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.objects import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
from spmd.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.store import HashStore, PrefixStore, Store
from spmd.comm.work import Work
from spmd.comm.world import (
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    new_subgroups,
)

__all__ = [
    "DistributedDataParallel", "FileStore", "HashStore", "NonMemberGroup", "P2POp", "PrefixStore", "ProcessGroup",
    "ReduceOp", "Store", "TCPStore", "Work", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "destroy_process_group", "gather", "gather_object", "get_backend", "get_global_rank",
    "get_group_rank", "get_process_group_ranks", "get_rank", "get_world_size", "init_process_group", "irecv",
    "is_initialized", "isend", "monitored_barrier", "new_group", "new_subgroups", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
]

_LAZY = {
    "DistributedDataParallel": ("spmd.ddp", "DistributedDataParallel"),
    "TCPStore": ("spmd.comm.tcp_store", "TCPStore"),
    "FileStore": ("spmd.comm.file_store", "FileStore"),
}


def __getattr__(name: str):
    """Import heavier or optional parts (DDP, TCPStore, FileStore) only when first used."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")
