"""FSDP2 in real rank processes: spmd's fully_shard on the shared-memory transport and torch's own FSDP2 on gloo,
side by side in the same two processes, on the same model, data and optimizer: same losses and parameters to
1e-5, and both equal to one process; again with weights that all-gather through FSDP2's extension
(tests/fsdp/gather_extensions.py), and with both libraries' replicate on FSDP2's machinery. Pool workers
(tests/procpool.py) spare the torch import per test."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import spmd
from tests.fsdp.gather_extensions import split_precision_weights, torch_scaled_weights
from tests.fsdp.harness import BATCH_PER_RANK, STEPS, assert_parity, fsdp_train, optimizer, reference
from tests.fsdp.test_replicate import replicate_blocks_then_root
from tests.parity.models import batch, build, loss_fn
from tests.procpool import ProcPool, free_port


def _torch_fsdp2_train(rank: int, world_size: int, extension: bool = False, replicated: bool = False) -> dict[str, Any]:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = split_precision_weights(build("gpt")) if extension else build("gpt")
    mesh = init_device_mesh("cpu", (world_size,))
    apply = replicate if replicated else fully_shard
    for block in model.blocks:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch("gpt", BATCH_PER_RANK * world_size, seed=step)
        loss = loss_fn("gpt", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        return {"losses": losses, "params": [p.full_tensor() for p in model.parameters()]}


def _spmd_and_torch(rank: int, world_size: int, gloo_port: int) -> dict[str, Any]:
    import torch.distributed as tdist

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    try:
        ours = fsdp_train("gpt", rank, world_size)
        ours.pop("model")
        ours_extended = fsdp_train("gpt", rank, world_size, model=split_precision_weights(build("gpt")))
        ours_extended.pop("model")
        ours_replicated = fsdp_train("gpt", rank, world_size, shard=replicate_blocks_then_root)
        ours_replicated.pop("model")
        return {"spmd": ours, "torch": _torch_fsdp2_train(rank, world_size),
                "spmd extension": ours_extended, "torch extension": _torch_fsdp2_train(rank, world_size, True),
                "spmd replicate": ours_replicated,
                "torch replicate": _torch_fsdp2_train(rank, world_size, replicated=True)}
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()


@pytest.mark.timeout(180)
def test_matches_torch_fsdp2_on_gloo_and_one_process(procpool: ProcPool) -> None:
    results = procpool.run(_spmd_and_torch, 2, timeout=150, args=(free_port(),))
    assert_parity([r["spmd"] for r in results], reference("gpt", 2))
    assert_parity([r["spmd extension"] for r in results], reference("gpt", 2))
    assert_parity([r["spmd replicate"] for r in results], reference("gpt", 2))
    for result in results:
        for ours, theirs in (("spmd", "torch"), ("spmd extension", "torch extension"),
                             ("spmd replicate", "torch replicate")):
            torch.testing.assert_close(result[ours]["losses"], result[theirs]["losses"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(result[ours]["params"], result[theirs]["params"], rtol=1e-5, atol=1e-6)


def _torch_written_extension(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as tdist

    from spmd.comm.torch_backend import torch_group

    spmd.init_process_group("shm", timeout=60)        # torch's default group over spmd's world, as by default
    try:
        trained = fsdp_train("gpt", rank, world_size, model=torch_scaled_weights(build("gpt")))
        trained.pop("model")
        pair = torch_group(spmd.new_group([1, 0]))       # a subgroup seen from torch: both libraries' calls take it
        by_spmd, by_torch = torch.full((2,), rank + 1.0), torch.full((2,), rank + 1.0)
        spmd.all_reduce(by_spmd, group=pair)
        tdist.all_reduce(by_torch, group=pair)
        trained["subgroup"] = (by_spmd.tolist(), by_torch.tolist(), tdist.get_rank(pair), tdist.get_world_size(pair))
        return trained
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_an_extension_written_for_torch_runs_its_collectives_on_the_shard_group(procpool: ProcPool) -> None:
    """torchao's float8 weights all-reduce their scale with torch's functional collectives over the mesh the
    pre-gather gets: torch's view of spmd's shard group takes them (it failed with 'Unsupported group type')."""
    results = procpool.run(_torch_written_extension, 2, timeout=90)
    assert [r.pop("subgroup") for r in results] == [([3.0, 3.0], [3.0, 3.0], rank, 2) for rank in (0, 1)]
    assert_parity(results, reference("gpt", 2))
