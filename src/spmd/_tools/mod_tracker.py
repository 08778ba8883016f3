"""ModTracker: which modules are running forward or backward right now, by fully qualified name, at torch's
mod_tracker path (the module hierarchy the memory trackers attribute memory to).

Layer: _tools (imports torch only). Names are the root's class name then attribute names (`GPT.blocks.0`), given
the first time a module runs. Forward is followed with global module hooks; backward with multi-grad hooks on
each module's outputs (its backward starts when the first output gradient is computed) and inputs (it ends when
all input gradients are computed; a module whose inputs need no gradient ends with the backward pass).
The global module hooks see every thread's modules, and spmd runs ranks as threads: a tracker follows only the
thread that entered it, so each rank's tracker sees its own rank's modules.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

__all__ = ["ModTracker"]

_GLOBAL = "Global"
ForwardPreHook = Callable[[nn.Module, Any], None]
ForwardHook = Callable[[nn.Module, Any, Any], None]
BackwardHook = Callable[[nn.Module | None, Any], None]


def _grad_tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.requires_grad]


class ModTracker:
    """Context manager that keeps `parents`, the fully qualified names of the modules whose forward or backward
    is running (always with "Global"), and `is_bw`, whether a backward pass is running; user hooks mark each
    module's forward and backward start and end."""

    parents: set[str]

    def __init__(self) -> None:
        self.parents = {_GLOBAL}
        self._active: dict[str, int] = {}                      # name -> how many of its calls are running
        self._known: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._named_children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._backward_end_queued = False
        self._ends_at_backward_end: list[Callable[[], None]] = []   # post-backward of modules without grad inputs
        self._user_pre_fw: ForwardPreHook | None = None
        self._user_post_fw: ForwardHook | None = None
        self._user_pre_bw: BackwardHook | None = None
        self._user_post_bw: BackwardHook | None = None
        self._handles: list[RemovableHandle] = []
        self._thread: int | None = None

    @property
    def is_bw(self) -> bool:
        """Whether a backward pass is running (on this thread)."""
        return torch._C._current_graph_task_id() != -1

    def get_known_fqn(self, mod: nn.Module) -> str | None:
        """The name this tracker gave `mod`, or None if it has not seen it (nor a module above it) run."""
        return self._known.get(mod)

    def register_user_hooks(self, pre_fw_hook: ForwardPreHook | None = None, post_fw_hook: ForwardHook | None = None,
                            pre_bw_hook: BackwardHook | None = None, post_bw_hook: BackwardHook | None = None) -> None:
        """Call these at each tracked module's forward start (module, input) and end (module, input, output), and
        backward start (module, grad_outputs) and end (module, grad_inputs); the module's name is in `parents`
        during each. One hook of each kind at a time: clear_user_hooks() before registering another."""
        new = {"pre_fw_hook": pre_fw_hook, "post_fw_hook": post_fw_hook, "pre_bw_hook": pre_bw_hook,
               "post_bw_hook": post_bw_hook}
        old = {"pre_fw_hook": self._user_pre_fw, "post_fw_hook": self._user_post_fw,
               "pre_bw_hook": self._user_pre_bw, "post_bw_hook": self._user_post_bw}
        clash = [name for name, hook in new.items() if hook is not None and old[name] is not None]
        if clash:
            raise RuntimeError(f"ModTracker: a {clash[0]} is registered already; call clear_user_hooks() before "
                               f"registering another")
        self._user_pre_fw = pre_fw_hook or self._user_pre_fw
        self._user_post_fw = post_fw_hook or self._user_post_fw
        self._user_pre_bw = pre_bw_hook or self._user_pre_bw
        self._user_post_bw = post_bw_hook or self._user_post_bw

    def clear_user_hooks(self) -> None:
        """Forget the hooks register_user_hooks set."""
        self._user_pre_fw = self._user_post_fw = self._user_pre_bw = self._user_post_bw = None

    # -- names ----------------------------------------------------------------------------------------------

    def _name(self, mod: nn.Module) -> str:
        """`mod`'s name, naming it (by class) if new, and its children (recursively) by attribute below it."""
        name = self._known.setdefault(mod, type(mod).__name__)
        if mod not in self._named_children:
            for child_name, child in mod.named_children():
                self._known[child] = f"{name}.{child_name}"
                self._name(child)
            self._named_children.add(mod)
        return name

    # -- entering and leaving a module -----------------------------------------------------------------------

    def _enter_fn(self, mod: weakref.ref[nn.Module], name: str, backward: bool) -> Callable[..., None]:
        def enter(*grads: Any) -> None:
            if backward:
                self._queue_backward_end()
            elif name in self.parents and not self.is_bw:
                warnings.warn(f"ModTracker: {name} starts forward while its forward is running; the module "
                              f"hierarchy may be tracked wrongly", stacklevel=2)
            self._active[name] = self._active.get(name, 0) + 1 if name in self.parents else 1
            self.parents.add(name)
            if backward and self._user_pre_bw is not None:
                self._user_pre_bw(mod(), grads)
        return enter

    def _leave_fn(self, mod: weakref.ref[nn.Module], name: str, backward: bool) -> Callable[..., None]:
        def leave(*grads: Any) -> None:
            if backward and self._user_post_bw is not None:
                self._user_post_bw(mod(), grads)
            if name in self.parents:
                self._active[name] -= 1
                if self._active[name] == 0:
                    self.parents.remove(name)
            elif not self.is_bw:           # backward need not nest: some inputs or outputs need no gradient
                raise RuntimeError(f"ModTracker: {name} ends forward but never started it; the module hierarchy "
                                   f"is tracked wrongly")
        return leave

    def _queue_backward_end(self) -> None:
        """At the first module backward of a pass: queue the ends of modules no input hook will end, then reset."""
        if self._backward_end_queued:
            return
        engine = torch.autograd.Variable._execution_engine
        for end in reversed(self._ends_at_backward_end):
            engine.queue_callback(end)
        self._ends_at_backward_end.clear()

        def reset() -> None:
            self.parents = {_GLOBAL}
            self._backward_end_queued = False

        engine.queue_callback(reset)
        self._backward_end_queued = True

    def _forward_pre_hook(self, mod: nn.Module, args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        name, ref = self._name(mod), weakref.ref(mod)
        self._enter_fn(ref, name, backward=False)()
        if self._user_pre_fw is not None:
            self._user_pre_fw(mod, args)
        if self.is_bw:
            return
        inputs = _grad_tensors(args)
        if inputs:
            register_multi_grad_hook(inputs, self._leave_fn(ref, name, backward=True))
        else:
            self._ends_at_backward_end.append(self._leave_fn(ref, name, backward=True))

    def _forward_hook(self, mod: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        name, ref = self._name(mod), weakref.ref(mod)
        if self._user_post_fw is not None:
            self._user_post_fw(mod, args, output)
        self._leave_fn(ref, name, backward=False)()
        outputs = _grad_tensors(output)
        if outputs and not self.is_bw:
            register_multi_grad_hook(outputs, self._enter_fn(ref, name, backward=True), mode="any")

    def __enter__(self) -> ModTracker:
        self._thread = threading.get_ident()
        self._handles = [register_module_forward_pre_hook(self._forward_pre_hook),
                         register_module_forward_hook(self._forward_hook, always_call=True)]
        return self

    def __exit__(self, *args: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
