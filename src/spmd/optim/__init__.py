"""Distributed optimizers: torch's `torch.distributed.optim` names on spmd's groups.

Layer 4. `ZeroRedundancyOptimizer` shards any optimizer's state over the ranks (zero_redundancy_optimizer.py).
"""

from spmd.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
