"""torch's `torch.distributed.checkpoint.filesystem` path: the directory storage save and load use."""

from spmd.checkpoint.storage import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
