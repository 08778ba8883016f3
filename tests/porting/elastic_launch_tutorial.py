"""Launching from Python, as accelerate's notebook_launcher and torchx do: torch's launcher API starts two
workers on this node, each trains a small model with hand-reduced gradients, and the launching process gets what
each returned. Usage: python elastic_launch_tutorial.py OUT (it writes the returned values there)."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def train(steps: int, lr: float) -> dict:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for step in range(steps):
        data = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        model(data[rank::world_size]).pow(2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param -= lr * param.grad / world_size
                param.grad = None
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world_size, "state": {k: v.clone() for k, v in model.state_dict().items()}}


if __name__ == "__main__":
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", run_id="tutorial", max_restarts=0)
    returned = elastic_launch(config, train)(3, 0.1)
    torch.save(returned, sys.argv[1])
