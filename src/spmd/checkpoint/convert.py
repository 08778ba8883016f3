"""Conversion between a checkpoint directory and one full state-dict file, both ways, and between spmd's checkpoint
format and torch's DCP format, both ways:

    python -m spmd.checkpoint.convert CHECKPOINT_DIR model.safetensors [--only model]
    python -m spmd.checkpoint.convert CHECKPOINT_DIR state.pt
    python -m spmd.checkpoint.convert model.safetensors CHECKPOINT_DIR
    python -m spmd.checkpoint.convert CHECKPOINT_DIR OTHER_DIR     (spmd's format to torch's, or torch's to spmd's)

Layer: checkpoint. One process, no group. A .safetensors file is flat: its keys are the checkpoint's dotted keys
(with --only PREFIX, those under PREFIX, the prefix removed: `--only model` gives what `model.state_dict()` has)
and the non-tensor values ride in its metadata as JSON. A .pt / .pth file is torch.save of the nested state dict
as it was saved, values included; one is read back with torch.load(weights_only=True), which runs no code.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from typing import Any

import torch

from spmd._core.errors import CheckpointError
from spmd.checkpoint import api
from spmd.checkpoint.format import TensorFile, as_bytes, dtype_of, header_bytes
from spmd.checkpoint.metadata import Metadata, decode_value, encode_value
from spmd.checkpoint.storage import FileSystemReader
from spmd.checkpoint.torch_format import TorchCheckpointReader, is_torch_checkpoint
from spmd.checkpoint.torch_format_writer import TorchFormatWriter

_VALUES = "spmd.values"     # the safetensors metadata entry holding the non-tensor values
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth")


def load_full(checkpoint: str | os.PathLike[str], only: str | None = None) -> tuple[dict[str, Any], Metadata]:
    """Every tensor of the checkpoint whole (and every value), by dotted key; with `only`, the keys under that
    prefix, the prefix removed. Reads the whole checkpoint into this process's memory."""
    if is_torch_checkpoint(checkpoint):
        metadata = TorchCheckpointReader(checkpoint).read_metadata()
    else:
        metadata = Metadata.from_json(FileSystemReader(checkpoint).read_metadata(),
                                      f"checkpoint {os.fspath(checkpoint)}")
    state: dict[str, Any] = {key: torch.empty(entry.shape, dtype=dtype_of(entry.dtype))
                             for key, entry in metadata.tensors.items()}
    state.update({key: None for key in metadata.values})
    api.load(state, checkpoint_id=checkpoint, no_dist=True)
    if only is None:
        return state, metadata
    prefix = only.rstrip(".") + "."
    chosen = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    if not chosen:
        raise CheckpointError(f"convert: nothing in {os.fspath(checkpoint)} lies under {only!r} (its keys start with "
                              f"{sorted({key.split('.')[0] for key in state})})")
    return chosen, metadata


def dcp_to_file(checkpoint: str | os.PathLike[str], target: str | os.PathLike[str], only: str | None = None) -> None:
    """Write the checkpoint as one full state-dict file: .safetensors (flat) or .pt / .pth (torch.save, nested)."""
    state, metadata = load_full(checkpoint, only)
    target = os.fspath(target)
    if target.endswith(".safetensors"):
        tensors = {key: value.contiguous() for key, value in state.items() if isinstance(value, torch.Tensor)}
        values = {key: encode_value(value, key) for key, value in state.items() if key not in tensors}
        entries = {key: (t.dtype, tuple(t.shape), t.numel() * t.element_size()) for key, t in tensors.items()}
        header = header_bytes(entries, {_VALUES: json.dumps(values)})
        with open(target, "wb") as file:
            file.write(header)
            for tensor in tensors.values():
                file.write(as_bytes(tensor))
    elif target.endswith((".pt", ".pth")):
        torch.save(metadata.nested(state) if only is None else state, target)
    else:
        raise CheckpointError(f"convert: can't tell the format of {target}; name it .safetensors, .pt or .pth")


def convert_format(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rewrite checkpoint directory `source` in the other format at `target`: one of spmd's in torch's DCP format
    (for torch's load, format_utils and the tools built on them), one of torch's in spmd's."""
    state, metadata = load_full(source)
    if is_torch_checkpoint(source):
        api.save(metadata.nested(state), checkpoint_id=target, no_dist=True)
    else:
        api.save(metadata.nested(state), storage_writer=TorchFormatWriter(target), no_dist=True)


def file_to_dcp(source: str | os.PathLike[str], checkpoint: str | os.PathLike[str]) -> None:
    """Write a full state-dict file (.safetensors, or .pt / .pth read with weights_only=True) as a checkpoint."""
    source = os.fspath(source)
    if source.endswith(".safetensors"):
        with open(source, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
        view = memoryview(mapped)
        file = TensorFile(source, lambda offset, length: view[offset:offset + length], size)
        state: dict[str, Any] = {key: file.tensor(key).clone() for key in file}
        state.update({key: decode_value(value) for key, value in json.loads(file.metadata.get(_VALUES, "{}")).items()})
    elif source.endswith((".pt", ".pth")):
        state = _read_torch_save(source)
    else:
        raise CheckpointError(f"convert: can't tell the format of {source}; name it .safetensors, .pt or .pth")
    api.save(state, checkpoint_id=checkpoint, no_dist=True)


def _read_torch_save(source: str | os.PathLike[str]) -> dict[str, Any]:
    state = torch.load(source, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"convert: {os.fspath(source)} holds a {type(state).__name__}, not a state dict")
    return state


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike[str], torch_save_path: str | os.PathLike[str]) -> None:
    """torch's name: the checkpoint as one torch.save file of the nested state dict, whatever the file's name."""
    state, metadata = load_full(dcp_checkpoint_dir)
    torch.save(metadata.nested(state), torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike[str], dcp_checkpoint_dir: str | os.PathLike[str]) -> None:
    """torch's name: a torch.save'd state dict (read with weights_only=True) as a checkpoint, to load resharded."""
    api.save(_read_torch_save(torch_save_path), checkpoint_id=dcp_checkpoint_dir, no_dist=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spmd.checkpoint.convert", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a checkpoint directory, or a .safetensors / .pt / .pth file")
    parser.add_argument("target", help="a .safetensors / .pt / .pth file, or a checkpoint directory (in torch's DCP "
                                           "format for a source in spmd's, in spmd's for one in torch's)")
    parser.add_argument("--only", default=None, help="from a checkpoint: only the keys under this prefix")
    args = parser.parse_args(argv)
    try:
        if os.path.isdir(args.source) and not args.target.endswith(_FILE_SUFFIXES):
            if args.only is not None:
                parser.error("--only applies to a conversion into a file")
            convert_format(args.source, args.target)
        elif os.path.isdir(args.source):
            dcp_to_file(args.source, args.target, args.only)
        else:
            if args.only is not None:
                parser.error("--only applies to a checkpoint directory source")
            file_to_dcp(args.source, args.target)
    except CheckpointError as error:
        parser.exit(1, f"{parser.prog}: {error}\n")


if __name__ == "__main__":
    main()
