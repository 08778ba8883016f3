"""FSDPMemTracker: MemTracker for a model sharded by spmd's fully_shard, in FSDP's own categories (sharded and
unsharded parameters and gradients, all-gather and reduce-scatter buffers), at torch's fsdp2_mem_tracker path.

Layer: _tools (may import _core, comm, tensor, fsdp). Only the model's FSDP modules get snapshots (see Note: snapshots
in mem_tracker.py), at the FSDP states `_FSDPModState` names. While active the tracker hooks spmd's FSDP where
its state changes, and undoes it on exit:
- each module's FSDP forward hooks (FSDPState._pre_forward, _post_forward: gathering, resharding) are wrapped in
  place in the module's hook dicts, keeping their order; after pre-forward the unsharded parameters are filed;
- each state's pre-backward (FSDPState._pre_backward: gathering again, prefetch) is wrapped;
- each parameter group's post_backward (unsharded gradients filed before, which it turns into the reduce-scatter
  input) and finish_reduction (the reduced pieces added into the sharded gradients, filed after) are wrapped;
- each group's all-gather and reduce-scatter Comm (spmd.fsdp.comm) is wrapped to file the all-gather output and
  the reduce-scatter input as it is issued.
spmd's FSDP finishes a group's reduce-scatter when the next group issues its own (or at the end of backward),
where torch's FSDP2 adds it into the sharded gradients at once: the sharded gradients appear one group later.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn, optim
from torch.utils.hooks import RemovableHandle

from spmd._tools._display import Snapshot
from spmd._tools.mem_tracker import MemTracker, _RefType, _State, _tensors
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.fsdp.api import FSDPModule
from spmd.fsdp.comm import AllGather, ReduceScatter
from spmd.fsdp.param import FSDPParam
from spmd.fsdp.param_group import FSDPParamGroup
from spmd.fsdp.state import FSDPState, state_of

__all__ = ["FSDPMemTracker"]


class _FSDPRefType(_RefType):
    """FSDPMemTracker's categories: sharded and unsharded parameters and gradients, buffers, activations (forward
    and recomputation), temporaries (backward), the all-gather output and reduce-scatter input, optimizer state,
    and the inputs passed to track_inputs."""

    SHARDED_PARAM = "Sharded Param"
    UNSHARDED_PARAM = "Unsharded Param"
    BUFFER = "Buffer"
    SHARDED_GRAD = "Sharded Grad"
    UNSHARDED_GRAD = "Unsharded Grad"
    ACT = "Activation"
    TEMP = "Temp"
    ALL_GATHER = "All Gather"
    REDUCE_SCATTER = "Reduce Scatter"
    OPT = "OptState"
    INP = "Inputs"


class _FSDPModState(_State):
    """The points of an FSDP module's run where FSDPMemTracker takes a snapshot; PEAK_* hold its peak while
    running."""

    BEF_PRE_FW = "Before Pre-Forward"
    AFT_PRE_FW = "After Pre-Forward"
    BEF_POST_FW = "Before Post-Forward"
    AFT_POST_FW = "After Post-Forward"
    BEF_PRE_BW = "Before Pre-Backward"
    AFT_PRE_BW = "After Pre-Backward"
    BEF_POST_BW = "Before Post-Backward"
    AFT_POST_BW = "After Post-Backward"
    PRE_FW_AC = "Pre-Forward AC"
    POST_FW_AC = "Post-Forward AC"
    PEAK_FW = "Peak Forward"
    PEAK_BW = "Peak Backward"


class _FSDPModMemStats:
    """One FSDP module's running peak per device and its snapshots per `_FSDPModState`."""

    def __init__(self, mod_fqn: str) -> None:
        self.mod_fqn = mod_fqn
        self.local_peak: dict[torch.device, int] = {}
        self.snapshots: dict[_State, list[Snapshot]] = {}


class _FilingAllGather(AllGather):
    """A group's all-gather, unchanged, that first files its output buffer."""

    def __init__(self, inner: AllGather, file: Callable[[Tensor], None]) -> None:
        self.inner = inner
        self._file = file

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None:
        self._file(output_tensor)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class _FilingReduceScatter(ReduceScatter):
    """A group's reduce-scatter, unchanged, that first files its input buffer."""

    def __init__(self, inner: ReduceScatter, file: Callable[[Tensor], None]) -> None:
        self.inner = inner
        self._file = file

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup, op: ReduceOp,
                 async_op: bool = False) -> Work | None:
        self._file(input_tensor)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


