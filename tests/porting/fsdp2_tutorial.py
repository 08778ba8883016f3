# FSDP2 as the tutorial writes it ("Getting Started with Fully Sharded Data Parallel (FSDP2)"), on a CPU mesh,
# with activation checkpointing and gradient scaling as TorchTitan-style trainers add them, plus DTensor through
# torch's older `_tensor` path; rank 0 saves the full trained weights to argv[1].
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tensor import Replicate, Shard, distribute_tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.relu(self.proj(self.norm(x)))


class Model(nn.Module):
    def __init__(self, dim=16, n_layers=3):
        super().__init__()
        self.layers = nn.ModuleList([Block(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@record
def main():
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    torch.manual_seed(0)
    model = Model()
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)

    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()

    full = {name: param.full_tensor() for name, param in model.state_dict().items()}
    big = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(big, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()])
    if rank == 0:
        torch.save({"state": full, "local": sharded.to_local(), "replicated": replicated.to_local()}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
