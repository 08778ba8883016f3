"""replicate: DDP applied to a module in place, by hooks instead of a wrapper (torch's
`_composable.replicate.replicate`, as TorchTitan's `apply_ddp` calls it).

Layer: _composable (L4: may import ddp and fsdp). The module keeps its class's behaviour and its parameter names
(no `module.` prefix in state dicts); its class becomes `DDP<Class>`, gaining `set_requires_gradient_sync` and
`register_comm_hook`. A DistributedDataParallel over the module, built at the first forward (so comm hooks
and fully_shard submodules added before it count), does the work: its forward-pre and forward hooks run DDP's
own steps around the module's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch
from torch import nn

from spmd.ddp.api import DistributedDataParallel
from spmd.ddp.reducer import CommHook
from spmd.ddp.sync import IGNORE_ATTR, ignored_names
from spmd.fsdp.state import state_of

_STATE_ATTR = "_spmd_replicate_state"


class _ReplicateState:
    """What replicate attached to a module: DDP's arguments until the first forward builds it, then the DDP."""

    def __init__(self, module: nn.Module, ignored_modules: set[nn.Module], kwargs: dict[str, Any]) -> None:
        self.module = module
        self.ignored_modules = ignored_modules
        self.kwargs = kwargs
        self.requires_gradient_sync = True
        self.comm_hooks: list[tuple[object, CommHook]] = []
        self._ddp: DistributedDataParallel | None = None

    @property
    def ddp(self) -> DistributedDataParallel:
        """The DDP doing the work, built on first use. Collective (DDP's construction) the first time."""
        if self._ddp is None:
            self._ddp = self._build()
        return self._ddp

    def _build(self) -> DistributedDataParallel:
        module = self.module
        skipped = {id(p) for m in self.ignored_modules for p in m.parameters()}
        skipped |= {id(p) for m in module.modules() if state_of(m) is not None for p in m.parameters()}
        names = ignored_names(module) | {name for name, p in module.named_parameters() if id(p) in skipped}
        names |= {name for m_name, m in module.named_modules() if m in self.ignored_modules
                  for name in (f"{m_name}.{b}" if m_name else b for b, _ in m.named_buffers())}
        setattr(module, IGNORE_ATTR, sorted(names))     # DDP's ignore list, which it reads at every forward
        ddp = DistributedDataParallel(module, **self.kwargs)
        for state, hook in self.comm_hooks:
            ddp.register_comm_hook(state, hook)
        self.comm_hooks.clear()
        return ddp

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ddp = self.ddp
        ddp.require_backward_grad_sync = self.requires_gradient_sync
        ddp._pre_forward()
        return ddp._inputs_to_device(args, kwargs)

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return self.ddp._post_forward(output)


class DDP:
    """The methods a module gains from replicate (its class becomes `DDP<Class>`)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """With False, backward accumulates gradients locally (gradient accumulation); the next backward with True
        averages the sum, as DDP's no_sync."""
        _state(self).requires_gradient_sync = requires_gradient_sync

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """DDP's register_comm_hook, applied when the DDP is built at the first forward (or now, if it was)."""
        replicate_state = _state(self)
        if replicate_state._ddp is not None:
            replicate_state._ddp.register_comm_hook(state, hook)
        else:
            replicate_state.comm_hooks.append((state, hook))

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise AssertionError("replicate: a DDP module can't be deep-copied; save and load its state dict instead")


_CLASSES: dict[type, type] = {}


def replicate(module: nn.Module, ignored_modules: Iterable[nn.Module] | None = None, **kwargs: Any) -> nn.Module:
    """Make `module` data parallel in place: DistributedDataParallel(module, **kwargs) runs its steps in hooks
    around the module's own forward, built at the first forward. Parameters of `ignored_modules` (and of
    fully_shard submodules, which reduce their own) are neither broadcast nor reduced. `device_id` (an int or a
    device) stands for `device_ids=[device_id]`, as in torch. Collective at the first forward."""
    if "device_id" in kwargs:
        device_id = kwargs.pop("device_id")
        if device_id is not None and (isinstance(device_id, bool) or not isinstance(device_id, int | torch.device)):
            raise RuntimeError(f"replicate: device_id must be an int or a torch.device, got "
                               f"{type(device_id).__name__}")
        cpu = device_id is None or (isinstance(device_id, torch.device) and device_id.type == "cpu")
        kwargs["device_ids"] = None if cpu else [device_id]
    if state_of(module) is not None:
        raise RuntimeError(f"replicate: {type(module).__name__} is already managed by fully_shard; apply "
                           f"replicate to a module fully_shard does not manage")
    if module.__dict__.get(_STATE_ATTR) is not None:
        raise RuntimeError(f"replicate: {type(module).__name__} is already replicated; call replicate once per "
                           f"module")
    state = _ReplicateState(module, set(ignored_modules or ()), kwargs)
    module.__dict__[_STATE_ATTR] = state
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    cls = type(module)
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"DDP{cls.__name__}", (DDP, cls), {})
    module.__class__ = made
    return module


def _state(module: object) -> _ReplicateState:
    state = module.__dict__.get(_STATE_ATTR) if hasattr(module, "__dict__") else None
    if state is None:
        raise RuntimeError(f"{type(module).__name__} is not a module replicate made data parallel")
    return state


def _state_of(module: nn.Module) -> _ReplicateState | None:
    """torch's `replicate.state(module)`: the state replicate attached to `module`, or None."""
    return module.__dict__.get(_STATE_ATTR)


replicate.state = _state_of   # type: ignore[attr-defined]
