"""Tensor parallelism: Megatron-style layers from a plan, with sequence and loss parallelism; torch's
tensor-parallel API names (`parallelize_module`, the parallel styles, `loss_parallel`).

Layer: tensor.parallel (layer 4; may import _core, comm, device_mesh, tensor). See Note: Megatron's layers as
DTensor layouts (style.py) and Note: cross-entropy over a sharded class dim (loss.py).
"""

from spmd.tensor.parallel.api import parallelize_module
from spmd.tensor.parallel.loss import loss_parallel
from spmd.tensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "loss_parallel", "parallelize_module"]
