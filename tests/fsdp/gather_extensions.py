"""Tensor subclasses that use FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather), for the
tests of spmd's FSDP and torch's (the real-process test runs both on them).

SplitPrecisionWeight gathers its shard as two inputs of different dtypes, a bfloat16 head and the float32
remainder, and rebuilds the exact float32 weight from them, so a model of them trains exactly like a plain one:
the parity tests compare against one process with plain parameters. Like torchao's NF4 weights it can't be sliced
from an offset (aten.slice), only split: torch's FSDP2 takes a shard's rows with torch.chunk. It pads a short
shard itself, which torch's FSDP2 requires of an extension (spmd pads inputs shaped like the shard; the TwoTensor
tests rely on that).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only


class SplitPrecisionWeight(Tensor):
    """A float32 weight that all-gathers as (bfloat16 head, float32 remainder); the unsharded weight is plain."""

    calls: ClassVar[dict[str, int]] = {"pre": 0, "post": 0, "post_out": 0}   # per process, thread ranks share it

    @staticmethod
    def __new__(cls, data: Tensor) -> SplitPrecisionWeight:
        return Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                             dtype=data.dtype, device=data.device, requires_grad=False)

    def __init__(self, data: Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.slice.Tensor and _offset_slice(*args):    # as torchao's NF4Tensor
            raise NotImplementedError("SplitPrecisionWeight: no slice from an offset (torch.chunk instead)")
        out = func(*tree_map_only(cls, lambda t: t._data, args), **tree_map_only(cls, lambda t: t._data, kwargs or {}))
        return tree_map_only(Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, Tensor], meta: None, size: Any, stride: Any) -> Tensor:
        return cls(inner["_data"])

    def __repr__(self) -> str:
        return f"SplitPrecisionWeight({self._data})"

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        SplitPrecisionWeight.calls["pre"] += 1
        data, rows = self._data, -(-outer_size[0] // mesh.size())
        if data.shape[0] < rows:      # a short shard: pad it to the piece, as torch requires (spmd would pad it)
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        head = data.to(torch.bfloat16)
        return (head, data - head.float()), {"size": tuple(outer_size), "shard_ranks": mesh.size()}

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        head, rest = outputs
        assert head.dtype == torch.bfloat16 and rest.dtype == torch.float32, (head.dtype, rest.dtype)
        assert head.shape[0] >= metadata["size"][0], (head.shape, metadata)
        with torch.no_grad():
            if out is not None:
                SplitPrecisionWeight.calls["post_out"] += 1
                local = getattr(out, "_local_tensor", out)     # a tensor-parallel weight is a DTensor
                with torch.autograd._unsafe_preserve_version_counter(local):
                    local.copy_((head.float() + rest)[: local.shape[0]])
                return None
            SplitPrecisionWeight.calls["post"] += 1
            weight = (head.float() + rest).to(param_dtype)
        return weight, (weight,)


def _offset_slice(tensor: Tensor, dim: int = 0, start: int | None = None, end: int | None = None,
                  step: int = 1) -> bool:
    return (start or 0) != 0 or step != 1


def split_precision_weights(model: nn.Module) -> nn.Module:
    """Make every 2-d weight of `model` a SplitPrecisionWeight (in place); returns the model."""
    return _weights_of(model, SplitPrecisionWeight)


def _weights_of(model: nn.Module, kind: type[Tensor]) -> nn.Module:
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim == 2:
                setattr(module, name, nn.Parameter(kind(param.detach().clone())))
    return model


class TorchScaledWeight(SplitPrecisionWeight):
    """A weight whose pre-gather is written for torch, as torchao's float8 weights are: it takes the largest
    magnitude over the shard group with torch's functional all_reduce on `mesh.get_group()`, then gathers its
    shard divided by that power of two (exact) and multiplies it back."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        from torch.distributed import _functional_collectives as funcol

        largest = funcol.all_reduce(self._data.abs().amax().reshape(1), "max", mesh.get_group())
        scale = torch.exp2(torch.ceil(torch.log2(largest.wait() if hasattr(largest, "wait") else largest)))
        return (self._data / scale,), scale

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        (scaled,) = outputs
        with torch.no_grad():
            if out is not None:
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_((scaled * metadata)[: out.shape[0]])
                return None
            weight = (scaled * metadata).to(param_dtype)
        return weight, (weight,)


def torch_scaled_weights(model: nn.Module) -> nn.Module:
    """Make every 2-d weight of `model` a TorchScaledWeight (in place); returns the model."""
    return _weights_of(model, TorchScaledWeight)
