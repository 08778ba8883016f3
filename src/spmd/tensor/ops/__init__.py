"""Sharding rules, one module per op family; importing this package registers them all.

Layer: tensor. Each module registers its rules with spmd.tensor.rules when imported (see that module's
docstring for how to write one). Order matters only for `register_family` predicates (pointwise first).
"""

from spmd.tensor.ops import (  # noqa: F401  (imported for their registrations)
    attention,
    embedding,
    foreach,
    loss,
    matmul,
    norm,
    pointwise,
    random_ops,
    reduction,
    tensor_ops,
    view,
)
