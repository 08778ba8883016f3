# Pipelining as torch's docs write it ("Pipeline Parallelism": the tracer front end): `pipeline` cuts the model
# at a SplitPoint, each rank builds its stage and steps ScheduleGPipe; the last rank saves the losses and every
# rank its trained stage weights to argv[1] + rank.
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class Model(nn.Module):
    def __init__(self, dim=16, n_layers=4):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = Model()
    n_microbatches, batch_size = 4, 16
    example_input_microbatch = torch.randn(batch_size // n_microbatches, 8)
    pipe = pipeline(module=model, mb_args=(example_input_microbatch,),
                    split_spec={"layers.2": SplitPoint.BEGINNING})
    assert pipe.num_stages == world_size
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.1, momentum=0.9)

    losses = []
    for step in range(3):
        torch.manual_seed(10 + step)
        x, y = torch.randn(batch_size, 8), torch.randn(batch_size, 4)
        if rank == 0:
            schedule.step(x)
        else:
            step_losses = []
            schedule.step(target=y, losses=step_losses)
            losses.append(torch.stack(step_losses).mean().item())
        optimizer.step()
        optimizer.zero_grad()

    state = {name: param.detach().clone() for name, param in stage.submod.named_parameters()}
    torch.save({"losses": losses, "state": state}, f"{sys.argv[1]}{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
