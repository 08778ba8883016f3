"""Sharding rules, one module per op family; importing this package registers them all.

Layer: tensor. Each module registers its rules with spmd.tensor.rules at import (see that module's docstring).
"""

import importlib
import importlib.util

# The families, in registration order. Each is imported for its registrations only.
_FAMILIES = ("pointwise", "view", "tensor_ops", "random_ops",
             "matmul", "reduction", "embedding", "norm", "loss", "attention", "foreach")

for _name in _FAMILIES:
    if importlib.util.find_spec(f"spmd.tensor.ops.{_name}") is not None:
        importlib.import_module(f"spmd.tensor.ops.{_name}")
