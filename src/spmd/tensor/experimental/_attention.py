"""torch's older path for context parallelism (`tensor.experimental._attention`), where scripts (TorchTitan's
among them) import `set_rotate_method`, `_cp_options`, `_ContextParallel`, `_context_parallel_shard`, the
dispatcher switches and the load balancers: an alias of `context_parallel`, `load_balancer` and
`tensor.parallel.context_parallel`.

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
from spmd.tensor.experimental.load_balancer import (
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from spmd.tensor.parallel.context_parallel import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _is_causal_behavior,
)

__all__ = ["_CausalBehavior", "_ContextParallel", "_ContextParallelOptions", "_HeadTailLoadBalancer", "_LoadBalancer",
           "_PTRRLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_RotateMethod", "_context_parallel_shard",
           "_cp_options", "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher",
           "_is_causal_behavior", "context_parallel", "context_parallel_unshard", "set_rotate_method"]
