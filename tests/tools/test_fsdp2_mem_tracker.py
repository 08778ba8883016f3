"""spmd's FSDPMemTracker over spmd's fully_shard against torch's FSDPMemTracker over torch's fully_shard (the
oracle): one Adam step of the same model on rank r of a 4-rank world (backend "fake" on both sides, torch's in a
pool process), category by category at the peak and module by module; the same tracker on 4 thread ranks of a
real job; TorchTitan's estimation under FakeTensorMode equal to the same steps with real tensors; the FSDP hooks
put back on exit; and the error for a model fully_shard did not shard."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import spmd
from spmd._tools.fsdp2_mem_tracker import FSDPMemTracker
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.fsdp.comm import DefaultAllGather, DefaultReduceScatter
from spmd.fsdp.state import state_of
from spmd.testing import run_ranks
from tests.procpool import ProcPool

WORLD = 4
EVEN = (32, 64, 32)     # every parameter's rows divide by 4: no shard is padded
UNEVEN = (30, 50, 22)   # torch.chunk gives rank 3 fewer rows (6 of 8, 11 of 13, 4 of 6)
# Where the two FSDP2s differ by design (see _assert_snapshots_match), every other category is compared exactly
TIMING = ("All Gather", "Sharded Grad", "Temp", "Unsharded Grad", "Total")


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.norm(self.fc1(x))))


def build(dims: tuple[int, int, int]) -> nn.Sequential:
    torch.manual_seed(0)
    width, first, second = dims
    return nn.Sequential(nn.Linear(width, width), Block(width, first), Block(width, second), nn.Linear(width, 8))


def _plain(snapshot: dict) -> dict[str, int]:
    """The CPU entry of a snapshot, categories by name (each tracker has its own enum)."""
    return {getattr(key, "value", key): nbytes for key, nbytes in snapshot.get(torch.device("cpu"), {}).items()}


def tracked_step(tracker_class: type, fully_shard_fn: Any, mesh: Any, dims: tuple[int, int, int],
                 forward_prefetch: bool = True) -> dict[str, Any]:
    """Shard blocks then root, take one Adam step (so the optimizer state exists), then track the second: its
    peak, the snapshot right after backward, and each FSDP module's snapshots."""
    model = build(dims)
    for module in (model[1], model[2], model):
        fully_shard_fn(module, mesh=mesh)
    if not forward_prefetch:      # torch's FSDP2 prefetches no all-gather in forward unless told to
        for module in (model[1], model[2], model):
            module.set_modules_to_forward_prefetch([])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(6, dims[0], generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    tracker = tracker_class(model, optimizer)
    tracker.track_inputs((x,))
    with tracker:
        model(x).sum().backward()
        after_backward = tracker.get_tracker_snapshot()
        optimizer.step()
        optimizer.zero_grad()
    return {"peak": _plain(tracker.get_tracker_snapshot("peak")), "after_backward": _plain(after_backward),
            "modules": {stats.mod_fqn: {state.value: [_plain(s) for s in snapshots]
                                        for state, snapshots in stats.snapshots.items()}
                        for stats in tracker.memory_tracking.values()}}


def _torch_side(rank: int, world_size: int, cases: list[tuple[tuple[int, int, int], int]]) -> list[dict]:
    """In a pool process (torch's tracker patches torch's FSDP2 process-wide): torch's FSDP2 on rank r of a fake
    4-rank process group, per case (dims, rank r)."""
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as TorchFSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = []
    for dims, fake_rank in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=WORLD)
        try:
            results.append(tracked_step(TorchFSDPMemTracker, torch_fully_shard, torch_mesh("cpu", (WORLD,)), dims))
        finally:
            dist.destroy_process_group()
    return results


def _spmd_side(dims: tuple[int, int, int], rank: int) -> dict:
    spmd.init_process_group("fake", rank=rank, world_size=WORLD, torch_default_group=False)
    try:
        return tracked_step(FSDPMemTracker, fully_shard, init_device_mesh("cpu", (WORLD,)), dims,
                            forward_prefetch=False)
    finally:
        spmd.destroy_process_group()


