"""The tracing front end: one model cut into pipeline stages at its `pipe_split()` marks or a `split_spec`.

Layer: pipelining. `pipeline` captures the model's forward as one graph (torch.export), cuts it at the marks
into a GraphModule per stage and returns a `Pipe`; `Pipe.build_stage` wraps one stage in a PipelineStage that
the schedules run. Nothing here communicates.

Note: values between stages
The stages form a chain: stage k receives from stage k-1 only (the runtime sends between neighbours). A value
made in stage d (a model input counts as made before stage 0) and used last in stage u > d travels through every
stage between: it is an output of stages d..u-1 and an input of stages d+1..u, in the graph's order; the
model's outputs count as used by the last stage, which returns them in the model's own structure. Only tensors
travel, so a value of another kind (a Python number the graph computed) that crosses a cut is refused, naming
it. Parameters, buffers and constants never travel: each stage that uses one holds it under the model's own
name for it, so stage state dicts use the model's keys. One used by several stages (tied weights) is copied
into each stage after the first and listed in `Pipe.replicated_params`: as in torch, the copies' gradients must
be summed across those stages before the optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from spmd.comm.world import AnyGroup
from spmd.pipelining.stage import PipelineStage, build_stage

_OPS = torch.library.Library("spmd_pipelining", "DEF")
_OPS.define("pipe_split() -> ()")
_OPS.impl("pipe_split", lambda: None, "CompositeExplicitAutograd")
_SPLIT = torch.ops.spmd_pipelining.pipe_split.default
fx.node.has_side_effect(_SPLIT)          # export keeps the mark although nothing uses its result


def pipe_split() -> None:
    """Mark a cut between two pipeline stages in a model's forward, for `pipeline`; run eagerly, it does nothing."""
    _SPLIT()


_MARKS = (_SPLIT, pipe_split)      # the op a traced forward records, and the function a split_policy may insert


class SplitPoint(enum.Enum):
    """Where `pipeline`'s `split_spec` cuts at a submodule: before its forward runs, or after."""

    BEGINNING = 1
    END = 2


@dataclasses.dataclass
class PipeInfo:
    """What a stage needs to know of the whole pipe (`Pipe.info()`): the pipe's graph and its stage count."""

    graph: fx.Graph
    num_stages: int
    has_loss_and_backward: bool = False


def _submod_name(stage_index: int) -> str:
    return f"submod_{stage_index}"


class Pipe(nn.Module):
    """A model cut into `num_stages` stage modules (`split_gm.submod_<i>`, GraphModules holding the parameters
    each stage uses under the model's names). Called, it runs the stages in turn, as the model does; see Note:
    values between stages."""

    def __init__(self, split_gm: fx.GraphModule, num_stages: int,
                 replicated_params: list[dict[str, str]]) -> None:
        super().__init__()
        self.split_gm = split_gm
        self.num_stages = num_stages
        self.has_loss_and_backward = False
        self.loss_spec = None
        self.replicated_params = replicated_params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.split_gm(*args, **kwargs)

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        """Stage `stage_idx`'s module."""
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"Pipe: stage index {stage_idx} is out of range for {self.num_stages} stages "
                             f"(0..{self.num_stages - 1})")
        return self.split_gm.get_submodule(_submod_name(stage_idx))

    def info(self) -> PipeInfo:
        return PipeInfo(self.split_gm.graph, self.num_stages)

    def print_readable(self) -> None:
        """Print the pipe's graph and each stage's."""
        self.split_gm.print_readable()

    def build_stage(self, stage_index: int, device: torch.device | str,
                    group: AnyGroup | None = None) -> PipelineStage:
        """The PipelineStage running stage `stage_index` on `device` in the pipeline group `group`."""
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group)


