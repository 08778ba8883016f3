"""The all-gather extension: a parameter whose local tensor defines `fsdp_pre_all_gather` and
`fsdp_post_all_gather` chooses what FSDP all-gathers for it and how the unsharded parameter is rebuilt, as in
torch's FSDP2 (torchao's float8 all-gather, torchtune's NF4 QLoRA weights).

Layer: fsdp. Nothing here communicates: the group lays the inputs out and gathers them (collectives.py).

Note: the extension protocol
- `local.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)` (or the older
  `fsdp_pre_all_gather(mesh)`) returns `(inputs, metadata)`: the tensors to all-gather (any number, any dtypes,
  e.g. float8 data and a scale) and anything the post-gather needs. `mesh` is the 1-d shard mesh, `outer_size`
  the unsharded shape. Every rank must return inputs of the same shapes; an input shaped like this rank's
  shard, on a rank whose shard is short (uneven sharding), is padded to the full piece here (torch requires the
  extension to pad it). Its `get_group()` is torch's view of the shard group while torch's default group is
  spmd's world's (comm.torch_backend.torch_group), so an extension written for torch, calling torch's
  collectives on it (torchao's float8 weights all-reduce their scale), runs; spmd's collectives take it too.
- The gathered outputs arrive dim-0 concatenated over the shard ranks (`(group_size * rows, *rest)` for an
  input of shape `(rows, *rest)`), in persistent tensors of their own whose storage is freed at reshard.
- The first time, `fsdp_post_all_gather(outputs, metadata, param_dtype)` returns `(tensor, inner)`: the
  unsharded parameter is `tensor` trimmed to the parameter's shape (as_strided), and `inner` are the tensors
  whose storage FSDP frees at reshard and re-allocates before the next gather. Later gathers call it with
  `out=` the unsharded parameter, which it refills in place, so what autograd saved stays valid; its version
  counter is kept across the call, as for the plain parameters' copy-out.
Gradients are reduce-scattered like any parameter's: the unsharded parameter's gradient is copied into the
group's reduce-scatter buffer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from spmd.comm import torch_backend
from spmd.device_mesh import DeviceMesh
from spmd.fsdp.policy import MixedPrecisionPolicy
from spmd.fsdp.storage import alloc_storage, free_storage, holds_memory
from spmd.tensor.spec import contiguous_stride

_PRE = "fsdp_pre_all_gather"
_POST = "fsdp_post_all_gather"


class _MeshForTorchCode:
    """The shard mesh as an extension written for torch uses it: `get_group()` gives torch's view of the group
    where there is one (see the protocol), the rest is the mesh's."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._mesh = mesh

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        group = self._mesh.get_group() if mesh_dim is None else self._mesh.get_group(mesh_dim)
        return torch_backend.torch_group(group) or group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mesh, name)


def has_extension(local: Tensor, fqn: str) -> bool:
    """Whether `local` (a sharded parameter's local tensor) defines the all-gather extension; a ValueError when
    it defines only one of the two methods."""
    pre, post = hasattr(local, _PRE), hasattr(local, _POST)
    if pre != post:
        missing, present = (_POST, _PRE) if pre else (_PRE, _POST)
        raise ValueError(f"fully_shard: parameter {fqn}'s {type(local).__name__} defines {present} but not "
                         f"{missing}; an all-gather extension needs both")
    return pre


