"""Parallel styles: how `parallelize_module` lays out one module's parameters, inputs and outputs.

Layer: tensor.parallel. Each style is torch's of the same name and arguments. A style's `_apply(module, mesh,
fqn)` turns the module's parameters into DTensors on the (1-d) tensor-parallel mesh and installs forward
hooks converting its inputs and outputs; the hooks are where the collectives of tensor parallelism happen.

Note: Megatron's layers as DTensor layouts
- ColwiseParallel: a Linear's weight (out, in) and bias are Shard(0), so each rank computes a slice of the
  output features: input Replicate -> output Shard(-1); no collective in forward; backward all-reduces the
  input gradient (a Replicate input's gradient arrives Partial). An Embedding's table is Shard(1) (embedding
  dim), output Shard(-1).
- RowwiseParallel: a Linear's weight is Shard(1) (input features), bias Replicate: input Shard(-1) -> output
  Partial, reduced to `output_layouts` (Replicate: all-reduce; Shard(1): reduce-scatter along the sequence,
  which is sequence parallelism's exit). An Embedding's table is Shard(0) (vocabulary rows): ids Replicate ->
  output Partial (each id's row lives on one rank), reduced the same way.
- SequenceParallel: parameters Replicate; the input is (or becomes) Shard(sequence_dim), so norms and dropout
  run on a slice of the sequence; a Replicate parameter's gradient is Partial and is reduced where it is read.
Colwise then rowwise is Megatron's pair: one all-reduce in forward and one in backward per pair; with
sequence parallelism an all-gather before and a reduce-scatter after instead.

Note: one DTensor per shared input
Attention's q, k and v projections are three ColwiseParallel Linears reading the same plain input x. Made into
three DTensors, x would get three Partial gradients, each all-reduced in backward (torch's tensor parallel
does that: three all-reduces where Megatron has one). So a plain input becomes ONE DTensor, reused by every
module it enters while that DTensor is alive (autograd keeps it for backward): the three gradients add up as
Partials on it and its single from_local backward all-reduces their sum. The reuse is keyed on the tensor's
identity, version (an in-place change makes a new one) and requires_grad, the grad mode, the mesh and the
layout, per rank thread; entries hold only weak references. Under torch.compile the traced hooks convert the
input once per module, as torch's do (three all-reduces in backward).
"""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor, distribute_module, distribute_tensor
from spmd.tensor.placement import Placement, Replicate, Shard

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]


class ParallelStyle(abc.ABC):
    """How one module is parallelized; `parallelize_module` calls `_apply` on each module a plan names."""

    src_data_rank: int | None = 0

    @abc.abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        """Lay out `module` (named `fqn` in the plan, for error messages) on the 1-d `device_mesh`."""


def _describe(module: nn.Module, fqn: str) -> str:
    return f"{fqn!r} ({type(module).__name__})" if fqn else type(module).__name__


