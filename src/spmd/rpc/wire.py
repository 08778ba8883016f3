"""How an RPC message travels: the message pickled with its CPU tensors taken out, so that each tensor moves once,
straight from its memory into the receiver's (the transport's copy), instead of through pickle's bytes.

Layer: rpc. A message is (body, tensors): the body pickles (the message's pickle, each tensor's dtype, shape and
requires_grad, and the bytes of those under INLINE_BYTES) and the larger tensors follow as byte views. The agent
writes a header (the body's length and the tensors' count), the body, then the tensors' bytes. Only members of
the job's group can connect to send messages (see channel.py); unpickling is as safe as the peers are.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import Tensor

Meta = tuple[str, tuple[int, ...], bool, bytes | None]     # dtype, shape, requires_grad, inline bytes
INLINE_BYTES = 16 << 10      # tensors up to this size travel in the body (one write beats a copy)


class _Pickler(pickle.Pickler):
    """Pickles a message, keeping its plain CPU tensors aside (persistent ids)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not Tensor or obj.device.type != "cpu" or obj.layout is not torch.strided:
            return None
        self.tensors.append(obj)     # its data: outside a dist_autograd context, autograd's history stays here
        return len(self.tensors) - 1


def encode(message: Any) -> tuple[bytes, list[Tensor]]:
    """(body, tensors) of `message`."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(message)
    metas, apart = [], []
    for tensor in pickler.tensors:
        data = tensor.detach().contiguous()
        inline = data.nbytes <= INLINE_BYTES
        metas.append((str(data.dtype).removeprefix("torch."), tuple(data.shape), tensor.requires_grad,
                      bytes(byte_view(data)) if inline else None))
        if not inline:
            apart.append(data)
    body = pickle.dumps((buffer.getvalue(), metas), protocol=pickle.HIGHEST_PROTOCOL)
    return body, apart


def metas_of(body: bytes) -> tuple[bytes, list[Meta]]:
    """The message's pickle and its tensors' metadata, from a body."""
    pickled, metas = pickle.loads(body)
    return pickled, metas


def tensor_of(meta: Meta) -> Tensor:
    """The tensor of `meta`: over its inline bytes, or empty, to receive into."""
    dtype, shape, _, data = meta
    if data is None:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape) \
        if data else torch.empty(shape, dtype=getattr(torch, dtype))


def byte_view(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous tensor, as a writable flat memoryview over the same memory."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Tensor:
        return self.tensors[pid]


def decode(pickled: bytes, metas: list[Meta], tensors: list[Tensor]) -> Any:
    """The message, its tensors put back (requires_grad as sent)."""
    for tensor, (_, _, requires_grad, _) in zip(tensors, metas, strict=True):
        if requires_grad:
            tensor.requires_grad_()
    return _Unpickler(io.BytesIO(pickled), tensors).load()