class GatherExtension:
    """The all-gather extension state of one parameter: its last pre-gather's metadata and input layout, the
    persistent gather outputs and the inner tensors freed at reshard (see Note: the extension protocol)."""

    def __init__(self, fqn: str, module: nn.Module, mp_policy: MixedPrecisionPolicy) -> None:
        self.fqn = fqn
        self.module = module
        self.mp_policy = mp_policy
        self.metadata: Any = None
        self.input_shapes: list[torch.Size] = []
        self.input_dtypes: list[torch.dtype] = []
        self.outputs: list[Tensor] = []        # persistent; storage freed while sharded
        self.inner: list[Tensor] = []          # what post-gather said to free with them

    def inputs(self, local: Tensor, mesh: DeviceMesh, outer_size: torch.Size, padded_shape: torch.Size,
               device: torch.device) -> list[Tensor]:
        """Run the pre-gather on `local` and return its inputs, padded to whole pieces and flat."""
        if not has_extension(local, self.fqn):
            raise RuntimeError(f"fully_shard: parameter {self.fqn}'s local tensor no longer defines {_PRE}; the "
                               f"all-gather extension must stay in place once the model has run forward")
        if local.device != device:
            local = local.to(device, non_blocking=True)      # CPU offload: the shard lives on the host
        pre = getattr(local, _PRE)
        arity = len(inspect.signature(pre).parameters)
        seen = _MeshForTorchCode(mesh)
        if arity == 1:
            inputs, self.metadata = pre(seen)
        elif arity == 5:
            inputs, self.metadata = pre(seen, outer_size, contiguous_stride(outer_size), self.module, self.mp_policy)
        else:
            raise TypeError(f"fully_shard: parameter {self.fqn}'s {_PRE}{inspect.signature(pre)} takes {arity} "
                            f"arguments; expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)")
        padded = [_padded(t, local.shape, padded_shape) for t in ([inputs] if isinstance(inputs, Tensor) else inputs)]
        shapes, dtypes = [t.shape for t in padded], [t.dtype for t in padded]
        if local.shape != padded_shape and any(shape != padded_shape for shape in shapes):
            raise ValueError(f"fully_shard: parameter {self.fqn} is sharded unevenly (this rank's shard is "
                             f"{tuple(local.shape)} of a {tuple(padded_shape)} piece), so every input its {_PRE} "
                             f"returns must be shaped like the shard or the piece; got {[tuple(s) for s in shapes]}")
        if self.outputs and (shapes != self.input_shapes or dtypes != self.input_dtypes):
            raise RuntimeError(f"fully_shard: parameter {self.fqn}'s {_PRE} returned inputs of shapes "
                               f"{[tuple(s) for s in shapes]} and dtypes {dtypes}, but "
                               f"{[tuple(s) for s in self.input_shapes]} / {self.input_dtypes} before; they must "
                               f"keep their shapes and dtypes from one all-gather to the next")
        self.input_shapes, self.input_dtypes = shapes, dtypes
        return [t.reshape(-1) for t in padded]

    def output_targets(self, group_size: int, device: torch.device) -> list[Tensor]:
        """The gather outputs, allocated (once, then their storage re-grown), as (group_size, bytes) views."""
        if not self.outputs:
            self.outputs = [torch.empty(group_size * shape.numel(), dtype=dtype, device=device)
                            for shape, dtype in zip(self.input_shapes, self.input_dtypes, strict=True)]
        for tensor in self.outputs:
            alloc_storage(tensor)
        return [tensor.view(torch.uint8).view(group_size, -1) for tensor in self.outputs]

    def unsharded(self, local: Tensor, param_dtype: torch.dtype, out: Tensor | None) -> Tensor | None:
        """Run `local`'s post-gather: return the unsharded tensor (for the caller to trim) the first time, or
        refill `out`, the unsharded parameter, in place and return None."""
        post = getattr(local, _POST)
        outputs = tuple(tensor.view(-1, *shape[1:]) for tensor, shape in
                        zip(self.outputs, self.input_shapes, strict=True))
        metadata, self.metadata = self.metadata, None
        if out is not None:
            for tensor in self.inner:
                alloc_storage(tensor)
            # the refill restores what autograd saved in forward (see Note: FSDP tensors in param.py)
            with torch.autograd._unsafe_preserve_version_counter(out):
                post(outputs, metadata, param_dtype, out=out)
            return None
        result = post(outputs, metadata, param_dtype)
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], Tensor):
            raise TypeError(f"fully_shard: parameter {self.fqn}'s {_POST} returned {type(result).__name__}; "
                            f"without out= it must return (unsharded tensor, tensors to free at reshard)")
        tensor, inner = result
        self.inner = list(inner)
        return tensor

    def free(self) -> None:
        """Free the storage of the gather outputs and the inner tensors (the tensors themselves stay)."""
        for tensor in (*self.outputs, *self.inner):
            free_storage(tensor)

    def held(self) -> list[Tensor]:
        """The tensors holding memory now, for memory accounting."""
        return [t for t in (*self.outputs, *self.inner) if holds_memory(t)]


def _padded(tensor: Tensor, local_shape: torch.Size, padded_shape: torch.Size) -> Tensor:
    """`tensor`, contiguous; padded with zero rows to `padded_shape` when it is shaped like a short local shard."""
    tensor = tensor.contiguous()
    if tensor.shape == padded_shape or tensor.shape != local_shape:
        return tensor
    padded = tensor.new_zeros(padded_shape)
    padded[: tensor.shape[0]].copy_(tensor)
    return padded

