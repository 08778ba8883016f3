"""Alias of `spmd.tensor.experimental` under torch's older path (`_tensor.experimental`, where TorchTitan's
autoparallel experiment imports `local_map`). Layer: tensor (an alias; it holds no logic)."""

from spmd.tensor.experimental import context_parallel, implicit_replication, local_map, register_sharding

__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]
