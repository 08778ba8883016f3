"""The c10d functions at torch's module path (`distributed_c10d`): process groups, collectives, P2P, object
collectives, stores and backend names, as the top-level `spmd` package serves them, plus torch's private helpers
that scripts and libraries reach for (`_get_default_group` and `_set_pg_timeout` as TorchTitan calls them,
`_rank_not_in_group`, `_resolve_process_group`, `_get_pg_default_device`, `_object_to_tensor`, ...). Layer: comm (an
alias; it holds no logic)."""

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
from spmd.comm.c10d_helpers import check_single_tensor as _check_single_tensor
from spmd.comm.c10d_helpers import check_tensor_list as _check_tensor_list
from spmd.comm.c10d_helpers import default_store as _get_default_store
from spmd.comm.c10d_helpers import group_size as _get_group_size
from spmd.comm.c10d_helpers import pg_default_device as _get_pg_default_device
from spmd.comm.c10d_helpers import process_group_name as _get_process_group_name
from spmd.comm.c10d_helpers import rank_not_in_group as _rank_not_in_group
from spmd.comm.c10d_helpers import resolve_process_group as _resolve_process_group
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
from spmd.comm.debug import DebugLevel, get_debug_level
from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.group_methods import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from spmd.comm.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from spmd.comm.objects import object_to_tensor as _object_to_tensor
from spmd.comm.objects import tensor_to_object as _tensor_to_object
from spmd.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from spmd.comm.reduce_op import ReduceOp, reduce_op, supports_complex
from spmd.comm.rendezvous_api import register_rendezvous_handler, rendezvous
from spmd.comm.store.base import HashStore, PrefixStore, Store
from spmd.comm.store.file import FileStore
from spmd.comm.store.tcp import TCPStore
from spmd.comm.work import Work
from spmd.comm.world import (
    SHRINK_ABORT,
    SHRINK_DEFAULT,
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
    shrink_group,
    split_group,
)
from spmd.comm.world import default_group as _get_default_group
from spmd.comm.world import set_group_timeout as _set_pg_timeout

__all__ = [
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "AllToAllOptions",
    "AllreduceCoalescedOptions",
    "AllreduceOptions",
    "Backend",
    "BarrierOptions",
    "BroadcastOptions",
    "DebugLevel",
    "DistStoreError",
    "FileStore",
    "GatherOptions",
    "GroupMember",
    "HashStore",
    "NonMemberGroup",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "ReduceOptions",
    "ReduceScatterOptions",
    "ScatterOptions",
    "Store",
    "TCPStore",
    "Work",
    "_check_single_tensor",
    "_check_tensor_list",
    "_get_default_group",
    "_get_default_store",
    "_get_group_size",
    "_get_pg_default_device",
    "_get_process_group_name",
    "_object_to_tensor",
    "_rank_not_in_group",
    "_resolve_process_group",
    "_set_pg_timeout",
    "_tensor_to_object",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_rendezvous_handler",
    "rendezvous",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "shrink_group",
    "split_group",
    "supports_complex",
]
