"""ReduceOp and the local reduction kernels every transport uses to combine two buffers.

Layer: comm. Kernels work in place on contiguous tensors with torch's vectorized ops; nothing here
communicates. AVG is reduced as SUM and divided once at the end (see `finish_average`).
"""

from __future__ import annotations

import enum

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


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_reduce_op(op: ReduceOp, dtype: torch.dtype, op_name: str) -> None:
    """Raise ValueError before any communication when `op` can't reduce `dtype`."""
    if not isinstance(op, ReduceOp):
        raise ValueError(f"{op_name}: op must be a spmd.ReduceOp, got {op!r}")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{op_name}: {op!r} needs an integer or bool tensor, got {dtype}")
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{op_name}: ReduceOp.AVG needs a floating-point tensor, got {dtype}; use SUM and divide")


def combine_(acc: Tensor, other: Tensor, op: ReduceOp) -> Tensor:
    """acc <- op(acc, other), in place; AVG accumulates as SUM."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        if acc.dtype is torch.bool:
            return acc.logical_or_(other)
        return acc.add_(other)
    if op is ReduceOp.PRODUCT:
        if acc.dtype is torch.bool:
            return acc.logical_and_(other)
        return acc.mul_(other)
    if op is ReduceOp.MIN:
        return torch.minimum(acc, other, out=acc)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    if op is ReduceOp.BAND:
        return acc.bitwise_and_(other)
    if op is ReduceOp.BOR:
        return acc.bitwise_or_(other)
    return acc.bitwise_xor_(other)


def finish_average(tensor: Tensor, op: ReduceOp, group_size: int) -> None:
    """Turn a SUM-reduced buffer into the AVG the caller asked for (no-op for other ops)."""
    if op is ReduceOp.AVG and group_size > 1:
        tensor.div_(group_size)
