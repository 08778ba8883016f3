"""FSDP's memory: the peak of live tensor bytes per rank (spmd.testing.memory's dispatch-mode tracker) stays
within sharded state + the groups in flight + activations, and below the same step in one process."""

from __future__ import annotations

import torch
from torch import nn

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.testing import run_ranks
from spmd.testing.memory import TensorMemoryTracker, fsdp_categories
from tests.fsdp.harness import TIMEOUT, optimizer, shard_blocks_then_root
from tests.parity.models import batch, build, loss_fn

GPT = {"width": 96, "layers": 4, "heads": 4}   # model state dominates, as in the models FSDP is for


def _step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    loss_fn("gpt", model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _measured_step(rank: int, size: int) -> dict:
    """One rank's second FSDP training step of the GPT, under the tracker: its peak and its shards' bytes."""
    model = build("gpt", **GPT)
    shard_blocks_then_root(model, init_device_mesh("cpu", (size,)))
    opt = optimizer(model.parameters())
    x, y = batch("gpt", 2 * size)
    xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
    _step(model, opt, xs, ys)                           # the optimizer state exists from here on
    with TensorMemoryTracker(classify=fsdp_categories(model, opt)) as tracker:
        tracker.track([*model.parameters(), opt.state])
        _step(model, opt, xs, ys)
    return {"peak": tracker.peak_bytes, "breakdown": tracker.peak_breakdown,
            "shards": sum(p._local_tensor.nbytes for p in model.parameters())}


def test_peak_is_sharded_state_plus_groups_in_flight_plus_activations() -> None:
    results = run_ranks(_measured_step, 2, timeout=TIMEOUT)

    full = build("gpt", **GPT)
    params = sum(p.nbytes for p in full.parameters())
    largest_group = max(sum(p.nbytes for p in block.parameters()) for block in full.blocks)
    opt = optimizer(full.parameters())
    x, y = batch("gpt", 2)
    _step(full, opt, x, y)
    with TensorMemoryTracker() as forward_only:
        forward_only.track([*full.parameters()])
        loss_fn("gpt", full(x), y)
    activations = forward_only.peak_bytes - params            # the local batch's forward, one process
    with TensorMemoryTracker() as one_process:
        one_process.track([*full.parameters(), opt.state])
        _step(full, opt, x, y)

    for result in results:
        sharded_state = 3 * result["shards"]                  # parameters, gradients, momentum: all sharded
        # in flight at once: the group computing and the prefetched one, an all-gather output before its
        # copy-out, and a reduce-scatter input beside the unsharded gradients it is built from
        bound = sharded_state + 4 * largest_group + activations
        assert result["peak"] <= bound, (result, bound)
        assert result["peak"] < one_process.peak_bytes
        assert sum(result["breakdown"].values()) == result["peak"]
        assert result["breakdown"]["sharded parameters"] == result["shards"]


def test_one_rank_of_a_fake_world_has_the_memory_of_that_rank_in_the_real_job() -> None:
    real = run_ranks(_measured_step, 2, timeout=TIMEOUT)
    for rank in range(2):
        spmd.init_process_group("fake", rank=rank, world_size=2, torch_default_group=False)
        try:
            simulated = _measured_step(rank, 2)
        finally:
            spmd.destroy_process_group()
        assert simulated == real[rank]
    spmd.init_process_group("fake", rank=37, world_size=64, torch_default_group=False)   # a job this machine
    try:                                                                                   # could not run
        at_scale = _measured_step(37, 64)
    finally:
        spmd.destroy_process_group()
    rows = [(p.shape[0], p.nbytes // p.shape[0]) for p in build("gpt", **GPT).parameters()]
    chunk = [-(-dim // 64) for dim, _ in rows]                  # torch.chunk's rows per rank, rounded up
    assert at_scale["shards"] == sum(max(0, min(c, dim - 37 * c)) * row for (dim, row), c in zip(rows, chunk))
    assert at_scale["peak"] < real[0]["peak"]