def _swap_hook(hooks: dict[int, Callable[..., Any]], original: Callable[..., Any],
               replacement: Callable[..., Any]) -> Callable[[], None]:
    """Put `replacement` where `original` is registered in a module's hook dict (same place, same flags); the
    function that puts `original` back."""
    key = next((k for k, hook in hooks.items() if hook == original), None)
    if key is None:
        raise RuntimeError(f"FSDPMemTracker: the module's FSDP hook {original.__name__} is not registered; is "
                           f"another FSDPMemTracker tracking the model already?")
    hooks[key] = replacement

    def restore() -> None:
        if hooks.get(key) is replacement:
            hooks[key] = original

    return restore


def _shadow(obj: object, name: str, replacement: Any) -> Callable[[], None]:
    """Set `replacement` as `obj`'s own attribute `name` (in front of its class's); the function that undoes it."""
    had, previous = name in obj.__dict__, obj.__dict__.get(name)
    setattr(obj, name, replacement)

    def restore() -> None:
        if obj.__dict__.get(name) is replacement:
            if had:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)

    return restore


class FSDPMemTracker(MemTracker):
    """MemTracker for a model sharded by spmd.fsdp.fully_shard (the root FSDP module `mod`) and its optimizer
    `optm`: the step's peak memory in FSDP's categories, and snapshots of each FSDP module at FSDP's states.

    Usage (TorchTitan's memory estimation; on rank r of a world of backend "fake" it gives that rank's memory in
    a job of any size, with real tensors: spmd's collectives take no FakeTensors)::

        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((inputs,))
        with tracker:
            model(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        tracker.display_snapshot("peak", units="MiB", tabulate=True)
    """

    _ref_class = _FSDPRefType
    _ACT = _FSDPRefType.ACT
    _TEMP = _FSDPRefType.TEMP
    _OPT = _FSDPRefType.OPT
    _PEAK_FW = _FSDPModState.PEAK_FW
    _PEAK_BW = _FSDPModState.PEAK_BW

    def __init__(self, mod: nn.Module, optm: optim.Optimizer | None = None) -> None:
        super().__init__()
        if not isinstance(mod, FSDPModule):
            raise TypeError(f"FSDPMemTracker: the model must be sharded by spmd.fsdp.fully_shard (the root module "
                            f"fully_shard was applied to), but {type(mod).__name__} is not; call fully_shard on it, "
                            f"or use MemTracker for a model that is not sharded")
        self._root_mod = mod
        self._optm = optm
        self._restore: list[Callable[[], None]] = []
        self._optimizer_hooks: list[RemovableHandle] = []

    def _states(self) -> list[FSDPState]:
        states: list[FSDPState] = []
        for module in self._root_mod.modules():
            state = state_of(module)
            if state is not None and all(state is not seen for seen in states):
                states.append(state)
        return states

    def _file(self, reftype: _RefType, tensors: Any) -> None:
        for t in _tensors(tensors):
            self._update_and_maybe_create_winfos(t, reftype)

    def _file_sharded_grads(self, group: FSDPParamGroup) -> None:
        self._file(_FSDPRefType.SHARDED_GRAD, [p.sharded_param.grad for p in group.params])

    # -- the FSDP hooks' wrappers -----------------------------------------------------------------------------

    def _stats(self, module: nn.Module) -> _FSDPModMemStats | None:
        return self.memory_tracking.get(module) if self._depth > 0 else None

    def _snap(self, stats: _FSDPModMemStats, state: _FSDPModState) -> None:
        stats.snapshots.setdefault(state, []).append(self.get_tracker_snapshot())

    def _wrap_pre_forward(self, module: nn.Module, state: FSDPState) -> Callable[..., Any]:
        original = state._pre_forward

        @functools.wraps(original)
        def pre_forward(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self._depth == 0:
                return original(mod, args, kwargs)
            name = self._mod_tracker.get_known_fqn(module)
            assert name is not None
            stats = self.memory_tracking.get(module)
            if stats is None:
                stats = self.memory_tracking[module] = _FSDPModMemStats(name)
                self._start_peak(stats, _FSDPModState.PEAK_FW, _FSDPModState.BEF_PRE_FW)
            elif not self._mod_tracker.is_bw:
                self._check_not_next_iteration(name)
            args, kwargs = original(mod, args, kwargs)
            self._file(_FSDPRefType.UNSHARDED_PARAM, [p.unsharded_param for group in state.groups
                                                      for p in group.params if _gathered(group, p)])
            if self._mod_tracker.is_bw:
                if self._ac_mod is None:
                    self._ac_mod = weakref.ref(module)
                    self._in_ac = True
                self._snap(stats, _FSDPModState.PRE_FW_AC)
            else:
                self._snap(stats, _FSDPModState.AFT_PRE_FW)
            return args, kwargs

        return pre_forward

    def _wrap_post_forward(self, module: nn.Module, state: FSDPState) -> Callable[..., Any]:
        original = state._post_forward

        @functools.wraps(original)
        def post_forward(mod: nn.Module, args: tuple, output: Any) -> Any:
            stats = self._stats(module)
            if stats is None:
                return original(mod, args, output)
            if self._mod_tracker.is_bw:
                if self._ac_mod is not None and self._ac_mod() is module:
                    self._ac_mod = None
                    self._in_ac = False
                self._snap(stats, _FSDPModState.POST_FW_AC)
                return original(mod, args, output)
            self._snap(stats, _FSDPModState.BEF_POST_FW)
            output = original(mod, args, output)
            self._snap(stats, _FSDPModState.AFT_POST_FW)
            return output

        return post_forward

    def _wrap_pre_backward(self, state: FSDPState) -> Callable[[], None]:
        original = state._pre_backward

        @functools.wraps(original)
        def pre_backward() -> None:
            stats = self._stats(state.modules[0])
            if stats is None:
                return original()
            self._start_peak(stats, _FSDPModState.PEAK_BW, _FSDPModState.BEF_PRE_BW)
            original()
            self._snap(stats, _FSDPModState.AFT_PRE_BW)

        return pre_backward

    def _wrap_post_backward(self, state: FSDPState, group: FSDPParamGroup) -> Callable[..., None]:
        original = group.post_backward

        @functools.wraps(original)
        def post_backward(*args: Any, **kwargs: Any) -> None:
            stats = self._stats(state.modules[0])
            if stats is None:
                return original(*args, **kwargs)
            self._file(_FSDPRefType.UNSHARDED_GRAD, [p.unsharded_grad() for p in group.grad_params])
            self._snap(stats, _FSDPModState.BEF_POST_BW)
            original(*args, **kwargs)
            self._file_sharded_grads(group)
            self._snap(stats, _FSDPModState.AFT_POST_BW)

        return post_backward

    def _wrap_finish_reduction(self, group: FSDPParamGroup) -> Callable[..., None]:
        original = group.finish_reduction

        @functools.wraps(original)
        def finish_reduction(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            if self._depth > 0:
                self._file_sharded_grads(group)

        return finish_reduction

    def _filer(self, reftype: _RefType) -> Callable[[Tensor], None]:
        def file(t: Tensor) -> None:
            if self._depth > 0:
                self._update_and_maybe_create_winfos(t, reftype)
        return file

    # -- entering and leaving ---------------------------------------------------------------------------------

    def _instrument_fsdp(self) -> None:
        for state in self._states():
            for module in state.modules:
                self._restore.append(_swap_hook(module._forward_pre_hooks, state._pre_forward,
                                                self._wrap_pre_forward(module, state)))
                self._restore.append(_swap_hook(module._forward_hooks, state._post_forward,
                                                self._wrap_post_forward(module, state)))
            self._restore.append(_shadow(state, "_pre_backward", self._wrap_pre_backward(state)))
            for group in state.groups:
                self._restore.append(_shadow(group, "post_backward", self._wrap_post_backward(state, group)))
                self._restore.append(_shadow(group, "finish_reduction", self._wrap_finish_reduction(group)))
                self._restore.append(_shadow(group, "all_gather_comm", _FilingAllGather(
                    group.all_gather_comm, self._filer(_FSDPRefType.ALL_GATHER))))
                self._restore.append(_shadow(group, "reduce_scatter_comm", _FilingReduceScatter(
                    group.reduce_scatter_comm, self._filer(_FSDPRefType.REDUCE_SCATTER))))
                self._file(_FSDPRefType.SHARDED_PARAM, [p.sharded_param for p in group.params])
                self._file_sharded_grads(group)
        self._file(_FSDPRefType.BUFFER, list(self._root_mod.buffers()))

    def _instrument_optimizer(self) -> None:
        optimizer = self._optm
        if optimizer is None:
            return
        self._track_optimizer_states(_FSDPRefType.OPT, optimizer)

        def before_step(opt: optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._in_opt = True

        def after_step(opt: optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(_FSDPRefType.OPT, opt)
            self._in_opt = False

        self._optimizer_hooks = [optimizer.register_step_pre_hook(before_step),
                                 optimizer.register_step_post_hook(after_step)]

    def _instrument(self) -> None:
        self._instrument_fsdp()
        self._instrument_optimizer()

    def _uninstrument(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []

    def track_inputs(self, inputs: tuple[Any, ...]) -> None:
        """Count the tensors in `inputs` (made before the tracker starts) as the model's inputs."""
        self._file(_FSDPRefType.INP, inputs)

    def track_external(self, *external: nn.Module | optim.Optimizer | Tensor) -> None:
        """Does nothing: FSDPMemTracker counts the model and optimizer it was given (and track_inputs' tensors)."""


def _gathered(group: FSDPParamGroup, param: FSDPParam) -> bool:
    """Whether `param`'s unsharded parameter has memory of its own (not the shard itself, as on a replicate-only
    mesh)."""
    return param.unsharded_param is not None and not (group.layout is not None and param in group.layout.aliased)
