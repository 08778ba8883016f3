"""Whole-tensor Hugging Face files from torch's sharded ones (HuggingFaceStorageWriter(save_distributed=True)'s
shard-*-model-*.safetensors), at torch's path, which TorchTitan imports: consolidate_safetensors_files in one
process, consolidate_safetensors_files_on_every_rank with the output files dealt over a group's ranks.

Layer: checkpoint. Each output file is laid out, created under a temporary name, filled box by box from the
mapped shard files (the byte runs hf_storage.write_region writes), flushed and renamed; the index comes last.
spmd's own HuggingFaceStorageWriter needs none of this (it writes the whole files directly); this serves
sharded files written earlier, or by torch.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import secrets
from collections.abc import Mapping

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.hf_storage import (
    INDEX_FILE,
    HuggingFaceStorageReader,
    create_file,
    index_bytes,
    lay_out,
    model_file_name,
    write_region,
)
from spmd.checkpoint.layout import Box, covered
from spmd.checkpoint.metadata import Metadata
from spmd.checkpoint.storage import FileSystemWriter
from spmd.comm.objects import all_gather_bytes
from spmd.comm.world import AnyGroup, is_initialized, resolve_group

__all__ = ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank"]


def consolidate_safetensors_files(input_dir: str, output_dir: str, fqn_to_index_mapping: dict[str, int],
                                  num_threads: int = 1) -> None:
    """Write the tensors of the sharded files in `input_dir` whole into `output_dir`'s model-0000i-of-0000N files,
    as `fqn_to_index_mapping` deals them (keys of the input it does not name are left out), and the index;
    `num_threads` files at once."""
    metadata = _read(input_dir, fqn_to_index_mapping)
    _write_files(input_dir, output_dir, metadata, fqn_to_index_mapping, set(fqn_to_index_mapping.values()),
                 num_threads)
    _write_index(output_dir, metadata, fqn_to_index_mapping)


def consolidate_safetensors_files_on_every_rank(input_dir: str, output_dir: str, fqn_to_index_mapping: dict[str, int],
                                                num_threads: int = 1, process_group: AnyGroup | None = None) -> None:
    """consolidate_safetensors_files with the output files dealt over the ranks of `process_group` (file index i
    to group rank i % size, as torch deals them); collective, and every rank returns once the index is written,
    or raises the first rank's error. Without a process group, one process does it all."""
    if not is_initialized():
        consolidate_safetensors_files(input_dir, output_dir, fqn_to_index_mapping, num_threads)
        return
    group = resolve_group(process_group, "consolidate_safetensors_files_on_every_rank")
    rank, size = group.group_rank, group.size()
    error = ""
    try:
        metadata = _read(input_dir, fqn_to_index_mapping)
        mine = {index for index in set(fqn_to_index_mapping.values()) if index % size == rank}
        _write_files(input_dir, output_dir, metadata, fqn_to_index_mapping, mine, num_threads)
    except Exception as failure:           # exchanged, so no rank waits for this one
        error = f"rank {rank} could not consolidate its files: {type(failure).__name__}: {failure}"
    _raise_first(all_gather_bytes(error.encode(), group=group))
    if rank == 0:
        try:
            _write_index(output_dir, metadata, fqn_to_index_mapping)
        except Exception as failure:
            error = f"rank 0 could not write {INDEX_FILE}: {type(failure).__name__}: {failure}"
    _raise_first(all_gather_bytes(error.encode(), group=group))


def _raise_first(errors: list[bytes]) -> None:
    for error in errors:
        if error:
            raise CheckpointError(f"consolidating Hugging Face files failed: {error.decode()}")


def _read(input_dir: str, mapping: Mapping[str, int]) -> Metadata:
    """The sharded files' metadata, checked to hold every key the mapping names, whole."""
    metadata = HuggingFaceStorageReader(input_dir).read_metadata()
    missing = [key for key in mapping if key not in metadata.tensors]
    if missing:
        raise CheckpointError(f"{input_dir} holds no {', '.join(map(repr, missing[:8]))}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} keys of fqn_to_index_mapping)")
    for key in mapping:
        entry = metadata.tensors[key]
        if not covered(entry.shape, [Box(chunk.offsets, chunk.sizes) for chunk in entry.chunks]):
            raise CheckpointError(f"{input_dir}: the shards of {key!r} don't cover its shape {list(entry.shape)} "
                                  f"(boxes {[(c.offsets, c.sizes) for c in entry.chunks]}): a rank's files are missing")
    return metadata


def _write_files(input_dir: str, output_dir: str, metadata: Metadata, mapping: Mapping[str, int], indices: set[int],
                 num_threads: int) -> None:
    """Output files `indices`: laid out, filled from the shards' bytes, flushed, renamed."""
    count = max(mapping.values())
    tensors = {key: (tensor_format.dtype_of(metadata.tensors[key].dtype), metadata.tensors[key].shape)
               for key, index in mapping.items() if index in indices}
    placed, files = lay_out(tensors, {key: model_file_name(mapping[key], count) for key in tensors})
    os.makedirs(output_dir, exist_ok=True)
    token = secrets.token_hex(8)
    reader = HuggingFaceStorageReader(input_dir)
    opened: dict[str, tensor_format.TensorFile] = {}

    def shard_file(name: str) -> tensor_format.TensorFile:
        if name not in opened:
            opened[name] = tensor_format.TensorFile(name, lambda offset, length: reader.read(name, offset, length),
                                                    metadata.files[name])
        return opened[name]

    for name in {chunk.file for key in tensors for chunk in metadata.tensors[key].chunks}:
        shard_file(name)           # parsed here, so the threads below only read

    def write(name: str) -> None:
        partial = os.path.join(output_dir, f".{name}.{token}.partial")
        create_file(partial, *files[name])
        descriptor = os.open(partial, os.O_WRONLY)
        try:
            for key in (key for key, where in placed.items() if where.file == name):
                item_size = tensors[key][0].itemsize
                for chunk in metadata.tensors[key].chunks:
                    if math.prod(chunk.sizes):
                        write_region(descriptor, placed[key].start, opened[chunk.file].raw(chunk.key), item_size,
                                     tensors[key][1], chunk.offsets, chunk.sizes, partial)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(partial, os.path.join(output_dir, name))

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, min(num_threads, len(files))),
                                                   thread_name_prefix="spmd-hf-consolidate") as pool:
            for done in [pool.submit(write, name) for name in files]:
                done.result()
    finally:
        opened.clear()
        reader.close()


def _write_index(output_dir: str, metadata: Metadata, mapping: Mapping[str, int]) -> None:
    count = max(mapping.values())
    total = sum(math.prod(metadata.tensors[key].shape) * tensor_format.dtype_of(metadata.tensors[key].dtype).itemsize
                for key in mapping)
    weight_map = {key: model_file_name(index, count) for key, index in sorted(mapping.items())}
    FileSystemWriter(output_dir).write_file(INDEX_FILE, [memoryview(index_bytes(weight_map, total))])
