"""loss_parallel: cross-entropy on vocab-sharded DTensor logits equals F.cross_entropy on the whole logits, loss
and gradient, for every reduction, class weights, ignore_index, label smoothing, spatial (N, C, L) inputs and
uneven or empty class shards; and it moves a few values per row, never the logits.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.parallel import loss_parallel
from spmd.testing import run_ranks

TIMEOUT = 60.0


def logits_and_target(rows: int, classes: int, *, spatial: int = 0, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (rows, classes, spatial) if spatial else (rows, classes)
    target_shape = (rows, spatial) if spatial else (rows,)
    return (torch.randn(shape, generator=generator) * 3,
            torch.randint(0, classes, target_shape, generator=generator))


def sharded_cross_entropy(world_size: int, logits: Tensor, target: Tensor, class_dim: int = -1,
                          target_as_dtensor: bool = False, **options: Any) -> list[tuple[Tensor, Tensor]]:
    """(full loss, full logits gradient) of every rank, under loss_parallel with the logits Shard(class_dim)."""
    def body(rank: int, size: int) -> tuple[Tensor, Tensor]:
        mesh = init_device_mesh("cpu", (size,))
        x = distribute_tensor(logits, mesh, [Shard(class_dim)]).requires_grad_()
        t = distribute_tensor(target, mesh, [Replicate()]) if target_as_dtensor else target
        with loss_parallel():
            loss = F.cross_entropy(x, t, **options)
            assert isinstance(loss, DTensor)
            # label smoothing adds a sum over the class dim: DTensor's rules leave it Partial until it is read
            assert loss.placements == ((Partial(),) if options.get("label_smoothing") else (Replicate(),))
            loss.backward(torch.ones_like(loss)) if loss.ndim else loss.backward()
        return loss.full_tensor(), x.grad.full_tensor()
    return run_ranks(body, world_size, timeout=TIMEOUT)


def expected(logits: Tensor, target: Tensor, **options: Any) -> tuple[Tensor, Tensor]:
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, **options)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def check(results: list[tuple[Tensor, Tensor]], want: tuple[Tensor, Tensor]) -> None:
    for loss, grad in results:
        torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_cross_entropy_on_the_whole_logits(reduction: str, world_size: int) -> None:
    logits, target = logits_and_target(6, 12)
    check(sharded_cross_entropy(world_size, logits, target, reduction=reduction),
          expected(logits, target, reduction=reduction))


def test_class_weights_ignore_index_and_label_smoothing() -> None:
    logits, target = logits_and_target(8, 10, seed=1)
    target[[1, 5]] = -100
    weight = torch.rand(10, generator=torch.Generator().manual_seed(2)) + 0.5
    for options in ({"weight": weight}, {"ignore_index": -100}, {"weight": weight, "reduction": "sum"},
                    {"weight": weight, "reduction": "none"}):
        check(sharded_cross_entropy(2, logits, target, **options), expected(logits, target, **options))
    smoothing = {"label_smoothing": 0.1, "ignore_index": -100}
    check(sharded_cross_entropy(2, logits, target, target_as_dtensor=True, **smoothing),
          expected(logits, target, **smoothing))


def test_an_ignore_index_inside_the_class_range() -> None:
    logits, target = logits_and_target(8, 10, seed=3)
    target[[0, 3]] = 7
    check(sharded_cross_entropy(2, logits, target, ignore_index=7), expected(logits, target, ignore_index=7))


def test_uneven_and_empty_class_shards() -> None:
    for classes in (13, 3):          # 4, 4, 4, 1 and 1, 1, 1, 0 classes per rank
        logits, target = logits_and_target(5, classes, seed=classes)
        check(sharded_cross_entropy(4, logits, target), expected(logits, target))


def test_spatial_logits_sharded_on_dim_1_and_a_dtensor_target() -> None:
    logits, target = logits_and_target(3, 8, spatial=5, seed=4)
    check(sharded_cross_entropy(2, logits, target, class_dim=1, target_as_dtensor=True), expected(logits, target))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_rows_sharded_on_another_mesh_dim_stay_sharded(reduction: str) -> None:
    """A (dp, tp) mesh: logits (Shard(0), Shard(1)), the target (Shard(0), Replicate); mean is the exact global one."""
    logits, target = logits_and_target(7, 10, seed=5)
    target[2] = -100
    weight = torch.rand(10, generator=torch.Generator().manual_seed(6)) + 0.5

    def body(rank: int, size: int) -> tuple[Tensor, Tensor, tuple]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(logits, mesh, [Shard(0), Shard(1)]).requires_grad_()
        t = distribute_tensor(target, mesh, [Shard(0), Replicate()])
        with loss_parallel():
            loss = F.cross_entropy(x, t, weight=weight, reduction=reduction)
            loss.backward(torch.ones_like(loss)) if loss.ndim else loss.backward()
        return loss.full_tensor(), x.grad.full_tensor(), loss.placements
    want = expected(logits, target, weight=weight, reduction=reduction)
    results = run_ranks(body, 4, timeout=TIMEOUT)
    check([(loss, grad) for loss, grad, _ in results], want)
    placements = {"mean": (Replicate(), Replicate()), "sum": (Partial(), Replicate()),
                  "none": (Shard(0), Replicate())}[reduction]
    assert all(p == placements for _, _, p in results)


def test_only_a_few_values_per_row_move() -> None:
    rows, classes = 16, 64
    logits, target = logits_and_target(rows, classes)

    def body(rank: int, size: int) -> list[tuple[str, int]]:
        mesh = init_device_mesh("cpu", (size,))
        x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        group = mesh.get_group()
        seen: list[tuple[str, int]] = []
        run = group.run

        def recording_run(fingerprint, body, outputs, async_op, **options):
            seen.append((fingerprint.op, 0 if fingerprint.shape is None else torch.Size(fingerprint.shape).numel()))
            return run(fingerprint, body, outputs, async_op, **options)
        group.run = recording_run
        with loss_parallel():
            F.cross_entropy(x, target).backward()
        return seen
    for seen in run_ranks(body, 2, timeout=TIMEOUT):
        ops = collections.Counter(op for op, _ in seen)
        assert ops == {"all_reduce": 4}, ops      # forward: row max, row sum-exp, picked logit; backward: row sum
        assert max(numel for _, numel in seen) <= rows


def test_outside_the_context_the_logits_are_gathered_and_the_result_is_the_same() -> None:
    logits, target = logits_and_target(6, 8)

    def body(rank: int, size: int) -> Tensor:
        mesh = init_device_mesh("cpu", (size,))
        x = distribute_tensor(logits, mesh, [Shard(1)])
        return F.cross_entropy(x, distribute_tensor(target, mesh, [Replicate()])).full_tensor()
    for loss in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(loss, F.cross_entropy(logits, target))


def test_logits_not_sharded_on_the_class_dim_are_refused() -> None:
    logits, target = logits_and_target(6, 8)

    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        x = distribute_tensor(logits, mesh, [Shard(0)])
        with loss_parallel(), pytest.raises(ValueError, match=r"sharded on the class dim 1 over exactly one mesh dim"):
            F.cross_entropy(x, target)
    run_ranks(body, 2, timeout=TIMEOUT)
