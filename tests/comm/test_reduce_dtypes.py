"""Every ReduceOp x dtype on every reducing collective and transport: the result equals a one-process reference
computed with torch ops, or the call raises (naming rank, op and dtype) before anything is sent.

The table: SUM, MIN, MAX, PRODUCT reduce every real dtype (bool SUM/PRODUCT/MIN/MAX are or/and/and/or, as in
gloo); AVG takes every dtype but bool; BAND/BOR/BXOR need integers or bool; complex reduces with SUM and AVG only
(as torch refuses the rest: complex travels as pairs of reals); uint64 and float8 don't reduce at all. gloo is
the oracle where it defines a pair: test_gloo_agrees_with_the_table runs torch's own gloo on the same table. AVG on
integers, which gloo refuses, is the sum divided and truncated toward zero.
After every refused call the ranks go on to the next collective, whose result is checked too: a refused call
that had sent anything would desynchronise them (tcp and shm check each op's fingerprint in-band).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

import spmd
from spmd import ReduceOp
from spmd.comm import functional
from spmd.comm.world import resolve_group
from spmd.testing import run_ranks
from tests.procpool import ProcPool

GLOO_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool, torch.complex64, torch.complex128]
DTYPES = [*GLOO_DTYPES, torch.int16, torch.uint16, torch.uint32, torch.complex32, torch.uint64,
          torch.float8_e4m3fn]
OPS = list(ReduceOp)
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def refused(op: ReduceOp, dtype: torch.dtype) -> bool:
    """The table: whether spmd refuses to reduce `dtype` with `op`."""
    if dtype in (torch.uint64, torch.float8_e4m3fn):
        return True
    if dtype.is_complex:
        return op not in (ReduceOp.SUM, ReduceOp.AVG)
    if dtype.is_floating_point:
        return op in BITWISE
    return op is ReduceOp.AVG and dtype is torch.bool


def gloo_refuses(op: ReduceOp, dtype: torch.dtype) -> bool:
    """What torch's gloo refuses: the table's refusals, and AVG on integers (spmd's truncates toward zero)."""
    return refused(op, dtype) or (op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex))


def value(rank: int, dtype: torch.dtype, numel: int = 6) -> Tensor:
    """Rank `rank`'s input: small integers (exact in every dtype; products of 3 ranks fit in int8)."""
    generator = torch.Generator().manual_seed(rank * 7919 + DTYPES.index(dtype))
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    if dtype.is_complex:
        parts = torch.randint(-3, 4, (numel, 2), generator=generator).float()
        return torch.view_as_complex(parts).to(dtype)
    low = -3 if dtype.is_signed else 0
    return torch.randint(low, 4, (numel,), generator=generator).to(torch.float64).to(dtype)


def reference(inputs: list[Tensor], op: ReduceOp) -> Tensor:
    """op over `inputs`, computed in one process in a wide dtype and cast back (integers wrap like torch's)."""
    dtype = inputs[0].dtype
    if dtype is torch.bool:
        stack = torch.stack(inputs)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return stack.any(0)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return stack.all(0)
        return functools.reduce(torch.logical_xor, inputs)
    wide = torch.complex128 if dtype.is_complex else torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in inputs])
    if op is ReduceOp.SUM:
        result = stack.sum(0)
    elif op is ReduceOp.AVG:
        result = stack.sum(0) / len(inputs) if wide is not torch.int64 else \
            torch.div(stack.sum(0), len(inputs), rounding_mode="trunc")
    elif op is ReduceOp.PRODUCT:
        result = stack.prod(0)
    elif op is ReduceOp.MIN:
        result = stack.amin(0)
    elif op is ReduceOp.MAX:
        result = stack.amax(0)
    else:
        kernel = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}
        result = functools.reduce(kernel[op], list(stack))
    return result.to(dtype)


