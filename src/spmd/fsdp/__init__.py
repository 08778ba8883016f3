"""FSDP2: `fully_shard` shards each parameter as a DTensor over a DeviceMesh, gathering a group's parameters
for its forward and backward and reduce-scattering its gradients, with the API names of torch's FSDP2; and
FSDP1's `FullyShardedDataParallel` wrapper with its configs, built on fully_shard.

Layer: fsdp (L4; may import _core, _autograd, comm, device_mesh, tensor). Ported code swaps
torch's fsdp package for `spmd.fsdp`.
"""

from spmd.fsdp.api import (
    DataParallelMeshDims,
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from spmd.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.wrapper_config import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["BackwardPrefetch", "CPUOffload", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule",
           "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel", "LocalOptimStateDictConfig",
           "LocalStateDictConfig", "MixedPrecision", "MixedPrecisionPolicy", "OffloadPolicy", "OptimStateDictConfig",
           "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
           "StateDictConfig", "StateDictSettings", "StateDictType", "UnshardHandle", "fully_shard",
           "register_fsdp_forward_method", "share_comm_ctx"]
