"""RemoteModule (torch's): an nn.Module built and run on another RPC worker, called here as if local; inside a
distributed autograd context its forward is differentiable and remote_parameters() feeds a DistributedOptimizer.

Layer: nn (over rpc).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spmd.rpc.agent import WorkerInfo
from spmd.rpc.api import RRef, _current, get_worker_info, remote, rpc_async, rpc_sync


def _forward(module: RRef, args: tuple, kwargs: dict) -> Any:
    return module.local_value()(*args, **kwargs)


def _parameters(module: RRef, recurse: bool) -> list[RRef]:
    return [RRef(param) for param in module.local_value().parameters(recurse)]


def _parse_remote_device(remote_device: str) -> tuple[str, torch.device]:
    """'worker1/cpu' -> ('worker1', cpu); 'rank:1/cuda:0' -> the worker of rank 1; 'worker1' -> its cpu (torch's
    forms; a bare device names no worker)."""
    worker, separator, device = remote_device.partition("/")
    if not separator:
        device = "cpu"
    if not worker or not device or "/" in device or _is_device(worker):
        raise ValueError(f"RemoteModule: remote_device must be '<worker name>/<device>', '<worker name>' (its cpu) "
                         f"or 'rank:<r>/<device>', got {remote_device!r}")
    if worker.startswith("rank:"):
        worker = _current("RemoteModule").worker(int(worker.removeprefix("rank:"))).name
    return worker, torch.device(device)


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def _build(module_cls: type[nn.Module], args: tuple, kwargs: dict, device: torch.device) -> nn.Module:
    return module_cls(*args, **kwargs).to(device)


class RemoteModule(nn.Module):
    """`RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))`: the module lives on worker1; forward(*args) runs
    it there and returns its output here (forward_async returns a Future). remote_parameters() gives RRefs to its
    parameters, get_module_rref() the module's RRef. The module's other methods are not forwarded."""

    def __init__(self, remote_device: str, module_cls: type[nn.Module], args: tuple | None = None,
                 kwargs: dict | None = None) -> None:
        super().__init__()
        worker, device = _parse_remote_device(remote_device)
        self.on: WorkerInfo = get_worker_info(worker)
        self.device = device
        self.module_rref: RRef = remote(worker, _build, (module_cls, tuple(args or ()), dict(kwargs or {}), device))
        self.module_rref._get_future().wait()         # a constructor's error is raised here

    @classmethod
    def init_from_module_rref(cls, remote_device: str, module_rref: RRef) -> RemoteModule:
        """A RemoteModule over a module already held on its owner through `module_rref`."""
        made = cls.__new__(cls)
        nn.Module.__init__(made)
        worker, made.device = _parse_remote_device(remote_device)
        made.on = get_worker_info(worker)
        made.module_rref = module_rref
        return made

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return rpc_sync(self.on, _forward, (self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return rpc_async(self.on, _forward, (self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        return rpc_sync(self.on, _parameters, (self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        return self.module_rref

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on.name}, device={self.device})"
