"""The c10d functions at torch's module path (`distributed_c10d`): process groups, collectives, P2P, object
collectives, stores and backend names, as the top-level `spmd` package serves them, plus `_get_default_group`,
which scripts reach for. Layer: comm (an alias; it holds no logic)."""

from spmd._core.errors import DistStoreError
from spmd.comm.backend import (
    Backend,
    get_default_backend_for_device,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
)
from spmd.comm.collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from spmd.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from spmd.comm.reduce_op import ReduceOp, supports_complex
from spmd.comm.store.base import HashStore, PrefixStore, Store
from spmd.comm.store.file import FileStore
from spmd.comm.store.tcp import TCPStore
from spmd.comm.work import Work
from spmd.comm.world import (
    GroupMember,
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from spmd.comm.world import default_group as _get_default_group

__all__ = [
    "Backend", "DistStoreError", "FileStore", "GroupMember", "HashStore", "NonMemberGroup", "P2POp", "PrefixStore",
    "ProcessGroup", "ReduceOp", "Store", "TCPStore", "Work", "_get_default_group", "all_gather",
    "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "default_pg_timeout", "destroy_process_group", "gather", "gather_object", "get_backend",
    "get_default_backend_for_device", "get_global_rank", "get_group_rank", "get_node_local_rank", "get_pg_count",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group", "irecv", "is_available",
    "is_backend_available", "is_gloo_available", "is_initialized", "is_mpi_available", "is_nccl_available",
    "is_torchelastic_launched", "is_ucc_available", "is_xccl_available", "isend", "monitored_barrier", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "recv", "recv_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "send_object_list",
    "split_group", "supports_complex",
]