def _shard_bytes(module: nn.Module, rank: int, padded: bool) -> int:
    """Bytes of `module`'s parameters' shards on `rank` (Shard(0) over WORLD ranks, torch.chunk's rows), with
    every shard padded to the largest (what FSDP2 communicates) or not."""
    total = 0
    for param in module.parameters():
        rows, row_bytes = param.shape[0], param.nbytes // param.shape[0]
        per_rank = math.ceil(rows / WORLD)
        total += (per_rank if padded else max(0, min(per_rank, rows - per_rank * rank))) * row_bytes
    return total


def _assert_snapshots_match(ours: dict, theirs: dict, last_param_grad_bytes: dict[str, int]) -> None:
    """Per FSDP module and state, the same snapshots; categories in TIMING differ only as spmd's FSDP frees or
    finishes things at other times than torch's:
    - All Gather: torch's FSDP2 keeps a group's all-gather output, after its copy into the unsharded parameters,
      until the next all-gather is issued (so the copy, on another CUDA stream, ends before the memory is
      reused); spmd frees it after the copy. torch's is never smaller (17280 B more, a block's, in forward here).
    - Unsharded Grad: when a group's post-backward returns, torch's FSDP2 still holds the unsharded gradient of
      its last parameter (a bias: 128 B for a block, 32 B for the root); spmd drops each gradient once copied
      into the reduce-scatter input.
    - Sharded Grad and Temp: spmd finishes a group's reduce-scatter when the next group issues its own (or at
      the end of backward), torch's FSDP2 adds the result into the sharded gradients in post-backward: until
      then the output is spmd's Temp, and the sharded gradients appear one group later.
    """
    assert ours.keys() == theirs.keys()
    for module, states in theirs.items():
        assert ours[module].keys() == states.keys(), module
        for state, snapshots in states.items():
            assert len(ours[module][state]) == len(snapshots), (module, state)
            for mine, torchs in zip(ours[module][state], snapshots, strict=True):
                assert {k: v for k, v in mine.items() if k not in TIMING} == \
                    {k: v for k, v in torchs.items() if k not in TIMING}, (module, state)
                assert torchs["All Gather"] >= mine["All Gather"], (module, state)
                extra_grad = last_param_grad_bytes[module] if state == "After Post-Backward" else 0
                assert torchs["Unsharded Grad"] - mine["Unsharded Grad"] == extra_grad, (module, state)
                assert torchs["Sharded Grad"] + torchs["Temp"] == mine["Sharded Grad"] + mine["Temp"], (module, state)
                assert torchs["Total"] - mine["Total"] == torchs["All Gather"] - mine["All Gather"] + extra_grad


@pytest.fixture(scope="module")
def torch_results(procpool: ProcPool) -> list[dict]:
    [results] = procpool.run(_torch_side, 1, args=([(EVEN, 0), (UNEVEN, 3)],), timeout=120)
    return results


