"""Collectives and point-to-point messages of picklable Python objects; the only module that pickles.

Layer: comm. Objects travel as pickled bytes in uint8 tensors: their lengths are exchanged first, then one
padded buffer. Unpickling runs code chosen by the sender: use these only between ranks of one job.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import Tensor

from spmd._core.fake import on_real_tensors
from spmd.comm import collectives, p2p
from spmd.comm.group import ProcessGroup
from spmd.comm.world import AnyGroup, resolve_group


def staging_device(pg: ProcessGroup, device: torch.device | str | None = None) -> torch.device:
    """Where an object collective's byte tensors live: `device` if given, else the first device type the
    group's transport moves (the current device of that type when it is the accelerator, as torch stages
    objects on the current CUDA device for NCCL)."""
    if device is not None:
        return torch.device(device)
    kind = pg.transport.devices[0]
    accelerator = torch.accelerator.current_accelerator() if kind != "cpu" else None
    if accelerator is not None and accelerator.type == kind:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device(kind)


def _to_tensor(obj: Any, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_tensor(data: Tensor, length: int) -> Any:
    """Unpickle from host bytes; `data` already lives on the CPU (one copy per collective, made by the caller)."""
    return pickle.loads(data[:length].numpy().tobytes())


def object_to_tensor(obj: Any, device: torch.device | str, group: AnyGroup | None = None) -> tuple[Tensor, Tensor]:
    """torch's `_object_to_tensor`: `obj` pickled into a uint8 tensor on `device`, and its length as a one-element
    int64 tensor there (what libraries build their own object collectives from). `group` is taken for torch's
    signature."""
    data = _to_tensor(obj, torch.device(device))
    return data, torch.tensor([data.numel()], dtype=torch.int64, device=data.device)


def tensor_to_object(tensor: Tensor, tensor_size: int | Tensor, group: AnyGroup | None = None) -> Any:
    """torch's `_tensor_to_object`: the object pickled in the first `tensor_size` bytes of `tensor` (any device).
    Unpickling runs code chosen by whoever made the bytes: only between ranks of one job."""
    return _from_tensor(tensor.cpu(), int(tensor_size))


def portable_exception(error: Exception) -> Exception:
    """`error` if it survives pickling (its class importable, its arguments picklable), else a RuntimeError
    naming its type and message: an exception that an object collective carries to other ranks."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__qualname__}: {error}")
    return error


@on_real_tensors
def all_gather_object(object_list: list[Any], obj: Any, group: AnyGroup | None = None) -> None:
    """object_list[i] <- rank i's `obj`, on every rank. Collective."""
    pg = resolve_group(group, "all_gather_object")
    if len(object_list) != pg.size():
        raise ValueError(f"all_gather_object on rank {pg.global_rank}: object_list must have {pg.size()} "
                         f"entries, got {len(object_list)}")
    object_list[:] = [pickle.loads(data) for data in all_gather_bytes(pickle.dumps(obj), group=pg)]


