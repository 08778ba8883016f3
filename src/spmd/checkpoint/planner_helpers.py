"""torch's `checkpoint.planner_helpers` path: the read items that fill a rank's boxes of a tensor from its saved
boxes, for load planners written against torch's. Layer: checkpoint."""

from __future__ import annotations

import torch

from spmd.checkpoint.layout import Box
from spmd.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorEntry, TensorStorageMetadata
from spmd.checkpoint.planner import LoadItemType, ReadItem

__all__ = ["create_read_items_for_chunk_list"]


def create_read_items_for_chunk_list(fqn: str, checkpoint_md: TensorStorageMetadata | TensorEntry,
                                     local_chunks: list[ChunkStorageMetadata]) -> list[ReadItem]:
    """One ReadItem per overlap of a box in `local_chunks` (the boxes this rank holds of tensor `fqn`, in its global
    coordinates) with a saved box of `checkpoint_md`: each names its local box (dest_index, with the box's
    position in `local_chunks`) and its saved box (storage_index, with the box's position in the checkpoint).
    `checkpoint_md` is torch's view of a saved tensor or spmd's index entry (DefaultLoadPlanner plans with it)."""
    items = []
    for local_index, local_chunk in enumerate(local_chunks):
        local = Box(tuple(local_chunk.offsets), tuple(local_chunk.sizes))
        for storage_index, saved_chunk in enumerate(checkpoint_md.chunks):
            saved = Box(tuple(saved_chunk.offsets), tuple(saved_chunk.sizes))
            region = local.overlap(saved)
            if region is None or region.empty:
                continue
            items.append(ReadItem(
                LoadItemType.TENSOR,
                MetadataIndex(fqn, local_chunk.offsets, local_index),
                torch.Size(start - origin for start, origin in zip(region.offsets, local.offsets, strict=True)),
                MetadataIndex(fqn, saved_chunk.offsets, storage_index),
                torch.Size(start - origin for start, origin in zip(region.offsets, saved.offsets, strict=True)),
                torch.Size(region.sizes)))
    return items
