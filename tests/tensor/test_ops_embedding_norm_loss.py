"""Sharding rules for embedding (vocab-, column- and id-sharded), softmax / log_softmax, layer norm, rms norm,
nll_loss / cross_entropy and mse_loss, forward and backward, against plain torch.

Layouts: every combination on 1- and 2-rank meshes, a fixed sample on 4-rank ones. Sizes are odd (a vocab
of 11 rows over 4 ranks is 3, 3, 3, 2) and targets include ignore_index, so an averaged-means shortcut or an
unmasked lookup would show.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from spmd.device_mesh import DeviceMesh
from spmd.tensor import Partial, Placement, Replicate, Shard
from tests.tensor.rule_checks import MESH_SHAPES, budget, check, combos, layouts, make_dtensor, on_meshes, sample

torch.manual_seed(0)
TABLE = torch.randn(11, 6)
IDS = torch.tensor([[10, 0, 3, 3, 7], [1, 2, 9, 5, 3], [4, 8, 6, 0, 10]])
ACTIVATIONS = torch.randn(5, 6, 3)
LOGITS = torch.randn(7, 5)
TARGETS = torch.tensor([0, 4, -100, 2, 2, 1, 3])
CLASS_WEIGHTS = torch.rand(5) + 0.5
REGRESSION_TARGETS = torch.randn(7, 5)
NORM_WEIGHT, NORM_BIAS = torch.randn(3), torch.randn(3)


def _rep(mesh: DeviceMesh) -> list[Placement]:
    return [Replicate()] * mesh.ndim


# -- embedding ------------------------------------------------------------------------------------------------

def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def _lookup_padded(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table, padding_idx=3)


def _lookup_freq(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table, scale_grad_by_freq=True)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_embedding_every_layout(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh: DeviceMesh) -> None:
        for seed, fn in enumerate((_lookup, _lookup_padded, _lookup_freq)):
            for table_layout, ids_layout in combos(layouts(2, mesh, partial=True), layouts(2, mesh),
                                                   limit=budget(mesh, on_two=10), seed=seed):
                check(fn, [TABLE, IDS], mesh, [table_layout, ids_layout])
    on_meshes(body, [mesh_shape])


def test_vocab_sharded_embedding_is_a_masked_partial_lookup() -> None:
    def body(mesh: DeviceMesh) -> None:
        vocab = [Shard(0)] * mesh.ndim
        out = check(_lookup, [TABLE, IDS], mesh, [vocab, _rep(mesh)], expect_placements=[Partial()] * mesh.ndim)
        # Each rank's partial holds the rows of the ids it owns and zeros elsewhere.
        local = out.to_local()
        rows_held = local.abs().sum(-1) != 0
        spec = make_dtensor(TABLE, mesh, vocab)._spec
        _, offset = spec.local_shape_and_offset(mesh.get_coordinate())
        owned = (IDS >= offset[0]) & (IDS < offset[0] + spec.local_shape()[0])
        assert torch.equal(rows_held, owned)
        check(_lookup, [TABLE, IDS], mesh, [[Shard(1)] * mesh.ndim, _rep(mesh)],
              expect_placements=[Shard(2)] * mesh.ndim)
        check(_lookup, [TABLE, IDS], mesh, [_rep(mesh), [Shard(1)] * mesh.ndim],
              expect_placements=[Shard(1)] * mesh.ndim)
    on_meshes(body, [(4,), (2, 2)])


def test_embedding_backward_layouts() -> None:
    """Batch-sharded ids give a Partial table gradient (each rank adds its rows); column-sharded tables a
    column-sharded one; with scale_grad_by_freq the counts must be global, so ids are gathered."""
    def body(mesh: DeviceMesh) -> None:
        table = make_dtensor(TABLE, mesh, [Replicate()], requires_grad=True)
        ids = make_dtensor(IDS, mesh, [Shard(0)])
        _lookup(table, ids).backward(make_dtensor(torch.ones(3, 5, 6), mesh, [Shard(0)]))
        assert table.grad.placements == (Partial(),)
        table = make_dtensor(TABLE, mesh, [Shard(1)], requires_grad=True)
        _lookup(table, make_dtensor(IDS, mesh, [Replicate()])).backward(
            make_dtensor(torch.ones(3, 5, 6), mesh, [Shard(2)]))
        assert table.grad.placements == (Shard(1),)
        check(_lookup_freq, [TABLE, IDS], mesh, [[Replicate()], [Shard(1)]])
    on_meshes(body, [(2,)])


# -- softmax, layer norm, rms norm ----------------------------------------------------------------------------

def _softmax_last(x: torch.Tensor) -> torch.Tensor:
    return x.softmax(-1)


def _log_softmax_mid(x: torch.Tensor) -> torch.Tensor:
    return x.log_softmax(1)


def _layer_norm_plain(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (3,))


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (3,), weight, bias, eps=1e-4)


def _layer_norm_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (6, 3), weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (3,), weight, eps=1e-5)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_normalizations_every_layout(mesh_shape: tuple[int, ...]) -> None:
    weight, bias = NORM_WEIGHT, NORM_BIAS
    weight_2d, bias_2d = torch.randn(6, 3), torch.randn(6, 3)

    def body(mesh: DeviceMesh) -> None:
        limit = budget(mesh)
        for x_layout in sample(layouts(3, mesh, partial=True), limit):
            check(_softmax_last, [ACTIVATIONS], mesh, [x_layout])
            check(_log_softmax_mid, [ACTIVATIONS], mesh, [x_layout])
            check(_layer_norm_plain, [ACTIVATIONS], mesh, [x_layout])
        for x_layout, w_layout in combos(layouts(3, mesh, partial=True), layouts(1, mesh), limit=limit):
            check(_layer_norm, [ACTIVATIONS, weight, bias], mesh, [x_layout, w_layout, w_layout])
        for x_layout, w_layout in combos(layouts(3, mesh), layouts(2, mesh), limit=limit and limit // 2):
            check(_layer_norm_2d, [ACTIVATIONS, weight_2d, bias_2d], mesh, [x_layout, w_layout, w_layout])
        # rms_norm reaches DTensor decomposed (pow, mean, add_, rsqrt, mul); the normalized dim is kept whole.
        for x_layout, w_layout in combos(layouts(3, mesh, shard_dims=(0, 1)), layouts(1, mesh), limit=limit):
            check(_rms_norm, [ACTIVATIONS, weight], mesh, [x_layout, w_layout])
    on_meshes(body, [mesh_shape])


def test_normalizations_keep_rows_sharded() -> None:
    def body(mesh: DeviceMesh) -> None:
        rows = [Shard(0)]
        check(_softmax_last, [ACTIVATIONS], mesh, [rows], expect_placements=rows)
        check(_layer_norm, [ACTIVATIONS, NORM_WEIGHT, NORM_BIAS], mesh, [[Shard(1)], [Replicate()], [Replicate()]],
              expect_placements=[Shard(1)])
        x = make_dtensor(ACTIVATIONS, mesh, rows, requires_grad=True)
        w = make_dtensor(NORM_WEIGHT, mesh, [Replicate()], requires_grad=True)
        F.layer_norm(x, (3,), w).backward(make_dtensor(torch.ones(5, 6, 3), mesh, rows))
        assert x.grad.placements == (Shard(0),) and w.grad.placements == (Partial(),)   # weight grad: row sums
    on_meshes(body, [(2,)])


# -- nll_loss / cross_entropy ---------------------------------------------------------------------------------

def _nll(reduction: str, weighted: bool = False):
    def loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.nll_loss(logits.log_softmax(-1), targets, weight if weighted else None, reduction=reduction)
    loss.__name__ = f"nll_{reduction}{'_weighted' if weighted else ''}"
    return loss


def _mse(reduction: str):
    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(x, y, reduction=reduction)
    loss.__name__ = f"mse_{reduction}"
    return loss


def _cross_entropy_smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, label_smoothing=0.1)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_losses_every_layout(mesh_shape: tuple[int, ...]) -> None:
    logits_2d, targets_2d = torch.randn(3, 5, 2, 3), torch.randint(0, 5, (3, 2, 3))
    targets_2d[0, 1, 1] = -100

    def body(mesh: DeviceMesh) -> None:
        limit = budget(mesh)
        pairs = combos(layouts(2, mesh, partial=True), layouts(1, mesh), limit=budget(mesh, on_two=5))
        for reduction in ("mean", "sum", "none"):
            for logits_layout, target_layout in pairs:
                check(_nll(reduction), [LOGITS, TARGETS], mesh, [logits_layout, target_layout])
                check(_nll(reduction, weighted=True), [LOGITS, TARGETS, CLASS_WEIGHTS], mesh,
                      [logits_layout, target_layout, _rep(mesh)], constants=(2,))
        for reduction in ("mean", "sum", "none"):
            for x_layout, y_layout in combos(layouts(2, mesh, partial=True), layouts(2, mesh),
                                             limit=budget(mesh, on_two=6)):
                check(_mse(reduction), [LOGITS, REGRESSION_TARGETS], mesh, [x_layout, y_layout])
        for logits_layout, target_layout in pairs:
            check(F.cross_entropy, [LOGITS, TARGETS], mesh, [logits_layout, target_layout])
            check(_cross_entropy_smoothed, [LOGITS, TARGETS], mesh, [logits_layout, target_layout])
        for logits_layout, target_layout in combos(layouts(4, mesh, shard_dims=(0, 2, 3)), layouts(3, mesh),
                                                   limit=limit and 4):
            check(F.cross_entropy, [logits_2d, targets_2d], mesh, [logits_layout, target_layout])
    on_meshes(body, [mesh_shape])


def test_loss_over_sharded_rows() -> None:
    """Rows sharded: 'none' stays sharded, 'sum' is Partial, 'mean' is all-reduced once to the exact mean
    (mse_loss's mean stays Partial: a local sum over the global count)."""
    def body(mesh: DeviceMesh) -> None:
        rows: Sequence[Placement] = [Shard(0)]
        check(_mse("mean"), [LOGITS, REGRESSION_TARGETS], mesh, [rows, rows], expect_placements=[Partial()])
        check(_nll("none"), [LOGITS, TARGETS], mesh, [rows, rows], expect_placements=[Shard(0)])
        check(_nll("sum"), [LOGITS, TARGETS], mesh, [rows, rows], expect_placements=[Partial()])
        check(_nll("mean", weighted=True), [LOGITS, TARGETS, CLASS_WEIGHTS], mesh,
              [rows, rows, [Replicate()]], expect_placements=[Replicate()], constants=(2,))
        # nll_loss is linear in its input: Partial log-probabilities give a Partial loss, no communication.
        check(F.nll_loss, [LOGITS, TARGETS], mesh, [[Partial()], [Replicate()]], expect_placements=[Partial()])
    on_meshes(body, [(4,)])
