"""Run by torch's launcher (torchrun), which serves the job's store from its agent: first a script written for
spmd (spmd.init_process_group, spmd's collectives), then a torch script whose only change is the backend name
"spmd" (torch's collectives and DDP). Each rank saves what it saw to argv[1].<rank>."""

import copy
import os
import sys

import torch
import torch.distributed

import spmd

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
seen = {}
spmd.init_process_group("gloo")
t = torch.tensor([rank + 1.0])
spmd.all_reduce(t)
seen["spmd sum"] = t.item()
seen["torch sees"] = (torch.distributed.get_rank(), torch.distributed.get_world_size(),
                      torch.distributed.get_backend())
spmd.destroy_process_group()

torch.distributed.init_process_group("spmd")
t = torch.tensor([rank + 1.0])
torch.distributed.all_reduce(t)
seen["torch sum"] = t.item()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
reference = copy.deepcopy(model)
inputs = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
ddp(inputs.chunk(world_size)[rank]).square().mean().backward()
reference(inputs).square().mean().backward()
seen["ddp"] = all(torch.allclose(p.grad, q.grad, atol=1e-6)
                  for p, q in zip(model.parameters(), reference.parameters(), strict=True))
torch.distributed.destroy_process_group()
seen["left"] = (torch.distributed.is_initialized(), spmd.is_initialized())
torch.save(seen, f"{sys.argv[1]}.{rank}")
