"""MemTracker: the tensor memory a training step holds, by what it is for (parameters, buffers, gradients,
activations, temporaries, optimizer state) and by module, at torch's mem_tracker path with its API.

Layer: _tools (may import _core, comm, tensor, fsdp). A TorchDispatchMode: every tensor an op returns has its
storages filed under a category (activation in forward, temporary in backward, optimizer state inside an
optimizer step) until they are freed; parameters, buffers and gradients are re-filed as such by hooks. Memory is
counted per storage (views count once; a DTensor counts its local tensor), in bytes, rounded up to the CUDA
caching allocator's 512-byte blocks on CUDA, as torch's tracker counts it.

Note: snapshots
A snapshot is {device: {category: bytes, ..., "Total": bytes}}. The tracker keeps the current one and the peak
one (the snapshot when the total was highest), and for each module that ran a list of snapshots per state
(`_ModState`): before and after its forward and backward, and its own peak during each forward and backward
(the highest total while it was running). `display_snapshot` and `display_modulewise_snapshots` print them.

Note: what is not seen
Tensors made before the tracker starts are counted once passed to `track_external` (or, for modules, when
their forward first runs). Storage resizes outside dispatch (`untyped_storage().resize_`, how FSDP frees and
re-grows unsharded parameters) are seen by patching `torch.UntypedStorage.resize_` while any tracker is active.
Ops that bypass dispatch (under `no_dispatch`) and ops on other threads are not seen: each rank of a
threads-transport job tracks its own.
"""

from __future__ import annotations

import copy
import math
import re
import threading
import weakref
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, nn, optim
from torch._guards import active_fake_mode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from spmd._core.env import optional_str
from spmd._core.higher_order import is_higher_order, run_inside
from spmd._tools._display import Snapshot, format_snapshot, format_state_snapshots
from spmd._tools.mod_tracker import ModTracker
from spmd.tensor import DTensor

__all__ = ["MemTracker"]

_TOTAL_KEY = "Total"


class _RefType(StrEnum):
    """Base of the memory categories a tracker files storages under."""


class _State(StrEnum):
    """Base of the module states a tracker takes snapshots at."""


class _MemRefType(_RefType):
    """MemTracker's categories: parameters, buffers, gradients, activations (forward and recomputation),
    temporaries (backward, including activation gradients), optimizer state, other (`track_external` tensors)."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"


class _ModState(_State):
    """The points of a module's run where MemTracker takes a snapshot; PEAK_* hold its peak while running."""

    PRE_FW = "Pre-Forward"
    POST_FW = "Post-Forward"
    PEAK_FW = "Peak-Forward"
    PRE_BW = "Pre-Backward"
    PRE_FW_AC = "Pre-Forward-AC"
    POST_FW_AC = "Post-Forward-AC"
    POST_BW = "Post-Backward"
    PEAK_BW = "Peak-Backward"


class _ModMemStats:
    """One module's memory: its parameters', buffers', inputs' and outputs' bytes, its running peak per device,
    and its snapshots per state (see Note: snapshots)."""

    def __init__(self, mod_fqn: str) -> None:
        self.mod_fqn = mod_fqn
        self.parameter_mem = 0
        self.buffer_mem = 0
        self.input_mem = 0
        self.output_mem = 0
        self.local_peak: dict[torch.device, int] = {}
        self.snapshots: dict[_State, list[Snapshot]] = {}


class _WeakRefInfo:
    """What the tracker knows of one storage: its size, device, category and the bytes it is counted as."""

    def __init__(self, size: int, element_size: int, device: torch.device, reftype: _RefType,
                 cuda_block: int) -> None:
        self.size = size
        self.element_size = element_size
        self.device = device
        self.reftype = reftype
        self._cuda_block = cuda_block
        self.mem_consumed = self._bytes()

    def _bytes(self) -> int:
        nbytes = self.size * self.element_size
        if self.device.type == "cuda":
            return math.ceil(nbytes / self._cuda_block) * self._cuda_block
        return nbytes

    def update_mem_consumed(self, st: torch.UntypedStorage) -> int:
        """Re-read the storage's size (it may have been resized); the bytes it is counted as now."""
        if st.size() != self.size:
            self.size = st.size()
            self.mem_consumed = self._bytes()
        return self.mem_consumed


