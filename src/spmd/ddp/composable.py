"""The composable replicate's DDP side: the state it attaches to a module (DDP's arguments until the first forward
builds a DistributedDataParallel over the module itself, then that DDP) and the methods the module's class gains.
spmd._composable.replicate applies it; spmd.accumulate finds it.

Layer: ddp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from torch import nn

from spmd.ddp.api import DistributedDataParallel
from spmd.ddp.reducer import CommHook
from spmd.ddp.sync import IGNORE_ATTR, ignored_names

STATE_ATTR = "_spmd_replicate_state"


class ReplicateState:
    """What replicate attached to a module: DDP's arguments until the first forward builds it, then the DDP."""

    def __init__(self, module: nn.Module, ignored_modules: set[nn.Module], kwargs: dict[str, Any],
                 reduced_elsewhere: Callable[[nn.Module], bool]) -> None:
        self.module = module
        self.ignored_modules = ignored_modules
        self.reduced_elsewhere = reduced_elsewhere   # a submodule another parallelism reduces (fully_shard's)
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
        skipped |= {id(p) for m in module.modules() if self.reduced_elsewhere(m) for p in m.parameters()}
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
        _required_state(self).requires_gradient_sync = requires_gradient_sync

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """DDP's register_comm_hook, applied when the DDP is built at the first forward (or now, if it was)."""
        replicate_state = _required_state(self)
        if replicate_state._ddp is not None:
            replicate_state._ddp.register_comm_hook(state, hook)
        else:
            replicate_state.comm_hooks.append((state, hook))

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise AssertionError("replicate: a DDP module can't be deep-copied; save and load its state dict instead")


_CLASSES: dict[type, type] = {}


def _required_state(module: object) -> ReplicateState:
    found = module.__dict__.get(STATE_ATTR) if hasattr(module, "__dict__") else None
    if found is None:
        raise RuntimeError(f"{type(module).__name__} is not a module replicate made data parallel")
    return found


def replicate_state_of(module: nn.Module) -> ReplicateState | None:
    """The state the composable replicate attached to `module` (torch's `replicate.state(module)`), or None."""
    return module.__dict__.get(STATE_ATTR)


def attach(module: nn.Module, replicate_state: ReplicateState) -> None:
    """Attach `replicate_state` to `module`: its hooks around the module's forward, and the module's class made
    `DDP<Class>`."""
    module.__dict__[STATE_ATTR] = replicate_state
    module.register_forward_pre_hook(replicate_state.pre_forward, with_kwargs=True)
    module.register_forward_hook(replicate_state.post_forward)
    cls = type(module)
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"DDP{cls.__name__}", (DDP, cls), {})
    module.__class__ = made
