"""ReduceOp and the one local reduction kernel every transport uses (`reduce_into`, with AVG finishing).

Layer: comm. The kernel writes into a caller's buffer with torch's vectorized out= ops, so a transport
reduces in place or straight into shared memory without extra copies; nothing here communicates.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class ReduceOp(enum.Enum):
    """How a collective combines the ranks' values (the names of torch's ReduceOp)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


class _DeprecatedReduceOp:
    """torch's long-deprecated `reduce_op`: ReduceOp's members, each read warning as torch's does (older tutorials
    still write `dist.reduce_op.SUM`)."""

    def __getattr__(self, name: str) -> ReduceOp:
        if name not in ReduceOp.__members__:
            raise AttributeError(f"reduce_op has no member {name!r}; the members are {list(ReduceOp.__members__)}")
        warnings.warn("spmd.reduce_op is deprecated, as torch's reduce_op is; use spmd.ReduceOp",
                      FutureWarning, stacklevel=2)
        return ReduceOp[name]


reduce_op = _DeprecatedReduceOp()

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def supports_complex(reduceOp: ReduceOp) -> bool:
    """Whether `reduceOp` is defined for complex tensors (SUM and AVG, as in torch)."""
    return reduceOp in (ReduceOp.SUM, ReduceOp.AVG)
# Dtypes the kernel reduces: torch's CPU kernels take these, but for uint16 and uint32, which it reduces
# widened (see _WIDENED). Complex tensors reduce as pairs of their real dtype (SUM and AVG only).
_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                        torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.bool,
                        torch.complex32, torch.complex64, torch.complex128})
_WIDENED = {torch.uint16: torch.int32, torch.uint32: torch.int64}   # exact: the result is cast back, wrapping


def check_reduce_op(op: ReduceOp, dtype: torch.dtype, op_name: str) -> None:
    """Raise ValueError before any communication when spmd can't reduce `dtype` with `op` exactly.

    The pairs refused are those torch's gloo refuses (bitwise ops on floats, anything but SUM and AVG on complex),
    AVG on bool, and dtypes no kernel reduces (uint64, float8); `op_name` says which op on which rank. AVG on
    integers is the sum divided and truncated toward zero (NCCL averages integers too; gloo refuses them, and
    Lightning sends one for an integer count on any backend not named "gloo").
    """
    if not isinstance(op, ReduceOp):
        raise ValueError(f"{op_name}: op must be a spmd.ReduceOp (e.g. spmd.ReduceOp.SUM), got {op!r}")
    if dtype not in _REDUCIBLE:
        raise ValueError(f"{op_name}: spmd can't reduce {dtype} tensors with {op!r} or any op (no reduction "
                         f"kernel for that dtype); "
                         f"reduce a copy in a dtype it can (e.g. .to(torch.float32) or .to(torch.int64)) and "
                         f"cast the result back")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{op_name}: {op!r} needs an integer or bool tensor, got {dtype}; use SUM, MIN or MAX, "
                         f"or reduce an integer view of the bits (tensor.view(torch.int32)) if bits are meant")
    if dtype.is_complex and op not in (ReduceOp.SUM, ReduceOp.AVG):
        # complex tensors travel as pairs of reals: only sums (and averages) of pairs are sums of complexes
        raise ValueError(f"{op_name}: {op!r} is not defined for complex tensors ({dtype}), as in torch; only "
                         f"SUM and AVG are. Reduce torch.view_as_real(tensor) for a per-component {op.name}, "
                         f"or tensor.abs() for one of magnitudes")
    if op is ReduceOp.AVG and dtype is torch.bool:
        raise ValueError(f"{op_name}: ReduceOp.AVG of a {dtype} tensor has no bool result; reduce it as an integer "
                         f"(tensor.to(torch.int32)) or use SUM (logical or)")


_KERNELS: dict[ReduceOp, Callable[..., Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum, ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor,
}
_BOOL_KERNELS: dict[ReduceOp, Callable[..., Tensor]] = {ReduceOp.SUM: torch.logical_or,
                                                        ReduceOp.PRODUCT: torch.logical_and}


def reduce_into(dst: Tensor, sources: Sequence[Tensor], op: ReduceOp) -> Tensor:
    """dst <- op over `sources` (at least one), combined left to right; returns dst.

    Every rank that reduces the same sources in the same order gets the same bits. AVG is the sum divided
    once by len(sources); bool SUM and PRODUCT are logical or and and (as in gloo); uint16 and uint32 reduce
    widened and wrap back. dst may be sources[0] or sources[1] itself (reduction in place: both are read
    before dst is written) but must not overlap any other source.
    A reduction made of several calls (pairwise steps, or partial results from several groups) reduces with
    `partial_op(op)` and ends with `finish_average`.
    """
    if len(sources) == 1:
        if sources[0] is not dst:
            dst.copy_(sources[0])
        return dst
    wide = _WIDENED.get(dst.dtype)
    if wide is not None:          # torch has no CPU add, minimum or maximum for these dtypes
        return dst.copy_(reduce_into(torch.empty(dst.shape, dtype=wide, device=dst.device),
                                     [source.to(wide) for source in sources], op))
    kernel = _BOOL_KERNELS.get(op, _KERNELS[op]) if dst.dtype is torch.bool else _KERNELS[op]
    kernel(sources[0], sources[1], out=dst)
    for source in sources[2:]:
        kernel(dst, source, out=dst)
    if op is ReduceOp.AVG:
        _divide(dst, len(sources))
    return dst


def partial_op(op: ReduceOp) -> ReduceOp:
    """The op that combines part of a reduction's operands: SUM for AVG (see `finish_average`), else `op`."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def finish_average(tensor: Tensor, op: ReduceOp, count: int) -> None:
    """End a reduction of `count` operands made with `partial_op(op)`: AVG divides the sum once by `count`."""
    if op is ReduceOp.AVG and count > 1:
        _divide(tensor, count)


def _divide(tensor: Tensor, count: int) -> None:
    """tensor /= count in place: rounded in a float dtype, truncated toward zero in an integer one."""
    wide = _WIDENED.get(tensor.dtype)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(count)
    elif wide is not None:        # torch has no CPU division for these dtypes
        tensor.copy_(torch.div(tensor.to(wide), count, rounding_mode="trunc"))
    else:
        tensor.div_(count, rounding_mode="trunc")
