"""The DTensor subclass, its conversions (from_local / to_local / full_tensor / redistribute) and
distribute_tensor / distribute_module.

Layer: tensor. A DTensor is a wrapper subclass: it reports the GLOBAL shape, stride and dtype, holds this
rank's `_local_tensor` and a `_spec` (DTensorSpec). Ops on it go through `__torch_dispatch__` (the dispatch package).

Note: DTensor autograd
Autograd runs above dispatch, on DTensors: every gradient is a DTensor whose full value is the gradient of
the logical (global) tensor. The conversions are autograd functions with adjoint backwards:
- from_local: backward redistributes the gradient to the forward placements with Partial -> Replicate (or to
  `grad_placements`) and returns its local tensor. No communication when the gradient already has them.
- to_local: backward wraps the plain local gradient as a DTensor with the forward placements, Partial ->
  Replicate (or `grad_placements`, e.g. [Partial()] when each rank computed a partial loss). No communication.
- redistribute(src -> dst): backward redistributes the gradient back to src, Partial -> Replicate (the
  gradient of a sum is the same on every term). So Replicate -> Shard is undone by an all-gather, and
  Shard -> Replicate by a local chunk; a Partial gradient arriving at a Shard source is reduce-scattered.
A parameter's gradient may come out Partial (e.g. a Replicate weight times Shard(0) activations). It is never
read as if it were reduced: every rule that needs its value (optimizer foreach ops, norms, full_tensor)
reduces it first, and `.placements` shows it.

Note: DTensors under torch.compile
A DTensor is a traceable wrapper subclass (__tensor_flatten__: its local tensor, and its spec as the constant
that guards a compiled graph). Dynamo traces a function over DTensors whole: its ops run through
__torch_dispatch__ on fake local tensors while AOTAutograd traces, so the graph holds the local ops and the
collectives of each redistribution (spmd.comm.traceable's ops); `redistribute`, `to_local` and `full_tensor`
are recorded as calls on the DTensor and `from_local` as a call in the graph (registered with dynamo when dynamo
is first imported, see `_tell_dynamo`); they run, autograd and all, when AOTAutograd traces the
graph. Meshes are graph constants (spmd.device_mesh, Note: meshes in compiled graphs). So the hooks of the
parallel styles compile into the same graph as the module they wrap. distribute_tensor stays eager
(`eager_under_compile`): it scatters real data once, before training.
Dynamic shapes: when dynamo recompiles for a new size, the spec's shape holds symbols. Such a spec has no hash
(DTensorSpec.symbolic), so no cache keeps it: every decision is made afresh while tracing; cost models read the
sizes' hints instead of guarding on them; a graph's DTensor outputs get their concrete shape back in
__tensor_unflatten__ (torch passes the outer size). A gradient arriving in another layout than the one the
backward was traced for is redistributed to it (__coerce_same_metadata_as_tangent__).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.utils._foreach_utils
from torch import Tensor, nn
from torch._ops import OpOverload
from torch.optim.optimizer import _foreach_supported_types as _optimizer_foreach_types

from spmd._core.compile import eager_under_compile, when_dynamo_imported
from spmd.comm.collectives import broadcast
from spmd.device_mesh import DeviceMesh
from spmd.tensor.dispatch import dispatch
from spmd.tensor.dispatch.run import values_of
from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard, normalize_placements
from spmd.tensor.redistribute import run_plan
from spmd.tensor.spec import DTensorSpec, Placements, contiguous_stride, stride_like


def _is_symbolic(sizes: Sequence[Any]) -> bool:
    """Whether any of `sizes` is a torch.SymInt (a dynamic shape being traced)."""
    return any(isinstance(size, torch.SymInt) for size in sizes)


class DTensor(torch.Tensor):
    """A tensor laid out over a DeviceMesh: the global view of the local shards given by `placements`."""

    _local_tensor: Tensor
    _spec: DTensorSpec
    _gathered_view: Any = None     # dispatch's: set on a view of a gathered copy (run.py, Note: writes through views)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
        local_tensor = values_of(local_tensor)         # a lazily conjugated local as its values (a copy)
        out = Tensor._make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype,
                                            device=local_tensor.device, layout=local_tensor.layout,
                                            requires_grad=requires_grad)
        out._local_tensor = local_tensor
        out._spec = spec
        return out

    @classmethod
    def _wrap_local(cls, local_tensor: Tensor, spec: DTensorSpec) -> DTensor:
        """Wrap a local tensor computed by dispatch (no autograd; the caller guarantees it matches `spec`)."""
        out = Tensor._make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype,
                                            device=local_tensor.device, requires_grad=False)
        out._local_tensor = local_tensor
        out._spec = spec
        return out

    @classmethod
    def __torch_dispatch__(cls, func: OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        return dispatch(cls, func, types, args, kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], DTensorSpec]:
        """The inner tensor and the constant context torch.compile traces a DTensor by (Note: DTensors under
        torch.compile)."""
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], spec: DTensorSpec, outer_size: Any,
                             outer_stride: Any) -> DTensor:
        local = inner["_local_tensor"]
        if spec.symbolic or _is_symbolic(outer_size) or tuple(outer_size) != tuple(spec.shape):
            spec = DTensorSpec(spec.mesh, spec.placements, outer_size, tuple(outer_stride), spec.dtype)
        return DTensor(local, spec, requires_grad=local.requires_grad)

    def _stable_hash_for_caching(self) -> str:
        """torch.compile's key for this input in its AOT autograd cache (torch's hook; without it torch warns and
        pickles the spec): the mesh, the layout, the local tensor's kind and dtype, and requires_grad."""
        spec, local = self._spec, self._local_tensor
        mesh = spec.mesh
        key = repr((mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, spec.placements, tuple(spec.shape),
                    tuple(spec.stride), str(spec.dtype), type(local).__qualname__, str(local.dtype),
                    tuple(local.shape), self.requires_grad))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    @classmethod
    def __metadata_guard__(cls, compiled_for: DTensorSpec, given: DTensorSpec) -> bool:
        """Whether a graph compiled for a DTensor of spec `compiled_for` takes one of spec `given`: the same mesh,
        placements and dtype. Shapes and strides are left to dynamo's own guards on the DTensor's sizes, which
        may be symbolic (with the whole spec compared, every new size recompiled, dynamic or not)."""
        return (compiled_for.placements == given.placements and compiled_for.dtype == given.dtype
                and compiled_for.mesh == given.mesh)

    def __coerce_tangent_metadata__(self) -> DTensor:
        """The layout a compiled backward is traced with for this output's gradient: a Partial one is guessed
        reduced (Replicate), the layout gradients usually arrive in."""
        if not self._spec.has_partial():
            return self
        return self.redistribute(self._spec.mesh, [Replicate() if isinstance(p, Partial) else p
                                                   for p in self._spec.placements])

    def __coerce_same_metadata_as_tangent__(self, expected: DTensorSpec,
                                            expected_type: type | None = None) -> DTensor | None:
        """This gradient laid out as the compiled backward was traced to expect (`expected`: the traced spec);
        None (torch then names the mismatch) when the backward expects another type."""
        if expected_type is not None:
            return None
        return self.redistribute(self._spec.mesh, expected.placements)

    def __repr__(self, *, tensor_contents: Any = None) -> str:   # torch passes tensor_contents to subclasses
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
                f"placements={list(self._spec.placements)}, shape={tuple(self._spec.shape)})")

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickled (torch.save of a sharded state dict) as its local tensor, its spec and its attributes (a
        parameter's flag); torch.load, weights_only included, rebuilds it in the loading rank's world, its mesh's
        groups found among those the world has (see device_mesh._unpickled_mesh)."""
        extra = {name: value for name, value in self.__dict__.items() if name not in ("_local_tensor", "_spec")}
        return _unpickled_dtensor, (self._local_tensor, self._spec, self.requires_grad, extra)

    def __deepcopy__(self, memo: dict) -> DTensor:
        """A copy with its own local tensor, sharing the spec (and so the mesh and its process groups)."""
        if id(self) in memo:
            return memo[id(self)]
        out = DTensor(copy.deepcopy(self._local_tensor, memo), self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        for name, value in self.__dict__.items():       # e.g. nn.Parameter's _is_param flag
            if name not in ("_local_tensor", "_spec"):
                setattr(out, name, copy.deepcopy(value, memo))
        return out

    # -- layout ---------------------------------------------------------------------------------------------

    @property
    def placements(self) -> Placements:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    # -- conversions ----------------------------------------------------------------------------------------

    @staticmethod
    def from_local(local_tensor: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None,
                   *, run_check: bool = False, shape: torch.Size | Sequence[int] | None = None,
                   stride: Sequence[int] | None = None,
                   grad_placements: Sequence[Placement] | None = None) -> DTensor:
        """Wrap this rank's `local_tensor` as its piece of a DTensor; no communication unless `run_check`.

        Without `shape`, the global shape assumes EVEN shards (local size x number of shards); pass `shape`
        (and `stride`) for uneven ones: this rank's local shape is then checked against it. Without `stride`,
        the global strides lay the dims out in the local tensor's memory order (row-major if it isn't dense).
        `run_check=True` also broadcasts Replicate dims from the first rank of each mesh dim (collective).
        A local with torch's lazy conjugate or negative bit (`x.conj()`) is taken as its values, a copy.
        Differentiable (see Note: DTensor autograd).
        """
        if placements is None:
            placements = (Replicate(),) * device_mesh.ndim
        elif isinstance(placements, list):
            placements = tuple(placements)
        spec = _from_local_spec(local_tensor, device_mesh, placements, shape, stride)
        if run_check:
            local_tensor = _broadcast_replicated(local_tensor, spec)
        grad = None if grad_placements is None else normalize_placements(
            grad_placements, local_tensor.ndim, device_mesh.ndim, "DTensor.from_local grad_placements")
        if not (local_tensor.requires_grad and torch.is_grad_enabled()):     # what _FromLocal would return
            return DTensor(local_tensor.detach(), spec)
        return _FromLocal.apply(local_tensor, spec, grad)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """This rank's local tensor (no communication). Differentiable (see Note: DTensor autograd)."""
        grad = None if grad_placements is None else normalize_placements(
            grad_placements, self.ndim, self._spec.mesh.ndim, "DTensor.to_local grad_placements")
        if not torch.is_grad_enabled():
            return self._local_tensor
        return _ToLocal.apply(self, grad)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
                     *, async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """This DTensor laid out with `placements` on the same mesh, with the cheapest collectives.

        Collective over the mesh. `async_op` is accepted for torch compatibility; the result is always ready.
        `forward_dtype` (torch's): cast first, the collectives and the result in that dtype; `backward_dtype`: the
        gradient's collectives in that dtype (default this DTensor's), the gradient returned in this DTensor's.
        Differentiable (see Note: DTensor autograd).
        """
        if (forward_dtype is not None and forward_dtype != self.dtype) or \
                (backward_dtype is not None and backward_dtype != self.dtype):
            target = self._target(device_mesh, placements)
            return _CastRedistribute.apply(self, target, forward_dtype or self.dtype, backward_dtype or self.dtype)
        source = self._spec
        target = self._target(device_mesh, placements)
        if target == source.placements:
            return self
        if not (self.requires_grad and torch.is_grad_enabled()):             # what _Redistribute would return
            return DTensor(_redistributed(self, target), source.with_placements(target))
        return _Redistribute.apply(self, target)

    def _target(self, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> Placements:
        """redistribute's target placements, checked (the same mesh, one placement per mesh dim)."""
        source = self._spec
        if device_mesh is not None and device_mesh != source.mesh:
            raise ValueError(f"DTensor.redistribute on rank {device_mesh.get_rank()}: moving from {source.mesh} to "
                             f"another mesh {device_mesh} is not supported; redistribute within one mesh")
        if placements is None:
            raise ValueError("DTensor.redistribute: pass the target placements (one per mesh dim)")
        return normalize_placements(placements, self.ndim, source.mesh.ndim, "DTensor.redistribute")

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> Tensor:
        """The whole global value as a plain tensor on every rank (collective: gathers and reduces as needed)."""
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


# torch's optimizers (torch.optim.optimizer's list: their default foreach on accelerators) and clip_grad_norm_
# (torch.utils._foreach_utils's) take their fast multi-tensor (foreach) path only for the tensor types listed, as
# torch's own DTensor is in both; spmd's DTensor has foreach rules (ops/foreach.py), one dispatch per op for the
# whole parameter list instead of one per parameter.
for _supported in (torch.utils._foreach_utils._foreach_supported_types, _optimizer_foreach_types):
    if DTensor not in _supported:
        _supported.append(DTensor)


def _tell_dynamo(dynamo: ModuleType) -> None:
    """Dynamo records DTensor.from_local as one call in its graph instead of tracing into it (as torch's own
    from_local is listed in dynamo's rules): it builds a DTensor from a mesh and placements, which AOTAutograd
    runs when it traces the graph (Note: DTensors under torch.compile)."""
    dynamo.allow_in_graph(DTensor.from_local)


when_dynamo_imported(_tell_dynamo)


def _unpickled_dtensor(local: Tensor, spec: DTensorSpec, requires_grad: bool, extra: dict[str, Any]) -> DTensor:
    """A DTensor torch.load rebuilt (see DTensor.__reduce_ex__)."""
    out = DTensor(local, spec, requires_grad=requires_grad)
    for name, value in extra.items():
        setattr(out, name, value)
    return out

# torch.load(weights_only=True) of a state dict of DTensors (as torch registers its own DTensor's pieces).
torch.serialization.add_safe_globals([_unpickled_dtensor, DTensorSpec, Shard, _StridedShard, Replicate, Partial])


def _scaled_stride(local: Tensor, placements: Placements, mesh: DeviceMesh) -> tuple[int, ...]:
    """The global strides of a local tensor that isn't dense (a strided slice, an expanded tensor), as torch
    computes them: its own, each stride at least that of a sharded dim scaled by the shards. A row-major stride
    here would call the tensor contiguous, and ops would then view a local tensor that can't be viewed."""
    stride = list(local.stride())
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            pivot = local.stride(placement.dim)
            stride = [value * mesh.size(mesh_dim) if dim != placement.dim and value >= pivot else value
                      for dim, value in enumerate(stride)]
    return tuple(stride)


def _from_local_spec(local: Tensor, mesh: DeviceMesh, placements: Placements, shape: Sequence[int] | None,
                     stride: Sequence[int] | None) -> DTensorSpec:
    """from_local's spec, checked against the local tensor; its strides follow the local tensor's memory order.
    Without `shape` and `stride` (the global shape from even shards), for a contiguous local tensor, it depends
    only on the placements and the local shape and dtype, and is kept in the mesh's dispatch cache: a step's
    from_local of the same layout yields the same spec object."""
    key = None
    if shape is None and stride is None and local.is_contiguous():
        key = (_FromLocal, placements, local.shape, local.dtype)
        try:
            spec = mesh.dispatch_cache.get(key)
        except TypeError:          # an unhashable placement (normalize_placements names it) or a symbolic shape
            key = spec = None
        if spec is not None:
            return spec
    placements = normalize_placements(placements, local.ndim, mesh.ndim, "DTensor.from_local")
    if shape is None:
        global_shape = list(local.shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                global_shape[placement.dim] *= mesh.size(mesh_dim)
        shape = global_shape
    if stride is None:                 # the local tensor's memory order
        stride = stride_like(local, shape) or _scaled_stride(local, placements, mesh)
    spec = DTensorSpec(mesh, placements, torch.Size(shape), tuple(stride), local.dtype)
    if spec.ndim != local.ndim or (mesh.get_coordinate() is not None and spec.local_shape() != local.shape):
        raise ValueError(f"DTensor.from_local on rank {mesh.get_rank()}: the local tensor has shape "
                         f"{tuple(local.shape)}, but global shape {tuple(spec.shape)} with placements "
                         f"{list(placements)} gives this rank {tuple(spec.local_shape())}")
    if key is not None:
        mesh.dispatch_cache[key] = spec
    return spec


def _redistributed(dtensor: DTensor, target: Placements) -> Tensor:
    """The local tensor of `dtensor` laid out as `target`, never `dtensor`'s own local tensor object."""
    local = run_plan(dtensor._local_tensor, dtensor._spec, target)
    return local.view_as(local) if local is dtensor._local_tensor else local


def _with_partial_as_replicate(placements: Placements) -> Placements:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _broadcast_replicated(local: Tensor, spec: DTensorSpec) -> Tensor:
    mesh = spec.mesh
    out = local.detach().clone(memory_format=torch.contiguous_format)
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Replicate) and mesh.size(mesh_dim) > 1:
            broadcast(out, group=mesh.get_group(mesh_dim), group_src=0)
    return out


class _FromLocal(torch.autograd.Function):
    """Forward: wrap the local tensor. Backward: redistribute the gradient to the forward placements
    (Partial -> Replicate) or `grad_placements`, and unwrap. Adjoint of _ToLocal."""

    @staticmethod
    def forward(ctx, local: Tensor, spec: DTensorSpec, grad_placements: Placements | None) -> DTensor:
        ctx.spec, ctx.grad_placements = spec, grad_placements
        return DTensor(local.detach(), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        if not isinstance(grad, DTensor):
            return grad, None, None
        target = ctx.grad_placements or _with_partial_as_replicate(ctx.spec.placements)
        return grad.redistribute(placements=target).to_local(), None, None


class _ToLocal(torch.autograd.Function):
    """Forward: the local tensor. Backward: wrap the local gradient with the forward placements (Partial ->
    Replicate) or `grad_placements`; no communication. Adjoint of _FromLocal."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, grad_placements: Placements | None) -> Tensor:
        ctx.spec, ctx.grad_placements = dtensor._spec, grad_placements
        return dtensor._local_tensor.view_as(dtensor._local_tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[DTensor, None]:
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or _with_partial_as_replicate(spec.placements)
        stride = stride_like(grad, spec.shape)    # a gradient may come in another memory order than the forward's
        if stride is None:                        # not dense (an expanded gradient): no strides describe it
            grad = grad.contiguous()
            stride = contiguous_stride(spec.shape)
        if stride == spec.stride and grad.dtype == spec.dtype:
            return DTensor(grad, spec.with_placements(placements)), None
        return DTensor(grad, DTensorSpec(spec.mesh, placements, spec.shape, stride, grad.dtype)), None


class _Redistribute(torch.autograd.Function):
    """Forward: redistribute to the target placements. Backward: redistribute the gradient back to the source
    placements, Partial -> Replicate. Twice differentiable (the backward is this function again)."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, target: Placements) -> DTensor:
        source = dtensor._spec
        ctx.source_placements = source.placements
        return DTensor(_redistributed(dtensor, target), source.with_placements(target))

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None]:
        target = _with_partial_as_replicate(ctx.source_placements)
        if grad._spec.placements == target:
            return grad, None
        return _Redistribute.apply(grad, target), None


class _CastRedistribute(torch.autograd.Function):
    """redistribute with torch's forward_dtype / backward_dtype. Forward: cast to `forward_dtype`, then
    redistribute (the result in that dtype). Backward: the gradient cast to `backward_dtype`, redistributed back
    (Partial -> Replicate, as _Redistribute), then cast to the input's dtype."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, target: Placements, forward_dtype: torch.dtype,
                backward_dtype: torch.dtype) -> DTensor:
        source = dtensor._spec
        ctx.source_placements, ctx.input_dtype, ctx.backward_dtype = source.placements, dtensor.dtype, backward_dtype
        cast = DTensor(dtensor._local_tensor.to(forward_dtype),
                       DTensorSpec(source.mesh, source.placements, source.shape, source.stride, forward_dtype))
        local = _redistributed(cast, target) if target != source.placements else cast._local_tensor
        if local is dtensor._local_tensor:        # forward_dtype is the input's own and nothing moved
            local = local.view_as(local)
        return DTensor(local, DTensorSpec(source.mesh, target, source.shape, source.stride, forward_dtype))

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None, None, None]:
        target = _with_partial_as_replicate(ctx.source_placements)
        grad = grad.to(ctx.backward_dtype)
        if grad._spec.placements != target:
            grad = _Redistribute.apply(grad, target)
        return grad.to(ctx.input_dtype), None, None, None


@eager_under_compile
def distribute_tensor(tensor: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay out the full `tensor` over `device_mesh` with `placements` (default all Replicate); a new leaf.

    Collective over the mesh when `src_data_rank` is set: the value of the rank at group rank
    `src_data_rank` of every mesh dim is broadcast, then each rank keeps its piece. With None, every rank
    must pass the same value and no communication happens. A meta `tensor` gives a meta DTensor, this rank's
    piece's shape, without communicating (to be materialised by to_empty, as in torch).
    """
    if isinstance(tensor, DTensor):
        if tensor.device_mesh == device_mesh and placements is not None and tuple(placements) == tensor.placements:
            return tensor
        raise ValueError(f"distribute_tensor on rank {device_mesh.get_rank()}: got a DTensor "
                         f"({list(tensor.placements)} on {tensor.device_mesh}); use redistribute() instead")
    placements = placements if placements is not None else [Replicate()] * device_mesh.ndim
    placements = normalize_placements(placements, tensor.ndim, device_mesh.ndim, "distribute_tensor")
    if tensor.is_meta:      # a model built on the meta device, laid out before to_empty (TorchTitan's way): shapes only
        spec = DTensorSpec(device_mesh, placements, tensor.shape, contiguous_stride(tensor.shape), tensor.dtype)
        local = torch.empty(spec.local_shape(), dtype=tensor.dtype, device="meta")
        return DTensor(local, spec, requires_grad=tensor.requires_grad)
    full = tensor.detach().to(device_mesh.device_type)
    if src_data_rank is not None:
        full = full.clone(memory_format=torch.contiguous_format)
        for mesh_dim in range(device_mesh.ndim):
            if device_mesh.size(mesh_dim) > 1:
                broadcast(full, group=device_mesh.get_group(mesh_dim), group_src=src_data_rank)
    spec = DTensorSpec(device_mesh, placements, full.shape, contiguous_stride(full.shape), full.dtype)
    return DTensor(spec.local_from_full(full), spec, requires_grad=tensor.requires_grad)


PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]
InputFn = Callable[[nn.Module, Any, DeviceMesh], Any]
OutputFn = Callable[[nn.Module, Any, DeviceMesh], Any]


