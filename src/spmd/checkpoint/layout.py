"""The layout of a state dict: its flattened keys, the box of every tensor a rank holds, and the overlaps a load
copies between saved boxes and the boxes this rank holds now.

Layer: checkpoint. No I/O, no communication. A DTensor's local shard is one box of the global tensor
(DTensorSpec.local_shape_and_offset; _StridedShard included); a plain tensor is taken to be the whole, and the
same on every rank that has it (as torch's DCP does). Which rank writes a box: default_planner, Note: who writes
what.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.tensor.api import DTensor
from spmd.tensor.placement import Partial

Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """A block of a global tensor: where it starts and its extent, per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return any(size == 0 for size in self.sizes)

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def overlap(self, other: Box) -> Box | None:
        """The block both cover, or None."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes,
                                                            strict=True))
        if any(end <= start for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(starts, tuple(end - start for start, end in zip(starts, ends, strict=True)))

    def view(self, tensor: Tensor, region: Box) -> Tensor:
        """The part of `tensor` (this box's data) that `region` (inside this box) covers."""
        for dim, (start, size) in enumerate(zip(region.offsets, region.sizes, strict=True)):
            if start != self.offsets[dim] or size != tensor.shape[dim]:     # a dim read whole stays as it is
                tensor = tensor.narrow(dim, start - self.offsets[dim], size)
        return tensor


@dataclasses.dataclass(slots=True)
class LocalTensor:
    """What this rank holds of one tensor of the state dict."""

    data: Tensor                 # the local values: a DTensor's local shard, or the plain tensor
    shape: tuple[int, ...]       # global
    box: Box
    distributed: bool            # a DTensor (its box is its shard) rather than a plain tensor (the whole)


def is_stateful(value: Any) -> bool:
    """Whether save and load go through `value.state_dict()` / `value.load_state_dict()` (torch's Stateful)."""
    return (not isinstance(value, (Tensor, torch.nn.Module, Mapping)) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def flatten(state_dict: Mapping[str, Any]) -> dict[str, tuple[Path, Any]]:
    """key -> (path, leaf) for every tensor and every other value of the nested `state_dict` (dicts, and lists or
    tuples that hold tensors, are walked; keys are the path joined by dots, as torch's DCP flattens)."""
    flat: dict[str, tuple[Path, Any]] = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                visit((*path, key), item)
            return
        if isinstance(value, (list, tuple)) and _holds_tensor(value):
            for index, item in enumerate(value):
                visit((*path, index), item)
            return
        key = ".".join(map(str, path))
        if key in flat:
            raise CheckpointError(f"checkpoint: two entries of the state dict flatten to the same key {key!r} "
                                  f"({flat[key][0]} and {path}); rename one")
        flat[key] = (path, value)

    for key, value in state_dict.items():
        visit((key,), value)
    return flat


def local_tensor(key: str, tensor: Tensor) -> LocalTensor:
    """This rank's part of `tensor`."""
    if isinstance(tensor, DTensor):
        spec = tensor._spec
        if any(isinstance(p, Partial) for p in spec.placements):
            raise CheckpointError(f"checkpoint: {key!r} is a DTensor with a Partial placement "
                                  f"({list(spec.placements)}); reduce it (redistribute to Replicate) before saving")
        shape, offsets = spec.local_shape_and_offset(spec.mesh.get_coordinate())
        return LocalTensor(tensor._local_tensor, tuple(spec.shape), Box(tuple(offsets), tuple(shape)), True)
    shape = tuple(tensor.shape)
    return LocalTensor(tensor, shape, Box((0,) * len(shape), shape), False)


def covered(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether `boxes` (disjoint, as the writers' are) tile a tensor of `shape`."""
    return sum(box.volume for box in boxes) == math.prod(shape)
