"""DTensor: tensors laid out over a DeviceMesh (Shard / Replicate / Partial per mesh dim), the torch DTensor's
API names.

Layer: tensor (may import _core, comm, device_mesh). Importing it registers every op family's sharding rules.
`spmd.tensor.parallel` (layer 4) is NOT imported here.
"""

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import _random  # noqa: F401  (torch's package holds it: TorchTitan calls tensor._random.manual_seed)
from spmd.tensor import ops as _ops  # noqa: F401  (registers the sharding rules)
from spmd.tensor.api import DTensor, distribute_module, distribute_tensor
from spmd.tensor.factories import empty, full, ones, rand, randn, zeros
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import record_fallbacks

__all__ = ["DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
           "distribute_tensor", "empty", "full", "init_device_mesh", "ones", "rand", "randn", "record_fallbacks",
           "zeros"]
