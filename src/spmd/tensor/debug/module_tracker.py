"""ModuleTracker: which module's forward or backward is running on one rank, for CommDebugMode's breakdown.

Layer: tensor (may import _core, comm, device_mesh).

Note: per-rank module tracking
torch's global module hooks fire for every thread of the process, so with thread ranks every rank's tracker
sees every rank's forwards. A tracker belongs to one rank, its owner: the rank's World (or, with no process
group, the thread that started it); it ignores forwards run under another owner.
- Forward: a global forward pre-hook pushes the module on the forward stack, before the module's own
  pre-hooks run (a collective they issue, such as distribute_module's input_fn, counts for the module), and a
  forward hook the tracker adds to the module itself pops it, after the hooks the module had already (an
  output_fn's collective counts for it too; torch's tracker does the same). It is added once, when the module
  is first seen, and removed when the tracker stops.
- Backward runs on whatever thread autograd picks, so it is followed through the tensors of this rank's
  forward: a multi-grad hook on a module's outputs (on the first of their gradients) marks its backward
  begun, one on its inputs (when all their gradients are in) marks it done. A module whose inputs need no
  gradient stays begun until the backward ends: a callback queued on the engine then clears the stack.
- A forward run during backward (activation checkpointing recomputing a module) is tracked on the forward
  stack and counts as backward, as in torch; it records no module information.
A hook registered while the tracker ran and called after it stopped does nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from spmd.comm.world import current_world, is_initialized
from spmd.tensor.api import DTensor

GLOBAL = "Global"

# torch.utils.hooks.RemovableHandle draws its ids from an unlocked class counter: thread ranks registering
# global hooks at once could draw the same id and overwrite each other's hook. Registration goes through here.
_REGISTRATION_LOCK = threading.Lock()


def current_owner() -> object:
    """Who a tracker started now belongs to: this rank's World, or this thread when there is no process group."""
    return current_world() if is_initialized() else threading.current_thread()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(values: Any) -> list[Tensor]:
    leaves, _ = tree_flatten(values)
    return [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]


