"""torch's `checkpoint.resharding` path: the box type its resharding helpers take. Layer: checkpoint (an alias)."""

from spmd.checkpoint.metadata import ChunkStorageMetadata

__all__ = ["ChunkStorageMetadata"]
