"""RPC (torch's distributed `rpc` package): workers that call functions on each other, remote references, and
distributed autograd across them (spmd.autograd), over spmd's own transports.

Layer: rpc (over comm). agent.py carries the messages, api.py is the public surface, dist_autograd.py the
gradients across calls, options.py and functions.py torch's option classes and async_execution.
"""

from spmd.rpc import functions
from spmd.rpc.agent import RemoteException, WorkerInfo
from spmd.rpc.api import (
    UNSET_RPC_TIMEOUT,
    RRef,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from spmd.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "BackendType",
    "RRef",
    "RemoteException",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "functions",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
