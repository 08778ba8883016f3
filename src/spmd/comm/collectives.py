"""The public collectives, named and behaving as torch.distributed's: validate, resolve group, run.

Layer: comm. Every check happens before anything is sent, and every error names the rank, the op and the
group. In-place results bump the tensor's version counter, so autograd notices a collective that overwrote a
tensor it saved for backward. A collective takes non-contiguous tensors (a transposed or sliced view), reading
and writing the view's own elements: the transport works on a contiguous copy, written back into the view when
the op is done (torch's gloo takes them too, but reduces a column slice's first elements of storage instead);
point-to-point ops refuse them, as gloo's do.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import sys
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from spmd._core.deadline import as_seconds
from spmd._core.errors import CommTimeoutError, StoreTimeoutError
from spmd.comm import traceable
from spmd.comm.debug import dtype_name, user_call_site
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp, check_reduce_op
from spmd.comm.transports.base import OpContext
from spmd.comm.work import Work
from spmd.comm.world import SIMULATED, AnyGroup, resolve_group


def _where(op: str, group: ProcessGroup) -> str:
    return f"{op} on rank {group.global_rank} of {group.description}"


def check_tensor(tensor: object, name: str, op: str, group: ProcessGroup) -> Tensor:
    """A dense tensor on a device the group's transport serves; ValueError otherwise."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{_where(op, group)}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{_where(op, group)}: {name} must be a dense tensor, got layout {tensor.layout}")
    if is_wrapper_subclass(tensor) and not (is_fake(tensor) and not group.transport.moves_data):
        raise TypeError(f"{_where(op, group)}: {name} is a {type(tensor).__name__}, a tensor subclass whose data "
                        f"lives in the tensors it wraps, which no transport can read or write; pass a plain "
                        f"tensor (torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t), and copy results "
                        f"back the same way)")
    devices = group.transport.devices
    if tensor.device.type not in devices:
        raise ValueError(f"{_where(op, group)}: {name} is on {tensor.device}, but the {group.backend} backend "
                         f"moves only {', '.join(devices)} tensors; move it with .to() or use a group whose "
                         f"backend moves {tensor.device.type} tensors")
    return tensor


def check_contiguous(tensor: Tensor, name: str, op: str, group: ProcessGroup) -> None:
    """What the ops that write straight into a caller's tensor (point-to-point) need; ValueError otherwise."""
    if not tensor.is_contiguous():
        raise ValueError(f"{_where(op, group)}: {name} must be contiguous (shape {tuple(tensor.shape)}, "
                         f"stride {tensor.stride()}); pass tensor.contiguous() and copy the result back")


