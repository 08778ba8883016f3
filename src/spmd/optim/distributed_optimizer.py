"""DistributedOptimizer (torch's): one optimizer step over parameters that live on several RPC workers, each
owner stepping its own parameters with the gradients a distributed autograd context holds for them.

Layer 4 (over rpc). Each owner keeps a local optimizer of `optimizer_class` over its parameters (made once,
through remote()); step(context_id) asks every owner at once and waits for all. A local step takes the
context's gradients as the parameters' `.grad` for the step's duration (then restores what `.grad` was), under one
lock for every local optimizer of the process: trainers' optimizers over the same parameters (each trainer makes
its own) take turns, as torch's do, instead of stepping on each other's `.grad`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from spmd.rpc import dist_autograd
from spmd.rpc.api import RRef, remote, rpc_async

_STEP_LOCK = threading.Lock()


class _LocalOptimizer:
    """The optimizer of one owner's parameters."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: list[RRef], args: tuple,
                 kwargs: dict) -> None:
        self.params = [rref.local_value() for rref in params]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _STEP_LOCK:
            held = [p.grad for p in self.params]
            try:
                for param in self.params:
                    param.grad = grads.get(param)
                self.optimizer.step()
            finally:
                for param, grad in zip(self.params, held, strict=True):
                    param.grad = grad


def _local_step(optimizer: RRef, context_id: int) -> None:
    optimizer.local_value().step(context_id)


class DistributedOptimizer:
    """`DistributedOptimizer(optim.SGD, param_rrefs, lr=0.05)`: `step(context_id)` steps every parameter the
    RRefs name, on its owner, with the gradients of that distributed autograd context."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef], *args: Any,
                 **kwargs: Any) -> None:
        by_owner: dict[Any, list[RRef]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner(), []).append(rref)
        self.remote_optimizers = [remote(owner, _LocalOptimizer, (optimizer_class, rrefs, args, kwargs))
                                  for owner, rrefs in by_owner.items()]

    def step(self, context_id: int) -> None:
        """One step on every owner at once; raises the first owner's error after all finished."""
        dist_autograd._retrieve_context(context_id)
        futures = [rpc_async(optimizer.owner(), _local_step, (optimizer, context_id))
                   for optimizer in self.remote_optimizers]
        errors = []
        for future in futures:
            try:
                future.wait()
            except Exception as error:      # every owner's step finishes before any error is raised
                errors.append(error)
        if errors:
            raise errors[0]