def pipeline(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Pipe:
    """Cut `module` into pipeline stages: at the `pipe_split()` calls in its forward, at the submodules that
    `split_spec` names (a cut at the BEGINNING or END of each), or where `split_policy` (a function from the
    traced GraphModule to one with `pipe_split` calls inserted) puts them. `mb_args` / `mb_kwargs` are example
    inputs of one microbatch: the graph is captured for their shapes. A mark that would leave a stage with
    nothing to compute (two in a row, or at either end) is dropped."""
    if split_spec is not None and split_policy is not None:
        raise ValueError("pipeline: give split_spec or split_policy, not both")
    with _marked(module, split_spec or {}):
        traced = _export(module, tuple(mb_args), mb_kwargs)
    if split_policy is not None:
        traced = split_policy(traced)
        if not isinstance(traced, fx.GraphModule):
            raise TypeError(f"pipeline: split_policy must return a torch.fx.GraphModule, got "
                            f"{type(traced).__name__}")
    return _cut(traced)


@contextlib.contextmanager
def _marked(module: nn.Module, split_spec: dict[str, SplitPoint]) -> Iterator[None]:
    """`module` with a `pipe_split()` before or after the forward of each submodule `split_spec` names, for the
    time of the trace (the model is left as it was)."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name, point in split_spec.items():
            if not isinstance(point, SplitPoint):
                raise ValueError(f"pipeline: split_spec[{name!r}] must be SplitPoint.BEGINNING or SplitPoint.END, "
                                 f"got {point!r}")
            try:
                target = module.get_submodule(name)
            except AttributeError as error:
                raise ValueError(f"pipeline: split_spec names {name!r}, which {type(module).__name__} lacks "
                                 f"({error})") from None
            patched.append((target, target.__dict__.get("forward")))
            target.forward = functools.partial(_split_before if point is SplitPoint.BEGINNING else _split_after,
                                               target.forward)
        yield
    finally:
        for target, own_forward in reversed(patched):
            if own_forward is None:
                del target.forward
            else:
                target.forward = own_forward


def _split_before(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    pipe_split()
    return forward(*args, **kwargs)


def _split_after(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    output = forward(*args, **kwargs)
    pipe_split()
    return output


_EXPORTING = threading.Lock()     # torch.export keeps global tracing state: thread ranks trace one at a time


def _export(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None) -> fx.GraphModule:
    try:
        with _EXPORTING:
            program = torch.export.export(module, mb_args, mb_kwargs)
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise RuntimeError(
            f"pipeline: torch.export could not capture {type(module).__name__}'s forward as one graph "
            f"({type(error).__name__}: {first_line}). Typical causes: control flow on tensor values, or an op "
            f"without a meta kernel. Remove the graph break, or build each stage's module yourself and wrap it "
            f"in PipelineStage") from error
    return program.module(check_guards=False)


@dataclasses.dataclass
class _Stage:
    """One stage's part of the traced graph, before it becomes a GraphModule."""

    body: list[fx.Node] = dataclasses.field(default_factory=list)       # the ops, in the graph's order
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)     # received values (Note: values between..)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)    # sent values
    attrs: list[fx.Node] = dataclasses.field(default_factory=list)      # parameters, buffers and constants used


def _stages_of(graph: fx.Graph) -> list[_Stage]:
    """The traced graph's ops split at the marks, dropping marks that would leave a stage empty."""
    stages = [_Stage()]
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_function" and node.target in _MARKS:
            if stages[-1].body:
                stages.append(_Stage())
            continue
        stages[-1].body.append(node)
    if not stages[-1].body and len(stages) > 1:
        stages.pop()
    return stages


def _cut(traced: fx.GraphModule) -> Pipe:
    graph = traced.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    output = next(node for node in graph.nodes if node.op == "output")
    stages = _stages_of(graph)
    last = len(stages) - 1
    made_in: dict[fx.Node, int] = dict.fromkeys(placeholders, -1)
    for index, stage in enumerate(stages):
        made_in.update(dict.fromkeys(stage.body, index))
    order = _order(graph)
    used_last: dict[fx.Node, int] = {}
    for index, stage in enumerate(stages):
        attrs: dict[fx.Node, None] = {}
        for node in stage.body + ([output] if index == last else []):
            for value in node.all_input_nodes:
                if value.op == "get_attr":
                    attrs[value] = None
                elif made_in[value] < index:
                    used_last[value] = max(used_last.get(value, index), index)
        stage.attrs = sorted(attrs, key=order)
    travelling = sorted((v for v in used_last if used_last[v] > max(made_in[v], 0)), key=order)
    for value in travelling:
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise ValueError(f"pipeline: {value.name} ({type(value.meta.get('val')).__name__}), made in "
                             f"{_where(made_in[value])} and used in stage {used_last[value]}, would cross a cut "
                             f"between stages, and only tensors travel between stages: move the cut or make it a "
                             f"tensor")
    for index, stage in enumerate(stages):
        stage.inputs = placeholders if index == 0 else [v for v in travelling if made_in[v] < index <= used_last[v]]
        stage.outputs = [v for v in travelling if made_in[v] <= index < used_last[v]]
        if index < last and not stage.outputs:
            raise ValueError(f"pipeline: stage {index + 1} uses nothing that stage {index} or the stages before "
                             f"it compute, so nothing would travel between them: move the cut")
    modules = [_stage_module(traced, stage, index, index == last, output) for index, stage in enumerate(stages)]
    replicated = _replicate_shared(modules, stages)
    return Pipe(_split_gm(traced, stages, modules), len(stages), replicated)


