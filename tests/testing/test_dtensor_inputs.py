"""spmd.testing.dtensor: Partial inputs whose terms reduce to the value, and that no rule can pass by luck."""

from __future__ import annotations

import functools

import pytest
import torch

from spmd.tensor import Partial, Replicate, Shard, init_device_mesh
from spmd.testing import run_ranks
from spmd.testing.dtensor import make_dtensor, partial_terms

VALUE = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))


def _reduce(terms: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack(terms)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)       # integer sums wrap in the dtype, as a SUM reduction does
    if op == "avg":
        return stack.mean(0)
    if op == "product":
        return stack.prod(0, dtype=stack.dtype)
    if op == "max":
        return stack.amax(0)
    if op == "min":
        return stack.amin(0)
    kernel = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    return functools.reduce(kernel, terms)


@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg", "product", "max", "min"])
def test_float_terms_reduce_to_the_value_and_none_is_degenerate(op: str, group_size: int) -> None:
    terms = partial_terms(VALUE, op, group_size, torch.Generator().manual_seed(1))
    assert len(terms) == group_size
    torch.testing.assert_close(_reduce(terms, op), VALUE, rtol=1e-5, atol=1e-5)
    for term in terms:
        assert not torch.equal(term, VALUE)                         # no rank holds the whole value
        assert (term == 0).float().mean() < 0.5                     # nor the reduction's identity
    if op in ("sum", "avg"):
        nonlinear = _reduce([torch.tanh(t) for t in terms], op)
        assert (nonlinear - torch.tanh(VALUE)).abs().max() > 0.1     # tanh(a) + tanh(b) != tanh(a + b) visibly


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("op", ["sum", "product", "max", "min", "band", "bor", "bxor"])
def test_integer_terms_reduce_exactly(op: str, dtype: torch.dtype) -> None:
    value = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(2)).to(dtype)
    value[0] = 0                                                    # an unsigned minimum stays reducible
    terms = partial_terms(value, op, 3, torch.Generator().manual_seed(3))
    assert torch.equal(_reduce(terms, op), value)


def test_make_dtensor_holds_random_terms_on_every_rank_of_every_partial_mesh_dim() -> None:
    def body(rank: int, world_size: int) -> tuple:
        mesh = init_device_mesh("cpu", (2, 2))
        both = make_dtensor(VALUE, mesh, [Partial(), Partial()])
        mixed = make_dtensor(VALUE, mesh, [Shard(0), Partial("max")])
        replicated = make_dtensor(VALUE, mesh, [Replicate(), Replicate()])
        return both.to_local(), both.full_tensor(), mixed.full_tensor(), replicated.to_local()

    results = run_ranks(body, world_size=4, timeout=30)
    locals_ = [r[0] for r in results]
    for _, full, mixed, replicated in results:
        torch.testing.assert_close(full, VALUE, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed, VALUE)
        assert torch.equal(replicated, VALUE)
    assert all(not torch.equal(local, VALUE) for local in locals_)
    assert len({tuple(local.flatten().tolist()) for local in locals_}) == 4   # four different terms


def test_make_dtensor_takes_0_d_values_and_size_1_dims_of_any_stride() -> None:
    odd = torch.randn(1, 3, generator=torch.Generator().manual_seed(4)).t()      # (3, 1), last dim's stride 3
    assert odd.is_contiguous() and odd.stride()[-1] != 1

    def body(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (world_size,))
        return (make_dtensor(torch.tensor(3.0), mesh, [Partial()]).full_tensor(),
                make_dtensor(odd, mesh, [Partial()]).full_tensor())

    for scalar, column in run_ranks(body, world_size=2, timeout=30):
        torch.testing.assert_close(scalar, torch.tensor(3.0))
        torch.testing.assert_close(column, odd)
