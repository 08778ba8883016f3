"""Data-parallel stages: how the runtime drives a stage whose module is wrapped in DistributedDataParallel or
fully sharded (FSDP2) over the data-parallel dim of a (pp, dp) mesh, so that gradients are reduced once per step.

Layer: pipelining. The wrappers are recognised by their methods (duck typing: the parallel packages are siblings
at layer 4, which pipelining must not import), as torch's pipelining recognises torch's. The wrappers communicate
over the data-parallel group when the runtime calls them; every rank of that group runs the same program (the
pipeline rank's), so their collectives line up.

Note: data-parallel stages
Each microbatch's backward adds its gradients into `.grad`; only the stage's last one in the step (its
n_microbatches-th B, or W after I) may reduce them over the data-parallel ranks. The runtime counts a stage's
backwards and tells the wrapper before each one whether it is the last (`before_backward`):
- DDP: every forward runs under `no_sync()`, so no backward reduces; before the last backward the runtime arms
  the DDP reducer itself (`reducer.arm()`, what a forward outside no_sync would do; torch's pipelining reaches
  into its DDP's reducer the same way), and that backward all-reduces every bucket as its gradients are ready.
  A W accumulates all of a microbatch's weight gradients in one backward pass (backward.py), so it works as the
  last backward too.
- FSDP: every FSDP module of the stage gets `set_requires_gradient_sync(last)`, `set_reshard_after_backward(last)`
  and `set_is_last_backward(last)`: the earlier backwards accumulate unsharded gradients and keep the parameters
  gathered for the next microbatch, the last one reduce-scatters the sums once and reshards. A B reduces from
  FSDP's own hooks, as its backward starts at the stage's outputs. A W starts inside the graph, where none of
  FSDP's hooks runs: the W that is last calls `reduce_accumulated_gradients()` after its backward (what torch's
  pipelining does for every FSDP stage). Every I runs with sync and resharding off: it computes no weight
  gradient, and the W after it needs the gathered parameters the graph saved (a RESHARD between them is undone
  by gathering again before the W).
The program's actions for these stages (programs.add_data_parallel, as torch lowers its programs): UNSHARD starts
the all-gather of every FSDP module of the stage (waited before the stage's next computation; nothing before
the stage's first forward, where FSDP initialises, so the first step gathers in the forward), RESHARD frees the
gathered parameters, REDUCE_GRAD marks the stage's gradients complete and puts the wrappers back to their
defaults (sync on, reshard after backward), as does the end of the step. For a plain module all of these do
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

_FSDP_METHODS = ("unshard", "reshard", "set_requires_gradient_sync", "set_reshard_after_backward",
                 "set_is_last_backward", "reduce_accumulated_gradients")


class DataParallel:
    """A plain stage module: nothing to drive."""

    @staticmethod
    def of(module: nn.Module) -> DataParallel:
        """The driver for `module`: DDP-wrapped, holding FSDP modules, or plain."""
        if callable(getattr(module, "no_sync", None)) and hasattr(module, "reducer"):
            return _DistributedDataParallel(module)
        sharded = [m for m in module.modules() if all(callable(getattr(m, name, None)) for name in _FSDP_METHODS)]
        return _FullyShardedDataParallel(sharded) if sharded else DataParallel()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The context of each forward."""
        yield

    def before_input_backward(self) -> None:
        """An I (the input half of a backward, no weight gradients) is about to run."""

    def before_backward(self, last: bool) -> None:
        """A B (a whole backward) is about to run; `last`: the stage's last weight-computing backward in the step."""

    def before_weight_backward(self, last: bool) -> None:
        """A W (the weight half of a backward) is about to run; `last` as for before_backward."""
        self.before_backward(last)

    def after_weight_backward(self, last: bool) -> None:
        """A W has run; `last` as for before_backward."""

    def unshard(self) -> None:
        """UNSHARD: start gathering the parameters."""

    def wait_unsharded(self) -> None:
        """Before a computation: finish what UNSHARD started."""

    def reshard(self) -> None:
        """RESHARD: free the gathered parameters."""

    def reduce_grad(self) -> None:
        """REDUCE_GRAD, and the end of each step: the gradients are complete; back to the defaults."""


class _DistributedDataParallel(DataParallel):
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        arm = getattr(getattr(module, "reducer", None), "arm", None)
        if not callable(arm):
            raise TypeError(f"pipelining: the stage module {type(module).__name__} has no_sync() but no reducer "
                            f"with arm(); wrap stages in spmd.DistributedDataParallel")
        self._arm = arm

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return self.module.no_sync()   # type: ignore[operator,no-any-return]

    def before_backward(self, last: bool) -> None:
        if last:
            self._arm()


class _FullyShardedDataParallel(DataParallel):
    def __init__(self, modules: list[Any]) -> None:
        self.modules = modules
        self._handles: list[Any] = []
        self._initialised = False           # FSDP initialises at its root's first forward: no unshard before it

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        yield
        self._initialised = True

    def before_input_backward(self) -> None:
        self.before_backward(last=False)

    def before_backward(self, last: bool) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(last, recurse=False)
            module.set_reshard_after_backward(last, recurse=False)
            module.set_is_last_backward(last)

    def before_weight_backward(self, last: bool) -> None:
        self.unshard()                      # no-op for modules still gathered since their I
        self.wait_unsharded()
        self.before_backward(last)

    def after_weight_backward(self, last: bool) -> None:
        if last:
            for module in self.modules:
                module.reduce_accumulated_gradients(recurse=False)

    def unshard(self) -> None:
        if not self._initialised:
            return
        self._handles += [handle for handle in (m.unshard(async_op=True) for m in self.modules) if handle is not None]

    def wait_unsharded(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()

    def reshard(self) -> None:
        self.wait_unsharded()
        for module in self.modules:
            module.reshard()

    def reduce_grad(self) -> None:
        self.before_backward(last=True)