def _order(graph: fx.Graph) -> Callable[[fx.Node], int]:
    position = {node: at for at, node in enumerate(graph.nodes)}
    return position.__getitem__


def _where(stage: int) -> str:
    return "the model's inputs" if stage < 0 else f"stage {stage}"


def _stage_module(traced: fx.GraphModule, stage: _Stage, index: int, is_last: bool,
                  output: fx.Node) -> fx.GraphModule:
    """The GraphModule of one stage: its inputs as positional arguments (the model's own on stage 0), its body,
    and its outputs: the model's, in the model's structure, on the last stage, else the travelling values."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in stage.inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = copy.copy(value.meta)
    for node in stage.attrs + stage.body:
        env[node] = graph.node_copy(node, env.__getitem__)
    if is_last:
        graph.output(_structured(fx.map_arg(output.args[0], env.__getitem__), traced))
    else:
        sent = [env[value] for value in stage.outputs]
        graph.output(sent[0] if len(sent) == 1 else tuple(sent))
    if index == 0:
        graph._codegen = _taking_the_models_arguments(traced)
    return fx.GraphModule(traced, graph, class_name=f"PipeStage{index}")


def _taking_the_models_arguments(traced: fx.GraphModule) -> fx.graph.CodeGen:
    """The traced model's argument handling (positional and keyword, as the model takes them), returning as is."""
    codegen = traced.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        return fx.graph._PyTreeCodeGen(codegen.pytree_info._replace(out_spec=None))
    return fx.graph.CodeGen()


def _structured(flat_outputs: Any, traced: fx.GraphModule) -> Any:
    """The model's flat outputs put back in its own structure (tuples, lists, dicts; flat for other types)."""
    codegen = traced.graph._codegen
    spec = codegen.pytree_info.out_spec if isinstance(codegen, fx.graph._PyTreeCodeGen) else None
    if spec is None or not _plain_containers(spec):
        return flat_outputs
    leaves = list(flat_outputs) if isinstance(flat_outputs, (list, tuple)) else [flat_outputs]
    return pytree.tree_unflatten(leaves, spec)


def _plain_containers(spec: pytree.TreeSpec) -> bool:
    if spec.is_leaf():
        return True
    return spec.type in (tuple, list, dict) and all(_plain_containers(spec.child(i))
                                                    for i in range(spec.num_children))


def _replicate_shared(modules: list[fx.GraphModule], stages: list[_Stage]) -> list[dict[str, str]]:
    """Give every stage after the first that uses a parameter or buffer its own copy; see Note: values between
    stages. Returns, per shared tensor, the stages' module names and its name in each."""
    users: dict[str, list[int]] = {}
    for index, stage in enumerate(stages):
        for attr in stage.attrs:
            users.setdefault(str(attr.target), []).append(index)
    replicated = []
    for name, indices in users.items():
        if len(indices) < 2:
            continue
        for index in indices[1:]:
            owner_name, _, leaf = name.rpartition(".")
            owner = modules[index].get_submodule(owner_name)
            setattr(owner, leaf, copy.deepcopy(getattr(owner, leaf)))
        replicated.append({_submod_name(index): name for index in indices})
    return replicated


def _split_gm(traced: fx.GraphModule, stages: list[_Stage], modules: list[fx.GraphModule]) -> fx.GraphModule:
    """The pipe's own GraphModule: the stage modules as `submod_<i>`, called in turn on the model's arguments."""
    holder = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in stages[0].inputs:
        env[value] = graph.placeholder(value.name)
    for index, (stage, module) in enumerate(zip(stages, modules, strict=True)):
        holder.add_module(_submod_name(index), module)
        result = graph.call_module(_submod_name(index), tuple(env[value] for value in stage.inputs))
        if index == len(stages) - 1:
            graph.output(result)
        elif len(stage.outputs) == 1:
            env[stage.outputs[0]] = result
        else:
            env.update({value: graph.call_function(operator.getitem, (result, at))
                        for at, value in enumerate(stage.outputs)})
    graph._codegen = _taking_the_models_arguments(traced)
    return fx.GraphModule(holder, graph, class_name="PipeSplit")