class _SharedInputs(threading.local):
    """Per rank thread: the DTensor each plain input tensor became, while that DTensor is alive (see Note:
    one DTensor per shared input)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref, tuple, DeviceMesh, Placement, weakref.ref]] = {}


_shared_inputs = _SharedInputs()


def _as_dtensor(value: Any, mesh: DeviceMesh, layout: Placement, what: str,
                global_shape: Callable[[Tensor], tuple[int, ...] | None] | None = None) -> DTensor:
    """A module input: a DTensor is kept; a plain tensor is this rank's piece of a DTensor laid out as `layout`,
    the same DTensor for every module it enters (Note: one DTensor per shared input). `global_shape(local)` is
    the whole tensor's shape where the module knows it (uneven shards), None to assume even ones."""
    if isinstance(value, DTensor):
        return value
    if not isinstance(value, Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    shape = None if global_shape is None else global_shape(value)
    if torch.compiler.is_dynamo_compiling():   # traced: the graph converts it once per use, no cache to consult
        return DTensor.from_local(value, mesh, (layout,), run_check=False, shape=shape,
                                  stride=None if shape is None else _contiguous_strides(shape))
    entries = _shared_inputs.entries
    state = (value._version, value.requires_grad, torch.is_grad_enabled(), shape)
    entry = entries.get(id(value))
    if entry is not None:
        source, entry_state, entry_mesh, entry_layout, made = entry
        dt = made()
        if (source() is value and entry_state == state and entry_mesh == mesh and entry_layout == layout
                and dt is not None):
            return dt
    dt = DTensor.from_local(value, mesh, (layout,), run_check=False, shape=shape,
                            stride=None if shape is None else _contiguous_strides(shape))
    if len(entries) > 64:
        for key in [key for key, item in entries.items() if item[0]() is None or item[4]() is None]:
            del entries[key]
    entries[id(value)] = (weakref.ref(value), state, mesh, layout, weakref.ref(dt))
    return dt


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _linear_input_shape(module: nn.Module, layout: Placement) -> Callable[[Tensor], tuple[int, ...] | None] | None:
    """For an nn.Linear whose input arrives sharded along its features (Shard(-1)), the input's whole shape: the
    features are the layer's in_features, however unevenly they split (a ColwiseParallel layer's local output
    feeding a RowwiseParallel one, when the tensor-parallel degree does not divide the width)."""
    if not isinstance(module, nn.Linear) or not isinstance(layout, Shard):
        return None

    def shape(local: Tensor) -> tuple[int, ...] | None:
        if layout.dim not in (-1, local.ndim - 1):
            return None
        return (*local.shape[:-1], module.in_features)

    return shape


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                           src_data_rank: int | None, fqn: str) -> None:
    """Replace `module`'s own parameters by DTensors laid out as `placements[name]` (Replicate if not named)."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, Replicate())
        if isinstance(placement, Shard):
            extent = param.shape[placement.dim]
            if extent < mesh.size():
                raise ValueError(f"parallelize_module: {_describe(module, fqn)}.{name} has {extent} entries along "
                                 f"dim {placement.dim}, fewer than the {mesh.size()} tensor-parallel ranks; it "
                                 f"cannot be split as {placement}")
        dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _check_mesh(mesh: DeviceMesh, style: ParallelStyle, module: nn.Module, fqn: str) -> None:
    """A 1-d mesh, and (for the styles that lay out parameters) a module not parallelized before."""
    laid_out = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if laid_out and not isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)):
        raise ValueError(f"parallelize_module: {type(style).__name__} on {_describe(module, fqn)}: parameter "
                         f"{laid_out[0]!r} is already a DTensor; a module can be parallelized once")
    check_one_d(mesh, style, module, fqn)


def check_one_d(mesh: DeviceMesh, style: ParallelStyle, module: nn.Module, fqn: str) -> None:
    """The 1-d tensor-parallel mesh spmd's styles lay a module out on."""
    if mesh.ndim != 1:
        names = f" (dims {mesh.mesh_dim_names}; pass e.g. mesh[{mesh.mesh_dim_names[-1]!r}])" \
            if mesh.mesh_dim_names else ""
        raise ValueError(f"parallelize_module: {type(style).__name__} on {_describe(module, fqn)} needs a 1-d "
                         f"tensor-parallel mesh, got a {mesh.ndim}-d one{names}")