def is_fake(tensor: Tensor) -> bool:
    """A FakeTensor (torch's: shapes without data, under a FakeTensorMode): only a transport that moves no data
    (the fake one) takes it."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and isinstance(tensor, module.FakeTensor)


def is_wrapper_subclass(tensor: Tensor) -> bool:
    """A tensor subclass whose ops run through its own __torch_dispatch__ (a wrapper such as a quantized weight,
    whose data lives in the tensors it holds and whose own data pointer is null): a transport must not read or
    write its memory directly."""
    return type(tensor) is not Tensor and torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python)


def holds_fewer_bytes(tensor: Tensor) -> bool:
    """A compressed tensor: a wrapper subclass whose own tensors (its __tensor_flatten__'s) hold fewer bytes than
    its values (a quantized weight or optimizer state), so a plain copy of its values is not what it holds."""
    if not is_wrapper_subclass(tensor) or not hasattr(tensor, "__tensor_flatten__"):
        return False
    names, _ = tensor.__tensor_flatten__()
    held = sum(inner.numel() * inner.element_size() for inner in (getattr(tensor, name) for name in names)
               if isinstance(inner, Tensor))
    return held < tensor.numel() * tensor.element_size()


def _check_same_device(tensor: Tensor, like: Tensor, name: str, op: str, group: ProcessGroup) -> None:
    """Every tensor of one op lives on one device (the transport moves between ranks, not between devices)."""
    if tensor.device != like.device:
        raise ValueError(f"{_where(op, group)}: {name} is on {tensor.device}, but the op's other tensors are on "
                         f"{like.device}; put every tensor of one op on one device")


def _check_same(tensor: Tensor, like: Tensor, name: str, op: str, group: ProcessGroup,
                numel: int | None = None) -> None:
    if tensor.dtype != like.dtype:
        raise ValueError(f"{_where(op, group)}: {name} has dtype {tensor.dtype}, expected {like.dtype}")
    _check_same_device(tensor, like, name, op, group)
    want = like.numel() if numel is None else numel
    if tensor.numel() != want:
        raise ValueError(f"{_where(op, group)}: {name} has {tensor.numel()} elements (shape "
                         f"{tuple(tensor.shape)}), expected {want}")


def _check_list(tensors: object, name: str, op: str, group: ProcessGroup, like: Tensor,
                sizes_may_differ: bool = False) -> list[Tensor]:
    """A list of a tensor per rank, of `like`'s dtype and device and, unless `sizes_may_differ`, its size (torch's
    all_gather and reduce_scatter take lists of uneven sizes: its NCCL and, for reduce_scatter, its gloo; this
    rank's entry is `like`'s size still)."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != group.size():
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{_where(op, group)}: {name} must be a list of {group.size()} tensors, got {got}")
    for index, tensor in enumerate(tensors):
        check_tensor(tensor, f"{name}[{index}]", op, group)
        own_size = not sizes_may_differ or index == group.group_rank
        _check_same(tensor, like, f"{name}[{index}]", op, group, numel=like.numel() if own_size else tensor.numel())
    return list(tensors)


def _uneven(tensors: list[Tensor]) -> bool:
    return len({t.numel() for t in tensors}) > 1


def group_root(group: ProcessGroup, global_root: int | None, root_in_group: int | None, op: str, role: str) -> int:
    """The group rank of a rooted operation's root, given as a global rank or a group rank (not both; neither:
    the group's first rank)."""
    if global_root is not None and root_in_group is not None:
        raise ValueError(f"{_where(op, group)}: pass {role} or group_{role}, not both")
    if root_in_group is None:
        if global_root is None:
            return 0
        return group.group_rank_of(global_root, f"{_where(op, group)}: {role}")
    if isinstance(root_in_group, bool) or not isinstance(root_in_group, int) or not 0 <= root_in_group < group.size():
        raise ValueError(f"{_where(op, group)}: group_{role}={root_in_group!r} is out of range for a group of "
                         f"{group.size()} ranks (group ranks are 0..{group.size() - 1})")
    return root_in_group


def _flat(tensor: Tensor) -> Tensor:
    """A contiguous tensor as one flat run of reals (a complex tensor as its real pairs): what transports move."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(-1)


def _flat_numel(tensor: Tensor) -> int:
    """The length of `tensor`'s _flat form."""
    return tensor.numel() * (2 if tensor.is_complex() else 1)


def _read(tensor: Tensor) -> Tensor:
    """`tensor`'s elements in order as a flat run (_flat), copied first when it is not contiguous."""
    return _flat(tensor if tensor.is_contiguous() else tensor.contiguous())


def _dense(tensor: Tensor, keep_values: bool = True) -> Tensor:
    """`tensor` itself, or for a non-contiguous one a contiguous stand-in for the transport to work in (with its
    values when `keep_values`); _settle writes it back."""
    if tensor.is_contiguous():
        return tensor
    return tensor.contiguous() if keep_values else torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _settle(tensor: Tensor, dense: Tensor) -> None:
    """The op's result in `dense` (from _dense) into the caller's `tensor`, and autograd told it changed."""
    if dense is not tensor:
        tensor.copy_(dense)
    increment_version(tensor)


