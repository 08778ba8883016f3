"""FSDPState: the module hooks that drive a parameter group through forward and backward, the root's lazy
initialisation, and the prefetch order.

Layer: fsdp.

Note: one training step under FSDP
The root is the state whose forward runs first (the outermost fully_shard module); at that first forward it
adopts every state below it (lazy init, collective: it checks that all ranks built the same model).
  1. root pre-forward: drop post-forward shards a forward without backward left behind.
  2. each pre-forward: wait for the group's all-gather (issue it if no prefetch did), then start the next
     group's all-gather (the next in the first forward's order, or `set_modules_to_forward_prefetch`).
  3. each post-forward: reshard (free, or keep a copy sharded over the smaller post-forward group), and hook the
     outputs, so that the first gradient reaching them runs pre-backward. The root never reshards after forward:
     backward needs its parameters first.
  4. pre-backward: queue the root's end-of-backward callback (once per backward), wait for the group's
     parameters (gather them again if resharded), start the next group's all-gather in backward order (the
     reverse of the post-forward order, or `set_modules_to_backward_prefetch`).
  5. post-backward (the group's last gradient accumulated, and with frozen parameters backward past the group's
     modules; see Note: when a group's backward is over): reshard, finish the previous group's reduce-scatter,
     issue this group's. So group i's reduce-scatter runs while group i-1 computes its backward.
  6. end of backward (root): post-backward for groups no hook finished, then wait for every reduce-scatter and
     add the results into the sharded `.grad`s.
A forward that runs again inside backward (activation checkpointing's recomputation) runs pre-backward (the only
one under reentrant checkpointing, whose forward ran without grad and left no output hook): it neither reshards
nor hooks its outputs.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from spmd._autograd import at_backward_end, in_backward, on_backward_reaching
from spmd._core.compile import eager_under_compile
from spmd.comm.objects import all_gather_object
from spmd.fsdp.param import FSDPParam, ParamState
from spmd.fsdp.param_group import FSDPParamGroup, GroupState, PendingReductions
from spmd.fsdp.policy import MixedPrecisionPolicy

_STATE_ATTR = "_spmd_fsdp_state"


class BackwardPass(enum.Enum):
    IDLE = enum.auto()      # no backward through the root is running
    RUNNING = enum.auto()   # a backward reached the model; the end-of-backward callback is queued


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state `fully_shard` attached to `module`, or None."""
    return module.__dict__.get(_STATE_ATTR)


class FSDPState:
    """One fully_shard call's modules, their parameter groups (one per mesh their parameters are sharded over;
    none when they own no parameters) and hooks."""

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[FSDPParamGroup], mp_policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int, name: str) -> None:
        self.modules = modules
        self.groups = groups
        self.group = groups[0] if groups else None    # the call's mesh's (the only one, unless shard_placement_fn
                                                       # put parameters on other meshes)
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.name = name
        self.root: FSDPState | None = None           # set at lazy init
        self.forward_prefetch: list[FSDPState] | None = None    # explicit (set_modules_to_forward_prefetch)
        self.backward_prefetch: list[FSDPState] | None = None
        self._finished_forward: set[int] = set()     # ids of this state's modules whose forward ended
        # root only:
        self.tree: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self._order_recorded = False
        self.backward_pass = BackwardPass.IDLE
        self.is_last_backward = True
        self.reductions = PendingReductions()
        self.post_optim_event: Any = None            # set_post_optim_event: waited on by the next root forward
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)

    @property
    def is_root(self) -> bool:
        return self.root is self

    @property
    def params(self) -> list[FSDPParam]:
        return [param for group in self.groups for param in group.params]

    # -- lazy init ------------------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Make this state the root of every state below its modules. Collective (the model check)."""
        tree = [self]
        for module in self.modules:
            for sub in module.modules():
                state = state_of(sub)
                if state is not None and state not in tree:
                    tree.append(state)
        for state in tree[1:]:
            if state.root is not None:
                raise RuntimeError(f"fully_shard: {state.name} already ran forward as its own root before the "
                                   f"root {self.name}; run the root module's forward first (a child's forward "
                                   f"before the root's initialises FSDP from the child alone)")
        _name_by_path(self)
        for state in tree:
            state.root = self
            for group in state.groups:
                group.reductions = self.reductions
            check_materialised(state)
        self.tree = tree
        self.reshard_after_forward = False    # backward needs the root's parameters first
        _check_same_model_on_every_rank(self)

    # -- forward --------------------------------------------------------------------------------------------

    @eager_under_compile
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            self._lazy_init()
        if in_backward():                     # recomputation (see Note: one training step under FSDP)
            for group in self.groups:
                group.pre_backward()          # reentrant checkpointing: no output hook ran pre-backward
            return args, kwargs
        root = self.root
        assert root is not None
        if self.is_root:
            if self.post_optim_event is not None:
                self.post_optim_event.wait()          # the stream the all-gathers run on waits for the step
                self.post_optim_event = None
            for state in root.tree:
                for group in state.groups:
                    group.drop_post_forward_copy()
        watching = module.training and any(group.watches_inputs for group in self.groups)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)] if watching else []
        for group in self.groups:
            group.wait_for_unshard()
            if watching:
                group.expect_input_grads(inputs)
        if not root._order_recorded and self not in root.forward_order:
            root.forward_order.append(self)
        self._prefetch(self._forward_prefetch_targets())
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    @eager_under_compile
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if in_backward():
            return output
        root = self.root
        assert root is not None
        self._finished_forward.add(id(module))
        if len(self._finished_forward) == len(self.modules):
            self._finished_forward.clear()
            for group in self.groups:
                group.reshard_after_forward(self.reshard_after_forward)
            if not root._order_recorded and self not in root.post_forward_order:
                root.post_forward_order.append(self)
            if self.is_root:
                root._order_recorded = True
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
        on_backward_reaching(tensors, self._pre_backward)
        if self.is_root and self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _forward_prefetch_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        root = self.root
        assert root is not None
        if not root._order_recorded:
            return []
        index = root.forward_order.index(self) if self in root.forward_order else -1
        return root.forward_order[index + 1: index + 2] if index >= 0 else []

    # -- backward -------------------------------------------------------------------------------------------

    def _pre_backward(self) -> None:
        root = self.root
        assert root is not None
        if root.backward_pass is BackwardPass.IDLE:
            root.backward_pass = BackwardPass.RUNNING
            at_backward_end(root._finish_backward)
        for group in self.groups:
            group.pre_backward()
        self._prefetch(self._backward_prefetch_targets(), backward=True)

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.post_forward_order if self.root is not None else []
        index = order.index(self) if self in order else -1
        return order[index - 1: index] if index >= 1 else []

    def reset_iteration(self) -> None:
        """Root only: after an exception cut a forward or backward short, wait for what is in flight, reshard every
        group and forget the iteration, so the next one runs as normal (see FSDPModule.reset_iter_state)."""
        while self.reductions.in_flight:
            _, reduction = self.reductions.in_flight.pop(0)
            for work in (reduction.work, reduction.replicas.work if reduction.replicas is not None else None):
                if work is not None:
                    work.wait()
        for state in self.tree or [self]:
            state._finished_forward.clear()
            for group in state.groups:
                group.abandon_iteration()
        self.backward_pass = BackwardPass.IDLE

    def _finish_backward(self) -> None:
        """Root only, once at the end of each backward (see Note: one training step under FSDP, step 6)."""
        for state in self.tree:
            for group in state.groups:
                group.finish_backward()
        if self.is_last_backward:
            self.reductions.finish_all()
        self.backward_pass = BackwardPass.IDLE

    @staticmethod
    def _prefetch(states: list[FSDPState], backward: bool = False) -> None:
        for group in (group for state in states for group in state.groups):
            if group.state in (GroupState.SHARDED, GroupState.SHARDED_POST_FORWARD) and \
                    (group.unshard_in_backward or not backward):
                group.unshard(async_op=True)


