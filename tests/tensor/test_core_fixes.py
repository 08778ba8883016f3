"""Core dispatch and rule fixes: in-place ops on Partial tensors, in-place views, out= variants, factories that
keep their input's layout, scatter/flip/cumprod rules, and the int-list cache key.

Each check compares full values (and gradients) with the same computation on plain tensors, on a 2-rank and a
2x2 mesh; a replicate-compute-reshard fallback warning fails the test (every op here has a rule).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from spmd.device_mesh import DeviceMesh
from spmd.tensor import DTensor, Partial, Replicate, Shard
from spmd.tensor.dispatch.decision import Path
from spmd.tensor.dispatch.keys import call_key
from spmd.tensor.rules import ShardingError
from tests.tensor.rule_checks import check, make_dtensor, on_meshes

aten = torch.ops.aten
MESHES = [(2,), (2, 2)]
TIMEOUT = 60.0


def _on_meshes(body: Callable[[DeviceMesh], None]) -> None:
    def one_thread(mesh: DeviceMesh) -> None:
        torch.set_num_threads(1)
        body(mesh)
    on_meshes(one_thread, MESHES, timeout=TIMEOUT)   # a fallback fails the test


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _all(mesh: DeviceMesh, placement) -> list:
    return [placement] * mesh.ndim


# -- 1. in-place ops on Partial tensors ---------------------------------------------------------------------

def test_masked_fill_zero_keeps_partial_and_other_values_reduce() -> None:
    x, mask = _randn(4, 6), _randn(4, 6, seed=1) > 0

    def body(mesh: DeviceMesh) -> None:
        p = make_dtensor(x, mesh, _all(mesh, Partial()))
        m = make_dtensor(mask, mesh, _all(mesh, Replicate()))
        out = p.masked_fill(m, 0.0)
        assert out.placements == (Partial(),) * mesh.ndim
        torch.testing.assert_close(out.full_tensor(), x.masked_fill(mask, 0.0))
        assert p.masked_fill_(m, 0) is p and p.placements == (Partial(),) * mesh.ndim
        torch.testing.assert_close(p.full_tensor(), x.masked_fill(mask, 0.0))
        q = make_dtensor(x, mesh, _all(mesh, Partial()))
        assert q.masked_fill(m, 1.5).placements == (Replicate(),) * mesh.ndim    # not linear: reduced first
        q.masked_fill_(m, 1.5)
        assert q.placements == (Replicate(),) * mesh.ndim
        torch.testing.assert_close(q.full_tensor(), x.masked_fill(mask, 1.5))
    _on_meshes(body)


def test_nonlinear_inplace_op_reduces_a_partial_self_in_place() -> None:
    x = _randn(4, 6)

    def body(mesh: DeviceMesh) -> None:
        placements = [Partial(), Shard(1)][: mesh.ndim]
        p = make_dtensor(x, mesh, placements)
        local = p._local_tensor
        assert p.add_(1.0).pow_(2) is p
        assert p.placements == (Replicate(), Shard(1))[: mesh.ndim] and p._local_tensor is local
        torch.testing.assert_close(p.full_tensor(), (x + 1.0) ** 2)
    _on_meshes(body)


def test_rms_norm_with_the_normalized_dim_sharded() -> None:
    x, w = _randn(4, 6), _randn(6, seed=1)

    def body(mesh: DeviceMesh) -> None:
        for layout in ([Shard(1)], [Shard(0), Shard(1)], [Partial()]):
            check(lambda a, b: F.rms_norm(a, (6,), b, eps=1e-6), [x, w], mesh,
                  [(layout * mesh.ndim)[: mesh.ndim], _all(mesh, Replicate())])
    _on_meshes(body)


def test_layer_norm_backward_with_a_partial_upstream_gradient() -> None:
    x, w, b, proj = _randn(4, 6), _randn(6, seed=1), _randn(6, seed=2), _randn(6, 5, seed=3)

    def body(mesh: DeviceMesh) -> None:
        # d(out)/d(normed) = grad @ proj.T with proj column-sharded: a Partial gradient reaches layer_norm
        fn = lambda a, weight, bias, p: F.layer_norm(a, (6,), weight, bias) @ p   # noqa: E731
        for x_layout in (Replicate(), Shard(0)):
            check(fn, [x, w, b, proj], mesh,
                  [_all(mesh, x_layout), _all(mesh, Replicate()), _all(mesh, Replicate()), _all(mesh, Shard(1))])
    _on_meshes(body)


# -- 2. in-place views ---------------------------------------------------------------------------------------

def test_vector_matrix_product_with_sharded_vector() -> None:
    v, m = _randn(6), _randn(6, 5, seed=1)

    def body(mesh: DeviceMesh) -> None:
        for layout in (Replicate(), Shard(1), Shard(0)):
            out = check(torch.matmul, [v, m], mesh, [_all(mesh, Shard(0)), _all(mesh, layout)])
            assert out.shape == (5,) and out._local_tensor.ndim == 1
    _on_meshes(body)


def test_inplace_views_update_shape_stride_and_placements() -> None:
    x = _randn(1, 6, 4)

    def body(mesh: DeviceMesh) -> None:
        d = make_dtensor(x, mesh, [Shard(1), Partial()][: mesh.ndim])
        assert d.squeeze_(0) is d
        assert d.shape == (6, 4) and d.stride() == (4, 1) and d.placements == (Shard(0), Partial())[: mesh.ndim]
        d.unsqueeze_(-1)
        assert d.shape == (6, 4, 1) and d.placements[0] == Shard(0)
        d.squeeze_()
        d.transpose_(0, 1)
        assert d.shape == (4, 6) and d.stride() == (1, 4) and d.placements[0] == Shard(1)
        d.t_()
        assert d.shape == (6, 4) and d.placements[0] == Shard(0)
        torch.testing.assert_close(d.full_tensor(), x[0])
        d.squeeze_(0)     # not a size-1 dim: no-op, even where a local shard has one row
        assert d.shape == (6, 4)
        r = make_dtensor(x[0], mesh, _all(mesh, Replicate()))
        r.as_strided_((4, 6), (1, 4))
        torch.testing.assert_close(r.full_tensor(), x[0].clone().as_strided_((4, 6), (1, 4)))
        with pytest.raises(ShardingError, match="as_strided_"):
            d.as_strided_((4, 6), (1, 4))
        e = make_dtensor(x, mesh, _all(mesh, Shard(0)))          # a sharded size-1 dim can't vanish in place
        with pytest.raises(ShardingError, match="in place"):
            e.squeeze_(0)
    _on_meshes(body)


# -- 3. out= variants ----------------------------------------------------------------------------------------

def test_amsgrad_single_tensor_adam_matches_plain() -> None:
    """Adam(amsgrad=True, foreach=False) keeps its running maximum with torch.maximum(..., out=)."""
    init, grads = _randn(5, 4), [_randn(5, 4, seed=s) for s in (1, 2, 3)]

    def body(mesh: DeviceMesh) -> None:
        for layout, grad_layout in ((Shard(0), Shard(0)), (Shard(1), Partial()), (Replicate(), Shard(1))):
            plain = init.clone().requires_grad_()
            dist = torch.nn.Parameter(make_dtensor(init, mesh, _all(mesh, layout)))
            options = {"lr": 0.1, "amsgrad": True, "foreach": False}
            plain_opt, dist_opt = torch.optim.Adam([plain], **options), torch.optim.Adam([dist], **options)
            for g in grads:
                plain.grad, dist.grad = g.clone(), make_dtensor(g, mesh, _all(mesh, grad_layout))
                plain_opt.step()
                dist_opt.step()
            assert dist.placements == (layout,) * mesh.ndim
            torch.testing.assert_close(dist.full_tensor(), plain.detach(), rtol=1e-5, atol=1e-6)
    _on_meshes(body)


def test_out_variants_take_the_result_placements_and_resize() -> None:
    a, b = _randn(4, 6), _randn(4, 6, seed=1)

    def body(mesh: DeviceMesh) -> None:
        x, y = make_dtensor(a, mesh, _all(mesh, Shard(0))), make_dtensor(b, mesh, _all(mesh, Shard(0)))
        out = make_dtensor(torch.zeros(4, 6), mesh, _all(mesh, Replicate()))
        assert torch.maximum(x, y, out=out) is out
        assert out.placements == (Shard(0),) * mesh.ndim
        torch.testing.assert_close(out.full_tensor(), torch.maximum(a, b))
        wide = make_dtensor(torch.zeros(4, 6, dtype=torch.float64), mesh, _all(mesh, Shard(0)))
        torch.add(x, y, out=wide)                                   # cast into out's dtype
        assert wide.dtype == torch.float64
        torch.testing.assert_close(wide.full_tensor(), (a + b).double())
        empty = make_dtensor(torch.zeros(0), mesh, _all(mesh, Replicate()))
        torch.mul(x, y, out=empty)                                  # resized to the result's shape
        assert empty.shape == (4, 6) and empty.placements == (Shard(0),) * mesh.ndim
        torch.testing.assert_close(empty.full_tensor(), a * b)
        values = make_dtensor(torch.zeros(4), mesh, _all(mesh, Replicate()))
        indices = make_dtensor(torch.zeros(4, dtype=torch.long), mesh, _all(mesh, Replicate()))
        got = torch.max(x, 1, out=(values, indices))               # several outputs
        assert got[0] is values and got[1] is indices
        torch.testing.assert_close(values.full_tensor(), a.max(1).values)
        torch.testing.assert_close(indices.full_tensor(), a.max(1).indices)
        with pytest.raises(ValueError, match="out= argument"):
            torch.maximum(x, y, out=torch.zeros(4, 6))
    _on_meshes(body)


# -- 4. new_empty_strided, scatter, flip, cumprod ------------------------------------------------------------

def test_new_empty_strided_keeps_the_layout_of_a_same_size_input() -> None:
    x = _randn(4, 6)

    def body(mesh: DeviceMesh) -> None:
        d = make_dtensor(x, mesh, [Shard(0), Partial()][: mesh.ndim])
        same = d.new_empty_strided((4, 6), (1, 4))
        assert same.placements == (Shard(0), Replicate())[: mesh.ndim] and same.stride() == (1, 4)
        assert same._local_tensor.shape == d._local_tensor.shape and same._local_tensor.stride()[0] == 1
        other = d.new_empty_strided((3, 6), (6, 1))
        assert other.placements == (Replicate(),) * mesh.ndim and other._local_tensor.shape == (3, 6)
        # AccumulateGrad re-strides a transposed gradient through new_empty_strided: it stays sharded
        p = make_dtensor(x, mesh, _all(mesh, Shard(0)), requires_grad=True)
        c = _randn(6, 4, seed=1)
        (p.t().contiguous() * make_dtensor(c, mesh, _all(mesh, Shard(1)))).sum().backward()
        assert p.grad.placements == (Shard(0),) * mesh.ndim and p.grad.stride() == (6, 1)
        torch.testing.assert_close(p.grad.full_tensor(), c.t())
    _on_meshes(body)


def test_max_dim_prod_flip_cumprod_and_scatter_parity() -> None:
    x = _randn(4, 6)
    x[1, 2] = 0.0       # a zero: prod's backward takes its cumprod/flip path (cumprod's own backward with a zero
    # builds a plain full-size tensor, which dispatch refuses as ambiguous; the cumprod cases below are zero-free)
    index = torch.randint(0, 6, (4, 3), generator=torch.Generator().manual_seed(5))
    fns = [lambda a: a.max(1).values, lambda a: a.max(0).values, lambda a: a.prod(1), lambda a: a.prod(0),
           lambda a: a.flip(1), lambda a: a.flip(0, 1), lambda a: (a + 3.0).cumprod(1), lambda a: (a + 3.0).cumprod(0),
           lambda a, i: a.new_zeros(4, 6).scatter(1, i, a[:, :3]), lambda a, i: a.gather(1, i) * 2.0]

    def body(mesh: DeviceMesh) -> None:
        layouts = [_all(mesh, Shard(0)), _all(mesh, Shard(1)), [Shard(0), Shard(1)][: mesh.ndim],
                   _all(mesh, Replicate()), _all(mesh, Partial())]
        for k, fn in enumerate(fns):
            for layout in layouts if mesh.ndim == 1 else layouts[k % 2::2]:
                if fn.__code__.co_argcount == 2:     # with the index, replicated
                    check(fn, [x, index], mesh, [layout, _all(mesh, Replicate())])
                else:
                    check(fn, [x], mesh, [layout])
    _on_meshes(body)


def test_scatter_keeps_shards_off_the_scattered_dim_and_partial() -> None:
    x, src = _randn(4, 6), _randn(4, 6, seed=1)
    index = torch.randint(0, 6, (4, 6), generator=torch.Generator().manual_seed(2))

    def body(mesh: DeviceMesh) -> None:
        idx = make_dtensor(index, mesh, _all(mesh, Shard(0)))
        out = make_dtensor(x, mesh, _all(mesh, Shard(0))).scatter(1, idx, make_dtensor(src, mesh, _all(mesh, Shard(0))))
        assert out.placements == (Shard(0),) * mesh.ndim
        torch.testing.assert_close(out.full_tensor(), x.scatter(1, index, src))
        rep = make_dtensor(index, mesh, _all(mesh, Replicate()))
        partial = make_dtensor(x, mesh, _all(mesh, Partial()))
        out = partial.scatter(1, rep, make_dtensor(src, mesh, _all(mesh, Partial())))
        assert out.placements == (Partial(),) * mesh.ndim
        torch.testing.assert_close(out.full_tensor(), x.scatter(1, index, src))
        assert partial.scatter(1, rep, 0.0).placements == (Partial(),) * mesh.ndim
        filled = partial.scatter(1, rep, 2.0)        # not linear: reduced (scattered to rows, the cheapest)
        assert not any(p.is_partial() for p in filled.placements)
        torch.testing.assert_close(filled.full_tensor(), x.scatter(1, index, 2.0))
        partial.scatter_(1, rep, 2.0)                          # in place: reduced first
        torch.testing.assert_close(partial.full_tensor(), x.scatter(1, index, 2.0))
        sharded = make_dtensor(x, mesh, _all(mesh, Shard(1)))
        with pytest.raises(ShardingError, match="in place"):  # the scattered dim of a written self can't move
            sharded.scatter_(1, rep, 2.0)
    _on_meshes(body)


# -- 5. the int-list cache key -------------------------------------------------------------------------------

def test_int_list_arguments_hit_the_fast_path() -> None:
    """sum(dim=[...]) and view(size) are cached under `(list, *ints)` by both paths, so a repeat runs fast."""
    x = _randn(4, 6)

    def body(mesh: DeviceMesh) -> None:
        d = make_dtensor(x, mesh, _all(mesh, Shard(0)))
        for op, args in ((aten.sum.dim_IntList, (d, [1])), (aten.view.default, (d, (4, 3, 2))),
                         (aten.sum.dim_IntList, (d, [0, 1], True))):
            first = op(*args)
            assert any(key[0] is op._op and key[2] == (list, *args[1]) for key in mesh.dispatch_cache)
            key = call_key(op, args, {}, DTensor)[0]
            assert mesh.dispatch_cache[key].path is Path.DIRECT_ONE, f"{op} missed the fast path"
            again = op(*args)
            assert again.placements == first.placements
            torch.testing.assert_close(again.full_tensor(), first.full_tensor())
        torch.testing.assert_close(d.sum([1]).full_tensor(), x.sum(1))
    _on_meshes(body)