def _assign(tensor: Tensor, flat: Tensor) -> None:
    """`flat` (a flat run of `tensor`'s elements, as _flat gives them) into `tensor`, contiguous or not."""
    if tensor.is_contiguous():
        _flat(tensor).copy_(flat)
    elif tensor.is_complex():
        tensor.copy_(torch.view_as_complex(flat.view(*tensor.shape, 2)))
    else:
        tensor.copy_(flat.view(tensor.shape))
    increment_version(tensor)


_op_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar("spmd_op_timeout", default=None)


@contextlib.contextmanager
def op_timeout(seconds: float | None) -> Iterator[None]:
    """Bound the collectives issued inside by `seconds` instead of their group's timeout (None: the group's)."""
    token = _op_timeout.set(seconds)
    try:
        yield
    finally:
        _op_timeout.reset(token)


def _run(group: ProcessGroup, op: str, like: Tensor | None, shape: tuple[int, ...] | None, body,
         outputs: list[Tensor], async_op: bool, reduce_op: ReduceOp | None = None,
         root: int | None = None, timeout: float | None = None) -> Work | None:
    dtype = "" if like is None else dtype_name(like.dtype)
    fingerprint = group.next_fingerprint(op, shape, dtype,
                                         None if reduce_op is None else reduce_op.name, root, user_call_site())
    return group.run(fingerprint, body, outputs, async_op, device=None if like is None else like.device,
                     timeout=timeout if timeout is not None else _op_timeout.get())


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce `tensor` over the group, in place, on every rank."""
    pg = resolve_group(group, "all_reduce")
    if traceable.tracing(tensor, async_op):
        return traceable.all_reduce_into(tensor, op, pg)
    check_tensor(tensor, "tensor", "all_reduce", pg)
    check_reduce_op(op, tensor.dtype, _where("all_reduce", pg))

    def body(ctx: OpContext) -> None:
        dense = _dense(tensor)
        pg.transport.all_reduce(_flat(dense), op, ctx)
        _settle(tensor, dense)

    return _run(pg, "all_reduce", tensor, tuple(tensor.shape), body, [tensor], async_op, reduce_op=op)


def all_reduce_coalesced(tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
                         async_op: bool = False) -> Work | None:
    """Reduce every tensor of `tensors` (one dtype, one device) in place, as one collective over a flat buffer."""
    pg = resolve_group(group, "all_reduce_coalesced")
    inputs = _check_coalesced(tensors, "tensors", "all_reduce_coalesced", pg)
    check_reduce_op(op, inputs[0].dtype, _where("all_reduce_coalesced", pg))

    def body(ctx: OpContext) -> None:
        flat = torch.cat([_read(t) for t in inputs])
        pg.transport.all_reduce(flat, op, ctx)
        for tensor, piece in zip(inputs, flat.split([_flat_numel(t) for t in inputs]), strict=True):
            _assign(tensor, piece)

    shape = (sum(t.numel() for t in inputs),)
    return _run(pg, "all_reduce", inputs[0], shape, body, inputs, async_op, reduce_op=op)


def all_gather_coalesced(output_tensor_lists: list[list[Tensor]], input_tensor_list: list[Tensor],
                         group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    """output_tensor_lists[i][j] <- rank i's input_tensor_list[j], as one all_gather of a flat buffer; inputs
    of one dtype and device, each the same shape on every rank."""
    pg = resolve_group(group, "all_gather_coalesced")
    op = "all_gather_coalesced"
    inputs = _check_coalesced(input_tensor_list, "input_tensor_list", op, pg)
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != pg.size():
        raise ValueError(f"{_where(op, pg)}: output_tensor_lists must hold a list per rank ({pg.size()})")
    outputs = list(output_tensor_lists)
    for rank, row in enumerate(outputs):
        if not isinstance(row, (list, tuple)) or len(row) != len(inputs):
            raise ValueError(f"{_where(op, pg)}: output_tensor_lists[{rank}] must hold {len(inputs)} tensors, "
                             f"one per input")
        for index, (out, like) in enumerate(zip(row, inputs)):
            check_tensor(out, f"output_tensor_lists[{rank}][{index}]", op, pg)
            _check_same(out, like, f"output_tensor_lists[{rank}][{index}]", op, pg)
    sizes = [t.numel() for t in inputs]

    def body(ctx: OpContext) -> None:
        flat = torch.cat([_read(t) for t in inputs])
        gathered = flat.new_empty(pg.size() * flat.numel())
        pg.transport.all_gather(gathered, flat, ctx)
        for row, block in zip(outputs, gathered.view(pg.size(), -1), strict=True):
            for out, piece in zip(row, block.split([_flat_numel(t) for t in inputs]), strict=True):
                _assign(out, piece)

    flat_outputs = [out for row in outputs for out in row]
    return _run(pg, "all_gather", inputs[0], (sum(sizes),), body, flat_outputs, async_op)


def _check_coalesced(tensors: object, name: str, op: str, group: ProcessGroup) -> list[Tensor]:
    """A coalesced op's non-empty list of tensors of one dtype and device."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{_where(op, group)}: {name} must be a non-empty list of tensors")
    for index, tensor in enumerate(tensors):
        check_tensor(tensor, f"{name}[{index}]", op, group)
        _check_same(tensor, tensors[0], f"{name}[{index}]", op, group, numel=tensor.numel())
    return list(tensors)


