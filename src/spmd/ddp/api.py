"""DistributedDataParallel: replicate a module on every rank and average its gradients during backward.

Layer: ddp (parallel, L4). May import _core, comm, device_mesh and tensor (DTensor parameters: dtensor_params.py).

Construction is collective: every rank of the group wraps the same model, in the same order.
  1. (all ranks) resolve the group; collect the parameters that require grad (error if none)
  2. (all ranks) all-gather every rank's parameter names, shapes and dtypes; raise on every rank, naming
     the parameters that differ, if any rank disagrees with rank 0
  3. (all ranks) broadcast parameters and buffers from the group's rank 0, coalesced per dtype
  4. (all ranks) lay out the gradient buckets and hook every parameter (see reducer.py)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from spmd._autograd import DDP_STEPS_IN_BACKWARD, add_in_backward_optimizer, in_backward_optimizers
from spmd._core.compile import disable_once_dynamo_imported
from spmd.comm.collectives import is_wrapper_subclass
from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.join import Join, Joinable, JoinHook
from spmd.comm.objects import all_gather_object
from spmd.comm.world import resolve_group
from spmd.ddp.bucket import FIRST_BUCKET_BYTES
from spmd.ddp.dtensor_params import check_replicated_across
from spmd.ddp.join import DDPJoinHook, announce_sync
from spmd.ddp.reducer import CommHook, Reducer
from spmd.ddp.sync import IGNORE_ATTR, broadcast_module_state, ignored_names
from spmd.tensor import DTensor

_MIB = 1 << 20


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: each rank runs `module` on its own batch; backward averages gradients over the group.

    Same constructor and behaviour as torch.nn.parallel.DistributedDataParallel for CPU training:
    `bucket_cap_mb` (25) caps each gradient bucket, the first one at 1 MiB; a bucket's all-reduce starts as
    soon as its last gradient is ready, overlapping the rest of backward. `find_unused_parameters` lets the
    forward skip parameters; `static_graph` promises the same graph every iteration (then parameters may
    receive gradients several times per backward, as with reentrant checkpointing, and the unused set is
    learned once); `gradient_as_bucket_view` makes .grad views into the buckets, saving a copy; with
    `broadcast_buffers`, rank 0's buffers overwrite the others' before each forward that records gradients
    (so an evaluation forward under torch.no_grad() on one rank alone does not hang). `device_mesh` (1-D) may
    replace `process_group`.

    Accepted for torch compatibility, with torch's rules: `device_ids` is None, or for a module on one
    accelerator the one index of its device (checked); then forward moves the inputs there. `output_device` only
    sets `self.output_device` (default device_ids[0]): the module's output is already on its device, so it
    moves nothing, as in torch for single-device modules. Both must be None for CPU and multi-device modules.
    `dim` is ignored: torch uses it only to scatter inputs over the devices of one process, which neither does.

    Unused parameters are found at the end of backward, not by walking the graph after forward: a parameter
    whose gradient never arrived (skipped by forward, or feeding only outputs the loss ignores) is reduced as
    zeros with find_unused_parameters=True (its .grad untouched if no rank used it), and is a named error
    without it. Forward under torch.autocast and torch.amp.GradScaler need nothing special (gradients stay
    fp32; use bf16_compress_hook to halve the bytes). Under torch.compile, compiling the wrapper or wrapping a
    compiled module, the module's graph is cut at bucket boundaries as torch's DDPOptimizer cuts torch's DDP (it
    is the same mechanism), so a compiled backward yields gradients bucket by bucket and the all-reduces overlap
    it; DDP's own steps before and after the module compile apart from it (a graph break each side). Over
    tensor parallelism (DTensor parameters, which DDPOptimizer's cut does not take) the graph stays whole.
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 broadcast_buffers: bool = True, init_sync: bool = True,
                 process_group: ProcessGroup | NonMemberGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, device_mesh: Any = None, *,
                 output_device: int | torch.device | None = None, dim: int = 0) -> None:
        super().__init__()
        Joinable.__init__(self)
        self.module = module
        self.process_group = _resolve(process_group, device_mesh)
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._ignored = ignored_names(module)       # set before wrapping (_set_params_and_buffers_to_ignore...)
        self._fused_optim_registered = False
        named = _trainable(module, self.process_group)
        self._param_names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._param_shapes = [param.shape for param in self._params]
        self.device = self._params[0].device
        self.device_ids, self.output_device = _device_ids(device_ids, output_device, self._params)
        self._divide_by_initial_world_size = True     # under Join: see join.py, Note: DDP under Join
        if init_sync and self.process_group.size() > 1:
            _check_same_parameters(named, self.process_group)
            broadcast_module_state(self.module, self.process_group, src=0, include_params=True)
        bucket_bytes = int((25.0 if bucket_cap_mb is None else bucket_cap_mb) * _MIB)
        if bucket_bytes <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_bytes_cap = bucket_bytes
        # DDPOptimizer's cut cannot take DTensor parameters (DDP over tensor parallelism): those compile uncut
        self._cut_when_compiled = not any(isinstance(param, DTensor) for param in self._params)
        for param in self._params:
            if in_backward_optimizers(param):   # step them once the average is in (see reducer.py)
                setattr(param, DDP_STEPS_IN_BACKWARD, True)
        self.reducer = Reducer(self._params, self._param_names, self.process_group, bucket_bytes,
                               min(FIRST_BUCKET_BYTES, bucket_bytes), find_unused_parameters, static_graph,
                               gradient_as_bucket_view)

    # -- forward --------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_exporting():       # an exported program is the module's computation, without DDP's
            inputs, kwargs = self._inputs_to_device(inputs, kwargs)     # collectives and gradient hooks
            return self.module(*inputs, **kwargs)
        self._pre_forward()
        inputs, kwargs = self._inputs_to_device(inputs, kwargs)
        if self._cut_when_compiled:
            return self._post_forward(self._run_module(inputs, kwargs))
        return self._post_forward(self.module(*inputs, **kwargs))

    def _run_module(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's forward, announced to torch.compile as a DDP module's: this frame stays out of any graph (it
        is disabled non-recursively once dynamo is imported, below the class), and the frames compiled inside it are
        cut at bucket boundaries, so a compiled backward hands gradients to the reducer bucket by bucket
        (torch_backend, Note: spmd's DDP under torch.compile)."""
        from spmd.comm import torch_backend

        with torch_backend.announced_to_dynamo_as_ddp(self.bucket_bytes_cap):
            return _call(self.module, inputs, kwargs)

    def _inputs_to_device(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                                          dict[str, Any]]:
        """The forward's inputs, moved to the module's device when `device_ids` names one (as torch's)."""
        if self.device_ids is None:
            return inputs, kwargs
        return _to_device((inputs, kwargs), self.device)

    def _post_forward(self, output: Any) -> Any:
        """After the module ran: in a training forward that syncs, watch the outputs, so the reducer learns
        which parameters the backward from them will reach."""
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.reducer.watch_outputs(output)
        return output

    def _pre_forward(self) -> None:
        """Before the module runs: check the parameters; in a training forward, join's count, the buffers'
        broadcast, and arming (or, under no_sync, disarming) the reducer."""
        self._check_parameters_unchanged()
        if not torch.is_grad_enabled():
            return
        training = Join.notify_join_context(self)
        if training is not None and not self._divide_by_initial_world_size:
            training.wait()
            self.reducer.set_divisor(int(training.result()[0].item()))
        if self._join_config.enable:
            announce_sync(self.process_group, self.reducer.device, self.require_backward_grad_sync)
        if self.broadcast_buffers and self.process_group.size() > 1:
            broadcast_module_state(self.module, self.process_group, src=0, include_params=False)
        if self.require_backward_grad_sync:
            self.reducer.arm()
        else:
            self.reducer.disarm()

    def _register_fused_optim(self, optim: type[torch.optim.Optimizer], *args: Any,
                              optim_params: Any = None, **kwargs: Any) -> None:
        """torch's optimizer overlapped with DDP: `optim(param, *args, **kwargs)` for each of `optim_params` (by
        default every parameter DDP reduces), stepped as soon as that parameter's averaged gradient is written
        back, which then frees the gradient (as _apply_optimizer_in_backward's). Once per wrapper, as torch's.
        Unlike torch's, it composes with comm hooks and no_sync (the step waits for the synced backward)."""
        if self._fused_optim_registered:
            raise RuntimeError("DistributedDataParallel._register_fused_optim: an optimizer is already registered on "
                               "this wrapper; register one, once (as torch)")
        params = list(optim_params) if optim_params is not None else self._params
        reduced = {id(param) for param in self._params}
        outside = [param for param in params if id(param) not in reduced]
        if outside:
            raise ValueError(f"DistributedDataParallel._register_fused_optim: {len(outside)} of optim_params are not "
                             f"parameters this wrapper reduces")
        for param in params:
            add_in_backward_optimizer(param, optim([param], *args, **kwargs), optim, kwargs)
            setattr(param, DDP_STEPS_IN_BACKWARD, True)
        self._fused_optim_registered = True

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Have DDP leave alone the parameters and buffers of `module` named in `params_and_buffers_to_ignore`
        (fully qualified names): not broadcast at construction or before forward, not reduced in backward (a
        parameter another parallelism owns, a per-rank buffer). Call it before wrapping, as torch's."""
        setattr(module, IGNORE_ATTR, list(params_and_buffers_to_ignore))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run inside this context don't communicate.

        The first forward + backward after the context averages the accumulated gradients.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` instead of the default all-reduce.

        Register once, before the first backward. The hook must average (it is given the summed-to-be bucket
        and `bucket.div_factor()`); see spmd.ddp.comm_hooks for the built-in ones.
        """
        if self.reducer.comm_hook is not None:
            raise RuntimeError("DistributedDataParallel.register_comm_hook: a comm hook is already registered; "
                               "it can be registered only once")
        if self.reducer.iterations > 0:
            raise RuntimeError("DistributedDataParallel.register_comm_hook: register the hook before the first "
                               "backward, so every rank reduces every iteration the same way")
        if not callable(hook):
            raise TypeError(f"DistributedDataParallel.register_comm_hook: hook must be callable, got {hook!r}")
        self.reducer.comm_hook = hook
        self.reducer.comm_hook_state = state

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context for training loops whose ranks have different numbers of batches: `Join([self], ...)`."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What a joined rank runs for this module (join.py); takes `divide_by_initial_world_size` (True)."""
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return DDPJoinHook(self.module, self.process_group, self.reducer, self.broadcast_buffers)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    # -- internals ------------------------------------------------------------------------------------------

    def _check_parameters_unchanged(self) -> None:
        current = [param for name, param in self.module.named_parameters()
                   if param.requires_grad and name not in self._ignored]
        same = len(current) == len(self._params) and all(
            a is b and a.shape == shape for a, b, shape in zip(current, self._params, self._param_shapes))
        if same:
            return
        names = {id(param): name for name, param in self.module.named_parameters()}
        before = {id(param) for param in self._params}
        after = {id(param) for param in current}
        added = [names.get(id(p), "?") for p in current if id(p) not in before]
        removed = [name for name, p in zip(self._param_names, self._params) if id(p) not in after]
        reshaped = [name for name, p, shape in zip(self._param_names, self._params, self._param_shapes)
                    if id(p) in after and p.shape != shape]
        raise RuntimeError(
            f"DistributedDataParallel on rank {self.process_group.global_rank}: the module's trainable parameters "
            f"changed after wrapping (added or newly trainable: {added}; removed or frozen: {removed}; reshaped: "
            f"{reshaped}). DDP lays out its gradient buckets at construction: finish changing the model, then "
            f"wrap it again.")


disable_once_dynamo_imported(DistributedDataParallel, ["_run_module"], recursive=False)


def _resolve(process_group: ProcessGroup | NonMemberGroup | None, device_mesh: Any) -> ProcessGroup:
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("DistributedDataParallel: pass process_group or device_mesh, not both")
        if device_mesh.ndim != 1:
            raise ValueError(f"DistributedDataParallel: device_mesh must be 1-D, got {device_mesh.ndim} dims; "
                             f"pass mesh['dp'] for the data-parallel dimension")
        process_group = device_mesh.get_group(0)
    return resolve_group(process_group, "DistributedDataParallel")


def _trainable(module: nn.Module, group: ProcessGroup) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    ignored = ignored_names(module)
    wrapped = [name for name, param in module.named_parameters()
               if name not in ignored and is_wrapper_subclass(param) and not isinstance(param, DTensor)]
    if wrapped:
        raise ValueError(
            f"DistributedDataParallel on rank {group.global_rank}: parameters {wrapped[:5]}"
            f"{' ...' if len(wrapped) > 5 else ''} are tensor subclasses other than DTensor, whose data DDP's "
            f"buckets cannot read. To have DDP leave them to another parallelism, name them in "
            f"DistributedDataParallel._set_params_and_buffers_to_ignore_for_model first")
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad and name not in ignored]
    check_replicated_across(named, group)
    if not named:
        raise ValueError(
            f"DistributedDataParallel on rank {group.global_rank}: {type(module).__name__} has no parameter that "
            f"requires grad, so there is nothing to average. Wrap a module with trainable parameters (frozen "
            f"models need no DDP).")
    sparse = [name for name, sub in module.named_modules() if getattr(sub, "sparse", False)]
    if sparse:
        raise ValueError(f"DistributedDataParallel: modules {sparse} produce sparse gradients, which spmd's DDP "
                         f"does not reduce; use sparse=False")
    return named


def _device_ids(device_ids: list[int | torch.device] | None, output_device: int | torch.device | None,
                params: list[nn.Parameter]) -> tuple[list[int] | None, int | None]:
    """torch's device_ids / output_device rules, checked: as indices, or None for CPU and multi-device modules."""
    devices = sorted({param.device for param in params}, key=str)
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"DistributedDataParallel: device_ids can only be None or contain a single element, got "
                         f"{device_ids}")
    if not device_ids or devices[0].type == "cpu" or len(devices) > 1:
        if device_ids or output_device is not None:
            raise ValueError(f"DistributedDataParallel: device_ids and output_device only work with modules on "
                             f"one accelerator; leave them None for CPU and multi-device modules (got device_ids "
                             f"{device_ids}, output_device {output_device}, module parameters on "
                             f"{[str(device) for device in devices]})")
        return None, None
    index = _index(device_ids[0])
    if torch.device(devices[0].type, index) != devices[0]:
        raise ValueError(f"DistributedDataParallel: device_ids {device_ids} names a device other than the module's "
                         f"{devices[0]}; pass device_ids=[{devices[0].index}], or move the module first")
    return [index], index if output_device is None else _index(output_device)


def _index(device: int | torch.device) -> int | None:
    return device if isinstance(device, int) else torch.device(device).index


def _check_same_parameters(named: list[tuple[str, nn.Parameter]], group: ProcessGroup) -> None:
    """Step 2 of construction: every rank must wrap the same parameters. Collective."""
    mine = [(name, tuple(param.shape), str(param.dtype), _layout(param)) for name, param in named]
    everyone: list[Any] = [None] * group.size()
    all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = []
    for group_rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            problems.append(f"rank {group.ranks[group_rank]} has {len(theirs)} trainable parameters, rank "
                            f"{group.ranks[0]} has {len(reference)}")
        differ = [f"{a[0]} {a[1]} {a[2]}{a[3]} vs {b[0]} {b[1]} {b[2]}{b[3]}" for a, b in zip(theirs, reference)
                  if a != b]
        if differ:
            problems.append(f"rank {group.ranks[group_rank]} vs rank {group.ranks[0]}: " + "; ".join(differ[:5])
                            + ("; ..." if len(differ) > 5 else ""))
    if problems:
        raise ValueError(f"DistributedDataParallel on rank {group.global_rank} of {group.description}: the ranks "
                         f"wrapped different models: " + " | ".join(problems))


def _layout(param: nn.Parameter) -> str:
    """'' for a plain parameter; a DTensor's placements and local shape (equal on the replicas of one shard)."""
    if not isinstance(param, DTensor):
        return ""
    return f" {list(param.placements)} local {tuple(param._local_tensor.shape)}"


def _call(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`module(*inputs, **kwargs)` in a frame of spmd's, which torch.compile converts whole; it skips the frames
    of torch's own modules (an nn.Sequential's forward), so calling the module directly from the skipped
    _run_module would compile nothing of such a model."""
    return module(*inputs, **kwargs)


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(item, device) for item in tree)
    if isinstance(tree, dict):
        return {key: _to_device(value, device) for key, value in tree.items()}
    return tree
