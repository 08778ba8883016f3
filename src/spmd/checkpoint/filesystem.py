"""Alias at torch's module path `checkpoint.filesystem` (in torch's distributed package): the directory
storage save and load use."""

from spmd.checkpoint.storage import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