def _name_by_path(root: FSDPState) -> None:
    """Name each state and parameter below `root` by its path from the root module, for errors."""
    for path, sub in root.modules[0].named_modules():
        state = state_of(sub)
        if state is None or state.modules[0] is not sub:
            continue
        state.name = f"{path or '<root>'} ({type(sub).__name__})"
        for index, group in enumerate(state.groups):
            group.name = state.name if index == 0 else f"{state.name} [mesh {index}]"
            if path and not group.params[0].fqn.startswith(f"{path}."):
                for param in group.params:
                    param.fqn = f"{path}.{param.fqn}"


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, tree)


def check_materialised(state: FSDPState) -> None:
    """Before the first gather of `state`'s parameters (at the first forward, or an explicit unshard()): the
    module holds what FSDP put there, and the shards are off the meta device."""
    for param in state.params:
        param.check_slots_hold(param.sharded_param if param.state is ParamState.SHARDED else param.unsharded_param)
        if param.local_shard.device.type == "meta" and param.shard_device.type != "meta":   # a meta mesh: shapes only
            raise RuntimeError(f"fully_shard: parameter {param.fqn} is still on the meta device, and FSDP was "
                               f"asked to gather it; call module.to_empty(device=...) and initialise the shards "
                               f"first")


def _check_same_model_on_every_rank(root: FSDPState) -> None:
    """Every rank of the root's mesh sharded the same parameters (names, shapes, dtypes), so that collectives
    match; else a ValueError naming the first difference. Collective over each mesh dim's group."""
    groups = [group for state in root.tree for group in state.groups]
    if not groups:
        return
    signature = [(group.name, [(p.fqn, tuple(p.shape), str(p.orig_dtype)) for p in group.params])
                 for group in groups]
    mesh = groups[0].shard_mesh.mesh
    for mesh_dim in range(mesh.ndim):
        group = mesh.get_group(mesh_dim)
        if group.size() == 1:
            continue
        theirs: list[Any] = [None] * group.size()
        all_gather_object(theirs, signature, group=group)
        for group_rank, other in enumerate(theirs):
            if other != signature:
                raise ValueError(f"fully_shard on rank {mesh.get_rank()}: the model differs from group rank "
                                 f"{group_rank}'s on mesh dim {mesh_dim}: {_first_difference(signature, other)}; "
                                 f"every rank must build the same model and call fully_shard the same way")


def _first_difference(mine: list, theirs: list) -> str:
    for (name, params), (other_name, other_params) in zip(mine, theirs, strict=False):
        if name != other_name:
            return f"sharded module {name} here, {other_name} there"
        for param, other in zip(params, other_params, strict=False):
            if param != other:
                return (f"in {name}, parameter {param[0]} {param[1]} {param[2]} here, "
                        f"{other[0]} {other[1]} {other[2]} there")
        if len(params) != len(other_params):
            return f"{name} shards {len(params)} parameters here, {len(other_params)} there"
    return f"{len(mine)} sharded modules here, {len(theirs)} there"