@pytest.mark.timeout(180)
def test_sharded_state_and_peak_equal_torchs_and_module_snapshots_differ_only_as_explained(
        torch_results: list[dict]) -> None:
    theirs, ours = torch_results[0], _spmd_side(EVEN, 0)
    model = build(EVEN)
    # right after backward: every reduction has finished on both sides
    assert ours["after_backward"] == theirs["after_backward"]
    for category, expected in (("Sharded Param", _shard_bytes(model, 0, padded=False)),
                               ("Sharded Grad", _shard_bytes(model, 0, padded=True)),
                               ("Inputs", 6 * EVEN[0] * 4)):
        assert ours["after_backward"][category] == expected, category
    assert ours["after_backward"]["OptState"] > 2 * ours["after_backward"]["Sharded Param"]   # Adam's moments
    # the peak (in backward): the same total and categories, but for the last block's reduce-scatter output
    # (its padded shard bytes, 2176 B), which torch already counts as sharded gradients and spmd as Temp, its
    # reduction still in flight (see _assert_snapshots_match)
    in_flight = _shard_bytes(model[2], 0, padded=True)
    assert ours["peak"]["Total"] == theirs["peak"]["Total"]
    assert theirs["peak"]["Sharded Grad"] - ours["peak"]["Sharded Grad"] == in_flight
    assert ours["peak"]["Temp"] - theirs["peak"]["Temp"] == in_flight
    same = [k for k in theirs["peak"] if k not in ("Sharded Grad", "Temp")]
    assert {k: ours["peak"][k] for k in same} == {k: theirs["peak"][k] for k in same}
    assert ours["peak"]["All Gather"] > 0 and ours["peak"]["Reduce Scatter"] > 0
    assert ours["peak"]["Unsharded Param"] > 0 and ours["peak"]["Activation"] > 0

    last_grads = {"FSDPSequential": model[3].bias.nbytes, "FSDPSequential.1": model[1].fc2.bias.nbytes,
                  "FSDPSequential.2": model[2].fc2.bias.nbytes}
    _assert_snapshots_match(ours["modules"], theirs["modules"], last_grads)


@pytest.mark.timeout(180)
def test_uneven_shards_differ_by_exactly_torchs_padding(torch_results: list[dict]) -> None:
    # torch's FSDP2 keeps every rank's shard padded to the largest (its local tensor a view of the padded piece);
    # spmd's holds torch.chunk's rows only. Rank 3 holds 6 of 8, 11 of 13 and 4 of 6 rows: the difference in
    # sharded parameters, and in the peak, is exactly those padded rows' bytes. Gradients are padded on both
    # sides (views of the reduce-scatter output), and optimizer state unpadded on both (zeros_like the shard).
    theirs, ours = torch_results[1], _spmd_side(UNEVEN, 3)
    model = build(UNEVEN)
    padding = _shard_bytes(model, 3, padded=True) - _shard_bytes(model, 3, padded=False)
    assert padding == 1368
    for snapshot in ("after_backward", "peak"):
        assert theirs[snapshot]["Sharded Param"] - ours[snapshot]["Sharded Param"] == padding
        assert theirs[snapshot]["Total"] - ours[snapshot]["Total"] == padding
    assert ours["after_backward"]["Sharded Grad"] == theirs["after_backward"]["Sharded Grad"]
    assert ours["after_backward"]["OptState"] == theirs["after_backward"]["OptState"]


COMM_BUFFERS = ("All Gather", "Reduce Scatter", "Total")


def _without_comm_buffers(snapshot: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in snapshot.items() if k not in COMM_BUFFERS}


@pytest.mark.timeout(60)
def test_thread_ranks_of_a_real_job_track_what_fake_ranks_do() -> None:
    # each rank's tracker sees only its own thread's modules, optimizer steps and dispatch, and the storage
    # resize patch they share acts on each tracker's own storages: every rank's snapshots equal those of the
    # same rank of a fake world (the collectives' values differ, their memory does not). Except for when the
    # communication buffers go: the threads transport's executor thread may still hold a finished collective's
    # buffers for a moment after its wait returns (the fake one runs none), so those (and so the totals and
    # where the peaks fall) may differ; each rank's other categories, in every snapshot but the peaks, may not.
    def body(rank: int, world_size: int) -> dict:
        return tracked_step(FSDPMemTracker, fully_shard, init_device_mesh("cpu", (world_size,)), UNEVEN,
                            forward_prefetch=False)

    real = run_ranks(body, WORLD, timeout=50)
    for rank in (0, 3):
        fake = _spmd_side(UNEVEN, rank)
        assert _without_comm_buffers(real[rank]["after_backward"]) == _without_comm_buffers(fake["after_backward"])
        for module, states in fake["modules"].items():
            for state, snapshots in states.items():
                if not state.startswith("Peak"):
                    assert [_without_comm_buffers(s) for s in real[rank]["modules"][module][state]] == \
                        [_without_comm_buffers(s) for s in snapshots], (rank, module, state)
    assert real[0]["peak"]["Sharded Param"] > real[3]["peak"]["Sharded Param"]


