"""torch's older path for context parallelism (`tensor.experimental._attention`), where scripts import
`set_rotate_method`, `context_parallel_unshard` and `_cp_options`: an alias of `context_parallel`.

Layer: tensor.
"""

from spmd.tensor.experimental.context_parallel import (
    _ContextParallelOptions,
    _cp_options,
    _HeadTailLoadBalancer,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)

__all__ = ["_ContextParallelOptions", "_HeadTailLoadBalancer", "_RotateMethod", "_cp_options", "context_parallel",
           "context_parallel_unshard", "set_rotate_method"]