class _LinearStyle(ParallelStyle):
    """What ColwiseParallel and RowwiseParallel share: layouts, the input and output hooks, the module check."""

    _name: ClassVar[str]
    _desired_input: ClassVar[dict[type[nn.Module], Placement]]
    _parameters: ClassVar[dict[type[nn.Module], dict[str, Placement]]]

    def __init__(self, *, input_layouts: Placement | None, output_layouts: Placement | None,
                 use_local_output: bool, default_input: Placement, default_output: Placement) -> None:
        self.input_layouts = (input_layouts or default_input,)
        self.output_layouts = (output_layouts or default_output,)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        _check_mesh(device_mesh, self, module, fqn)
        kind = next((k for k in self._parameters if isinstance(module, k)), None)
        if kind is None:
            raise TypeError(f"parallelize_module: {self._name} supports nn.Linear and nn.Embedding, but "
                            f"{_describe(module, fqn)} is neither; use PrepareModuleInput/Output or a custom style")
        placements = self._parameters[kind]
        desired = (self._desired_input[kind],)
        what = f"{self._name} input of {_describe(module, fqn)}"
        input_shape = _linear_input_shape(module, self.input_layouts[0])

        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            if submodule is module:
                _distribute_parameters(module, mesh, placements, self.src_data_rank, fqn)

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            if not inputs:
                raise TypeError(f"{what}: the module was called without a positional input")
            dt = _as_dtensor(inputs[0], mesh, self.input_layouts[0], what, input_shape)
            if dt.placements != desired:
                dt = dt.redistribute(placements=desired)
            return (dt, *inputs[1:])

        def prepare_output(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            if outputs.placements != self.output_layouts:
                outputs = outputs.redistribute(placements=self.output_layouts)
            return outputs.to_local() if self.use_local_output else outputs

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)

    def __repr__(self) -> str:
        return (f"{self._name}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearStyle):
    """Shard an nn.Linear's output features (weight and bias Shard(0)) or an nn.Embedding's embedding dim
    (Shard(1)); input Replicate (or `input_layouts`, redistributed to Replicate), output Shard(-1) (or
    `output_layouts`), a local tensor unless `use_local_output=False`. See Note: Megatron's layers."""

    _name = "ColwiseParallel"
    _desired_input: ClassVar[dict[type[nn.Module], Placement]] = {nn.Linear: Replicate(), nn.Embedding: Replicate()}
    _parameters: ClassVar[dict[type[nn.Module], dict[str, Placement]]] = {
        nn.Linear: {"weight": Shard(0), "bias": Shard(0)}, nn.Embedding: {"weight": Shard(1)}}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output, default_input=Replicate(), default_output=Shard(-1))


class RowwiseParallel(_LinearStyle):
    """Shard an nn.Linear's input features (weight Shard(1), bias Replicate; input Shard(-1)) or an nn.Embedding's
    vocabulary (Shard(0); ids Replicate); the Partial output is reduced to Replicate (or `output_layouts`, e.g.
    Shard(1) for sequence parallelism), a local tensor unless `use_local_output=False`."""

    _name = "RowwiseParallel"
    _desired_input: ClassVar[dict[type[nn.Module], Placement]] = {nn.Linear: Shard(-1), nn.Embedding: Replicate()}
    _parameters: ClassVar[dict[type[nn.Module], dict[str, Placement]]] = {
        nn.Linear: {"weight": Shard(1)}, nn.Embedding: {"weight": Shard(0)}}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output, default_input=Shard(-1), default_output=Replicate())