def test_the_fsdp_hooks_are_put_back_on_exit_and_training_goes_on() -> None:
    def body(rank: int, world_size: int) -> float:
        model = build(EVEN)
        for module in (model[1], model[2], model):
            fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, EVEN[0], generator=torch.Generator().manual_seed(rank))
        with FSDPMemTracker(model, optimizer) as tracker:
            model(x).sum().backward()
            optimizer.step()
        for module in (model[1], model[2], model):
            state = state_of(module)
            assert state is not None
            assert state._pre_forward in module._forward_pre_hooks.values()
            assert state._post_forward in module._forward_hooks.values()
            assert "_pre_backward" not in vars(state)
            for group in state.groups:
                assert not {"post_backward", "finish_reduction"} & set(vars(group))
                assert type(group.all_gather_comm) is DefaultAllGather
                assert type(group.reduce_scatter_comm) is DefaultReduceScatter
        assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] > 0
        optimizer.zero_grad()
        loss = model(x).sum()                # untracked: FSDP's own hooks again
        loss.backward()
        return loss.item()

    losses = run_ranks(body, 2, timeout=30)
    assert all(math.isfinite(loss) for loss in losses)


def test_a_model_fully_shard_did_not_shard_is_refused() -> None:
    with pytest.raises(TypeError, match=r"must be sharded by spmd.fsdp.fully_shard.*Linear is not.*MemTracker"):
        FSDPMemTracker(nn.Linear(4, 4))

    def body(rank: int, world_size: int) -> None:
        model = build(EVEN)
        fully_shard(model[1], mesh=init_device_mesh("cpu", (world_size,)))      # a block only, not the root
        with pytest.raises(TypeError, match="Sequential is not"):
            FSDPMemTracker(model)
        FSDPMemTracker(model[1])                                              # the sharded block is fine

    run_ranks(body, 2, timeout=30)


def _estimation(fake_tensors: bool) -> dict:
    """TorchTitan's memory estimation, on rank 1 of a fake 8-rank world: the mesh built first; then, under a
    FakeTensorMode (or not), the model made on meta, sharded HSDP on (2, 4), materialized with to_empty; AdamW;
    two tracked iterations, the module statistics reset after the first (it has no optimizer state yet)."""
    spmd.init_process_group("fake", rank=1, world_size=8, torch_default_group=False)
    try:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
        with FakeTensorMode() if fake_tensors else contextlib.nullcontext():
            with torch.device("meta"):
                model = build(EVEN)
            for module in (model[1], model[2], model):
                fully_shard(module, mesh=mesh)
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(6, EVEN[0])
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x,))
            with tracker:
                for iteration in range(2):
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if iteration == 0:
                        tracker.reset_mod_stats()
        assert isinstance(model[0].weight.to_local(), FakeTensor) == fake_tensors
        return {"peak": _plain(tracker.get_tracker_snapshot("peak")),
                "modules": {stats.mod_fqn: {state.value: [_plain(s) for s in snapshots]
                                            for state, snapshots in stats.snapshots.items()}
                            for stats in tracker.memory_tracking.values()}}
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(60)
def test_under_fake_tensor_mode_the_estimate_is_what_real_tensors_give() -> None:
    # No memory is allocated under FakeTensorMode, so a layout's memory shows at any model size: every snapshot
    # (peak, and each module's at each of its states) equals the same steps' with real tensors, to the byte.
    real, fake = _estimation(fake_tensors=False), _estimation(fake_tensors=True)
    assert fake == real
    assert real["peak"]["Sharded Param"] > 0 and real["peak"]["OptState"] > 0 and real["peak"]["All Gather"] > 0
