# FSDP1 as the tutorials still write it ("Getting Started with Distributed Checkpoint", "Asynchronous Saving with
# Distributed Checkpoint", "Getting Started with FSDP"): FullyShardedDataParallel with an auto-wrap policy over a
# CPU model (device_id=cpu stands for the tutorials' GPU index), an AppState that DCP saves through get_state_dict,
# a restart that loads it into a fresh model and trains on, and the full-state-dict save of the FSDP tutorial; rank 0
# saves what it saw to argv[1]. dcp.save, not async_save: torch 2.13's async_save of an FSDP1 state dict fails on
# CPU (its stager asks a ShardedTensor for data_ptr), and so does its full state dict with offload_to_cpu=True
# (setStorage out of bounds), which a CPU model doesn't need.
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

CHECKPOINT_DIR = os.path.join(os.path.dirname(sys.argv[1]), "fsdp1_checkpoint")


class AppState(Stateful):
    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def build(strategy):
    torch.manual_seed(0)
    model = FSDP(ToyModel(), sharding_strategy=strategy, device_id=torch.device("cpu"),
                 auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model, optimizer, steps, rank, first):
    losses = []
    for step in range(first, first + steps):
        torch.manual_seed(100 * step + rank)
        optimizer.zero_grad()
        loss = model(torch.rand(8, 16)).sum()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build(ShardingStrategy.FULL_SHARD)
    wrapped = [type(m).__name__ for m in model.modules()].count("FullyShardedDataParallel")
    losses = train(model, optimizer, 3, rank, 0)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=CHECKPOINT_DIR)

    restarted, restarted_optimizer = build(ShardingStrategy.FULL_SHARD)
    dcp.load({"app": AppState(restarted, restarted_optimizer)}, checkpoint_id=CHECKPOINT_DIR)
    losses += train(restarted, restarted_optimizer, 2, rank, 3)
    losses += train(model, optimizer, 2, rank, 3)          # the uninterrupted run, for comparison

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(restarted, StateDictType.FULL_STATE_DICT, config):
        state = restarted.state_dict()
    optim_state = FSDP.optim_state_dict(restarted, restarted_optimizer)
    if rank == 0:
        torch.save({"wrapped": wrapped, "losses": losses, "state": state,
                    "optim": {name: values["exp_avg"] for name, values in optim_state["state"].items()}},
                   sys.argv[1])
    else:
        assert state == {}
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
