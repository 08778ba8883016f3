"""The one reduction kernel (reduce_into) and its AVG helpers: every op on every dtype it takes, left-to-right
order, and the in-place forms the transports use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from spmd.comm.reduce_op import ReduceOp, check_reduce_op, finish_average, partial_op, reduce_into

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool]

_REFERENCE: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {    # one step, plain operators
    ReduceOp.SUM: lambda a, b: a | b if a.dtype is torch.bool else a + b,
    ReduceOp.AVG: lambda a, b: a + b,
    ReduceOp.PRODUCT: lambda a, b: a & b if a.dtype is torch.bool else a * b,
    ReduceOp.MIN: lambda a, b: torch.where(b < a, b, a),
    ReduceOp.MAX: lambda a, b: torch.where(b > a, b, a),
    ReduceOp.BAND: lambda a, b: a & b,
    ReduceOp.BOR: lambda a, b: a | b,
    ReduceOp.BXOR: lambda a, b: a ^ b,
}


def _accepts(op: ReduceOp, dtype: torch.dtype) -> bool:
    try:
        check_reduce_op(op, dtype, "test")
    except ValueError:
        return False
    return True


def _sources(count: int, dtype: torch.dtype, n: int = 257) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    if dtype is torch.bool:
        return [torch.rand(n, generator=generator) < 0.5 for _ in range(count)]
    if dtype.is_floating_point:
        return [(torch.rand(n, generator=generator) * 4 - 2).to(dtype) for _ in range(count)]
    return [torch.randint(0, 7, (n,), generator=generator).to(dtype) for _ in range(count)]


def _left_to_right(sources: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    acc = sources[0].clone()
    for source in sources[1:]:
        acc = _REFERENCE[op](acc, source)
    if op is not ReduceOp.AVG:
        return acc
    integer = not (acc.dtype.is_floating_point or acc.dtype.is_complex)
    return torch.div(acc, len(sources), rounding_mode="trunc") if integer else acc / len(sources)


@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize(("op", "dtype"), [pytest.param(op, dtype, id=f"{op.name}-{dtype}")
                                           for op in ReduceOp for dtype in DTYPES if _accepts(op, dtype)])
def test_every_op_on_every_dtype_it_accepts_matches_plain_operators_left_to_right(
        op: ReduceOp, dtype: torch.dtype, count: int) -> None:
    sources = _sources(count, dtype)
    before = [s.clone() for s in sources]
    dst = torch.empty_like(sources[0])
    assert reduce_into(dst, sources, op) is dst
    assert dst.dtype is dtype
    assert torch.equal(dst, _left_to_right(sources, op))
    assert all(torch.equal(s, b) for s, b in zip(sources, before))      # sources are only read


def test_integer_avg_truncates_toward_zero() -> None:
    a, b = torch.tensor([7, -7, 3], dtype=torch.int64), torch.tensor([0, 0, 0], dtype=torch.int64)
    assert reduce_into(torch.empty(3, dtype=torch.int64), [a, b], ReduceOp.AVG).tolist() == [3, -3, 1]
    partial = a.clone()
    finish_average(partial, ReduceOp.AVG, 2)
    assert partial.tolist() == [3, -3, 1] and partial.dtype is torch.int64


def test_bool_sum_and_product_are_logical_or_and_and() -> None:
    a, b = torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])
    dst = torch.empty(4, dtype=torch.bool)
    assert reduce_into(dst, [a, b], ReduceOp.SUM).tolist() == [True, True, True, False]
    assert reduce_into(dst, [a, b], ReduceOp.PRODUCT).tolist() == [True, False, False, False]


def test_integer_ops_keep_the_dtype_and_wrap_like_torch() -> None:
    a, b = torch.tensor([200, 3], dtype=torch.uint8), torch.tensor([100, 5], dtype=torch.uint8)
    dst = torch.empty(2, dtype=torch.uint8)
    assert reduce_into(dst, [a, b], ReduceOp.SUM).tolist() == [44, 8]
    assert reduce_into(dst, [a, b], ReduceOp.BXOR).tolist() == [200 ^ 100, 3 ^ 5]
    big = torch.tensor([2**62], dtype=torch.int64)
    assert reduce_into(torch.empty(1, dtype=torch.int64), [big, big, big], ReduceOp.MAX).tolist() == [2**62]


def test_sources_combine_in_list_order() -> None:
    # float32: (1e8 + -1e8) + 1 == 1, but (-1e8 + 1) + 1e8 == 0 (the 1 is lost to rounding)
    a, b, c = (torch.tensor([x], dtype=torch.float32) for x in (1e8, -1e8, 1.0))
    dst = torch.empty(1)
    assert reduce_into(dst, [a, b, c], ReduceOp.SUM).item() == 1.0
    assert reduce_into(dst, [b, c, a], ReduceOp.SUM).item() == 0.0


def test_avg_divides_once_by_the_number_of_sources() -> None:
    sources = [torch.full((5,), float(v), dtype=torch.float64) for v in (1, 2, 3, 10)]
    dst = torch.empty(5, dtype=torch.float64)
    assert reduce_into(dst, sources, ReduceOp.AVG).tolist() == [4.0] * 5
    assert reduce_into(dst, sources[:1], ReduceOp.AVG).tolist() == [1.0] * 5      # the mean of one operand


def test_steps_with_partial_op_then_finish_average_equal_one_call() -> None:
    sources = _sources(4, torch.float64)
    whole = reduce_into(torch.empty_like(sources[0]), sources, ReduceOp.AVG)
    acc = sources[0].clone()
    for source in sources[1:]:
        reduce_into(acc, (acc, source), partial_op(ReduceOp.AVG))
    finish_average(acc, ReduceOp.AVG, len(sources))
    assert torch.equal(acc, whole)
    assert partial_op(ReduceOp.AVG) is ReduceOp.SUM
    assert all(partial_op(op) is op for op in ReduceOp if op is not ReduceOp.AVG)
    untouched = sources[0].clone()
    finish_average(untouched, ReduceOp.SUM, 4)                                # other ops: nothing to do
    assert torch.equal(untouched, sources[0])


@pytest.mark.parametrize("alias", [0, 1])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN], ids=lambda op: op.name)
def test_dst_may_be_the_first_or_second_source(alias: int, op: ReduceOp) -> None:
    sources = _sources(4, torch.float32)
    expected = _left_to_right(sources, op)
    dst = sources[alias]
    assert reduce_into(dst, sources, op) is dst
    assert torch.equal(dst, expected)


def test_one_source_is_copied_or_left_alone_when_it_is_dst() -> None:
    source = torch.arange(6.0)
    dst = torch.zeros(6)
    assert torch.equal(reduce_into(dst, [source], ReduceOp.SUM), source)
    assert torch.equal(reduce_into(source, [source], ReduceOp.PRODUCT), torch.arange(6.0))


def test_reduces_into_a_view_of_a_larger_buffer_without_touching_the_rest() -> None:
    # as shm does: out= into one rank's slice of a shared slot, sources being views of other slots
    slot = torch.full((30,), -1.0)
    staged = torch.arange(60.0).view(2, 30)
    reduce_into(slot[10:20], [staged[0, 10:20], staged[1, 10:20], torch.ones(10)], ReduceOp.SUM)
    assert torch.equal(slot[10:20], staged[0, 10:20] + staged[1, 10:20] + 1)
    assert (slot[:10] == -1).all() and (slot[20:] == -1).all()


def test_bool_and_integer_pieces_reduce_in_place_pairwise() -> None:
    # the tcp algorithms' form: reduce_into(mine, (mine, received), op) on pieces of a tensor
    flags = torch.tensor([False, True, False, True])
    reduce_into(flags[:2], (flags[:2], torch.tensor([True, False])), ReduceOp.SUM)
    assert flags.tolist() == [True, True, False, True]
    counts = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    reduce_into(counts[2:], (counts[2:], torch.tensor([3, 12], dtype=torch.int32)), ReduceOp.MIN)
    assert counts.tolist() == [5, 6, 3, 8]