def broadcast(tensor: Tensor, src: int | None = None, group: AnyGroup | None = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy `src`'s tensor into `tensor` on every rank."""
    pg = resolve_group(group, "broadcast")
    root = group_root(pg, src, group_src, "broadcast", "src")
    if traceable.tracing(tensor, async_op):
        return traceable.broadcast_into(tensor, root, pg)
    check_tensor(tensor, "tensor", "broadcast", pg)

    def body(ctx: OpContext) -> None:
        dense = _dense(tensor, keep_values=pg.group_rank == root)
        pg.transport.broadcast(_flat(dense), root, ctx)
        _settle(tensor, dense)

    return _run(pg, "broadcast", tensor, tuple(tensor.shape), body, [tensor], async_op, root=root)


def broadcast_coalesced(tensors: list[Tensor], group: AnyGroup | None = None, group_src: int = 0,
                        bucket_bytes: int | None = None) -> None:
    """Overwrite `tensors` (any dtypes and devices) with group rank `group_src`'s: one broadcast per flat bucket of
    one dtype and device, of at most `bucket_bytes` (None: one bucket per dtype and device; a larger tensor goes
    alone). Every rank passes tensors of the same shapes in the same order (torch's `_broadcast_coalesced`, which
    DDP's and replicate's start and `utils._sync_module_states` use). Collective."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}      # bytes in each kind's last bucket
    for tensor in tensors:
        kind = (tensor.dtype, tensor.device)
        buckets = by_kind.setdefault(kind, [[]])
        nbytes = tensor.numel() * tensor.element_size()
        if bucket_bytes is not None and buckets[-1] and filled[kind] + nbytes > bucket_bytes:
            buckets.append([])
            filled[kind] = 0
        buckets[-1].append(tensor)
        filled[kind] = filled.get(kind, 0) + nbytes
    with torch.no_grad():
        for bucket in (bucket for buckets in by_kind.values() for bucket in buckets):
            flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
            broadcast(flat, group=group, group_src=group_src)
            for tensor, values in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(values.view_as(tensor))


def reduce(tensor: Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce `tensor` over the group into `dst`'s tensor; other ranks' tensors are left unchanged."""
    pg = resolve_group(group, "reduce")
    check_tensor(tensor, "tensor", "reduce", pg)
    check_reduce_op(op, tensor.dtype, _where("reduce", pg))
    root = group_root(pg, dst, group_dst, "reduce", "dst")

    def body(ctx: OpContext) -> None:
        dense = _dense(tensor)
        pg.transport.reduce(_flat(dense), root, op, ctx)
        if pg.group_rank == root:
            _settle(tensor, dense)

    return _run(pg, "reduce", tensor, tuple(tensor.shape), body, [tensor], async_op, reduce_op=op, root=root)


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor, group: AnyGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """output_tensor <- every rank's input, concatenated in rank order along dim 0."""
    pg = resolve_group(group, "all_gather_into_tensor")
    if traceable.tracing(input_tensor, async_op):
        return traceable.all_gather_into(output_tensor, input_tensor, pg)
    op = "all_gather_into_tensor"
    check_tensor(input_tensor, "input_tensor", op, pg)
    check_tensor(output_tensor, "output_tensor", op, pg)
    _check_same(output_tensor, input_tensor, "output_tensor", op, pg, numel=input_tensor.numel() * pg.size())

    def body(ctx: OpContext) -> None:
        dense = _dense(output_tensor, keep_values=False)
        pg.transport.all_gather(_flat(dense), _read(input_tensor), ctx)
        _settle(output_tensor, dense)

    return _run(pg, "all_gather", input_tensor, tuple(input_tensor.shape), body, [output_tensor], async_op)


all_gather_single = all_gather_into_tensor     # torch 2.13's name for it (torch deprecates the older one)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group: AnyGroup | None = None,
               async_op: bool = False) -> Work | None:
    """tensor_list[i] <- rank i's tensor, on every rank."""
    pg = resolve_group(group, "all_gather")
    if traceable.tracing(tensor, async_op):
        return traceable.all_gather_list_into(tensor_list, tensor, pg)
    check_tensor(tensor, "tensor", "all_gather", pg)
    outputs = _check_list(tensor_list, "tensor_list", "all_gather", pg, tensor, sizes_may_differ=True)
    if _uneven(outputs):
        return _all_gather_uneven(outputs, tensor, pg, async_op)

    def body(ctx: OpContext) -> None:
        gathered = torch.empty(pg.size(), *tensor.shape, dtype=tensor.dtype, device=tensor.device)
        pg.transport.all_gather(_flat(gathered), _read(tensor), ctx)
        for out, block in zip(outputs, gathered, strict=True):
            out.copy_(block)
            increment_version(out)

    return _run(pg, "all_gather", tensor, tuple(tensor.shape), body, outputs, async_op)


