"""spmd: distributed training for PyTorch, with torch.distributed's API names.

`import spmd as dist` gives the communication API (init_process_group, all_reduce, ...);
`spmd.DistributedDataParallel` wraps a module for data-parallel training. This facade holds no logic, and
resolves every name on first use, so `import spmd.run` (the launcher) does not import torch. It makes the "spmd"
torch.distributed backend known to torch, now or when torch is imported (comm/torch_hook.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "spmd.comm.collectives": (
        "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_single", "all_reduce",
        "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "broadcast", "gather",
        "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
        "scatter",
    ),
    "spmd.comm.backend": (
        "Backend", "get_default_backend_for_device", "is_available", "is_backend_available", "is_gloo_available",
        "is_mpi_available", "is_nccl_available", "is_torchelastic_launched", "is_ucc_available",
        "is_xccl_available",
    ),
    "spmd._core.errors": ("DistBackendError", "DistError", "DistStoreError", "QueueEmptyError"),
    "spmd.comm.breakpoint": ("breakpoint",),
    "spmd.comm.debug": ("DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"),
    "spmd.comm.group": ("NonMemberGroup", "ProcessGroup"),
    "spmd.comm.group_methods": ("AllToAllOptions", "AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions",
                                "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions",
                                "ReduceScatterOptions", "ScatterOptions"),
    "spmd.comm.objects": ("all_gather_object", "broadcast_object_list", "gather_object", "recv_object_list",
                          "scatter_object_list", "send_object_list"),
    "spmd.comm.p2p": ("P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"),
    "spmd.comm.reduce_op": ("ReduceOp", "reduce_op", "supports_complex"),
    "spmd.comm.store.base": ("HashStore", "PrefixStore", "Store"),
    "spmd.comm.store.tcp": ("TCPStore",),
    "spmd.comm.store.file": ("FileStore",),
    "spmd.comm.work": ("Work",),
    "spmd.comm.rendezvous_api": ("register_rendezvous_handler", "rendezvous"),
    "spmd.comm.world": (
        "GroupMember", "default_pg_timeout", "destroy_process_group", "get_backend", "get_global_rank",
        "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks", "get_rank",
        "get_world_size", "group", "init_process_group", "is_initialized", "new_group", "new_subgroups",
        "new_subgroups_by_enumeration", "shrink_group", "split_group",
    ),
    "spmd.device_mesh": ("DeviceMesh", "init_device_mesh"),
    "spmd.ddp": ("DistributedDataParallel", "GradBucket"),
    "spmd.accumulation": ("accumulate",),
}
importlib.import_module("spmd.comm.torch_hook").install()

_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module of `name` on first use and cache the attribute on the package."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
