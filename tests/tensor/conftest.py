"""Shared helpers for the DTensor tests: the meshes every rule is tested on, and the parity check.

Every check compares `full_tensor()` of a DTensor computation (and the full gradients of its inputs) with the
same computation on plain tensors. Values are float32 on CPU; distributed results differ from the reference
by summation order inside reductions and, for Partial inputs, by the rounding of their random float32 terms
(a few ulps of the value, even when an op then computes in float64): rule_checks' RTOL/ATOL (1e-5) cover both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, init_device_mesh
from spmd.testing import run_ranks
from spmd.testing.dtensor import make_dtensor
from tests.tensor.rule_checks import ATOL, RTOL, checking_fallbacks

# Mesh shapes the issue asks for: 1, 2 and 4 ranks, and a 2-d mesh.
MESH_SHAPES: list[tuple[int, ...]] = [(1,), (2,), (4,), (2, 2)]


def mesh_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def make_mesh(shape: tuple[int, ...]):
    names = ("dp", "tp")[: len(shape)] if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def world_size_of(shape: tuple[int, ...]) -> int:
    size = 1
    for s in shape:
        size *= s
    return size


def placement_combos(ndim: int, mesh_ndim: int, partial: bool = True) -> list[tuple[Placement, ...]]:
    """Every placements tuple of Shard(each dim) / Replicate / Partial on a mesh of `mesh_ndim` dims."""
    options: list[Placement] = [Replicate(), *[Shard(d) for d in range(ndim)]]
    if partial:
        options.append(Partial())
    return list(itertools.product(options, repeat=mesh_ndim))


def check_parity(fn: Callable[..., Tensor], fulls: Sequence[Tensor], mesh, placements: Sequence[Sequence[Placement]],
                 grad: bool = True, seed: int = 0) -> DTensor:
    """Run `fn` on DTensors laid out as `placements` and on plain tensors; compare values and input gradients."""
    xs = [make_dtensor(full, mesh, list(pl)) for full, pl in zip(fulls, placements)]   # Partial: random terms
    refs = [full.clone() for full in fulls]
    if grad:
        xs = [x.requires_grad_(x.is_floating_point()) for x in xs]
        refs = [r.requires_grad_(r.is_floating_point()) for r in refs]
    out = fn(*xs)
    ref = fn(*refs)
    assert isinstance(out, DTensor), f"{fn} returned {type(out).__name__}, not a DTensor"
    torch.testing.assert_close(out.full_tensor(), ref, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"value mismatch for {placements}: {m}")
    if grad and ref.requires_grad:
        weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
        (out.full_tensor() * weight).sum().backward()
        (ref * weight).sum().backward()
        for x, r in zip(xs, refs):
            if r.requires_grad:
                assert isinstance(x.grad, DTensor)
                torch.testing.assert_close(x.grad.full_tensor(), r.grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"gradient mismatch for {placements}: {m}")
    return out


def run_on_mesh(mesh_shape: tuple[int, ...], body: Callable[..., object], timeout: float = 60.0,
                expect_fallbacks: Sequence[str] = ()) -> list[object]:
    """Run `body(mesh)` on every rank of a fresh mesh of `mesh_shape` (threads transport).

    Each rank thread uses one intra-op thread (several rank threads sharing torch's pool crawl). A
    replicate-compute-reshard fallback fails the test unless named in `expect_fallbacks` (then it must fire).
    """
    def rank_body(rank: int, world_size: int) -> object:
        torch.set_num_threads(1)
        return checking_fallbacks(lambda: body(make_mesh(mesh_shape)), expect_fallbacks, world_size > 1)
    return run_ranks(rank_body, world_size_of(mesh_shape), timeout=timeout)


def spread(combos: Sequence, fns: Sequence, per_combo: int) -> list[tuple]:
    """(combo, fn) pairs: every combo with `per_combo` fns, rotating so that every fn meets several combos."""
    per_combo = min(per_combo, len(fns))
    return [(combo, fns[(i * per_combo + j) % len(fns)]) for i, combo in enumerate(combos) for j in range(per_combo)]


@pytest.fixture(params=MESH_SHAPES, ids=mesh_id)
def mesh_shape(request: pytest.FixtureRequest) -> tuple[int, ...]:
    return request.param
