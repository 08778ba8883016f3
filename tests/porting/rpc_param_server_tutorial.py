# The parameter server of the RPC tutorial ("Implementing a Parameter Server Using Distributed RPC Framework"), on
# CPU under torchrun: rank 0 serves the model, rank 1 trains it through RPC with distributed autograd and a
# DistributedOptimizer, and asks the server for its answer to an async_execution call; rank 1 saves the losses,
# the final weights (fetched over RPC) and that answer to argv[1].
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()

    def forward(self, inp):
        return self.model(inp)

    def get_param_rrefs(self):
        return [RRef(param) for param in self.model.parameters()]


param_server = None


def get_parameter_server():
    global param_server
    if param_server is None:
        param_server = ParameterServer()
    return param_server


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref, *args]
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


@rpc.functions.async_execution
def doubled_later(value):
    future = torch.futures.Future()
    future.set_result(value)
    return future.then(lambda done: done.wait() * 2)


class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def run_trainer(out):
    net = TrainerNet()
    opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(5):
        torch.manual_seed(step)
        data, target = torch.randn(16, 10), torch.randint(0, 3, (16,))
        with dist_autograd.context() as cid:
            loss = F.nll_loss(net(data), target)
            dist_autograd.backward(cid, [loss])
            assert len(remote_method(ParameterServer.get_param_rrefs, net.param_server_rref)) == 4
            opt.step(cid)
        losses.append(loss.item())
    weights = [rref.to_here() for rref in net.get_global_param_rrefs()]
    answer = rpc.rpc_sync("parameter_server", doubled_later, args=(torch.arange(3),))
    torch.save({"losses": losses, "weights": weights, "answer": answer}, out)


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=120)
    if rank == 0:
        rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_trainer(sys.argv[1])
    rpc.shutdown()


if __name__ == "__main__":
    main()
