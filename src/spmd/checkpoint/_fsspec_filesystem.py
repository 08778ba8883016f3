"""torch's `checkpoint._fsspec_filesystem` path: FsspecWriter / FsspecReader (fsspec_storage.py)."""

from spmd.checkpoint.fsspec_storage import FsspecReader, FsspecWriter

__all__ = ["FsspecReader", "FsspecWriter"]
