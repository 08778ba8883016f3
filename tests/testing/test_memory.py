"""TensorMemoryTracker counts live storage bytes exactly: allocations, views, frees, out-of-dispatch resizes,
tracked pre-existing tensors, DTensors' local tensors and the temporaries inside their dispatch, a training step's
peak against an analytic count, and the same peaks as torch's own trackers (MemTracker on a plain step,
FSDPMemTracker on torch's FSDP2, which frees and re-allocates its unsharded parameters with resize_)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.tensor.random import manual_seed
from spmd.testing import run_ranks
from spmd.testing.memory import TensorMemoryTracker, storage_key
from tests.parity.models import batch, build, loss_fn
from tests.procpool import ProcPool


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


def test_temporaries_inside_dtensor_dispatch_count() -> None:
    # normal_ on a Shard(0) DTensor fills the global (64, 256) tensor on every rank and keeps this rank's half
    # (spmd.tensor.random): at the peak the rank holds its shard, the whole tensor and the copy of its half that
    # local_from_full makes (it returns a tensor not aliasing the whole) before it is copied into the shard.
    def body(rank: int, size: int) -> tuple[int, int]:
        mesh = init_device_mesh("cpu", (size,))
        weight = distribute_tensor(torch.zeros(64, 256), mesh, [Shard(0)])
        manual_seed(0)
        with TensorMemoryTracker() as tracker:
            tracker.track([weight])
            torch.nn.init.normal_(weight)
            torch.empty(0)
        return tracker.peak_bytes, tracker.current_bytes

    shard, full = 32 * 256 * 4, 64 * 256 * 4
    assert run_ranks(body, 2) == [(2 * shard + full, shard)] * 2


def _gpt_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss_fn("gpt", model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _both_peaks(torch_tracker: MemTracker, model: nn.Module, opt: torch.optim.Optimizer,
                x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """One step under torch's tracker and ours at once (ours inside): (ours, torch's) peak bytes."""
    with torch_tracker, TensorMemoryTracker() as ours:
        ours.track([*model.parameters(), opt.state, x, y])
        _gpt_step(model, opt, x, y)
    return ours.peak_bytes, torch_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_equals_torch_mem_tracker_on_a_training_step() -> None:
    model = build("gpt", width=64, layers=2, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch("gpt", 4)
    _gpt_step(model, opt, x, y)                         # the optimizer state exists from here on
    mem_tracker = MemTracker()
    mem_tracker.track_external(model, opt, x, y)
    ours, theirs = _both_peaks(mem_tracker, model, opt, x, y)
    assert ours == theirs                               # both count storages exactly on CPU (no rounding)
    assert ours > 3 * sum(p.nbytes for p in model.parameters())   # parameters, gradients, two AdamW moments


def _torch_fsdp2_peaks(rank: int, world_size: int) -> tuple[int, int, int]:
    """In a fresh pool process (torch's FSDPMemTracker patches FSDP2's hooks process-wide): (ours, torch's peak,
    a block's full parameter bytes) for one FSDP2 step."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build("gpt", width=64, layers=2, heads=4)
        mesh = torch_mesh("cpu", (2,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = batch("gpt", 4)
        _gpt_step(model, opt, x, y)
        fsdp_tracker = FSDPMemTracker(model, opt)
        fsdp_tracker.track_inputs((x, y))
        ours, theirs = _both_peaks(fsdp_tracker, model, opt, x, y)
        return ours, theirs, sum(p.nbytes for p in model.blocks[0].parameters()) * 2
    finally:
        dist.destroy_process_group()


def test_peak_equals_torch_fsdp_mem_tracker_on_torch_fsdp2(procpool: ProcPool) -> None:
    # torch's FSDP2 over a fake 2-rank process group: collectives allocate their outputs but move nothing, so
    # the memory pattern is FSDP2's (all-gather buffers, unsharded parameters freed and re-allocated with
    # untyped_storage().resize_ between ops, reduce-scatter buffers).
    [(ours, theirs, unsharded)] = procpool.run(_torch_fsdp2_peaks, 1, timeout=120)
    assert ours == theirs
    assert ours > unsharded