def check(actual: Tensor, expected: Tensor, what: str, op: ReduceOp, bits: bool = True) -> None:
    """Bit for bit (by value with bits=False), but AVG: one division, rounded in the dtype, may differ from the
    reference's last bit."""
    assert actual.dtype is expected.dtype, what
    if op is ReduceOp.AVG and (actual.dtype.is_floating_point or actual.dtype.is_complex):
        real = torch.view_as_real if actual.dtype.is_complex else (lambda t: t)
        torch.testing.assert_close(real(actual), real(expected), rtol=torch.finfo(real(actual).dtype).eps, atol=0,
                                   msg=lambda message: f"{what}: {message}")
    elif bits:
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), f"{what}: {actual} != {expected}"
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def _reductions(rank: int, size: int, op: ReduceOp, dtype: torch.dtype) -> dict[str, tuple[Tensor | None, Tensor]]:
    """Run each reducing collective once; name -> (result on this rank or None, what it should be)."""
    inputs = [value(r, dtype) for r in range(size)]
    full = reference(inputs, op)
    block = full.numel() // size
    mine = full[rank * block:(rank + 1) * block]
    out: dict[str, tuple[Tensor | None, Tensor]] = {}

    t = inputs[rank].clone()
    spmd.all_reduce(t, op=op)
    out["all_reduce"] = (t, full)
    t = inputs[rank].clone()
    work = spmd.all_reduce(t, op=op, async_op=True)
    assert work is not None
    work.wait()
    out["all_reduce async"] = (t, full)
    t = inputs[rank].clone()
    spmd.reduce(t, dst=size - 1, op=op)
    out["reduce"] = (t if rank == size - 1 else None, full)
    t = torch.empty(block, dtype=dtype)
    spmd.reduce_scatter_tensor(t, inputs[rank][:block * size].clone(), op=op)
    out["reduce_scatter_tensor"] = (t, mine)
    t = torch.empty(block, dtype=dtype)
    spmd.reduce_scatter(t, list(inputs[rank][:block * size].clone().split(block)), op=op)
    out["reduce_scatter"] = (t, mine)
    group = resolve_group(None, "test")
    out["functional.all_reduced"] = (functional.all_reduced(inputs[rank], op, group), full)
    out["functional.reduce_scattered"] = (functional.reduce_scattered(inputs[rank], op, 0, group),
                                          torch.chunk(full, size)[rank])
    return out


_REFUSED_CALLS = {
    "all_reduce": lambda t, op, size: spmd.all_reduce(t, op=op),
    "reduce": lambda t, op, size: spmd.reduce(t, dst=size - 1, op=op),
    "reduce_scatter_tensor": lambda t, op, size: spmd.reduce_scatter_tensor(t[:1].clone(), t[:size].clone(), op=op),
    "reduce_scatter": lambda t, op, size: spmd.reduce_scatter(t[:1].clone(), list(t[:size].split(1)), op=op),
    "functional.all_reduced": lambda t, op, size: functional.all_reduced(t, op, resolve_group(None, "test")),
    "functional.reduce_scattered": lambda t, op, size: functional.reduce_scattered(t, op, 0,
                                                                                  resolve_group(None, "test")),
}


def _table(rank: int, size: int) -> int:
    """Every (op, dtype) on every reducing collective; returns how many calls were checked."""
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if refused(op, dtype):
                for name, call in _REFUSED_CALLS.items():
                    t = torch.zeros(6, dtype=dtype)
                    with pytest.raises(ValueError) as raised:
                        call(t, op, size)
                    message = str(raised.value)
                    assert f"on rank {rank} " in message and str(dtype) in message and op.name in message, (
                        f"{name} {op.name} {dtype}: {message}")
                    checked += 1
                continue
            for name, (actual, expected) in _reductions(rank, size, op, dtype).items():
                if actual is not None:
                    check(actual, expected, f"{name} {op.name} {dtype} on rank {rank}", op)
                    checked += 1
    return checked


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("transport", "world_size"), [("threads", 3), ("tcp", 2), ("shm", 3), ("torch:gloo", 2)])
def test_every_op_and_dtype_reduces_like_torch_or_raises_before_sending(transport: str, world_size: int) -> None:
    counts = run_ranks(_table, world_size, timeout=180, backend=transport)
    assert min(counts) > len(DTYPES) * len(OPS) * 6 - 20


def test_the_table_refuses_exactly_what_check_reduce_op_refuses() -> None:
    from spmd.comm.reduce_op import check_reduce_op

    for dtype in DTYPES:
        for op in OPS:
            try:
                check_reduce_op(op, dtype, "all_reduce on rank 0")
                spmd_refuses = False
            except ValueError:
                spmd_refuses = True
            assert spmd_refuses == refused(op, dtype), (op, dtype)


def _gloo_outcomes(rank: int, world_size: int) -> dict[tuple[str, str], object]:
    """torch's gloo on the table (torch.distributed in a pool process): result list, or "refused"."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        outcomes: dict[tuple[str, str], object] = {}
        for dtype in GLOO_DTYPES:
            for op in OPS:
                t = value(rank, dtype)
                try:
                    dist.all_reduce(t, op=getattr(dist.ReduceOp, op.name))
                except (RuntimeError, ValueError):
                    outcomes[(str(dtype), op.name)] = "refused"
                else:
                    outcomes[(str(dtype), op.name)] = t
        return outcomes
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_agrees_with_the_table(procpool: ProcPool) -> None:
    outcomes = procpool.run(_gloo_outcomes, 2, timeout=90)[0]
    for dtype in GLOO_DTYPES:
        for op in OPS:
            outcome = outcomes[(str(dtype), op.name)]
            if gloo_refuses(op, dtype):
                assert outcome == "refused", (op, dtype, outcome)
            else:
                assert isinstance(outcome, Tensor), (op, dtype, outcome)
                # by value: gloo's bool SUM adds the bytes (True + True is a bool holding 2, and 256 ranks
                # would wrap to False); spmd's is a logical or, canonical bytes on every transport
                check(outcome, reference([value(r, dtype) for r in range(2)], op), f"gloo {op.name} {dtype}", op,
                      bits=False)
