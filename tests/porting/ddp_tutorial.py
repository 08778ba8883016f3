# The DDP tutorial's script as torchrun runs it ("Getting Started with Distributed Data Parallel", the
# torchrun section), on CPU; it saves rank 0's trained weights to argv[1] so the test can compare launches.
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()  # noqa: UP008  (as the tutorial writes it)
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


@record
def demo_basic():
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model, device_ids=None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.1)

    for step in range(3):
        torch.manual_seed(100 * step + rank)
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    if rank == 0:
        torch.save({"backend": dist.get_backend(), "state": model.state_dict()}, sys.argv[1])
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    demo_basic()
