"""Pipelining in real rank processes: spmd's GPipe and 1F1B on the shared-memory transport and torch's own on
gloo, side by side in the same two processes, on the same GPT split, batches and optimizer: the same losses and
parameters to 1e-5, both equal to one process. Pool workers (tests/procpool.py) spare the torch import per test."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import spmd
from tests.pipelining.test_runtime import ATOL, RTOL, STEPS, GPTPart, batch, gpt, loss_fn, reference
from tests.procpool import ProcPool, free_port

LAYERS, N_MICROBATCHES = 4, 4


def _train(rank: int, world_size: int, stage_cls: type, schedule_cls: type) -> dict[str, Any]:
    local = copy.deepcopy(gpt(LAYERS))
    per = LAYERS // world_size
    part = GPTPart(local, range(rank * per, (rank + 1) * per), rank == 0, rank == world_size - 1)
    schedule = schedule_cls(stage_cls(part, rank, world_size, torch.device("cpu")), N_MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.5, momentum=0.9)
    step_losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=losses)
            step_losses.append(torch.stack(losses).mean().item())
        opt.step()
        opt.zero_grad()
    names = {id(p): k for k, p in local.named_parameters()}
    return {"losses": step_losses, "params": {names[id(p)]: p.detach().clone() for p in part.parameters()}}


def _spmd_and_torch(rank: int, world_size: int, gloo_port: int, schedule: str) -> dict[str, Any]:
    import torch.distributed as tdist
    from torch.distributed import pipelining as torch_pipelining

    from spmd import pipelining

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    try:
        return {"spmd": _train(rank, world_size, pipelining.PipelineStage, pipelining.get_schedule_class(schedule)),
                "torch": _train(rank, world_size, torch_pipelining.PipelineStage,
                                torch_pipelining.schedules.get_schedule_class(schedule))}
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_matches_torch_pipelining_on_gloo_and_one_process(procpool: ProcPool, schedule: str) -> None:
    results = procpool.run(_spmd_and_torch, 2, timeout=150, args=(free_port(), schedule))
    want_losses, want_params = reference(LAYERS)
    for source in ("spmd", "torch"):
        torch.testing.assert_close(torch.tensor(results[1][source]["losses"]), torch.tensor(want_losses),
                                   rtol=RTOL, atol=ATOL, msg=source)
        for name, value in {**results[0][source]["params"], **results[1][source]["params"]}.items():
            torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=f"{source} {name}")
