"""Op dispatch for DTensor: look up the rule -> redistribute inputs -> run the local op -> wrap the outputs.

Layer: tensor. Runs below autograd (`__torch_dispatch__`), on local tensors only; collectives happen only in
redistribution (redistribute.run_plan) and in kernels that communicate. Every op with a rule takes the same
path, whether its local function is the op itself or a kernel its registration builds (rules.OpOptions).
Modules: `signature` (what an op's schema says), `keys` (argument walking, the cache key), `decision` (rule ->
checked, compiled decision), `run` (the dispatcher: cache, redistribution, local call, wrapping).

Note: the dispatch fast path
The decision for a call is cached on the mesh (`DeviceMesh.dispatch_cache`, so per rank and freed with the
mesh) under a key built in one pass over the arguments (`keys.call_key`): the op (as its C callable `op._op`,
hashed in C where an OpOverload's hash is a Python call), every DTensor input's spec (hash precomputed), and
every other argument (Python numbers with their type, so 1 and 1.0 differ, or by type alone for ops whose rule
has numbers_matter=False, as the foreach ops and the pointwise ops but masked_fill: an optimizer's step-dependent
scalars don't miss every step; `int[]` arguments as `(list, *ints)`; lists of DTensors as their specs; plain
scalar tensors by shape/dtype/device). A miss runs the rule, checks its decision (`decision.check_decision`),
propagates the global output metadata with meta tensors, builds the op's kernel, and caches it all with the
path its calls take (`decision.Path`). A hit on a DIRECT path (no input moves, DTensors only at the top level
or in lists: most calls) costs the key, one dict lookup, the local function and one wrapper allocation per
output; the GENERAL path adds the redistribution and a substitution through nested arguments.
"""

from spmd.tensor.dispatch.keys import meta_form, schema_form
from spmd.tensor.dispatch.run import MixedTensorError, dispatch, forget_decisions, implicit_replication, local_as

__all__ = ["MixedTensorError", "dispatch", "forget_decisions", "implicit_replication", "local_as", "meta_form",
           "schema_form"]