# Note: uneven list collectives
# all_gather into a list of uneven sizes, and reduce_scatter of one (TorchRec's pooled embeddings over ranks with
# different batch sizes), run as the even collective over pieces padded to the largest: every rank knows every
# size from its list, so every rank pads alike and the ranks' fingerprints carry the padded size; each piece is
# read back without its padding. The padding costs (largest - own) elements a rank on the wire.

def _all_gather_uneven(outputs: list[Tensor], tensor: Tensor, pg: ProcessGroup, async_op: bool) -> Work | None:
    """all_gather into `outputs` of uneven sizes (see Note: uneven list collectives)."""
    width = max(_flat_numel(t) for t in outputs)

    def body(ctx: OpContext) -> None:
        mine = _read(tensor)
        padded = mine.new_zeros(width)
        padded[:mine.numel()] = mine
        gathered = padded.new_empty(pg.size() * width)
        pg.transport.all_gather(gathered, padded, ctx)
        for out, block in zip(outputs, gathered.view(pg.size(), width), strict=True):
            _assign(out, block[:_flat_numel(out)])

    return _run(pg, "all_gather", tensor, (width,), body, outputs, async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    """output <- reduce over ranks of block `rank` of input (input = group_size equal blocks along dim 0)."""
    pg = resolve_group(group, "reduce_scatter_tensor")
    if traceable.tracing(input, async_op):
        return traceable.reduce_scatter_into(output, input, op, pg)
    name = "reduce_scatter_tensor"
    check_tensor(input, "input", name, pg)
    check_tensor(output, "output", name, pg)
    check_reduce_op(op, input.dtype, _where(name, pg))
    _check_same(input, output, "input", name, pg, numel=output.numel() * pg.size())

    def body(ctx: OpContext) -> None:
        dense = _dense(output, keep_values=False)
        pg.transport.reduce_scatter(_flat(dense), _read(input), op, ctx)
        _settle(output, dense)

    return _run(pg, "reduce_scatter", output, tuple(output.shape), body, [output], async_op, reduce_op=op)


reduce_scatter_single = reduce_scatter_tensor  # torch 2.13's name for it (torch deprecates the older one)


def reduce_scatter(output: Tensor, input_list: list[Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    """output <- reduce over ranks of input_list[rank]."""
    pg = resolve_group(group, "reduce_scatter")
    check_tensor(output, "output", "reduce_scatter", pg)
    check_reduce_op(op, output.dtype, _where("reduce_scatter", pg))
    inputs = _check_list(input_list, "input_list", "reduce_scatter", pg, output, sizes_may_differ=True)
    if _uneven(inputs):
        return _reduce_scatter_uneven(output, inputs, op, pg, async_op)

    def body(ctx: OpContext) -> None:
        dense = _dense(output, keep_values=False)
        flat_input = torch.cat([_read(t) for t in inputs])
        pg.transport.reduce_scatter(_flat(dense), flat_input, op, ctx)
        _settle(output, dense)

    return _run(pg, "reduce_scatter", output, tuple(output.shape), body, [output], async_op, reduce_op=op)


def _reduce_scatter_uneven(output: Tensor, inputs: list[Tensor], op: ReduceOp, pg: ProcessGroup,
                           async_op: bool) -> Work | None:
    """reduce_scatter of `inputs` of uneven sizes (see Note: uneven list collectives)."""
    width = max(_flat_numel(t) for t in inputs)

    def body(ctx: OpContext) -> None:
        padded = _read(inputs[0]).new_zeros(pg.size(), width)
        for row, piece in zip(padded, inputs, strict=True):
            row[:_flat_numel(piece)] = _read(piece)
        reduced = padded.new_empty(width)
        pg.transport.reduce_scatter(reduced, padded.view(-1), op, ctx)
        _assign(output, reduced[:_flat_numel(output)])

    return _run(pg, "reduce_scatter", output, (width,), body, [output], async_op, reduce_op=op)


def gather(tensor: Tensor, gather_list: list[Tensor] | None = None, dst: int | None = None,
           group: AnyGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """On `dst`, gather_list[i] <- rank i's tensor; other ranks pass gather_list=None."""
    pg = resolve_group(group, "gather")
    check_tensor(tensor, "tensor", "gather", pg)
    root = group_root(pg, dst, group_dst, "gather", "dst")
    is_root = pg.group_rank == root
    if is_root:
        outputs = _check_list(gather_list, "gather_list", "gather", pg, tensor)
    elif gather_list:
        raise ValueError(f"{_where('gather', pg)}: gather_list must be None or empty off the destination rank")
    else:
        outputs = []

    def body(ctx: OpContext) -> None:
        gathered = torch.empty(pg.size(), *tensor.shape, dtype=tensor.dtype, device=tensor.device) if is_root else None
        pg.transport.gather(None if gathered is None else _flat(gathered), _read(tensor), root, ctx)
        if gathered is not None:
            for out, block in zip(outputs, gathered, strict=True):
                out.copy_(block)
                increment_version(out)

    return _run(pg, "gather", tensor, tuple(tensor.shape), body, outputs, async_op, root=root)


def scatter(tensor: Tensor, scatter_list: list[Tensor] | None = None, src: int | None = None,
            group: AnyGroup | None = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    """tensor <- `src`'s scatter_list[rank]; other ranks pass scatter_list=None."""
    pg = resolve_group(group, "scatter")
    check_tensor(tensor, "tensor", "scatter", pg)
    root = group_root(pg, src, group_src, "scatter", "src")
    is_root = pg.group_rank == root
    if is_root:
        inputs = _check_list(scatter_list, "scatter_list", "scatter", pg, tensor)
    elif scatter_list:
        raise ValueError(f"{_where('scatter', pg)}: scatter_list must be None or empty off the source rank")
    else:
        inputs = []

    def body(ctx: OpContext) -> None:
        flat_input = torch.cat([_read(t) for t in inputs]) if is_root else None
        dense = _dense(tensor, keep_values=False)
        pg.transport.scatter(_flat(dense), flat_input, root, ctx)
        _settle(tensor, dense)

    return _run(pg, "scatter", tensor, tuple(tensor.shape), body, [tensor], async_op, root=root)


def _splits(sizes: list[int] | None, tensor: Tensor, name: str, op: str, group: ProcessGroup) -> list[int]:
    """Split sizes along dim 0 converted to element counts (equal splits when `sizes` is None)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_numel = tensor.numel() // rows if rows else 0
    if sizes is None or len(sizes) == 0:
        if rows % group.size():
            raise ValueError(f"{_where(op, group)}: {name} dim 0 ({rows}) does not divide into {group.size()} "
                             f"equal splits; pass split sizes")
        return [rows // group.size() * row_numel] * group.size()
    sizes = [int(s) for s in sizes]
    if len(sizes) != group.size() or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"{_where(op, group)}: {name} split sizes {sizes} must be {group.size()} non-negative "
                         f"numbers summing to dim 0 of the tensor ({rows})")
    return [s * row_numel for s in sizes]


def all_to_all_single(output: Tensor, input: Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: AnyGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """Rank j's output block i <- rank i's input block j; blocks along dim 0, sizes as given (or equal)."""
    pg = resolve_group(group, "all_to_all_single")
    if traceable.tracing(input, async_op):
        return traceable.all_to_all_into(output, input, output_split_sizes, input_split_sizes, pg)
    name = "all_to_all_single"
    check_tensor(input, "input", name, pg)
    check_tensor(output, "output", name, pg)
    if output.dtype != input.dtype:
        raise ValueError(f"{_where(name, pg)}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    _check_same_device(output, input, "output", name, pg)
    in_splits = _splits(input_split_sizes, input, "input", name, pg)
    out_splits = _splits(output_split_sizes, output, "output", name, pg)

    def body(ctx: OpContext) -> None:
        dense = _dense(output, keep_values=False)
        pg.transport.all_to_all(_flat(dense), _read(input), out_splits, in_splits, ctx)
        _settle(output, dense)

    return _run(pg, "all_to_all", input, None, body, [output], async_op)


def all_to_all(output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], group: AnyGroup | None = None,
               async_op: bool = False) -> Work | None:
    """output_tensor_list[i] on rank j <- input_tensor_list[j] on rank i (sizes may differ per pair)."""
    pg = resolve_group(group, "all_to_all")
    for name, tensors in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != pg.size():
            raise ValueError(f"{_where('all_to_all', pg)}: {name} must be a list of {pg.size()} tensors")
        for index, tensor in enumerate(tensors):
            check_tensor(tensor, f"{name}[{index}]", "all_to_all", pg)
            if tensor.dtype != input_tensor_list[0].dtype:
                raise ValueError(f"{_where('all_to_all', pg)}: {name}[{index}] has dtype {tensor.dtype}, "
                                 f"expected {input_tensor_list[0].dtype}")
            _check_same_device(tensor, input_tensor_list[0], f"{name}[{index}]", "all_to_all", pg)
    like = input_tensor_list[0]

    def body(ctx: OpContext) -> None:
        flat_in = torch.cat([_read(t) for t in input_tensor_list])
        out_sizes = [_flat_numel(t) for t in output_tensor_list]
        flat_out = torch.empty(sum(out_sizes), dtype=flat_in.dtype, device=flat_in.device)
        pg.transport.all_to_all(flat_out, flat_in, out_sizes,
                                [_flat_numel(t) for t in input_tensor_list], ctx)
        for out, piece in zip(output_tensor_list, flat_out.split(out_sizes), strict=True):
            _assign(out, piece)

    return _run(pg, "all_to_all", like, None, body, list(output_tensor_list), async_op)


def barrier(group: AnyGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None,
            timeout: float | datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of the group has entered the barrier; `timeout` (torch's) bounds it instead of the
    group's timeout, with the same error naming the ranks that did not arrive.

    `device_ids` is accepted for torch.distributed compatibility (a list of ints, as torch checks) and ignored:
    torch's NCCL barrier all-reduces a tensor on that device, but spmd's barrier moves no tensor.
    """
    pg = resolve_group(group, "barrier")
    if device_ids is not None and not isinstance(device_ids, list):
        raise TypeError(f"{_where('barrier', pg)}: device_ids must be a list of ints, got "
                        f"{type(device_ids).__name__}")

    def body(ctx: OpContext) -> None:
        pg.transport.barrier(ctx)

    seconds = None if timeout is None else as_seconds(timeout, pg.timeout, f"{_where('barrier', pg)}: timeout")
    return _run(pg, "barrier", None, None, body, [], async_op, timeout=seconds)


def monitored_barrier(group: AnyGroup | None = None, timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier through the store that names the ranks that did not arrive within `timeout`.

    Collective. The group's first rank waits for each other rank's arrival key; it raises naming the
    first missing rank (or all of them with `wait_all_ranks`), and tells the others, which raise too. When all
    arrived it returns only once each has read the verdict: the first rank may host the store, and leaving
    right after (destroy_process_group, exit) would cut off a rank still reading it.
    """
    pg = resolve_group(group, "monitored_barrier")
    if pg.transport.name == SIMULATED:         # its other ranks are simulated, and always arrive
        barrier(group)
        return
    seconds = as_seconds(timeout, pg.timeout)
    seq = pg.next_fingerprint("monitored_barrier", (), "none").seq
    prefix = f"monitored_barrier/{seq}"
    if pg.group_rank != 0:
        pg.store.set(f"{prefix}/arrived/{pg.global_rank}", b"1")
        # The first rank publishes its verdict only once `seconds` have passed for a missing rank, so wait
        # a grace period longer: the verdict then names the missing rank instead of blaming the first one.
        grace = max(1.0, 0.5 * seconds)
        try:
            pg.store.wait([f"{prefix}/verdict"], timeout=seconds + grace)
        except StoreTimeoutError:
            raise CommTimeoutError(f"{_where('monitored_barrier', pg)}: rank {pg.ranks[0]} did not release the "
                                   f"barrier within {seconds + grace:.1f}s") from None
        verdict = pg.store.get(f"{prefix}/verdict").decode()
        pg.store.set(f"{prefix}/read/{pg.global_rank}", b"1")
        if verdict != "ok":
            raise CommTimeoutError(f"{_where('monitored_barrier', pg)}: {verdict}")
        return
    missing: list[int] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
    for rank in pg.ranks[1:]:
        remaining = max(0.0, (deadline - datetime.datetime.now()).total_seconds())
        try:
            pg.store.wait([f"{prefix}/arrived/{rank}"], timeout=remaining if not missing else 0.0)
        except StoreTimeoutError:
            missing.append(rank)
            if not wait_all_ranks:
                break
    verdict = "ok" if not missing else (
        f"ranks {missing} did not reach monitored_barrier #{seq} within {seconds:.1f}s")
    pg.store.set(f"{prefix}/verdict", verdict)
    if missing:
        raise CommTimeoutError(f"{_where('monitored_barrier', pg)}: {verdict}")
    try:
        pg.store.wait([f"{prefix}/read/{rank}" for rank in pg.ranks[1:]], timeout=seconds)
    except StoreTimeoutError:
        pass           # a rank that died after arriving: the barrier itself held
