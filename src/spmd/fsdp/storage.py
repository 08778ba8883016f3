"""Freeing and re-growing a tensor's storage in place: how FSDP frees unsharded parameters without replacing the
tensors autograd saved views of (see Note: FSDP tensors in param.py).

Layer: fsdp.
"""

from __future__ import annotations

from torch import Tensor


def alloc_storage(tensor: Tensor) -> None:
    """Give `tensor`'s storage its full size again (after free_storage); no-op when it has it."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def free_storage(tensor: Tensor) -> None:
    """Release `tensor`'s memory; the tensor and the views of it stay, holding nothing until alloc_storage."""
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def holds_memory(tensor: Tensor) -> bool:
    """Whether `tensor`'s storage holds memory now (not freed)."""
    return tensor.untyped_storage().nbytes() > 0
