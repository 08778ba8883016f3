"""torch's path `tensor.experimental._context_parallel._attention`: the context manager, the module style,
`_context_parallel_shard`, flex_attention's
`_create_cp_block_mask`, the dispatcher switches and the options of context parallelism.

Layer: tensor.
"""

from spmd.tensor.experimental.context_parallel import (
    _ContextParallelOptions,
    _cp_options,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from spmd.tensor.parallel.context_parallel import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _is_causal_behavior,
)
from spmd.tensor.parallel.flex_attention import _create_cp_block_mask

__all__ = ["_CausalBehavior", "_ContextParallel", "_ContextParallelOptions", "_RotateMethod",
           "_context_parallel_shard", "_cp_options", "_create_cp_block_mask", "_disable_context_parallel_dispatcher",
           "_enable_context_parallel_dispatcher", "_is_causal_behavior", "context_parallel",
           "context_parallel_unshard", "set_rotate_method"]