@on_real_tensors
def all_gather_bytes(data: bytes, group: AnyGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in group rank order, on every rank: for callers that encode their objects
    themselves (as JSON, say) and must not unpickle what peers send. Collective."""
    pg = resolve_group(group, "all_gather_bytes")
    device = staging_device(pg)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)
    lengths = torch.empty(pg.size(), dtype=torch.int64, device=device)
    collectives.all_gather_into_tensor(lengths, torch.tensor([tensor.numel()], device=device), group=pg)
    host_lengths = lengths.tolist()
    longest = max(host_lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:tensor.numel()] = tensor
    gathered = torch.empty(pg.size(), longest, dtype=torch.uint8, device=device)
    collectives.all_gather_into_tensor(gathered, padded, group=pg)
    host_gathered = gathered.cpu()
    return [host_gathered[rank, :host_lengths[rank]].numpy().tobytes() for rank in range(pg.size())]


@on_real_tensors
def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: AnyGroup | None = None, group_dst: int | None = None) -> None:
    """On `dst` (a global rank; or group rank `group_dst`; neither: the group's first), object_gather_list[i] <-
    rank i's `obj`. Collective."""
    pg = resolve_group(group, "gather_object")
    root = collectives.group_root(pg, dst, group_dst, "gather_object", "dst")
    if pg.group_rank == root and (object_gather_list is None or len(object_gather_list) != pg.size()):
        raise ValueError(f"gather_object on rank {pg.global_rank}: the destination needs an object_gather_list "
                         f"of {pg.size()} entries")
    gathered: list[Any] = [None] * pg.size()
    all_gather_object(gathered, obj, group=pg)
    if pg.group_rank == root:
        object_gather_list[:] = gathered


@on_real_tensors
def broadcast_object_list(object_list: list[Any], src: int | None = None, group: AnyGroup | None = None,
                          device: torch.device | None = None, group_src: int | None = None) -> None:
    """object_list <- `src`'s object_list (a global rank; or group rank `group_src`; neither: the group's first),
    in place, on every rank (lists must have equal lengths). Collective.

    The pickled bytes travel on `device` when given (as in torch), else where the group's transport stages them.
    """
    pg = resolve_group(group, "broadcast_object_list")
    root = collectives.group_root(pg, src, group_src, "broadcast_object_list", "src")
    is_root = pg.group_rank == root
    staging = staging_device(pg, device)
    parts = [_to_tensor(obj, staging) for obj in object_list] if is_root else []
    lengths = torch.tensor([p.numel() for p in parts] if is_root else [0] * len(object_list), dtype=torch.int64,
                           device=staging)
    collectives.broadcast(lengths, group=pg, group_src=root)
    host_lengths = lengths.tolist()
    payload = (torch.cat(parts) if is_root and parts
               else torch.empty(sum(host_lengths), dtype=torch.uint8, device=staging))
    collectives.broadcast(payload, group=pg, group_src=root)
    if not is_root:
        host_payload = payload.cpu()
        offset = 0
        for index, length in enumerate(host_lengths):
            object_list[index] = _from_tensor(host_payload[offset:offset + length], length)
            offset += length


@on_real_tensors
def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: AnyGroup | None = None, group_src: int | None = None) -> None:
    """scatter_object_output_list[0] <- `src`'s scatter_object_input_list[rank] (a global rank; or group rank
    `group_src`; neither: the group's first). Collective."""
    pg = resolve_group(group, "scatter_object_list")
    root = collectives.group_root(pg, src, group_src, "scatter_object_list", "src")
    if not scatter_object_output_list:
        raise ValueError(f"scatter_object_list on rank {pg.global_rank}: the output list needs one entry")
    everything = [scatter_object_input_list] if pg.group_rank == root else [None]
    if pg.group_rank == root and (scatter_object_input_list is None or
                                  len(scatter_object_input_list) != pg.size()):
        raise ValueError(f"scatter_object_list on rank {pg.global_rank}: the source needs an input list of "
                         f"{pg.size()} objects")
    broadcast_object_list(everything, group=pg, group_src=root)
    scatter_object_output_list[0] = everything[0][pg.group_rank]


@on_real_tensors
def send_object_list(object_list: list[Any], dst: int | None = None, group: AnyGroup | None = None,
                     device: torch.device | None = None, group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send `object_list` to rank `dst`, whose recv_object_list takes it into a list of the same length: the
    lengths first, then the pickled bytes (on `device` when given, as in torch). `use_batch` is accepted for
    torch's signature (its batched form of the same two messages)."""
    pg = resolve_group(group, "send_object_list")
    staging = staging_device(pg, device)
    parts = [_to_tensor(obj, staging) for obj in object_list]
    p2p.send(torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=staging), dst, pg,
             group_dst=group_dst)
    p2p.send(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=staging), dst, pg,
             group_dst=group_dst)


@on_real_tensors
def recv_object_list(object_list: list[Any], src: int | None = None, group: AnyGroup | None = None,
                     device: torch.device | None = None, group_src: int | None = None, use_batch: bool = False) -> int:
    """object_list <- the list rank `src` sent with send_object_list (of the same length), in place; returns
    `src`'s global rank. Unpickling runs code the sender chose: use it only between ranks of one job. `use_batch`
    is accepted for torch's signature."""
    pg = resolve_group(group, "recv_object_list")
    staging = staging_device(pg, device)
    lengths = torch.empty(len(object_list), dtype=torch.int64, device=staging)
    sender = p2p.recv(lengths, src, pg, group_src=group_src)
    host_lengths = lengths.tolist()
    payload = torch.empty(sum(host_lengths), dtype=torch.uint8, device=staging)
    p2p.recv(payload, src, pg, group_src=group_src)
    host_payload = payload.cpu()
    offset = 0
    for index, length in enumerate(host_lengths):
        object_list[index] = _from_tensor(host_payload[offset:offset + length], length)
        offset += length
    return sender
