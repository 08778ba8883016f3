"""Alias of `spmd.optim.post_local_sgd_optimizer` at torch's module path (`optim.post_localSGD_optimizer`).
Layer 4."""

from spmd.optim.post_local_sgd_optimizer import PostLocalSGDOptimizer

__all__ = ["PostLocalSGDOptimizer"]
