"""Peak live tensor bytes, as torch's FSDPMemTracker counts them: the storages ops create, while they live.

Layer: testing. `TensorMemoryTracker` is a TorchDispatchMode: every tensor an op returns has its storage tracked
(views of one storage count once; a DTensor counts its local tensor) until the storage is freed. Live bytes are
re-read from each storage after every op, so a storage resized outside dispatch (FSDP frees an unsharded
parameter with `untyped_storage().resize_(0)` and re-allocates it the same way) is counted at its current size.
Tensors that exist before the tracker starts (parameters, optimizer state) are counted once passed to `track()`.
An op on a tensor subclass (a DTensor) is handed to the subclass, whose local ops then come back through the
mode (as torch's MemTracker does), so temporaries inside DTensor's dispatch count too: a random init of a sharded
parameter fills the global tensor first (see spmd.tensor.random), and that is part of the peak.

    with TensorMemoryTracker(classify=lambda: {...}) as tracker:
        tracker.track(model.parameters())
        train_step()
    print(tracker.peak_bytes, tracker.peak_breakdown)

`classify()` returns {storage key: category} for the storages the caller can name (see `storage_key`); it runs at
each new peak, and the peak's bytes are split by it, the rest "other".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spmd._core.higher_order import is_higher_order, run_inside
from spmd.fsdp.state import state_of


def storage_key(tensor: Tensor) -> int | None:
    """The key the tracker files `tensor`'s storage under (a DTensor's local tensor's); None for tensors without
    one (meta tensors, wrapper subclasses other than DTensor)."""
    local = getattr(tensor, "_local_tensor", tensor)
    if local.device.type == "meta" or type(local) not in (Tensor, torch.nn.Parameter):
        return None
    return local.untyped_storage()._cdata


class TensorMemoryTracker(TorchDispatchMode):
    """Tracks live tensor storages through dispatch and records the peak of their total bytes."""

    def __init__(self, classify: Callable[[], dict[int, str]] | None = None) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self._classify = classify
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these existing tensors (and tensors inside lists, dicts, optimizer states) from now on."""
        for tensor in tree_flatten(list(tensors))[0]:
            if isinstance(tensor, Tensor):
                self._add(tensor)
        self._update()

    def reset_peak(self) -> None:
        self._update()
        self.peak_bytes = self.current_bytes
        self.peak_breakdown = {}

    def _add(self, tensor: Tensor) -> None:
        key = storage_key(tensor)
        if key is None or key in self._live:
            return
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        self._live[key] = weakref.ref(storage)
        weakref.finalize(storage, self._live.pop, key, None)

    def _update(self) -> None:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        self.current_bytes = total
        if total > self.peak_bytes:
            self.peak_bytes = total
            if self._classify is not None:
                self._snapshot()

    def _snapshot(self) -> None:
        assert self._classify is not None
        names = self._classify()
        breakdown: dict[str, int] = {}
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is not None:
                category = names.get(key, "other")
                breakdown[category] = breakdown.get(category, 0) + storage.nbytes()
        self.peak_breakdown = breakdown

    supports_higher_order_operators = True   # flex_attention's inner ops count too (run_inside)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(cls is not Tensor for cls in types):
            return NotImplemented            # the subclass runs its local ops, which come back here
        out = run_inside(self, func, args, kwargs) if is_higher_order(func) else func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor):
                self._add(tensor)
        self._update()
        return out


def fsdp_categories(model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Callable[[], dict[int, str]]:
    """A `classify` for a fully_shard model: its sharded parameters, sharded gradients and optimizer state (the
    sharded state), and what each parameter group holds (unsharded parameters and gradients, communication
    buffers); everything else (activations, temporaries) is "other"."""
    def classify() -> dict[int, str]:
        names: dict[int, str] = {}

        def name(tensors: Iterable[Any], category: str) -> None:
            for tensor in tree_flatten(list(tensors))[0]:
                key = storage_key(tensor) if isinstance(tensor, Tensor) else None
                if key is not None:
                    names.setdefault(key, category)

        groups = [group for sub in model.modules() if (state := state_of(sub)) is not None
                  and state.modules[0] is sub for group in state.groups]
        sharded = [param.sharded_param for group in groups for param in group.params]
        name(sharded, "sharded parameters")          # the modules may hold unsharded ones right now
        name((p.grad for p in sharded if p.grad is not None), "sharded gradients")
        if optimizer is not None:
            name(optimizer.state.values(), "optimizer state")
        for group in groups:
            for category, tensors in group.held_tensors().items():
                name(tensors, category)
        name(model.parameters(), "parameters not sharded")
        return names

    return classify
