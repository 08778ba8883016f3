"""Alias of `spmd.tensor.random` at torch's private path (`tensor._random`), which TorchTitan imports for
`manual_seed(seed, mesh)`. Layer: tensor (an alias; it holds no logic)."""

from spmd.tensor.random import is_rng_supported_mesh, manual_seed

__all__ = ["is_rng_supported_mesh", "manual_seed"]
