# ZeroRedundancyOptimizer as the tutorial writes it ("Shard Optimizer States with ZeroRedundancyOptimizer"), on
# CPU under torchrun: DDP over a stack of Linear layers, one Adam step with and one without ZeRO; rank 0 saves
# both models' weights to argv[1].
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def example(rank, use_zero):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(200, 200) for _ in range(6)])
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    if use_zero:
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    else:
        optimizer = torch.optim.Adam(ddp_model.parameters(), lr=0.01)
    for _ in range(2):
        torch.manual_seed(rank)
        outputs = ddp_model(torch.randn(20, 200))
        labels = torch.randn(20, 200)
        loss_fn(outputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"zero": example(rank, use_zero=True), "plain": example(rank, use_zero=False)}
    if rank == 0:
        torch.save(results, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
