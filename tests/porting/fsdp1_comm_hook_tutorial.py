"""FSDP1 with communication hooks: torch's default reduce-scatter hook on FULL_SHARD and its all-reduce hook on
NO_SHARD, each registered on the root before training. Rank 0 writes both models' full parameters to argv[1]."""

import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy


def train(strategy: ShardingStrategy, hook, rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = FSDP(model, sharding_strategy=strategy, device_id=torch.device("cpu"))
    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        data = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        model(data[rank::world_size]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with FSDP.summon_full_params(model):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=FutureWarning)      # torch: NO_SHARD is deprecated
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"reduce_scatter": train(ShardingStrategy.FULL_SHARD, default_hooks.reduce_scatter_hook, rank,
                                       world_size),
               "allreduce": train(ShardingStrategy.NO_SHARD, default_hooks.allreduce_hook, rank, world_size)}
    if rank == 0:
        torch.save(results, sys.argv[1])
    dist.destroy_process_group()
