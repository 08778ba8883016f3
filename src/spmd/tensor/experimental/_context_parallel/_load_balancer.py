"""torch's path `tensor.experimental._context_parallel._load_balancer`: the load balancers.

Layer: tensor.
"""

from spmd.tensor.experimental.load_balancer import (
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

__all__ = ["_HeadTailLoadBalancer", "_LoadBalancer", "_PTRRLoadBalancer", "_PerDocumentHeadTailLoadBalancer"]
