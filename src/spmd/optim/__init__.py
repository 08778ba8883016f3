"""Distributed optimizers on spmd's groups, under the names of torch's distributed `optim` package.

Layer 4. `ZeroRedundancyOptimizer` shards any optimizer's state over the ranks (zero_redundancy_optimizer.py).
"""

from spmd.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
