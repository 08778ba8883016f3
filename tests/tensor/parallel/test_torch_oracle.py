"""Tensor parallelism in real rank processes against torch's own: spmd.tensor.parallel on the shared-memory
transport and torch.distributed.tensor.parallel on gloo, side by side in the same two processes, on the same
models (plans.build) and the same plans (plans.parallelize, written once, built with each library's classes),
trained 3 SGD steps on the same batches: the same losses and full parameters to rtol 1e-5 / atol 1e-6; and
spmd's the same as one process (test_parity's reference). Pool workers (tests/procpool.py) spare the torch
import per test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.procpool import ProcPool, free_port
from tests.tensor.parallel.plans import Layout, parallelize, torch_api
from tests.tensor.parallel.test_parity import ATOL, RTOL, STEPS, batch, fresh, reference

CASES = [("gpt", layout) for layout in Layout] + [("llama", layout) for layout in Layout]


def _full(value: Tensor) -> Tensor:
    """A DTensor's (either library's) whole value, or a plain tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _train(model: nn.Module, loss_parallel: Callable[[], contextlib.AbstractContextManager] | None,
           ) -> dict[str, Any]:
    """test_parity.train with either library's loss_parallel (None: the logits are gathered)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        tokens, targets = batch(step)
        logits = model(tokens)
        with loss_parallel() if loss_parallel is not None else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        losses.append(_full(loss).item())
        opt.step()
    with torch.no_grad():
        return {"losses": losses, "params": {name: _full(p.detach()) for name, p in model.named_parameters()}}


def _spmd_and_torch(rank: int, world_size: int, gloo_port: int, cases: list[tuple[str, Layout]]) -> dict:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor.parallel import loss_parallel

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    try:
        ours = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))["tp"]
        theirs = torch_init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))["tp"]
        api = torch_api()
        results = {}
        for kind, layout in cases:
            lp = layout.loss_parallel
            results[kind, layout] = {
                "spmd": _train(parallelize(kind, fresh(kind), ours, layout), loss_parallel if lp else None),
                "torch": _train(parallelize(kind, fresh(kind), theirs, layout, api),
                                torch_loss_parallel if lp else None),
            }
        return results
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_matches_torch_tensor_parallel_on_gloo_and_one_process(procpool: ProcPool) -> None:
    per_rank = procpool.run(_spmd_and_torch, 2, timeout=90, args=(free_port(), CASES))
    for results in per_rank:
        for (kind, layout), result in results.items():
            what = f"{kind} {layout.value}"
            ours, theirs = result["spmd"], result["torch"]
            torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, where=what: f"{where}: {m}")
            assert ours["params"].keys() == theirs["params"].keys()
            for name, value in ours["params"].items():
                torch.testing.assert_close(value, theirs["params"][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, where=f"{what} {name}": f"{where}: {m}")
            ref_losses, ref_params = reference(kind)
            torch.testing.assert_close(ours["losses"], ref_losses, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, where=what: f"{where}: {m}")
            for name, value in ours["params"].items():
                torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, where=f"{what} {name}": f"{where} vs one process: {m}")
