"""Op dispatch for DTensor: look up the rule -> redistribute inputs -> run the local op -> wrap the outputs.

Layer: tensor. Runs below autograd (`__torch_dispatch__`), on local tensors only; collectives happen only in
redistribution (redistribute.run_plan). Modules: `signature` (what an op's schema says), `keys` (argument
walking), `decision` (rule -> checked, cached decision), `run` (the dispatcher itself).

Note: the dispatch fast path
The decision for a call is cached on the mesh (`DeviceMesh.dispatch_cache`, so per rank and freed with the
mesh) under a key of the op, every DTensor input's spec (hash precomputed), and every other argument (Python
numbers keyed with their type, so 1 and 1.0 differ; `int[]` arguments as `(list, *ints)`; plain scalar tensors by
shape/dtype/device). A hit costs one pass over the arguments, one dict lookup, the local op and one wrapper
allocation per output. A miss runs the rule, propagates the global output metadata with meta tensors, checks
everything and caches it.
"""

from spmd.tensor.dispatch.keys import meta_form, schema_form
from spmd.tensor.dispatch.run import _MISS, MixedTensorError, _fast_path, dispatch, local_as

__all__ = ["_MISS", "MixedTensorError", "_fast_path", "dispatch", "local_as", "meta_form", "schema_form"]
