"""DTensor's experimental API at torch's path (`tensor.experimental` in torch's distributed package):
`context_parallel`, `local_map`, `implicit_replication` and `register_sharding`.

Layer: tensor.
"""

from spmd.tensor.dispatch import implicit_replication
from spmd.tensor.experimental.context_parallel import context_parallel
from spmd.tensor.experimental.func_map import local_map
from spmd.tensor.experimental.register_sharding import register_sharding

__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]
