"""The tensor file format: safetensors (an 8-byte little-endian header length, a JSON header, the raw bytes), so
checkpoint files load with the `safetensors` library and never run code.

Layer: checkpoint. Pure file layout: writing streams each tensor's bytes straight from its memory (no copy into a
buffer), reading maps the file and hands out views of the byte ranges asked for. A CRC-32 per tensor, kept by the
caller (metadata.py), checks what is read.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError

# The safetensors dtype names (https://github.com/huggingface/safetensors, format.md).
_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
}
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}
_ALIGN = 8     # the header is padded with spaces so the data starts 8-byte aligned


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of `dtype`; raises for a dtype the format can't hold."""
    name = _NAMES.get(dtype)
    if name is None:
        raise CheckpointError(f"checkpoint: tensors of dtype {dtype} can't be saved (the format holds "
                              f"{', '.join(str(d).removeprefix('torch.') for d in _NAMES)})")
    return name


def dtype_of(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise CheckpointError(f"checkpoint: unknown dtype {name!r} in a tensor file")
    return dtype


def as_bytes(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def crc32(data: memoryview) -> int:
    """CRC-32 of `data` (zlib's: it releases the GIL, so it can run beside the writes)."""
    return zlib.crc32(data)


def header_bytes(entries: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]],
                 metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and padded JSON header of a file holding `entries` (name -> dtype, shape, byte size) in
    this order, back to back."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, nbytes) in entries.items():
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


class TensorFile:
    """A safetensors file opened for reading through `read(offset, length)` (a StorageReader's): its entries, and
    their bytes, read only when asked for."""

    def __init__(self, name: str, read: Callable[[int, int], memoryview], size: int) -> None:
        self.name = name
        self._read = read
        if size < 8:
            raise CheckpointError(f"checkpoint file {name}: {size} bytes, too short for a header (truncated?)")
        (length,) = struct.unpack("<Q", read(0, 8))
        if 8 + length > size:
            raise CheckpointError(f"checkpoint file {name}: its header claims {length} bytes but the file has "
                                  f"{size - 8} after the length (truncated or not a tensor file)")
        try:
            header = json.loads(bytes(read(8, length)))
        except ValueError as error:
            raise CheckpointError(f"checkpoint file {name}: the header is not valid JSON ({error})") from error
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._start = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            if not 0 <= begin <= end <= size - self._start:
                raise CheckpointError(f"checkpoint file {name}: tensor {key!r} lies at bytes {begin}-{end} of the "
                                      f"data, beyond the file's end (truncated?)")
            self.entries[key] = (dtype_of(entry["dtype"]), tuple(entry["shape"]), begin, end)

    def location(self, key: str) -> tuple[int, int]:
        """(offset in the file, byte count) of tensor `key`."""
        _, _, begin, end = self._entry(key)
        return self._start + begin, end - begin

    def raw(self, key: str) -> memoryview:
        """The bytes of tensor `key`."""
        _, _, begin, end = self._entry(key)
        return self._read(self._start + begin, end - begin)

    def tensor(self, key: str, raw: memoryview | None = None) -> Tensor:
        """Tensor `key` over its bytes (`raw`, when already read): a view of the map for a FileSystemReader, so
        copy what must outlive it."""
        dtype, shape, begin, end = self._entry(key)
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.raw(key) if raw is None else raw, dtype=torch.uint8).view(dtype).reshape(shape)

    def _entry(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        entry = self.entries.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint file {self.name}: no tensor {key!r} in it")
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)