class ModuleTracker:
    """Follows one rank's modules through forward and backward (see Note: per-rank module tracking).

    What it learns about each module that ran forward, keyed by its fully qualified name (the root module by
    its class name: "MLP", "MLP.fc1"; "Global" stands for outside every module), with torch's attribute names:
    - module_helper_dict: {"module_type", "depth", "parameters": {name: str(placements)}} per module;
    - module_parameters_dict: {param_name: param.data} per module (its own parameters, not its children's);
    - sharding_dict: "fqn.param_name" -> placements, for DTensor parameters;
    - parent_dict: module -> the modules it called, in the order first called;
    - module_parents_dict: module -> the modules running when it first ran (itself and "Global" included).
    """

    def __init__(self) -> None:
        self.module_helper_dict: dict[str, dict[str, Any]] = {}
        self.module_parameters_dict: dict[str, dict[str, Tensor]] = {}
        self.sharding_dict: dict[str, Any] = {}
        self.parent_dict: dict[str, list[str]] = {}
        self.module_parents_dict: dict[str, set[str]] = {}
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._named_children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._forward: list[str] = [GLOBAL]
        self._backward: list[str] = []
        self._backward_task = -1
        self._owner: object = None
        self._active = False
        self._global_handle: RemovableHandle | None = None
        self._module_handles: list[RemovableHandle] = []
        self._hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.busy = False    # the tracker's own hooks are running (see _busy)

    # -- lifetime -------------------------------------------------------------------------------------------

    def start(self, owner: object) -> None:
        """Forget what an earlier run learned and follow `owner`'s modules from now on."""
        for record in (self.module_helper_dict, self.module_parameters_dict, self.sharding_dict, self.parent_dict,
                       self.module_parents_dict):
            record.clear()
        self.module_helper_dict[GLOBAL] = {"depth": 0}
        self.module_parents_dict[GLOBAL] = set()
        self._forward = [GLOBAL]
        self._backward = []
        self._backward_task = -1
        self._owner = owner
        with _REGISTRATION_LOCK:
            self._global_handle = register_module_forward_pre_hook(self._pre_forward)
        self._active = True

    def stop(self) -> None:
        """Remove every hook this tracker put on torch or on a module; what it learned stays readable."""
        self._active = False
        with _REGISTRATION_LOCK:
            if self._global_handle is not None:
                self._global_handle.remove()
                self._global_handle = None
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        self._hooked = weakref.WeakSet()
        self._forward = [GLOBAL]
        self._backward = []

    # -- queries --------------------------------------------------------------------------------------------

    def current(self) -> tuple[str, bool]:
        """(the innermost module running on this rank, whether it runs backward)."""
        backward = _in_backward()
        forward = self._forward
        if backward and len(forward) == 1:
            running = self._backward
            return (running[-1] if running else GLOBAL), True
        return forward[-1], backward

    def recomputing(self) -> bool:
        """Whether a forward runs inside a backward now (activation checkpointing)."""
        return _in_backward() and len(self._forward) > 1

    def parents_of(self, name: str) -> set[str]:
        """`name` and the modules it ran inside, "Global" included: the ones its collectives count for."""
        parents = self.module_parents_dict.get(name)
        if parents is None:   # seen only in a backward of an earlier run: its name's prefixes are its parents
            parts = name.split(".")
            parents = {GLOBAL, *(".".join(parts[:n]) for n in range(1, len(parts) + 1))}
        return parents | {name}

    # -- forward --------------------------------------------------------------------------------------------

    def _owns_this_call(self) -> bool:
        return self._active and current_owner() is self._owner

    def name_of(self, module: nn.Module) -> str:
        """The fully qualified name of `module`: its class name if no module seen before contains it."""
        name = self._names.get(module)
        if name is None:
            name = self._names[module] = type(module).__name__
        if module not in self._named_children:
            self._named_children.add(module)
            for child_name, child in module.named_children():
                self._names[child] = f"{name}.{child_name}"
                self.name_of(child)
        return name

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if not self._owns_this_call():
            return
        name = self.name_of(module)
        parent = self._forward[-1]
        self._forward.append(name)
        if module not in self._hooked:
            self._hooked.add(module)
            self._module_handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        if _in_backward():
            return
        with self._busy():
            self._learn(module, name, parent)
            # Leaves are left out: autograd can't tell inside autograd.grad whether it will reach a leaf's grad
            # accumulator (a pipeline stage's received input is a leaf, and its I action runs autograd.grad);
            # a module whose inputs are all leaves ends its backward with the backward pass.
            inputs = [t for t in _grad_tensors(args) if t.grad_fn is not None]
            if inputs and torch.is_grad_enabled():
                register_multi_grad_hook(inputs, functools.partial(self._backward_done, name), mode="all")

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._owns_this_call():
            return
        name = self._names.get(module)
        forward = self._forward
        for index in range(len(forward) - 1, 0, -1):
            if forward[index] == name:
                del forward[index]
                break
        else:
            return   # its forward began before the tracker started
        outputs = _grad_tensors(output)
        if outputs and torch.is_grad_enabled() and not _in_backward():
            with self._busy():
                register_multi_grad_hook(outputs, functools.partial(self._backward_begun, name), mode="any")

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """The ops run here (reading parameters, setting up grad hooks) are the tracker's, not the program's."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def _learn(self, module: nn.Module, name: str, parent: str) -> None:
        info = self.module_helper_dict.setdefault(name, {})
        info["module_type"] = str(type(module)).replace("<", "").replace(">", "")
        info["depth"] = len(self._forward) - 1
        for param_name, param in module.named_parameters(recurse=False):
            self.module_parameters_dict.setdefault(name, {})[param_name] = param.data
            if isinstance(param, DTensor):
                self.sharding_dict[f"{name}.{param_name}"] = param.placements
                info.setdefault("parameters", {})[param_name] = str(param.placements)
        self.module_parents_dict.setdefault(name, set(self._forward))
        children = self.parent_dict.setdefault(parent, [])
        if name not in children:
            children.append(name)

    # -- backward -------------------------------------------------------------------------------------------

    def _backward_begun(self, name: str, grad: Tensor) -> None:
        if not self._active:
            return
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            self._backward_task = task
            self._backward = []
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        # A module returning its child's output begins backward on the same gradient, after the child (its
        # hook was added later): it goes below the child, so the innermost module stays on top.
        running = self._backward
        index = len(running)
        while index > 0 and running[index - 1] != name and name in self.parents_of(running[index - 1]):
            index -= 1
        running.insert(index, name)

    def _backward_done(self, name: str, grads: Any) -> None:
        running = self._backward
        for index in range(len(running) - 1, -1, -1):
            if running[index] == name:
                del running[index]
                return

    def _backward_ended(self) -> None:
        self._backward = []
        self._backward_task = -1
