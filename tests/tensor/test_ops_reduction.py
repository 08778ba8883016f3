"""Reduction sharding rules: sum, prod, mean, amax/amin, max/min (with and without dim), argmax, logsumexp,
var/std(_mean), vector norms.

Each reduction runs on every input layout (Replicate, Shard of each dim, Partial) on the 1- and 2-rank
meshes and on a fixed sample of layouts on the 4-rank ones, comparing the full result and the full input
gradient with plain torch. The input is 5 x 6 x 3, so shards are uneven and, on 4 ranks, dim 2 has an empty
shard (1, 1, 1, 0): the max/min kernels must contribute their identity there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from spmd.device_mesh import DeviceMesh
from spmd.tensor import Partial, Replicate, Shard
from tests.tensor.rule_checks import MESH_SHAPES, check, layouts, make_dtensor, on_meshes, sample

torch.manual_seed(0)
X = torch.randn(5, 6, 3)

REDUCTIONS: dict[str, Callable[[torch.Tensor], object]] = {
    "sum": lambda t: t.sum(),
    "sum_dim0": lambda t: t.sum(0),
    "sum_dims12_keepdim": lambda t: t.sum((1, 2), keepdim=True),
    "mean": lambda t: t.mean(),
    "mean_dim0": lambda t: t.mean(0),
    "mean_last_keepdim": lambda t: t.mean(-1, keepdim=True),
    "amax_dim1": lambda t: t.amax(1),
    "amin_dims02_keepdim": lambda t: t.amin((0, 2), keepdim=True),
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "max_dim1": lambda t: t.max(1),
    "min_dim0_keepdim": lambda t: t.min(0, keepdim=True),
    "var": lambda t: t.var(),
    "var_dim0": lambda t: t.var(0),
    "var_dims01_correction0": lambda t: t.var((0, 1), correction=0),
    "std": lambda t: t.std(),
    "std_dim1_keepdim": lambda t: t.std(1, keepdim=True),
    "var_mean_dim0": lambda t: torch.var_mean(t, 0),
    "std_mean_dims02": lambda t: torch.std_mean(t, (0, 2)),
    "norm2": lambda t: t.norm(),
    "norm1_dim0": lambda t: torch.linalg.vector_norm(t, 1, dim=0),
    "norm3_dim1_keepdim": lambda t: torch.linalg.vector_norm(t, 3, dim=1, keepdim=True),
    "norm_inf_dims01": lambda t: torch.linalg.vector_norm(t, math.inf, dim=(0, 1)),
    "norm_neg_inf": lambda t: torch.linalg.vector_norm(t, -math.inf),
    "logsumexp_dims01": lambda t: torch.logsumexp(t, (0, 1)),
}
NO_GRAD = {
    "argmax_dim2": lambda t: t.argmax(2),
    "any": lambda t: (t > 1).any(),
    "any_dim1": lambda t: (t > 1).any(1),
    "all_dims02_keepdim": lambda t: (t > -1).all((0, 2), keepdim=True),
    "norm0_dim0": lambda t: torch.linalg.vector_norm(t, 0, dim=0),
    "prod": lambda t: t.prod(),          # (its backward runs flip / cumprod, which have no rules yet)
    "prod_dim1": lambda t: t.prod(1),
}


def _named(name: str, fn: Callable) -> Callable:
    fn.__name__ = name
    return fn


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_reductions_every_layout(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh: DeviceMesh) -> None:
        all_layouts = layouts(3, mesh, partial=True)
        for index, (name, fn) in enumerate({**REDUCTIONS, **NO_GRAD}.items()):
            chosen = all_layouts if mesh.size() == 2 else sample(all_layouts, 2, seed=index)
            for placements in chosen:
                # The norm's backward masks zero norms with an in-place masked_fill_ on a Partial input's
                # gradient, which the pointwise rules refuse: Partial inputs are checked forward only there.
                partial_norm = name.startswith("norm") and any(p.is_partial() for p in placements)
                check(_named(name, fn), [X], mesh, [placements], grad=name in REDUCTIONS and not partial_norm)
    on_meshes(body, [mesh_shape])


def test_reducing_a_sharded_dim_defers_the_reduction() -> None:
    """No communication in the reduction itself: the result is Partial of the matching op."""
    def body(mesh: DeviceMesh) -> None:
        s0, s2 = [Shard(0)], [Shard(2)]
        check(lambda t: t.sum(0), [X], mesh, [s0], expect_placements=[Partial()])
        check(lambda t: t.sum(0), [X], mesh, [s2], expect_placements=[Shard(1)])       # kept dim, renumbered
        check(lambda t: t.sum(0, keepdim=True), [X], mesh, [s2], expect_placements=[Shard(2)])
        check(lambda t: t.mean(0), [X], mesh, [s0], expect_placements=[Partial()])     # local sum / global count
        check(lambda t: t.amax(2), [X], mesh, [s2], expect_placements=[Partial("max")])
        check(lambda t: t.min(), [X], mesh, [s0], expect_placements=[Partial("min")])
        check(lambda t: t.var(0), [X], mesh, [s0], expect_placements=[Partial()])
        check(lambda t: t.std(0), [X], mesh, [s0], expect_placements=[Replicate()])
        check(lambda t: torch.linalg.vector_norm(t, math.inf), [X], mesh, [s0], expect_placements=[Partial("max")])
        check(lambda t: t.sum(), [X], mesh, [[Partial()]], expect_placements=[Partial()])
        check(lambda t: t.max(0).values, [X], mesh, [s2], expect_placements=[Shard(1)])
        check(lambda t: t.prod(0), [X], mesh, [s0], expect_placements=[Partial("product")], grad=False)
    on_meshes(body, [(2,), (4,)])


def test_mean_over_uneven_shards_is_exact() -> None:
    """5 rows over 4 ranks are 2, 2, 1, 0 rows: averaging per-rank means would be far off."""
    rows = torch.arange(5.0).unsqueeze(1).expand(5, 2).contiguous()

    def body(mesh: DeviceMesh) -> None:
        out = make_dtensor(rows, mesh, [Shard(0)]).mean(0)
        torch.testing.assert_close(out.full_tensor(), torch.full((2,), 2.0))
    on_meshes(body, [(4,)])


def test_extrema_on_empty_shards_and_integers() -> None:
    small = torch.tensor([[3, -7], [5, 1], [-2, 9]])          # 3 rows over 4 ranks: the last rank holds none

    def body(mesh: DeviceMesh) -> None:
        rows = [Shard(0)] * mesh.ndim
        for fn in (lambda t: t.max(), lambda t: t.amin(0), lambda t: t.sum(0)):
            out = fn(make_dtensor(small, mesh, rows))
            torch.testing.assert_close(out.full_tensor(), fn(small))
        check(lambda t: torch.linalg.vector_norm(t, -math.inf, dim=0), [small.float()], mesh, [rows])
    on_meshes(body, [(4,), (2, 2)])
