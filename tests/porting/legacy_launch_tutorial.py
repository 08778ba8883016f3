# The launcher older tutorials and scripts (the ImageNet example among them) run: python -m
# torch.distributed.launch without --use-env, which hands each worker --local-rank=<n> that its argparse reads;
# DDP over a DistributedSampler's shards of a small dataset, two epochs; rank 0 saves the weights and every rank's
# local rank to argv's `out`.
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    assert args.local_rank == int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="gloo", init_method="env://")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2)))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 10, generator=generator), torch.randn(64, 2, generator=generator))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    local_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(local_ranks, args.local_rank)
    if rank == 0:
        torch.save({"local_ranks": local_ranks, "state": model.module.state_dict()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
