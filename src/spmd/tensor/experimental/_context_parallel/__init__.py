"""torch's package `tensor.experimental._context_parallel`: context parallelism's API in one place.

Layer: tensor.
"""

from spmd.tensor.experimental._context_parallel._attention import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _is_causal_behavior,
    _RotateMethod,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from spmd.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from spmd.tensor.parallel.flex_attention import flex_cp_allgather

__all__ = ["_CausalBehavior", "_ContextParallel", "_HeadTailLoadBalancer", "_LoadBalancer", "_PTRRLoadBalancer",
           "_PerDocumentHeadTailLoadBalancer", "_RotateMethod", "_context_parallel_shard", "_cp_options",
           "_disable_context_parallel_dispatcher", "_enable_context_parallel_dispatcher", "_is_causal_behavior",
           "context_parallel", "context_parallel_unshard", "flex_cp_allgather", "set_rotate_method"]
