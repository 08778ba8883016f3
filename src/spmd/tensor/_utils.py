"""torch's `tensor._utils` helpers that checkpoint, conversion and quantization code imports (torchao, torchtune,
TorchTitan): a DTensor's local shape and global offset from its layout alone, and size normalisation.

Layer: tensor. Pure layout arithmetic, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.device_mesh import DeviceMesh
from spmd.tensor.placement import Placement, Shard, normalize_placements
from spmd.tensor.spec import DTensorSpec, contiguous_stride


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                                          placements: Sequence[Placement], skip_offset: bool = False,
                                          ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this rank's local shape, its block's offset in the global tensor) for a DTensor of `global_shape` laid
    out as `placements` on `mesh`: what `DTensor.from_local` would expect here, without making one. Uneven
    shards follow torch.chunk, and an empty shard's offset is its dim's size, as torch's; with `skip_offset` the
    offset is (). A rank outside the mesh gets ((0,), ())."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return (0,), ()
    shape = torch.Size(global_shape)
    layout = normalize_placements(placements, len(shape), mesh.ndim, "compute_local_shape_and_global_offset")
    spec = DTensorSpec(mesh, layout, shape, contiguous_stride(shape), torch.float32)
    local, offset = spec.local_shape_and_offset(coordinate)
    if skip_offset:
        return tuple(local), ()
    sharded = {p.dim for p in layout if isinstance(p, Shard)}
    # torch's convention: an empty shard starts at the end of its dim
    return tuple(local), tuple(shape[d] if d in sharded and local[d] == 0 else o for d, o in enumerate(offset))


def normalize_to_torch_size(size: int | Sequence[int] | Sequence[Sequence[int]] | torch.Size) -> torch.Size:
    """A size given as an int, a sequence of ints, or a one-element tuple holding a sequence, as a torch.Size
    (factories' `*size` arguments)."""
    if isinstance(size, torch.Size):
        return size
    if isinstance(size, int):
        return torch.Size([size])
    if len(size) == 1 and isinstance(size[0], Sequence):
        return torch.Size(list(size[0]))
    return torch.Size(list(size))   # type: ignore[arg-type]
