"""Alias of `spmd.tensor.spec` at torch's private path (`tensor._dtensor_spec`), which TorchTitan's SimpleFSDP
imports: `DTensorSpec` (also built as torch's `DTensorSpec(mesh, placements, tensor_meta=...)`) and `TensorMeta`.
Layer: tensor (an alias; it holds no logic)."""

from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["DTensorSpec", "TensorMeta"]
