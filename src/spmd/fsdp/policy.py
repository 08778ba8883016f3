"""The policies `fully_shard` takes: mixed precision and offloading, frozen dataclasses checked on creation.

Layer: fsdp. Same names, fields and defaults as torch's FSDP2 policies, so code written for torch's FSDP2 ports.
"""

from __future__ import annotations

import dataclasses

import torch


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"MixedPrecisionPolicy: {name} must be a floating-point torch.dtype or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes FSDP computes, communicates and returns in; the sharded parameters keep their own dtype.

    A typical choice is `param_dtype=torch.bfloat16, reduce_dtype=torch.float32`: bf16 all-gathers and compute,
    fp32 gradient reduction, fp32 master parameters for the optimizer.
    """

    param_dtype: torch.dtype | None = None    # dtype of the all-gather and of the unsharded params (None: keep)
    reduce_dtype: torch.dtype | None = None   # dtype of the gradient reduce-scatter (None: param_dtype's)
    output_dtype: torch.dtype | None = None   # the root module's floating-point outputs are cast to it (None: no cast)
    cast_forward_inputs: bool = True          # cast each sharded module's floating-point inputs to param_dtype

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(field, getattr(self, field))


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state live on the mesh's device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, their gradients (and so the optimizer state) live in host memory; each all-gather copies
    the shards to the device and each reduce-scatter's result comes back to the host. The optimizer steps on CPU."""

    pin_memory: bool = True   # page-locked host copies (faster, asynchronous transfers); only with an accelerator
