"""torch.compile of a model sharded by fully_shard, compiled whole from outside (`torch.compile(model)`): FSDP's
forward hooks run eagerly, each one graph break, so dynamo never traces into FSDP's gathering (whose locks,
clocks and object exchanges broke the graph dozens of times and hit the recompile limit); training equals eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.testing import run_ranks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.timeout(120)
def test_a_sharded_model_compiled_whole_trains_as_eager_with_a_graph_break_per_fsdp_hook() -> None:
    torch._dynamo.reset()
    counters.clear()
    initial, x = _mlp(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def train(rank: int, size: int, compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
        model = copy.deepcopy(initial)
        mesh = init_device_mesh("cpu", (size,))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = run(x.chunk(size)[rank]).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, [param.full_tensor() for param in model.parameters()]

    def body(rank: int, size: int) -> tuple:
        torch.set_num_threads(1)
        return train(rank, size, compiled=False), train(rank, size, compiled=True)

    for (eager_losses, eager_params), (losses, params) in run_ranks(body, 2, timeout=100):
        assert losses == pytest.approx(eager_losses, rel=1e-6)
        torch.testing.assert_close(params, eager_params, rtol=1e-6, atol=1e-7)
    reasons = list(counters["graph_break"])
    assert reasons and all("torch.compiler.disable" in reason for reason in reasons), reasons