def _cuda_block() -> int:
    """The CUDA caching allocator's smallest block (every allocation is rounded up to it), 1 without caching."""
    return 512 if int(optional_str("PYTORCH_NO_CUDA_MEMORY_CACHING") or 0) == 0 else 1


def _storages(t: Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold `t`'s data: its own, or a DTensor's local tensor's, or those of the tensors a
    traceable wrapper subclass flattens to."""
    found: dict[int, torch.UntypedStorage] = {}
    pending = [t]
    while pending:
        tensor = pending.pop()
        if isinstance(tensor, DTensor):
            pending.append(tensor._local_tensor)
        elif is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            pending.extend(inner for name in names if isinstance(inner := getattr(tensor, name), Tensor))
        else:
            storage = tensor.untyped_storage()
            found.setdefault(id(storage), storage)
    return list(found.values())


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


class _ResizeWatch:
    """`torch.UntypedStorage.resize_` is not an op dispatch sees: while any tracker is active it is patched,
    once for the process, to tell every active tracker after each resize (each acts on the storages it tracks).
    Process-wide because the patch is; trackers on several threads (ranks) share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trackers: list[MemTracker] = []
        self._original: Callable[[torch.UntypedStorage, int], Any] | None = None
        self._had_own = False             # whether the class defined resize_ itself (else it inherits it)

    def watch(self, tracker: MemTracker) -> None:
        with self._lock:
            if not self._trackers:
                self._had_own = "resize_" in torch.UntypedStorage.__dict__
                self._original = original = torch.UntypedStorage.resize_
                trackers = self._trackers

                def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                    out = original(storage, size)
                    for active in list(trackers):
                        active._on_resize(storage)
                    return out

                torch.UntypedStorage.resize_ = resize_   # type: ignore[method-assign]
            self._trackers.append(tracker)

    def unwatch(self, tracker: MemTracker) -> None:
        with self._lock:
            self._trackers.remove(tracker)
            if not self._trackers:
                if self._had_own:
                    torch.UntypedStorage.resize_ = self._original   # type: ignore[method-assign]
                else:
                    del torch.UntypedStorage.resize_                # the inherited method again
                self._original = None


_RESIZES = _ResizeWatch()


class MemTracker(TorchDispatchMode):
    """Tracks, categorizes and attributes to modules the tensor memory of the code run inside it (a context
    manager); modules, optimizers and tensors made before it starts are counted once passed to track_external.

    Usage (one training step, then the peak by category and each module's snapshots)::

        tracker = MemTracker()
        tracker.track_external(model, optimizer, inputs)
        with tracker:
            model(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        tracker.display_snapshot("peak", units="MiB")
        tracker.display_modulewise_snapshots(depth=2, units="MiB")
    """

    _ref_class: type[_RefType] = _MemRefType
    _ACT: _RefType = _MemRefType.ACT
    _TEMP: _RefType = _MemRefType.TEMP
    _OPT: _RefType = _MemRefType.OPT
    _PEAK_FW: _State = _ModState.PEAK_FW
    _PEAK_BW: _State = _ModState.PEAK_BW

    def __init__(self) -> None:
        super().__init__()
        self.memory_tracking: WeakIdKeyDictionary = WeakIdKeyDictionary()   # module -> _ModMemStats
        self._curr_mem_snap: Snapshot = {}
        self._peak_mem: dict[torch.device, int] = {}
        self._peak_mem_snap: Snapshot = {}
        self._infos: WeakIdKeyDictionary = WeakIdKeyDictionary()   # storage -> (_WeakRefInfo, its weakref)
        self._grad_hook_handles: WeakIdKeyDictionary = WeakIdKeyDictionary()   # parameter -> its two handles
        self._optimizer_hook_handles: tuple[RemovableHandle, RemovableHandle] | None = None
        self._mod_tracker = ModTracker()
        self._in_opt = False                          # inside an optimizer step: new tensors are its state
        self._in_ac = False                           # recomputing forward in backward (activation checkpointing)
        self._ac_mod: weakref.ref[nn.Module] | None = None   # the outermost module being recomputed
        self._depth = 0
        self._fake_mode_on_entry: Any = None
        self._thread: int | None = None
        self._cuda_block = _cuda_block()

    # -- the current snapshot ---------------------------------------------------------------------------------

    def _device_snapshot(self, device: torch.device) -> dict[Any, int]:
        return self._curr_mem_snap.setdefault(device, {**dict.fromkeys(self._ref_class, 0), _TOTAL_KEY: 0})

    def _count(self, info: _WeakRefInfo, change: int) -> None:
        """Add `change` bytes to `info`'s category; a device whose total falls to zero leaves the snapshot."""
        snap = self._device_snapshot(info.device)
        snap[info.reftype] += change
        snap[_TOTAL_KEY] += change
        if snap[_TOTAL_KEY] == 0:
            del self._curr_mem_snap[info.device]

    def _refile(self, info: _WeakRefInfo, reftype: _RefType) -> None:
        snap = self._device_snapshot(info.device)
        snap[info.reftype] -= info.mem_consumed
        snap[reftype] += info.mem_consumed
        info.reftype = reftype

    def _new_info(self, storage: torch.UntypedStorage, device: torch.device, reftype: _RefType) -> _WeakRefInfo:
        info = _WeakRefInfo(storage.size(), storage.element_size(), device, reftype, self._cuda_block)

        def freed(_: weakref.ref) -> None:
            if info.mem_consumed > 0:
                self._count(info, -info.mem_consumed)

        self._infos[storage] = (info, weakref.ref(storage, freed))
        if info.mem_consumed > 0:
            self._count(info, info.mem_consumed)
        return info

    def _resized(self, info: _WeakRefInfo, storage: torch.UntypedStorage) -> None:
        if info.size != storage.size():
            old = info.mem_consumed
            self._count(info, info.update_mem_consumed(storage) - old)

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        entry = self._infos.get(storage)
        if entry is not None:
            self._resized(entry[0], storage)

    def _update_and_maybe_create_winfos(self, t: Tensor, reftype: _RefType) -> list[_WeakRefInfo]:
        """File `t`'s storages under `reftype`, counting those not tracked yet; their infos."""
        infos = []
        for storage in _storages(t):
            entry = self._infos.get(storage)
            if entry is None:
                infos.append(self._new_info(storage, t.device, reftype))
                continue
            info = entry[0]
            if info.reftype != reftype:
                self._refile(info, reftype)
            infos.append(info)
        return infos

    def _track(self, reftype: _RefType, t: Tensor) -> None:
        """An op returned `t`: count its storages not tracked yet under `reftype`; re-read the size of the others.
        Meta tensors hold no memory: spmd's DTensor works out a new op's output layouts on them."""
        if t.device.type == "meta":
            return
        for storage in _storages(t):
            entry = self._infos.get(storage)
            if entry is None:
                self._new_info(storage, t.device, reftype)
            else:
                self._resized(entry[0], storage)

    def _update_peak_stats(self, peak_state: _State) -> None:
        """Raise the running peaks, the tracker's and those of the modules running now, to the current total."""
        current = self._curr_mem_snap
        for stats in self.memory_tracking.values():
            if stats.mod_fqn not in self._mod_tracker.parents or peak_state not in stats.snapshots:
                continue
            for device, snap in current.items():
                if stats.local_peak.get(device, 0) < snap[_TOTAL_KEY]:
                    stats.local_peak[device] = snap[_TOTAL_KEY]
                    stats.snapshots[peak_state][-1][device] = copy.deepcopy(snap)
        for device, snap in current.items():
            if self._peak_mem.get(device, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[device] = snap[_TOTAL_KEY]
                self._peak_mem_snap[device] = copy.deepcopy(snap)

    def get_tracker_snapshot(self, type: str = "current") -> Snapshot:
        """A copy of the "current" or the "peak" snapshot: {device: {category: bytes, "Total": bytes}}."""
        if type == "current":
            return copy.deepcopy(self._curr_mem_snap)
        if type == "peak":
            return copy.deepcopy(self._peak_mem_snap)
        raise ValueError(f"MemTracker: snapshot type must be 'current' or 'peak', got {type!r}")

    # -- modules, optimizers, external tensors ----------------------------------------------------------------

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """File `module`'s parameters, their gradients and its buffers; with `install_grad_hooks`, file each new
        gradient as it is computed and accumulated. The parameters' and buffers' bytes."""
        def file_grad(grad: Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        param_bytes = 0
        for param in module.parameters():
            infos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
            param_bytes += sum(info.mem_consumed for info in infos)
            if param.grad is not None:
                file_grad(param.grad)
            if install_grad_hooks and self._grad_hook_handles.get(param) is None:
                self._grad_hook_handles[param] = (param.register_hook(file_grad),
                                                  param.register_post_accumulate_grad_hook(lambda p: file_grad(p.grad)))
        buffer_bytes = 0
        for buffer in module.buffers():
            buffer_bytes += sum(info.mem_consumed
                                for info in self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER))
        return param_bytes, buffer_bytes

    def _track_inputs_or_outputs(self, tree: Any) -> int:
        """The bytes of the tracked storages among the tensors in `tree` (each storage once)."""
        infos = {id(entry[0]): entry[0] for t in _tensors(tree) for storage in _storages(t)
                 if (entry := self._infos.get(storage)) is not None}
        return sum(info.mem_consumed for info in infos.values())

    def _track_optimizer_states(self, reftype: _RefType, optimizer: optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    self._update_and_maybe_create_winfos(value, reftype)

    def track_external(self, *external: nn.Module | optim.Optimizer | Tensor) -> None:
        """Count modules (parameters, gradients, buffers), optimizers (their state) and tensors ("Other") made
        before the tracker starts; call it before entering the tracker."""
        for obj in tree_flatten(external)[0]:
            if isinstance(obj, Tensor):
                self._update_and_maybe_create_winfos(obj, _MemRefType.OTH)
            elif isinstance(obj, nn.Module):
                self._track_module_params_and_buffers(obj, install_grad_hooks=False)
            elif isinstance(obj, optim.Optimizer):
                self._track_optimizer_states(_MemRefType.OPT, obj)
            elif obj is not None:
                raise TypeError(f"MemTracker.track_external: cannot track a {type(obj).__name__}; pass modules, "
                                f"optimizers and tensors")

    # -- module hooks (see Note: snapshots) ---------------------------------------------------------------------

    def _start_peak(self, stats: Any, peak_state: _State, state: _State) -> None:
        """Record `state`'s snapshot and restart the module's running peak under `peak_state` from it."""
        snapshot = self.get_tracker_snapshot()
        stats.local_peak = {device: snap[_TOTAL_KEY] for device, snap in snapshot.items()}
        stats.snapshots.setdefault(peak_state, []).append(snapshot)
        stats.snapshots.setdefault(state, []).append(copy.deepcopy(snapshot))

    def _check_not_next_iteration(self, name: str) -> None:
        """A second forward of a module, not inside another module's forward, is the next iteration."""
        if self._mod_tracker.parents - {name} == {"Global"}:
            raise NotImplementedError(f"{type(self).__name__}: {name} runs forward a second time, a new "
                                      f"iteration; call reset_mod_stats() between iterations to track the next")

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        assert name is not None
        stats = self.memory_tracking.get(module)
        if stats is None:                     # its first forward
            stats = self.memory_tracking[module] = _ModMemStats(name)
            stats.parameter_mem, stats.buffer_mem = self._track_module_params_and_buffers(module)
            stats.input_mem = self._track_inputs_or_outputs(inputs)
        elif self._mod_tracker.is_bw:         # recomputed in backward (activation checkpointing)
            if self._ac_mod is None:
                self._ac_mod = weakref.ref(module)
                self._in_ac = True
            stats.snapshots.setdefault(_ModState.PRE_FW_AC, []).append(self.get_tracker_snapshot())
            return
        else:                                 # run again in the same iteration (a shared submodule)
            self._check_not_next_iteration(name)
            stats.mod_fqn = name
            stats.input_mem = self._track_inputs_or_outputs(inputs)
        self._start_peak(stats, _ModState.PEAK_FW, _ModState.PRE_FW)

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        stats = self.memory_tracking[module]
        if self._mod_tracker.is_bw:
            state = _ModState.POST_FW_AC
            if self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False
        else:
            state = _ModState.POST_FW
            stats.output_mem = self._track_inputs_or_outputs(outputs)
        stats.snapshots.setdefault(state, []).append(self.get_tracker_snapshot())

    def _pre_bw_hook(self, module: nn.Module | None, grads: Any) -> None:
        if module is not None:                # None: the module died before its backward
            self._start_peak(self.memory_tracking[module], _ModState.PEAK_BW, _ModState.PRE_BW)

    def _post_bw_hook(self, module: nn.Module | None, grads: Any) -> None:
        if module is not None:
            self.memory_tracking[module].snapshots.setdefault(_ModState.POST_BW, []).append(
                self.get_tracker_snapshot())

    # -- entering and leaving ---------------------------------------------------------------------------------

    def _on_this_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def _instrument(self) -> None:
        """Install what this tracker needs while active: optimizer-step hooks and the module hooks."""
        def before_step(optimizer: optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._on_this_thread():
                self._in_opt = True

        def after_step(optimizer: optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._on_this_thread():
                self._track_optimizer_states(_MemRefType.OPT, optimizer)
                self._in_opt = False

        self._optimizer_hook_handles = (register_optimizer_step_pre_hook(before_step),
                                        register_optimizer_step_post_hook(after_step))
        self._mod_tracker.register_user_hooks(self._pre_fw_hook, self._post_fw_hook, self._pre_bw_hook,
                                              self._post_bw_hook)

    def _uninstrument(self) -> None:
        for handles in self._grad_hook_handles.values():
            for handle in handles:
                handle.remove()
        self._grad_hook_handles.clear()
        if self._optimizer_hook_handles is not None:
            for handle in self._optimizer_hook_handles:
                handle.remove()
            self._optimizer_hook_handles = None
        self._mod_tracker.clear_user_hooks()

    def __enter__(self) -> MemTracker:
        if self._depth == 0:
            self._fake_mode_on_entry = active_fake_mode()
            self._thread = threading.get_ident()
            self._instrument()
            _RESIZES.watch(self)
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {device: snap[_TOTAL_KEY] for device, snap in self._peak_mem_snap.items()}
            self._mod_tracker.__enter__()
        super().__enter__()
        self._depth += 1
        return self

    def __exit__(self, *args: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._uninstrument()
            _RESIZES.unwatch(self)
            self._mod_tracker.__exit__(*args)
        super().__exit__(*args)

    supports_higher_order_operators = True   # flex_attention's inner ops count too (run_inside)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented             # DTensor runs its local ops, which come back through the mode
        out = run_inside(self, func, args, kwargs) if is_higher_order(func) else func(*args, **(kwargs or {}))
        # ops under a fake mode other than the one the tracker started in (shape propagation) hold no memory
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = self._OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = self._TEMP
            else:
                reftype = self._ACT
            for t in _tensors(out):
                self._track(reftype, t)
            self._update_peak_stats(self._PEAK_BW if self._mod_tracker.is_bw else self._PEAK_FW)
        return out

    # -- display ----------------------------------------------------------------------------------------------

    def display_snapshot(self, type: str = "current", units: str = "B", tabulate: bool = False) -> None:
        """Print the "current" or "peak" snapshot per device, in units B, KiB, MiB or GiB, as a list or a table."""
        print(format_snapshot(self.get_tracker_snapshot(type), units, tabulate))

    def display_modulewise_snapshots(self, depth: int = 2, units: str = "B", tabulate: bool = False) -> None:
        """Print each tracked module's snapshots per state (modules up to `depth` levels deep, in name order)."""
        def natural(name: str) -> list[int | str]:
            return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]

        for stats in sorted(self.memory_tracking.values(), key=lambda s: natural(s.mod_fqn)):
            if stats.mod_fqn.count(".") + 1 <= depth:
                print(f"Module:  {stats.mod_fqn}")
                print(format_state_snapshots(stats.snapshots, units, tabulate))

    def reset_mod_stats(self) -> None:
        """Forget every module's statistics, to track the next iteration."""
        self.memory_tracking.clear()
