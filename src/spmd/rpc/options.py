"""RPC backend options as torch names them: BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions.

Layer: rpc. Pure data: spmd's agent stands for the TensorPipe backend (messages over the job's spmd transport).
"""

from __future__ import annotations

import enum
from typing import Any

DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"


class BackendType(enum.Enum):
    """The RPC backends torch names; spmd's agent serves TENSORPIPE."""

    TENSORPIPE = "TENSORPIPE"


class RpcBackendOptions:
    """How a worker joins (`init_method`) and each call's default timeout in seconds (0: none)."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD) -> None:
        if rpc_timeout < 0:
            raise ValueError(f"RpcBackendOptions: rpc_timeout must be 0 (none) or positive, got {rpc_timeout}")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's options: `num_worker_threads` serve requests at once (a request that calls another worker holds
    one while it waits). `device_maps` / `devices` are refused unless empty: CUDA tensors travel as they pickle
    (through host memory) and land on the device they left."""

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD,
                 device_maps: dict[Any, Any] | None = None, devices: list[Any] | None = None,
                 _transports: list[str] | None = None, _channels: list[str] | None = None) -> None:
        super().__init__(rpc_timeout, init_method)
        if num_worker_threads < 1:
            raise ValueError(f"TensorPipeRpcBackendOptions: num_worker_threads must be at least 1, got "
                             f"{num_worker_threads}")
        if device_maps or devices:
            raise ValueError("TensorPipeRpcBackendOptions: device_maps and devices are not served; move tensors to "
                             "the CPU before a call (they arrive on the device they were sent from)")
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[Any, Any] = {}
        self.devices: list[Any] = []

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        raise ValueError("TensorPipeRpcBackendOptions.set_device_map is not served; move tensors to the CPU before "
                         "a call")
