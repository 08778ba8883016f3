"""spmd.nn.functional (torch's torch.distributed.nn.functional): every differentiable collective's gradients
are those of the same computation done in one process on all ranks' inputs. Each rank weighs its outputs with
its own weights and backpropagates its loss; the one-process reference sums all ranks' losses. Ops that ignore a
rank's output (reduce, gather to a root) get weight only there, as in torch, where the others' outputs carry no
gradient. Also: the contrastive-learning use (cat of all_gather), and a MAX reduction's backward is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import spmd
import spmd.nn.functional as dfn
from spmd.testing import run_ranks

WORLD = 3
SHAPE = (2, 6)


def _inputs(rank: int) -> list[Tensor]:
    """Rank `rank`'s inputs: one tensor, or a list of WORLD pieces for the list collectives."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(SHAPE, generator=generator) for _ in range(WORLD)]


def _weights(rank: int, outputs: list[Tensor]) -> list[Tensor]:
    """Rank `rank`'s weight for each of its outputs (the gradient its loss sends into that output)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(o.shape, generator=generator) for o in outputs]


# name -> (distributed op on this rank's inputs -> its outputs, one-process op on all inputs -> every rank's
# outputs, the ranks whose outputs carry the loss)
Case = tuple[Callable[[int, list[Tensor]], list[Tensor]], Callable[[list[list[Tensor]]], list[list[Tensor]]], set]
ALL = set(range(WORLD))
CASES: dict[str, Case] = {
    "broadcast": (lambda r, xs: [dfn.broadcast(xs[0], src=1)], lambda X: [[X[1][0]] for _ in range(WORLD)], ALL),
    "reduce": (lambda r, xs: [dfn.reduce(xs[0], dst=2)],
               lambda X: [[sum(x[0] for x in X)] for _ in range(WORLD)], {2}),
    "gather": (lambda r, xs: list(dfn.gather(xs[0], dst=0)), lambda X: [[x[0] for x in X]] * WORLD, {0}),
    "scatter": (lambda r, xs: [dfn.scatter(xs, src=1)], lambda X: [[X[1][r]] for r in range(WORLD)], ALL),
    "all_gather": (lambda r, xs: list(dfn.all_gather(xs[0])), lambda X: [[x[0] for x in X]] * WORLD, ALL),
    "reduce_scatter": (lambda r, xs: [dfn.reduce_scatter(torch.empty(SHAPE), xs)],
                       lambda X: [[sum(x[r] for x in X)] for r in range(WORLD)], ALL),
    "reduce_scatter_avg": (lambda r, xs: [dfn.reduce_scatter(torch.empty(SHAPE), xs, op=spmd.ReduceOp.AVG)],
                           lambda X: [[sum(x[r] for x in X) / WORLD] for r in range(WORLD)], ALL),
    "all_to_all": (lambda r, xs: list(dfn.all_to_all([torch.empty(SHAPE) for _ in range(WORLD)], xs)),
                   lambda X: [[X[j][r] for j in range(WORLD)] for r in range(WORLD)], ALL),
    "all_to_all_single": (lambda r, xs: [dfn.all_to_all_single(torch.empty(WORLD * 2, 6), torch.cat(xs))],
                          lambda X: [[torch.cat([X[j][r] for j in range(WORLD)])] for r in range(WORLD)], ALL),
    "all_reduce": (lambda r, xs: [dfn.all_reduce(xs[0])], lambda X: [[sum(x[0] for x in X)]] * WORLD, ALL),
    "all_reduce_avg": (lambda r, xs: [dfn.all_reduce(xs[0], op=spmd.ReduceOp.AVG)],
                       lambda X: [[sum(x[0] for x in X) / WORLD]] * WORLD, ALL),
}


def _loss(rank: int, outputs: list[Tensor], weighted: set) -> Tensor:
    if rank not in weighted:
        return sum(o.sum() * 0 for o in outputs)
    return sum((o * w).sum() for o, w in zip(outputs, _weights(rank, outputs), strict=True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_are_the_one_process_gradients(name: str) -> None:
    distributed, simulated, weighted = CASES[name]

    def body(rank: int, size: int) -> list[Tensor | None]:
        xs = [x.requires_grad_() for x in _inputs(rank)]
        _loss(rank, distributed(rank, xs), weighted).backward()
        return [x.grad for x in xs]

    got = run_ranks(body, WORLD, timeout=60)
    every = [[x.requires_grad_() for x in _inputs(rank)] for rank in range(WORLD)]
    total = sum(_loss(rank, outputs, weighted) for rank, outputs in enumerate(simulated(every)))
    total.backward()
    for rank in range(WORLD):
        for piece, (mine, want) in enumerate(zip(got[rank], every[rank], strict=True)):
            expected = want.grad if want.grad is not None else torch.zeros(SHAPE)
            actual = mine if mine is not None else torch.zeros(SHAPE)
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank} input {piece}")


def test_contrastive_logits_over_every_ranks_embeddings_train_every_rank() -> None:
    def body(rank: int, size: int) -> Tensor:
        embeddings = _inputs(rank)[0].requires_grad_()
        everyone = torch.cat(dfn.all_gather(embeddings))                      # (WORLD * 2, 6)
        logits = embeddings @ everyone.t()
        labels = torch.arange(2) + 2 * rank
        torch.nn.functional.cross_entropy(logits, labels).backward()
        return embeddings.grad

    got = run_ranks(body, WORLD, timeout=60)
    every = [_inputs(rank)[0].requires_grad_() for rank in range(WORLD)]
    everyone = torch.cat(every)
    sum(torch.nn.functional.cross_entropy(e @ everyone.t(), torch.arange(2) + 2 * r)
        for r, e in enumerate(every)).backward()
    for rank in range(WORLD):
        torch.testing.assert_close(got[rank], every[rank].grad, rtol=1e-5, atol=1e-6)


def test_a_max_reductions_backward_is_refused() -> None:
    def body(rank: int, size: int) -> None:
        x = torch.ones(2, requires_grad=True)
        out = dfn.all_reduce(x, op=spmd.ReduceOp.MAX)
        with pytest.raises(RuntimeError, match=r"all_reduce: backward through .*MAX.* is not a collective"):
            out.sum().backward()

    run_ranks(body, 2, timeout=60)