def distribute_module(module: nn.Module, device_mesh: DeviceMesh, partition_fn: PartitionFn | None = None,
                      input_fn: InputFn | None = None, output_fn: OutputFn | None = None) -> nn.Module:
    """Make `module`'s parameters and buffers DTensors, in place; returns `module`.

    1. `partition_fn(name, submodule, mesh)` runs on every submodule (it replaces parameters as it likes);
    2. every parameter and buffer still a plain tensor becomes a Replicate DTensor (names unchanged);
    3. `input_fn(module, inputs, mesh)` becomes a forward pre-hook, `output_fn(module, outputs, mesh)` a forward
       hook (each may return replacements).
    Collective over the mesh (distribute_tensor). A module may be distributed once.
    """
    if getattr(module, "_spmd_distributed", False):
        raise RuntimeError(f"distribute_module: {type(module).__name__} was already distributed; call it once")
    replicate = [Replicate()] * device_mesh.ndim
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        for param_name, param in list(submodule._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dt = distribute_tensor(param.data, device_mesh, replicate)
                submodule.register_parameter(param_name, nn.Parameter(dt, requires_grad=param.requires_grad))
        for buffer_name, buffer in list(submodule._buffers.items()):
            if buffer is not None and not isinstance(buffer, DTensor):
                submodule._buffers[buffer_name] = distribute_tensor(buffer, device_mesh, replicate)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    module._spmd_distributed = True
    return module