class SequenceParallel(ParallelStyle):
    """Replicate the module's parameters and run it on inputs sharded along `sequence_dim` (LayerNorm, RMSNorm,
    Dropout: anything computed per token). A plain input is taken as already sharded; a DTensor input is
    redistributed to Shard(sequence_dim). The output stays Shard(sequence_dim), a DTensor unless
    `use_local_output=True`."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        _check_mesh(device_mesh, self, module, fqn)
        what = f"SequenceParallel input of {_describe(module, fqn)}"

        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_parameters(submodule, mesh, {}, self.src_data_rank, f"{fqn}.{name}" if name else fqn)

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            if not inputs:
                raise TypeError(f"{what}: the module was called without a positional input")
            dt = _as_dtensor(inputs[0], mesh, self.sequence_sharding[0], what)
            if dt.placements != self.sequence_sharding:
                dt = dt.redistribute(placements=self.sequence_sharding)
            return (dt, *inputs[1:])

        def prepare_output(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            return outputs.to_local() if self.use_local_output else outputs

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")


Layouts = Placement | tuple[Placement | None, ...] | None


def _as_tuple(layouts: Layouts) -> tuple[Placement | None, ...] | None:
    return (layouts,) if isinstance(layouts, Placement) else (tuple(layouts) if layouts is not None else None)


def _prepare(value: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None,
             use_local: bool, what: str) -> Any:
    """One input or output: annotated as `layout` (a plain tensor becomes a DTensor), moved to `desired`."""
    if layout is None:
        return value
    dt = _as_dtensor(value, mesh, layout, what)
    if desired is not None and dt.placements != (desired,):
        dt = dt.redistribute(placements=(desired,))
    return dt.to_local() if use_local else dt


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs at call time: each positional input (and keyword input) annotated with its
    `input_layouts` entry (None: leave it alone) is made a DTensor and redistributed to its `desired_input_layouts`
    entry; local tensors again with `use_local_output=True`. No parameters are touched."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError("PrepareModuleInput: input_layouts needs desired_input_layouts (one per input)")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(f"PrepareModuleInput: {len(self.input_layouts)} input_layouts but "
                                 f"{len(self.desired_input_layouts)} desired_input_layouts; give one per input")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts) and self.with_kwargs:
            raise ValueError(f"PrepareModuleInput: input_kwarg_layouts names {sorted(self.input_kwarg_layouts)} "
                             f"but desired_input_kwarg_layouts names {sorted(self.desired_input_kwarg_layouts)}")

    def _prepare_args(self, inputs: tuple, mesh: DeviceMesh, where: str) -> tuple:
        if self.input_layouts is None:
            return inputs
        if len(inputs) != len(self.input_layouts):
            raise ValueError(f"PrepareModuleInput on {where}: the module got {len(inputs)} positional inputs but "
                             f"input_layouts has {len(self.input_layouts)} entries (None for an input to leave)")
        assert self.desired_input_layouts is not None
        return tuple(_prepare(value, mesh, layout, desired, self.use_local_output, f"input {i} of {where}")
                     for i, (value, layout, desired) in enumerate(zip(inputs, self.input_layouts,
                                                                       self.desired_input_layouts)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        _check_mesh(device_mesh, self, module, fqn)
        where = _describe(module, fqn)
        if self.with_kwargs:
            def hook_with_kwargs(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                prepared = {name: _prepare(value, device_mesh, self.input_kwarg_layouts.get(name),
                                           self.desired_input_kwarg_layouts.get(name), self.use_local_output,
                                           f"keyword input {name!r} of {where}")
                            for name, value in kwargs.items()}
                return self._prepare_args(args, device_mesh, where), prepared
            module.register_forward_pre_hook(hook_with_kwargs, with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_args(args, device_mesh, where))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs after its forward: each output annotated with its `output_layouts` entry (None:
    leave it) becomes a DTensor redistributed to its `desired_output_layouts` entry; local tensors unless
    `use_local_output=False`."""

    def __init__(self, *, output_layouts: Placement | tuple[Placement | None, ...],
                 desired_output_layouts: Placement | tuple[Placement, ...], use_local_output: bool = True) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        self.use_local_output = use_local_output
        assert self.output_layouts is not None and self.desired_output_layouts is not None
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: {len(self.output_layouts)} output_layouts but "
                             f"{len(self.desired_output_layouts)} desired_output_layouts; give one per output")

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh, where: str) -> Any:
        assert self.output_layouts is not None and self.desired_output_layouts is not None
        values = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(values) != len(self.output_layouts):
            raise ValueError(f"PrepareModuleOutput on {where}: the module returned {len(values)} outputs but "
                             f"output_layouts has {len(self.output_layouts)} entries")
        prepared = tuple(_prepare(value, mesh, layout, desired, self.use_local_output, f"output {i} of {where}")
                         for i, (value, layout, desired) in enumerate(zip(values, self.output_layouts,
                                                                           self.desired_output_layouts)))
        return prepared[0] if len(prepared) == 1 else prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        _check_mesh(device_mesh, self, module, fqn)
        where = _describe(module, fqn)
        module.register_forward_hook(lambda mod, args, outputs: self._prepare_outputs(outputs, device_mesh, where))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module (`use_local_input` is the input side's
    `use_local_output`)."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None, use_local_input: bool = False,
                 output_layouts: Placement | tuple[Placement | None, ...],
                 desired_output_layouts: Placement | tuple[Placement, ...], use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh, fqn)
        self.prepare_module_output._apply(module, device_mesh, fqn)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"

