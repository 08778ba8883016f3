"""Quantized Hugging Face checkpoints loaded dequantized (torch's QuantizedHuggingFaceStorageReader): float8 weights
with a scale per block_size x block_size block (`X.weight` + `X.weight_scale_inv`, DeepSeek V3's release) and
MXFP4 weights (`X_blocks` of packed 4-bit values + `X_scales` of one power-of-two exponent per group of them,
gpt-oss's release), each rank dequantizing only the region its shard covers.

Layer: checkpoint. The metadata presents a quantized weight as the tensor it stands for (target_dtype, and for
MXFP4 the unpacked shape); the load asks read_region for each region, which reads the quantized bytes and the
scales that cover it. The arithmetic is torch's, so both readers give the same values.
"""

from __future__ import annotations

import enum
import math
import os

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.hf_storage import HuggingFaceStorageReader
from spmd.checkpoint.metadata import Chunk, Metadata

__all__ = ["QuantizedHuggingFaceStorageReader"]

_FP8_SCALE = ".weight_scale_inv"
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"
# the sixteen values of a 4-bit float (e2m1), by code: the sign is the high bit
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_EXPONENT_BIAS = 127


class _Scheme(enum.Enum):
    """How a weight is quantized."""

    BLOCK_FP8 = "block-scaled float8"     # 2-d weight, one scale per block_size x block_size block
    MXFP4 = "mxfp4"                       # [..., groups, bytes] of nibble pairs, one exponent per group


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader that loads quantized weights dequantized to `target_dtype`: a float8 weight with
    its `weight_scale_inv` (one scale per `block_size` square block), or an MXFP4 `_blocks` tensor with its
    `_scales` (loaded under the `_blocks` key, its last two dims unpacked into one). Scales are read whole; a
    quantized weight must be whole in one file, as the Hub ships them. Other tensors load as by the plain
    reader."""

    def __init__(self, path: str | os.PathLike[str], thread_count: int = 1, target_dtype: torch.dtype = torch.float32,
                 block_size: int = 128) -> None:
        super().__init__(path, thread_count)
        if block_size < 1:
            raise ValueError(f"QuantizedHuggingFaceStorageReader: block_size must be at least 1, got {block_size}")
        self.target_dtype = target_dtype
        self.block_size = block_size
        self._quantized: dict[str, tuple[_Scheme, Chunk, Chunk]] = {}     # key -> scheme, its box, its scales' box
        self._opened: dict[str, tensor_format.TensorFile] = {}

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        self._quantized.clear()
        for key, entry in metadata.tensors.items():
            scheme, scales = _scheme_of(key, metadata)
            if scheme is None:
                continue
            stored = [entry, metadata.tensors[scales]]
            if any(len(e.chunks) != 1 or any(e.chunks[0].offsets) for e in stored):
                raise CheckpointError(f"checkpoint {self.path}: the quantized {key!r} and its scales must each be "
                                      f"whole in one file, as the Hub ships them")
            if scheme is _Scheme.BLOCK_FP8 and len(entry.shape) != 2:
                raise CheckpointError(f"checkpoint {self.path}: {key!r} has a {_FP8_SCALE} but {len(entry.shape)} "
                                      f"dims; block-scaled float8 weights are 2-d")
            self._quantized[key] = (scheme, entry.chunks[0], metadata.tensors[scales].chunks[0])
            if scheme is _Scheme.MXFP4:
                *prefix, groups, nbytes = entry.shape
                entry.shape = (*prefix, groups * nbytes * 2)
            entry.dtype = tensor_format.dtype_name(self.target_dtype)
            entry.chunks = [Chunk(entry.chunks[0].file, key, (0,) * len(entry.shape), entry.shape, None)]
        return metadata

    def read_region(self, chunk: Chunk, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor | None:
        quantized = self._quantized.get(chunk.key)
        if quantized is None:
            return None
        scheme, stored, scales = quantized
        weight, scale = self._tensor(stored), self._tensor(scales)
        if scheme is _Scheme.BLOCK_FP8:
            return self._block_fp8(weight, scale, offsets, lengths)
        return self._mxfp4(weight, scale, offsets, lengths)

    def _block_fp8(self, weight: Tensor, scale_inv: Tensor, offsets: tuple[int, ...],
                   lengths: tuple[int, ...]) -> Tensor:
        """Each element times the scale of its block, in float32 (CPUs don't multiply float8), then cast."""
        (row, col), (rows, cols) = offsets, lengths
        blocks_of_rows = torch.arange(row, row + rows) // self.block_size
        blocks_of_cols = torch.arange(col, col + cols) // self.block_size
        if rows and cols and (int(blocks_of_rows[-1]) >= scale_inv.shape[0] or
                              int(blocks_of_cols[-1]) >= scale_inv.shape[1]):
            raise CheckpointError(f"checkpoint {self.path}: the scales ({list(scale_inv.shape)}) don't cover a weight "
                                  f"of {list(weight.shape)} in blocks of {self.block_size}; pass the block_size it "
                                  f"was quantized with")
        region = weight[row:row + rows, col:col + cols].to(torch.float32)
        return (region * scale_inv[blocks_of_rows][:, blocks_of_cols]).to(self.target_dtype)

    def _mxfp4(self, blocks: Tensor, scales: Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor:
        """Each byte two 4-bit values (low nibble first) looked up, times two to its group's exponent."""
        per_group = blocks.shape[-1] * 2
        first, last = offsets[-1] // per_group, math.ceil((offsets[-1] + lengths[-1]) / per_group)
        outer = tuple(slice(o, o + n) for o, n in zip(offsets[:-1], lengths[:-1], strict=True))
        packed = blocks[(*outer, slice(first, last))]
        exponents = scales[(*outer, slice(first, last))].to(torch.int32) - _MXFP4_EXPONENT_BIAS
        lut = torch.tensor(_FP4_VALUES, dtype=self.target_dtype)
        rows = packed.reshape(-1, packed.shape[-1])
        values = torch.empty(rows.shape[0], rows.shape[1] * 2, dtype=self.target_dtype)
        values[:, 0::2] = lut[(rows & 0x0F).long()]
        values[:, 1::2] = lut[(rows >> 4).long()]
        torch.ldexp(values, exponents.reshape(-1, 1), out=values)
        unpacked = values.reshape(*packed.shape[:-2], (last - first) * per_group)
        start = offsets[-1] - first * per_group
        return unpacked[..., start:start + lengths[-1]]

    def _tensor(self, chunk: Chunk) -> Tensor:
        opened = self._opened.get(chunk.file)
        if opened is None:
            size = self.file_size(chunk.file)
            assert size is not None
            opened = tensor_format.TensorFile(chunk.file, lambda offset, length, name=chunk.file:
                                              self.read(name, offset, length), size)
            self._opened[chunk.file] = opened
        return opened.tensor(chunk.key)

    def close(self) -> None:
        self._opened.clear()
        super().close()


def _scheme_of(key: str, metadata: Metadata) -> tuple[_Scheme | None, str]:
    """How `key` is quantized, and its scales' key (None where it is not)."""
    if key.endswith(".weight") and key + "_scale_inv" in metadata.tensors:
        return _Scheme.BLOCK_FP8, key + "_scale_inv"
    if key.endswith(_MXFP4_BLOCKS):
        scales = key[:-len(_MXFP4_BLOCKS)] + _MXFP4_SCALES
        if scales in metadata.tensors:
            return _Scheme.MXFP4, scales
    return None, ""
