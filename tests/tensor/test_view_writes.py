"""Writes through views of DTensors reach the DTensor they view, as on plain tensors (run.py, Note: writes through
views of gathered copies): `x[1] = 0`, `x[1].zero_()`, a slice scaled in place, a piece of split or unbind,
`x[1, 2] = 5` over two sharded dims, `out=` into a view, a diagonal written over sharded dims; also when the base
changed after the view was taken, and under autograd. A view that can't carry the write refuses it by name, as does
resize_ of a sharded DTensor (a replicated one resizes as a plain tensor does). The
view ops that had no rule (diagonal, unfold, view(dtype)) keep shards where they can, and a view taken through the
fallback of replicated inputs stays a view: linalg.qr's backward, which writes through a diagonal, is right."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.rules import ShardingError
from spmd.testing import run_ranks

BASE = torch.arange(48.0).view(4, 6, 2)

WRITES: dict[str, Callable[[Tensor], object]] = {
    "x[1] = 0": lambda x: x.__setitem__(1, 0.0),
    "x[:, 2] = -1": lambda x: x.__setitem__((slice(None), 2), -1.0),
    "x[1, 2] = 5": lambda x: x.__setitem__((1, 2), 5.0),
    "x[1].zero_()": lambda x: x[1].zero_(),
    "x[1][2:4] *= 3": lambda x: x[1][2:4].mul_(3),
    "x[:, 1:3].mul_(2)": lambda x: x[:, 1:3].mul_(2),
    "x.split(2)[1].zero_()": lambda x: x.split(2)[1].zero_(),
    "x.unbind(1)[3].fill_(9)": lambda x: x.unbind(1)[3].fill_(9),
    "x[:, 1].t().add_(1)": lambda x: x[:, 1].t().add_(1),
    "x[1].copy_(x[2])": lambda x: x[1].copy_(x[2]),
    "torch.add(x[0], 1, out=x[3])": lambda x: torch.add(x[0], 1, out=x[3]),
    "x.view(-1)[3] = 7": lambda x: x.view(-1).__setitem__(3, 7.0),
    "x.diagonal(0, 0, 1).mul_(0.5)": lambda x: x.diagonal(0, 0, 1).mul_(0.5),
    "stale view: x[1][2] after x.add_(1)": lambda x: _stale(x),
}
LAYOUTS = {"(4,)": [[Shard(0)], [Shard(1)], [Replicate()]],
           "(2, 2)": [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Shard(2), Shard(0)]]}


def _stale(x: Tensor) -> None:
    """Views taken, then the base changed, then written through: only the written elements change."""
    v = x[1]
    w = v[2]
    x.add_(1)
    w.fill_(-5)
    v[3, 1] = 100


def _expected(write: Callable[[Tensor], object]) -> Tensor:
    plain = BASE.clone()
    write(plain)
    return plain


@pytest.mark.parametrize("mesh_shape", list(LAYOUTS))
def test_writes_through_views_reach_the_dtensor(mesh_shape: str) -> None:
    def body(rank: int, size: int) -> dict[tuple[str, str], Tensor]:
        mesh = init_device_mesh("cpu", eval(mesh_shape))
        got = {}
        for placements in LAYOUTS[mesh_shape]:
            for name, write in WRITES.items():
                x = distribute_tensor(BASE.clone(), mesh, placements)
                write(x)
                assert x.placements == tuple(placements)
                got[str(placements), name] = x.full_tensor()
        return got

    for got in run_ranks(body, 4, timeout=120):
        for (placements, name), value in got.items():
            torch.testing.assert_close(value, _expected(WRITES[name]), rtol=0, atol=0,
                                       msg=lambda m, p=placements, n=name: f"{n} on {p}: {m}")


def test_writes_through_views_under_autograd_give_the_plain_gradients() -> None:
    def train(x: Tensor) -> None:
        y = x * 2
        y[1] = 0
        y[:, 2] *= 3
        (y ** 2).sum().backward()

    plain = BASE.clone().requires_grad_()
    train(plain)

    def body(rank: int, size: int) -> list[Tensor]:
        mesh = init_device_mesh("cpu", (size,))
        grads = []
        for placements in ([Shard(0)], [Shard(1)]):
            x = distribute_tensor(BASE.clone(), mesh, placements).requires_grad_()
            train(x)
            grads.append(x.grad.full_tensor())
        return grads

    for grads in run_ranks(body, 2, timeout=60):
        for grad in grads:
            torch.testing.assert_close(grad, plain.grad, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:.*aten.as_strided.default has no sharding rule")
def test_a_view_that_cannot_carry_a_write_refuses_it_and_one_of_replicas_carries_it() -> None:
    def body(rank: int, size: int) -> Tensor:
        mesh = init_device_mesh("cpu", (size,))
        sharded = distribute_tensor(BASE.clone(), mesh, [Shard(0)])
        with pytest.raises(ShardingError, match=r"aten.zero_.default on rank \d .*: this DTensor is a copy of part "
                                                r"of another DTensor \(taken by aten.as_strided.default"):
            sharded.as_strided((2, 2), (1, 2)).zero_()
        replicated = distribute_tensor(BASE.clone(), mesh, [Replicate()])
        replicated.as_strided((2, 2), (1, 2)).zero_()       # no rule: the fallback's view of the replicas
        return replicated.full_tensor()

    want = BASE.clone()
    want.as_strided((2, 2), (1, 2)).zero_()
    for got in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_diagonal_unfold_and_view_dtype_keep_shards_and_match_plain_tensors() -> None:
    ops: dict[str, Callable[[Tensor], Tensor]] = {
        "diagonal": lambda x: x.diagonal(0, 1, 2), "unfold": lambda x: x.unfold(2, 3, 2),
        "view(int32)": lambda x: x.view(torch.int32), "view(int8) of half": lambda x: x.half().view(torch.int8)}
    source = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))

    def body(rank: int, size: int) -> dict[tuple[str, int], tuple[Tensor, tuple]]:
        mesh = init_device_mesh("cpu", (size,))
        out = {}
        for dim in range(3):
            x = distribute_tensor(source.clone(), mesh, [Shard(dim)])
            for name, op in ops.items():
                y = op(x)
                out[name, dim] = (y.full_tensor(), y.placements)
        return out

    kept = {("diagonal", 0): Shard(0), ("unfold", 0): Shard(0), ("unfold", 1): Shard(1),
            ("view(int32)", 2): Shard(2), ("view(int8) of half", 1): Shard(1)}
    for out in run_ranks(body, 2, timeout=60):
        for (name, dim), (value, placements) in out.items():
            torch.testing.assert_close(value, ops[name](source), rtol=0, atol=0, msg=name)
            if (name, dim) in kept:
                assert placements == (kept[name, dim],), (name, dim, placements)


@pytest.mark.filterwarnings("ignore:.*aten.linalg_qr.default has no sharding rule")
def test_qr_backward_which_writes_through_a_diagonal_matches_plain_tensors() -> None:
    generator = torch.Generator().manual_seed(0)
    a, grad_q, grad_r = (torch.randn(5, 5, generator=generator) for _ in range(3))
    plain = a.clone().requires_grad_()
    want, = torch.autograd.grad(torch.linalg.qr(plain), plain, (grad_q, grad_r))

    def body(rank: int, size: int) -> Tensor:
        mesh = init_device_mesh("cpu", (size,))
        replicate = [Replicate()]
        x = distribute_tensor(a.clone(), mesh, replicate).requires_grad_()
        got, = torch.autograd.grad(torch.linalg.qr(x), x, (distribute_tensor(grad_q, mesh, replicate),
                                                            distribute_tensor(grad_r, mesh, replicate)))
        return got.full_tensor()

    for got in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_resize_of_a_replicated_dtensor_is_a_plain_tensors_and_of_a_sharded_one_is_refused() -> None:
    want = torch.arange(20.0).view(4, 5)
    want.resize_(2, 3)

    def body(rank: int, size: int) -> Tensor:
        mesh = init_device_mesh("cpu", (size,))
        sharded = distribute_tensor(torch.arange(20.0).view(4, 5), mesh, [Shard(0)])
        sharded.resize_(4, 5)                                      # its own size: nothing to do
        with pytest.raises(ShardingError, match=r"aten.resize_.default on rank \d of a \[Shard\(0\)\] DTensor "
                                                r"of shape \(4, 5\) to \(3, 13\): only a replicated DTensor resizes"):
            sharded.resize_(3, 13)
        replicated = distribute_tensor(torch.arange(20.0).view(4, 5), mesh, [Replicate()])
        replicated.resize_(2, 3)
        assert replicated.shape == (2, 3) and replicated.stride() == want.stride()
        return replicated.full_tensor()

    for got in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_boolean_mask_indexing_is_refused_saying_why_and_what_to_do() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        x = distribute_tensor(BASE.clone(), mesh, [Shard(0)])
        with pytest.raises(ShardingError, match=r"aten.index.Tensor on rank \d .*: indexing with a boolean mask gives "
                                                r"a shape that depends on the mask's values.*x.full_tensor\(\)"):
            x[x > 10]

    run_ranks(body, 2, timeout=60)
