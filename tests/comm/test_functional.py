"""The autograd-aware collectives of spmd.comm.functional: forward values and gradients against the math done by
hand in one process, on 2 and 4 thread ranks.

Start here when a tensor-parallel layer trains wrong: these four functions are its only communication.
Conventions (STYLE rule 4; each docstring names its adjoint). A rank's backward sees the gradient of the
objective with respect to its own tensors, where the objective is the sum of every rank's loss, except
downstream of `all_reduce_fwd_identity_bwd`, whose output is replicated: the computation after it (and so its
gradient) is the same on every rank and counts once. Hence:
  identity_fwd_all_reduce_bwd(x):        dx = sum over ranks of dy            (x replicated, used per rank)
  all_reduce_fwd_identity_bwd(x):        dx = dy                              (y = sum x, used replicated)
  all_gather_fwd_reduce_scatter_bwd(x):  dx = my piece of sum over ranks of dy
  reduce_scatter_fwd_all_gather_bwd(x):  dx = every rank's dy, concatenated
Each test builds every rank's inputs from a seed, so one process can compute what all ranks hold together.
Tolerances: float64, and the only difference from the reference is the order of additions, so 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from spmd.comm.functional import (
    all_gather_fwd_reduce_scatter_bwd,
    all_reduce_fwd_identity_bwd,
    identity_fwd_all_reduce_bwd,
    reduce_scatter_fwd_all_gather_bwd,
)
from spmd.comm.group import ProcessGroup
from spmd.comm.world import default_group
from spmd.testing import run_ranks

TIMEOUT = 60.0
TOL = {"rtol": 1e-12, "atol": 1e-12}
SIZES = [2, 4]


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def on_ranks(world_size: int, body: Callable[[int, ProcessGroup], object]) -> list:
    return run_ranks(lambda rank, size: body(rank, default_group()), world_size, timeout=TIMEOUT)


# -- forward values and gradients, one function at a time --------------------------------------------------

@pytest.mark.parametrize("world_size", SIZES)
def test_identity_fwd_all_reduce_bwd(world_size: int) -> None:
    x_full = randn(3, 5, seed=0)                                        # the same on every rank
    w = [randn(3, 5, seed=10 + r) for r in range(world_size)]          # each rank's own use of it

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        x = x_full.clone().requires_grad_()
        y = identity_fwd_all_reduce_bwd(x, group)
        (w[rank] * y).sum().backward()
        return y.detach(), x.grad

    for y, grad in on_ranks(world_size, body):
        torch.testing.assert_close(y, x_full, rtol=0, atol=0)
        torch.testing.assert_close(grad, sum(w), **TOL)                 # d/dx of sum_r <w_r, x>


@pytest.mark.parametrize("world_size", SIZES)
def test_all_reduce_fwd_identity_bwd(world_size: int) -> None:
    xs = [randn(3, 5, seed=r) for r in range(world_size)]
    w = randn(3, 5, seed=99)                                            # replicated: the same loss on every rank

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        x = xs[rank].clone().requires_grad_()
        y = all_reduce_fwd_identity_bwd(x, group)
        (w * y).sum().backward()
        return y.detach(), x.grad

    for y, grad in on_ranks(world_size, body):
        torch.testing.assert_close(y, sum(xs), **TOL)
        torch.testing.assert_close(grad, w, rtol=0, atol=0)             # d<w, sum_r x_r>/dx_r = w


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_fwd_reduce_scatter_bwd(world_size: int, dim: int) -> None:
    xs = [randn(3, 5, 7, seed=r) for r in range(world_size)]          # odd extents on every dim
    x_full = torch.cat(xs, dim=dim)
    w = [randn(*x_full.shape, seed=10 + r) for r in range(world_size)]

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        x = xs[rank].clone().requires_grad_()
        y = all_gather_fwd_reduce_scatter_bwd(x, dim, group)
        (w[rank] * y).sum().backward()
        return y.detach(), x.grad

    reference = x_full.clone().requires_grad_()
    sum((w_r * reference).sum() for w_r in w).backward()
    want = reference.grad.chunk(world_size, dim=dim)
    for rank, (y, grad) in enumerate(on_ranks(world_size, body)):
        torch.testing.assert_close(y, x_full, rtol=0, atol=0)
        torch.testing.assert_close(grad, want[rank], **TOL)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_fwd_all_gather_bwd(world_size: int, dim: int) -> None:
    shape = [3, 5, 7]
    shape[dim] *= world_size                                            # divisible along dim, odd elsewhere
    xs = [randn(*shape, seed=r) for r in range(world_size)]
    pieces = sum(xs).chunk(world_size, dim=dim)
    w = [randn(*pieces[r].shape, seed=10 + r) for r in range(world_size)]

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        x = xs[rank].clone().requires_grad_()
        y = reduce_scatter_fwd_all_gather_bwd(x, dim, group)
        (w[rank] * y).sum().backward()
        return y.detach(), x.grad

    for rank, (y, grad) in enumerate(on_ranks(world_size, body)):
        torch.testing.assert_close(y, pieces[rank], **TOL)
        torch.testing.assert_close(grad, torch.cat(w, dim=dim), rtol=0, atol=0)


def test_reduce_scatter_of_an_indivisible_dim_is_an_error() -> None:
    def body(rank: int, group: ProcessGroup) -> None:
        with pytest.raises(ValueError, match=r"dim 1 of shape \(4, 5\) does not divide into 2 equal pieces"):
            reduce_scatter_fwd_all_gather_bwd(torch.zeros(4, 5, requires_grad=True), 1, group)

    on_ranks(2, body)


# -- the dot-product test: each backward is the adjoint of its forward ---------------------------------------

@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("kind", ["identity_fwd", "all_reduce_fwd", "all_gather_fwd", "reduce_scatter_fwd"])
def test_backward_is_the_adjoint_of_forward(world_size: int, kind: str) -> None:
    # For a linear map A spread over the ranks, <A x, v> = <x, A^T v> for every x and v (the inner products
    # summed over ranks, a replicated tensor counted once). Random x and v, each rank's own: gradcheck for
    # linear collectives, which torch.autograd.gradcheck can't do (it perturbs one rank at a time).
    fn: dict[str, Callable[[Tensor, ProcessGroup], Tensor]] = {
        "identity_fwd": identity_fwd_all_reduce_bwd,
        "all_reduce_fwd": all_reduce_fwd_identity_bwd,
        "all_gather_fwd": lambda x, group: all_gather_fwd_reduce_scatter_bwd(x, 1, group),
        "reduce_scatter_fwd": lambda x, group: reduce_scatter_fwd_all_gather_bwd(x, 1, group),
    }
    replicated_in, replicated_out = kind == "identity_fwd", kind == "all_reduce_fwd"

    def body(rank: int, group: ProcessGroup) -> tuple[float, float]:
        x = randn(3, 4 * world_size, seed=0 if replicated_in else rank).requires_grad_()
        y = fn[kind](x, group)
        v = randn(*y.shape, seed=50 if replicated_out else 50 + rank)
        (grad,) = torch.autograd.grad(y, x, v)
        forward = float((y.detach() * v).sum()) / (world_size if replicated_out else 1)
        backward = float((x.detach() * grad).sum()) / (world_size if replicated_in else 1)
        return forward, backward

    results = on_ranks(world_size, body)
    forward, backward = (sum(column) for column in zip(*results))
    assert forward == pytest.approx(backward, rel=1e-12)


# -- composed as tensor parallelism uses them ----------------------------------------------------------------

@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_mlp_matches_one_process(world_size: int, sequence_parallel: bool) -> None:
    # y = W2 tanh(W1 x): W1 split by rows (column-parallel), W2 by columns (row-parallel). Without sequence
    # parallelism x enters replicated (identity / all-reduce) and y leaves through an all-reduce; with it, x
    # enters sharded along the sequence (all-gather / reduce-scatter) and y leaves sharded the same way.
    tokens, width, hidden = 3 * world_size, 5, 6 * world_size
    x_full, w1, w2 = randn(tokens, width, seed=0), randn(hidden, width, seed=1), randn(width, hidden, seed=2)
    target = randn(tokens, width, seed=3)

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, ...]:
        w1_shard = w1.chunk(world_size, dim=0)[rank].clone().requires_grad_()     # (hidden/tp, width)
        w2_shard = w2.chunk(world_size, dim=1)[rank].clone().requires_grad_()     # (width, hidden/tp)
        if sequence_parallel:
            x = x_full.chunk(world_size, dim=0)[rank].clone().requires_grad_()    # (tokens/tp, width)
            h = torch.tanh(all_gather_fwd_reduce_scatter_bwd(x, 0, group) @ w1_shard.t())
            y = reduce_scatter_fwd_all_gather_bwd(h @ w2_shard.t(), 0, group)      # (tokens/tp, width)
            loss = ((y - target.chunk(world_size, dim=0)[rank]) ** 2).sum()        # this rank's tokens
        else:
            x = x_full.clone().requires_grad_()
            h = torch.tanh(identity_fwd_all_reduce_bwd(x, group) @ w1_shard.t())  # (tokens, hidden/tp)
            y = all_reduce_fwd_identity_bwd(h @ w2_shard.t(), group)               # (tokens, width)
            loss = ((y - target) ** 2).sum()                                       # replicated: counts once
        loss.backward()
        return y.detach(), x.grad, w1_shard.grad, w2_shard.grad

    ref = [t.clone().requires_grad_() for t in (x_full, w1, w2)]
    y_ref = torch.tanh(ref[0] @ ref[1].t()) @ ref[2].t()
    ((y_ref - target) ** 2).sum().backward()
    for rank, (y, x_grad, w1_grad, w2_grad) in enumerate(on_ranks(world_size, body)):
        pieces = (lambda t, r=rank: t.chunk(world_size, dim=0)[r]) if sequence_parallel else (lambda t: t)
        torch.testing.assert_close(y, pieces(y_ref.detach()), **TOL)
        torch.testing.assert_close(x_grad, pieces(ref[0].grad), **TOL)
        torch.testing.assert_close(w1_grad, ref[1].grad.chunk(world_size, dim=0)[rank], **TOL)
        torch.testing.assert_close(w2_grad, ref[2].grad.chunk(world_size, dim=1)[rank], **TOL)


# -- second derivatives --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("kind", ["identity_fwd", "all_reduce_fwd", "all_gather_fwd", "reduce_scatter_fwd"])
def test_double_backward_matches_one_process(world_size: int, kind: str) -> None:
    # A Hessian-vector product through each collective (gradient penalties, some optimizers need one): with
    # create_graph=True the backward is itself differentiated, so it must be the adjoint collective run as an
    # autograd function, not a plain collective autograd can't see.
    n = world_size
    replicated_in, replicated_out = kind == "identity_fwd", kind == "all_reduce_fwd"
    xs = [randn(2, 3 * n, seed=0 if replicated_in else r) for r in range(n)]
    vs = [randn(2, 3 * n, seed=20 if replicated_in else 20 + r) for r in range(n)]
    out_shape = {"identity_fwd": (2, 3 * n), "all_reduce_fwd": (2, 3 * n), "all_gather_fwd": (2, 3 * n * n),
                 "reduce_scatter_fwd": (2, 3)}[kind]
    ws = [randn(*out_shape, seed=40 if replicated_out else 40 + r) for r in range(n)]
    fn: dict[str, Callable[[Tensor, ProcessGroup], Tensor]] = {
        "identity_fwd": identity_fwd_all_reduce_bwd,
        "all_reduce_fwd": all_reduce_fwd_identity_bwd,
        "all_gather_fwd": lambda x, group: all_gather_fwd_reduce_scatter_bwd(x, 1, group),
        "reduce_scatter_fwd": lambda x, group: reduce_scatter_fwd_all_gather_bwd(x, 1, group),
    }

    def body(rank: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        x = xs[rank].clone().requires_grad_()
        loss = (ws[rank] * fn[kind](x, group) ** 3).sum()
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (second,) = torch.autograd.grad((grad * vs[rank]).sum(), x)
        return grad.detach(), second

    # One process: every rank's tensors at once, the collectives written as sums, concatenations and chunks.
    leaves = [xs[0].clone().requires_grad_()] if replicated_in else [x.clone().requires_grad_() for x in xs]
    if kind == "identity_fwd":
        total = sum((w * leaves[0] ** 3).sum() for w in ws)
    elif kind == "all_reduce_fwd":
        total = (ws[0] * sum(leaves) ** 3).sum()
    elif kind == "all_gather_fwd":
        total = sum((w * torch.cat(leaves, dim=1) ** 3).sum() for w in ws)
    else:
        total = sum((w * piece ** 3).sum() for w, piece in zip(ws, sum(leaves).chunk(n, dim=1)))
    grads = torch.autograd.grad(total, leaves, create_graph=True)
    seconds = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), leaves)
    for rank, (grad, second) in enumerate(on_ranks(n, body)):
        leaf = 0 if replicated_in else rank
        torch.testing.assert_close(grad, grads[leaf].detach(), **TOL)
        torch.testing.assert_close(second, seconds[leaf], **TOL)
