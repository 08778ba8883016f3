"""The options of the FullyShardedDataParallel wrapper (torch's FSDP1 API): sharding strategies, prefetching,
offloading, mixed precision and state-dict kinds, with torch's names, fields and defaults so FSDP1 code ports.

Layer: fsdp. Plain data; `fully_sharded_data_parallel` maps each onto fully_shard's policies.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

__all__ = ["BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
           "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig",
           "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
           "StateDictConfig", "StateDictSettings", "StateDictType"]


class ShardingStrategy(enum.Enum):
    """How a wrapper lays out its parameters over its ranks."""

    FULL_SHARD = 1            # sharded; gathered for forward, resharded, gathered again for backward (ZeRO-3)
    SHARD_GRAD_OP = 2         # sharded; kept gathered from forward to backward (ZeRO-2)
    NO_SHARD = 3              # replicated on every rank, gradients all-reduced (DDP)
    HYBRID_SHARD = 4          # FULL_SHARD within a node, replicated across nodes (HSDP)
    _HYBRID_SHARD_ZERO2 = 5   # SHARD_GRAD_OP within a node, replicated across nodes


class BackwardPrefetch(enum.Enum):
    """When backward starts the next unit's all-gather: before (PRE) or after (POST) this unit's gradients."""

    BACKWARD_PRE = 1
    BACKWARD_POST = 2


class StateDictType(enum.Enum):
    """What `state_dict()` returns: full tensors, sharded DTensors, or this rank's local shards."""

    FULL_STATE_DICT = 1
    LOCAL_STATE_DICT = 2
    SHARDED_STATE_DICT = 3


class OptimStateKeyType(enum.Enum):
    """How `rekey_optim_state_dict` keys an optimizer state dict: by parameter name or by position."""

    PARAM_NAME = 1
    PARAM_ID = 2


@dataclasses.dataclass
class CPUOffload:
    """offload_params=True keeps the sharded parameters and their gradients in host memory (the optimizer steps
    on the CPU)."""

    offload_params: bool = False


@dataclasses.dataclass
class MixedPrecision:
    """The dtypes of compute and all-gathers (param_dtype), of gradient reduction (reduce_dtype, default
    param_dtype's) and of buffers (buffer_dtype); the sharded parameters keep their dtype. Modules of
    `_module_classes_to_ignore` (BatchNorm) run in full precision, their inputs cast up and outputs back down."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)


@dataclasses.dataclass
class StateDictConfig:
    """offload_to_cpu moves every returned tensor to host memory."""

    offload_to_cpu: bool = False


@dataclasses.dataclass
class FullStateDictConfig(StateDictConfig):
    """rank0_only: only global rank 0 gets the (full) values; every other rank gets {} (all take part)."""

    rank0_only: bool = False


@dataclasses.dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Values are DTensors (torch's `_use_dtensor=True`; spmd has no ShardedTensor)."""

    _use_dtensor: bool = False


@dataclasses.dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclasses.dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclasses.dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclasses.dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclasses.dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclasses.dataclass
class StateDictSettings:
    """A wrapper's state-dict kind and the configs of its model and optimizer state dicts."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
