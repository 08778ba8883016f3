# The Join context manager as the tutorial writes it ("Distributed Training with Uneven Inputs Using the Join
# Context Manager"), on CPU under torchrun: DDP with ZeroRedundancyOptimizer (and with plain Adam) on uneven inputs,
# and the tutorial's own Joinable counter; rank 0 saves the trained weights and both ranks' counts to argv[1].
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO
from torch.nn.parallel import DistributedDataParallel as DDP


class CounterJoinHook(JoinHook):
    def __init__(self, counter, sync_max_count):
        self.counter = counter
        self.sync_max_count = sync_max_count

    def main_hook(self):
        t = torch.zeros(1, device=self.counter.device)
        dist.all_reduce(t)

    def post_hook(self, is_last_joiner: bool):
        if not self.sync_max_count:
            return
        rank = dist.get_rank(self.counter.process_group)
        common_rank = self.counter.find_common_rank(rank, is_last_joiner)
        if rank == common_rank:
            self.counter.max_count = self.counter.count.detach().clone()
        dist.broadcast(self.counter.max_count, src=common_rank)


class Counter(Joinable):
    def __init__(self, device, process_group):
        super(Counter, self).__init__()  # noqa: UP008  (as the tutorial writes it)
        self.device = device
        self.process_group = process_group
        self.count = torch.tensor([0], device=device).float()
        self.max_count = torch.tensor([0], device=device).float()

    def __call__(self):
        Join.notify_join_context(self)
        t = torch.ones(1, device=self.device).float()
        dist.all_reduce(t)
        self.count += t

    def join_hook(self, **kwargs) -> JoinHook:
        sync_max_count = kwargs["sync_max_count"] if "sync_max_count" in kwargs else False
        return CounterJoinHook(self, sync_max_count)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def find_common_rank(self, rank, to_consider):
        common_rank = torch.tensor([rank if to_consider else -1], device=self.device)
        dist.all_reduce(common_rank, op=dist.ReduceOp.MAX, group=self.process_group)
        common_rank = common_rank.item()
        return common_rank


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trained = {}
    for use_zero in (True, False):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        if use_zero:
            optim = ZeRO(model.parameters(), torch.optim.Adam, lr=0.01)
        else:
            optim = torch.optim.Adam(model.parameters(), lr=0.01)
        # Rank 1 gets one more input than rank 0
        inputs = [torch.full((3, 4), 1.0 + step) for step in range(10 + rank)]
        with Join([model, optim] if use_zero else [model]):
            for input in inputs:
                loss = model(input).sum()
                loss.backward()
                optim.step()
        trained["zero" if use_zero else "plain"] = model.module.state_dict()
    counter = Counter(torch.device("cpu"), dist.group.WORLD)
    with Join([counter], sync_max_count=True):
        for _ in range(5 + rank):
            counter()
    counts = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(counts, torch.cat([counter.count, counter.max_count]))
    if rank == 0:
        torch.save({**trained, "counts": torch.stack(counts)}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
