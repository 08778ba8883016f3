"""The checkpoint's index, `metadata.json`: every tensor's global shape and dtype and which file holds which box of
it at which key, each box's CRC-32, every data file's size, and the non-tensor values, all as JSON.

Layer: checkpoint. Pure data. Non-tensor values are JSON with a few tags for what JSON lacks (tuples, bytes,
non-finite floats, dicts with non-string keys); anything else can't be saved, since loading must never run code.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

from spmd._core.errors import CheckpointError

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
FORMAT_NAME = "spmd.checkpoint"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One box of a global tensor, as one file holds it."""

    file: str                    # the data file, relative to the checkpoint directory
    key: str                     # the tensor's name inside that file
    offsets: tuple[int, ...]     # where the box starts in the global tensor, per dim
    sizes: tuple[int, ...]
    crc32: int                   # of the box's bytes, contiguous, in the file


@dataclasses.dataclass
class TensorEntry:
    dtype: str                   # the safetensors name (format.dtype_name)
    shape: tuple[int, ...]       # global
    chunks: list[Chunk] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Metadata:
    save_id: str
    tensors: dict[str, TensorEntry]
    values: dict[str, Any]       # flattened key -> the value (decoded)
    files: dict[str, int]        # data file -> its size in bytes
    paths: dict[str, list[str | int]] = dataclasses.field(default_factory=dict)
    """key -> where it sat in the nested state dict saved (dict keys and list indices), to rebuild the nesting."""
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_NAME, "version": self.version, "save_id": self.save_id, "files": self.files,
            "tensors": {key: {"dtype": e.dtype, "shape": list(e.shape),
                              "chunks": [{"file": c.file, "key": c.key, "offsets": list(c.offsets),
                                          "sizes": list(c.sizes), "crc32": c.crc32} for c in e.chunks]}
                        for key, e in self.tensors.items()},
            "values": {key: encode_value(value, key) for key, value in self.values.items()},
            "paths": self.paths,
        }
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Metadata:
        try:
            body = json.loads(data)
        except ValueError as error:
            raise CheckpointError(f"{where}: the metadata is not valid JSON ({error}); the file is corrupted") \
                from error
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not an spmd checkpoint's metadata")
        version = body.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(f"{where}: written in checkpoint format version {version}, newer than this spmd "
                                  f"reads ({FORMAT_VERSION}); load it with a newer spmd")
        try:
            tensors = {key: TensorEntry(e["dtype"], tuple(e["shape"]),
                                        [Chunk(c["file"], c["key"], tuple(c["offsets"]), tuple(c["sizes"]),
                                               int(c["crc32"])) for c in e["chunks"]])
                       for key, e in body["tensors"].items()}
            values = {key: decode_value(value) for key, value in body["values"].items()}
            return cls(str(body["save_id"]), tensors, values, {k: int(v) for k, v in body["files"].items()},
                       {k: list(v) for k, v in body.get("paths", {}).items()}, version)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{where}: malformed metadata ({type(error).__name__}: {error})") from error


# -- values ---------------------------------------------------------------------------------------------------

_TAG = "__spmd__"


def encode_value(value: Any, key: str) -> Any:
    """`value` as JSON (tagged where JSON has no such type); raises naming `key` for what can't be saved."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode_value(item, key) for item in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode_value(item, key) for item in value]}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode_value(v, key) for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode_value(k, key), encode_value(v, key)] for k, v in value.items()]}
    raise CheckpointError(f"checkpoint: {key!r} holds a {type(value).__name__}, which can't be saved without "
                          f"pickle; save tensors, numbers, strings, bytes, or lists, tuples and dicts of them "
                          f"(or an object with state_dict/load_state_dict returning such values)")


def decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode_value(v) for k, v in value.items()}
    if tag == "float":
        return float(value["value"])
    if tag == "tuple":
        return tuple(decode_value(item) for item in value["items"])
    if tag == "bytes":
        return base64.b64decode(value["base64"])
    if tag == "dict":
        return {_hashable(decode_value(k)): decode_value(v) for k, v in value["items"]}
    raise CheckpointError(f"checkpoint metadata: unknown value tag {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
