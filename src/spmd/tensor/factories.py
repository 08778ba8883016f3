"""DTensor factories (torch's DTensor `zeros`, `ones`, `empty`, `full`, `rand`, `randn`): a
DTensor of a global shape, laid out over a mesh, of which each rank allocates only its own piece.

Layer: tensor. No communication. rand and randn draw the numbers the one-process run draws for the global
tensor (spmd.tensor.random: the same generator state on every rank), so a sharded random init equals the
unsharded one; the other factories fill each local piece directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.placement import Placement, Replicate, normalize_placements
from spmd.tensor.random import get_generator
from spmd.tensor.spec import DTensorSpec, contiguous_stride

Size = int | Sequence[int] | torch.Size


def zeros(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros of global shape `size`."""
    return _make("zeros", torch.zeros, size, dtype, layout, requires_grad, device_mesh, placements)


def ones(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones of global shape `size`."""
    return _make("ones", torch.ones, size, dtype, layout, requires_grad, device_mesh, placements)


def empty(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialized DTensor of global shape `size`."""
    return _make("empty", torch.empty, size, dtype, layout, requires_grad, device_mesh, placements)


def full(size: Size, fill_value: Any, *, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of global shape `size` filled with `fill_value` (its dtype inferred from it, as torch.full's)."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype

    def fill(shape: torch.Size, **kwargs: Any) -> torch.Tensor:
        return torch.full(shape, fill_value, **kwargs)

    return _make("full", fill, (size,), dtype, layout, requires_grad, device_mesh, placements)


def rand(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of global shape `size` drawn uniformly from [0, 1): the numbers torch.rand(size) draws in
    one process from the same generator state."""
    return _make("rand", torch.empty, size, dtype, layout, requires_grad, device_mesh, placements, draw="uniform_")


def randn(*size: Size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of global shape `size` drawn from the standard normal: the numbers torch.randn(size) draws in
    one process from the same generator state."""
    return _make("randn", torch.empty, size, dtype, layout, requires_grad, device_mesh, placements, draw="normal_")


def _make(name: str, allocate: Callable[..., torch.Tensor], size: tuple[Size, ...], dtype: torch.dtype | None,
          layout: torch.layout, requires_grad: bool, device_mesh: DeviceMesh | None,
          placements: Sequence[Placement] | None, draw: str | None = None) -> DTensor:
    where = f"spmd.tensor.{name}"
    if device_mesh is None:
        raise ValueError(f"{where}: pass device_mesh= (the mesh the DTensor is laid out over)")
    if layout != torch.strided:
        raise ValueError(f"{where}: DTensors are strided; layout={layout} is not supported")
    shape = _global_shape(size, where)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    placements = normalize_placements(placements if placements is not None else [Replicate()] * device_mesh.ndim,
                                      len(shape), device_mesh.ndim, where)
    spec = DTensorSpec(device_mesh, placements, shape, contiguous_stride(shape), dtype)
    if draw is None:
        local = allocate(spec.local_shape(), dtype=dtype, device=device_mesh.device_type)
    else:   # the global draw, of which this rank keeps its piece (see spmd.tensor.random)
        generator = get_generator(device_mesh.device_type)
        drawn = getattr(torch.empty(shape, dtype=dtype, device=device_mesh.device_type), draw)(generator=generator)
        local = spec.local_from_full(drawn).clone()
    return DTensor(local, spec, requires_grad=requires_grad)


def _global_shape(size: tuple[Size, ...], where: str) -> torch.Size:
    """`size` as the factories take it: ints (zeros(2, 3)) or one sequence (zeros((2, 3)), zeros([2, 3]))."""
    dims: Any = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
    try:
        shape = torch.Size(dims)
    except TypeError:
        raise TypeError(f"{where}: size must be ints or one sequence of ints, got {size!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"{where}: size {tuple(shape)} has a negative dimension")
    return shape
