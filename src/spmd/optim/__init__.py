"""Distributed optimizers on spmd's groups, under the names of torch's distributed `optim` package.

Layer 4. `ZeroRedundancyOptimizer` shards any optimizer's state over the ranks (zero_redundancy_optimizer.py);
`PostLocalSGDOptimizer` averages the model replicas on a schedule after each step (post_local_sgd_optimizer.py);
`DistributedOptimizer` steps parameters on their RPC owners with a distributed autograd context's gradients
(distributed_optimizer.py); `_apply_optimizer_in_backward` steps each parameter's optimizer during backward
(apply_optimizer_in_backward.py).
"""

from spmd.optim.apply_optimizer_in_backward import (
    _apply_optimizer_in_backward as _apply_optimizer_in_backward,
)
from spmd.optim.apply_optimizer_in_backward import (
    _get_in_backward_optimizers as _get_in_backward_optimizers,
)
from spmd.optim.distributed_optimizer import DistributedOptimizer
from spmd.optim.post_local_sgd_optimizer import PostLocalSGDOptimizer
from spmd.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"]
