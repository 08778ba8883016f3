"""TensorMemoryTracker counts live storage bytes exactly: allocations, views, frees, out-of-dispatch resizes,
tracked pre-existing tensors, DTensors' local tensors, and a training step's peak against an analytic count."""

from __future__ import annotations

import torch
from torch import nn

from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks
from spmd.testing.memory import TensorMemoryTracker, storage_key


def test_allocations_views_frees_and_resizes() -> None:
    with TensorMemoryTracker() as tracker:
        a = torch.empty(1000)                       # 4000 bytes
        view = a[10:20].view(2, 5)                  # same storage: nothing more
        assert tracker.current_bytes == 4000
        b = torch.ones(500, dtype=torch.float64)    # +4000
        assert tracker.current_bytes == 8000
        del b
        torch.empty(0)                              # any op re-reads the live set
        assert tracker.current_bytes == 4000
        a.untyped_storage().resize_(0)              # outside dispatch, seen at the next op
        torch.empty(0)
        assert tracker.current_bytes == 0
        a.untyped_storage().resize_(12000)
        torch.empty(0)
        assert tracker.current_bytes == 12000
        del a, view
        torch.empty(0)
    assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 12000


def test_tracked_tensors_and_dtensors_count_their_local_bytes() -> None:
    def body(rank: int, size: int) -> tuple[int, int]:
        mesh = init_device_mesh("cpu", (size,))
        weight = distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)])   # rank 0: 5 rows, rank 1: 5 rows
        with TensorMemoryTracker() as tracker:
            tracker.track([weight])
            tracked = tracker.current_bytes
            doubled = weight * 2                     # a DTensor output: its local tensor is counted
            after = tracker.current_bytes
            del doubled
        return tracked, after

    assert run_ranks(body, 2) == [(80, 160), (80, 160)]


def test_training_step_peak_matches_an_analytic_count() -> None:
    # Linear(256 -> 256) on a (64, 256) batch, sum loss: before the step the parameters and the input are live,
    # after it the gradients too (nothing else survives), and during forward the (64, 256) output was live.
    layer = nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with TensorMemoryTracker() as tracker:
        tracker.track([*layer.parameters(), x])
        start = tracker.current_bytes
        layer(x).sum().backward()
        torch.empty(0)
        end = tracker.current_bytes
    params = (256 * 256 + 256) * 4
    assert start == params + 64 * 256 * 4
    assert end == start + params                      # the gradients
    assert tracker.peak_bytes >= start + 64 * 256 * 4


def test_peak_breakdown_names_classified_storages() -> None:
    weight = torch.zeros(1 << 18)                       # 1 MiB
    with TensorMemoryTracker(classify=lambda: {storage_key(weight): "weights"}) as tracker:
        tracker.track([weight])
        scratch = torch.zeros(1 << 19)                  # 2 MiB: the new peak
        del scratch
    assert tracker.peak_breakdown == {"weights": 1 << 20, "other": 2 << 20}
