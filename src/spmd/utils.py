"""torch's `distributed.utils` helpers, which FSDP- and DDP-adjacent code imports: apply a function to the
tensors of nested inputs, move or cast forward inputs, pack keyword arguments, free and re-grow a tensor's
storage, make every rank's module state rank `src`'s, check that every rank holds the same parameter shapes.

Layer: comm (may import _core and comm); collective only where a helper syncs or verifies across a group.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from collections.abc import Callable, Container
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from spmd.comm.collectives import broadcast_coalesced
from spmd.comm.objects import all_gather_object
from spmd.comm.world import AnyGroup, resolve_group


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_asdict") and hasattr(value, "_fields")


def _apply_to_tensors(fn: Callable[[Tensor], Any], container: Any) -> Any:
    """`container` with `fn` applied to every tensor in it, through dataclasses, (ordered) dicts, named tuples,
    lists, tuples and sets (a PackedSequence's data is visited, the sequence returned as it is)."""

    def apply(value: Any) -> Any:
        if isinstance(value, Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: apply(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        if isinstance(value, PackedSequence):
            apply(value.data)
            return value
        if isinstance(value, collections.OrderedDict):
            return value.__class__((key, apply(item)) for key, item in value.items())
        if isinstance(value, dict):
            return {key: apply(item) for key, item in value.items()}
        if _is_namedtuple(value):
            return type(value)(*(apply(item) for item in value))
        if isinstance(value, (list, tuple, set)):
            return type(value)(apply(item) for item in value)
        return value

    return apply(container)


def _pack_kwargs(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """(positional arguments then keyword values, the keywords): a call's arguments as one flat tuple."""
    return (*args, *kwargs.values()), tuple(kwargs)


def _unpack_kwargs(flat_args: tuple[Any, ...], kwarg_keys: tuple[str, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inverse of _pack_kwargs."""
    if len(kwarg_keys) > len(flat_args):
        raise AssertionError(f"too many keys {len(kwarg_keys)} vs. {len(flat_args)}")
    if not kwarg_keys:
        return flat_args, {}
    return flat_args[: -len(kwarg_keys)], dict(zip(kwarg_keys, flat_args[-len(kwarg_keys):], strict=True))


def _cast_forward_inputs(dtype: torch.dtype | None, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """(args, kwargs) with their floating-point tensors cast to `dtype` (None: as they are)."""
    if dtype is None:
        return args, kwargs

    def cast(tensor: Tensor) -> Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) and tensor.dtype != dtype else tensor

    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


def _recursive_to(inputs: Any, target_device: torch.device, use_side_stream_for_tensor_copies: bool) -> list[Any]:
    """[`inputs` with every tensor (and PackedSequence) on `target_device`], in torch's one-device-per-entry list
    form. The copies are made on the current stream (`use_side_stream_for_tensor_copies` is accepted: a copy
    on the caller's stream needs no hand-over)."""

    def move(value: Any) -> Any:
        if isinstance(value, (Tensor, PackedSequence)):
            return value.to(target_device)
        if _is_namedtuple(value):
            return type(value)(*(move(item) for item in value))
        if isinstance(value, (tuple, list)) and value:
            return type(value)(move(item) for item in value)
        if isinstance(value, dict) and value:
            return type(value)((key, move(item)) for key, item in value.items())
        return value

    return [move(inputs)]


def _to_kwargs(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, target_device: torch.device,
               use_side_stream_for_tensor_copies: bool) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """((inputs moved,), (kwargs moved,)): a forward's arguments on `target_device`, as DDP's forward takes them."""
    moved_inputs = _recursive_to(inputs, target_device, use_side_stream_for_tensor_copies) if inputs else []
    moved_kwargs = _recursive_to(kwargs, target_device, use_side_stream_for_tensor_copies) if kwargs else []
    if len(moved_inputs) < len(moved_kwargs):
        moved_inputs.extend([() for _ in range(len(moved_kwargs) - len(moved_inputs))])
    elif len(moved_kwargs) < len(moved_inputs):
        moved_kwargs.extend([{} for _ in range(len(moved_inputs) - len(moved_kwargs))])
    return tuple(moved_inputs), tuple(moved_kwargs)


def _p_assert(cond: Any, s: str, raise_assertion_error: bool = True) -> None:
    """An assert that also prints `s` and the stack (an AssertionError raised in backward can go unseen)."""
    if not cond:
        print(s)
        traceback.print_stack()
        if raise_assertion_error:
            raise AssertionError(s)


def _alloc_storage(tensor: Tensor, size: torch.Size) -> None:
    """Give `tensor`'s storage room for `size` elements again, after _free_storage (no-op when it has it)."""
    with torch.no_grad():
        storage = tensor.untyped_storage()
        nbytes = size.numel() * tensor.element_size()
        if storage.nbytes() != nbytes:
            _p_assert(storage.nbytes() == 0, f"Tensor storage should have been resized to be 0 but got "
                                             f"{storage.nbytes()} bytes")
            storage.resize_(nbytes)


def _free_storage(tensor: Tensor) -> None:
    """Release `tensor`'s memory in place (the tensor and its views stay, holding nothing until _alloc_storage);
    only for a tensor that starts its storage."""
    with torch.no_grad():
        storage = tensor.untyped_storage()
        if storage.nbytes():
            _p_assert(tensor.storage_offset() == 0, f"Freeing a tensor's storage is unsafe when it is not the sole "
                                                    f"occupant (storage offset {tensor.storage_offset()}, shape "
                                                    f"{tuple(tensor.shape)})")
            storage.resize_(0)


def _data_ptr_allocated(tensor: Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() > 0


def _verify_param_shape_across_processes(process_group: AnyGroup | None, tensors: list[Tensor],
                                         logger: Any = None) -> None:
    """Raise on every rank, naming the ranks and the first difference, unless every rank of the group holds
    `tensors` of the same count, shapes and dtypes (DDP's construction check). Collective."""
    group = resolve_group(process_group, "_verify_param_shape_across_processes")
    mine = [(tuple(tensor.shape), str(tensor.dtype)) for tensor in tensors]
    theirs: list[Any] = [None] * group.size()
    all_gather_object(theirs, mine, group=group)
    for rank, other in enumerate(theirs):
        if other == theirs[0]:
            continue
        if len(other) != len(theirs[0]):
            raise RuntimeError(f"the same model is expected on every rank, but rank {rank} has {len(other)} "
                               f"parameters and rank 0 has {len(theirs[0])}")
        index = next(i for i, (a, b) in enumerate(zip(other, theirs[0], strict=True)) if a != b)
        raise RuntimeError(f"the same model is expected on every rank, but parameter {index} is "
                           f"{other[index][1]} {list(other[index][0])} on rank {rank} and {theirs[0][index][1]} "
                           f"{list(theirs[0][index][0])} on rank 0")


def _sync_params_and_buffers(process_group: AnyGroup | None, module_states: list[Tensor],
                             broadcast_bucket_size: int, src: int) -> None:
    """Overwrite `module_states` with group rank `src`'s, broadcast in flat buckets of at most
    `broadcast_bucket_size` bytes per dtype and device (a tensor larger than that goes alone). Collective."""
    broadcast_coalesced(module_states, group=resolve_group(process_group, "_sync_params_and_buffers"), group_src=src,
                        bucket_bytes=broadcast_bucket_size)


def _sync_module_states(module: nn.Module, process_group: AnyGroup | None, broadcast_bucket_size: int, src: int,
                        params_and_buffers_to_ignore: Container[str], broadcast_buffers: bool = True) -> None:
    """Make `module`'s parameters (and, with `broadcast_buffers`, buffers) group rank `src`'s, leaving those named
    in `params_and_buffers_to_ignore`. Collective."""
    states = [param.detach() for name, param in module.named_parameters() if name not in params_and_buffers_to_ignore]
    if broadcast_buffers:
        states += [buffer.detach() for name, buffer in module.named_buffers()
                   if name not in params_and_buffers_to_ignore]
    if states:
        _sync_params_and_buffers(process_group, states, broadcast_bucket_size, src)


def _replace_by_prefix(state_dict: dict[str, Any], old_prefix: str, new_prefix: str) -> None:
    """Rename, in place, every key of `state_dict` that starts with `old_prefix` to start with `new_prefix`."""
    if old_prefix == new_prefix:
        raise ValueError("old_prefix and new_prefix must be distinct")
    for key in [key for key in state_dict if key.startswith(old_prefix)]:
        state_dict[new_prefix + key[len(old_prefix):]] = state_dict.pop(key)


def _get_root_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules of `modules` that are not inside another of them."""
    inside = {module: set(module.modules()) for module in modules}
    return [candidate for candidate in modules
            if not any(candidate is not module and candidate in subs for module, subs in inside.items())]
