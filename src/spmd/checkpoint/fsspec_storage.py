"""Checkpoints on any filesystem fsspec reaches (torch's FsspecWriter / FsspecReader): object stores (s3://,
gs://, az:// with their fsspec packages), memory://, or file:// URLs. save and load pick these for a
checkpoint_id that is a URL, as torch's DCP does.

Layer: checkpoint. The format and the save protocol are spmd's (storage.py): data files have names no earlier
save used, so they are written in place; the metadata, written last, is the commit (Note: never lose the last good
checkpoint): on a local filesystem under a temporary name, then renamed; on an object store by one upload, which
readers see whole or not at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from spmd._core.errors import CheckpointError
from spmd.checkpoint.metadata import DCP_MARKER, DCP_MARKER_FILE, METADATA_FILE
from spmd.checkpoint.storage import DATA_FILE, PARTIAL_SUFFIX, StorageReader, StorageWriter

_LOCAL_PROTOCOLS = {"file", "local"}


def is_url(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint_id names a place through fsspec (`scheme://...`) rather than a local directory."""
    return "://" in os.fspath(checkpoint_id)


def _filesystem(path: str | os.PathLike[str], storage_options: dict[str, Any]) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError as error:
        raise CheckpointError(f"checkpoint {os.fspath(path)}: a URL needs the fsspec package (pip install fsspec, "
                              f"and the package of its protocol, e.g. s3fs)") from error
    return url_to_fs(os.fspath(path), **storage_options)


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return bool(_LOCAL_PROTOCOLS & set(protocols))


class _AtURL:
    """Where an fsspec storage reads or writes: the filesystem, the path in it and the URL, from `storage_options`
    (credentials, endpoints); a save or load given a checkpoint_id moves it there, as torch's reset does."""

    storage_options: dict[str, Any]

    def _locate(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.fs, self.path = _filesystem(checkpoint_id, self.storage_options)
        self.url = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_url(checkpoint_id)

    def _join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"


class FsspecWriter(_AtURL, StorageWriter):
    """Writes a checkpoint at an fsspec URL. `storage_options` go to the filesystem (credentials, endpoints);
    torch's `sync_files`, `single_file_per_rank`, `thread_count`, `per_thread_copy_ahead` and `overwrite`
    are accepted: spmd writes one file per rank and never overwrites a data file."""

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000, overwrite: bool = True,
                 **storage_options: Any) -> None:
        self.storage_options = storage_options
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._locate(checkpoint_id)
            self.fs.makedirs(self.path, exist_ok=True)

    def write_file(self, name: str, parts: Iterable[memoryview]) -> int:
        size = 0
        with self.fs.open(self._join(name), "wb") as file:
            for part in parts:
                file.write(part)
                size += len(part)
        return size

    def commit(self, metadata: bytes, files: Iterable[str]) -> None:
        final = self._join(METADATA_FILE)
        if _is_local(self.fs):
            partial = self._join(f".{METADATA_FILE}{PARTIAL_SUFFIX}")
            self.fs.pipe_file(partial, metadata)
            self.fs.mv(partial, final)
        else:
            self.fs.pipe_file(final, metadata)
        self.fs.pipe_file(self._join(DCP_MARKER_FILE), DCP_MARKER)
        keep = set(files)
        for entry in self.fs.ls(self.path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if (DATA_FILE.match(name) and name not in keep) or name.endswith(PARTIAL_SUFFIX):
                self.fs.rm(entry)


class FsspecReader(_AtURL, StorageReader):
    """Reads a checkpoint at an fsspec URL; each read fetches its byte range."""

    def __init__(self, path: str | os.PathLike[str], **storage_options: Any) -> None:
        self.storage_options = storage_options
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._locate(checkpoint_id)

    def read_metadata(self) -> bytes:
        if not self.fs.exists(self.path):
            raise CheckpointError(f"checkpoint {self.url}: no such directory")
        try:
            return self.fs.cat_file(self._join(METADATA_FILE))
        except FileNotFoundError:
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.path, detail=False)]
            data = sorted(n for n in names if DATA_FILE.match(n))
            if data:
                raise CheckpointError(f"checkpoint {self.url} is incomplete: it has no {METADATA_FILE}, and "
                                      f"{len(data)} data files of a save that did not finish") from None
            raise CheckpointError(f"{self.url} is not a checkpoint: it has no {METADATA_FILE}") from None

    def read(self, name: str, offset: int, length: int) -> memoryview:
        try:
            data = self.fs.cat_file(self._join(name), start=offset, end=offset + length)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.url}: data file {name} is missing") from None
        if len(data) != length:
            raise CheckpointError(f"checkpoint {self.url}: data file {name} ended before byte {offset + length}, "
                                  f"which its metadata needs (truncated)")
        return memoryview(bytearray(data))

    def file_size(self, name: str) -> int | None:
        try:
            return int(self.fs.size(self._join(name)))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.url}: data file {name} is missing") from None
