"""parallelize_module: apply a tensor-parallel plan (a style, or module paths -> styles) to a model.

Layer: tensor.parallel. Collective over the mesh: laying out each parameter broadcasts it from `src_data_rank`
(see distribute_tensor), so every rank must call it with the same model and plan.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import warnings

from torch import nn

from spmd.comm import torch_backend
from spmd.device_mesh import DeviceMesh
from spmd.tensor.parallel.style import ParallelStyle

Plan = ParallelStyle | dict[str, ParallelStyle]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: Plan | None = None, *, src_data_rank: int | None = 0) -> nn.Module:
    """Parallelize `module` in place on `device_mesh`: 1-d for spmd's styles (slice an N-d mesh first:
    `mesh["tp"]`); a style of your own may take any mesh (TorchTitan's expert-tensor-parallel style takes
    (ep, etp)).

    `parallelize_plan` is a ParallelStyle for `module` itself, or a dict from module paths to styles, applied
    in order; a path's dot-separated parts may be fnmatch patterns (`"layers.*.attention.wq"`), and `""` names
    `module`. A path that matches no submodule is skipped with a warning naming it, as torch's is (TorchTitan
    applies one plan to every pipeline stage, whose modules of other stages are None). `src_data_rank`: the rank
    whose values every parameter takes (None: each rank keeps its own, no communication). Returns `module`.
    """
    if device_mesh is None:
        raise ValueError("parallelize_module: pass the tensor-parallel device_mesh (e.g. mesh['tp'])")
    if parallelize_plan is None:
        raise ValueError("parallelize_module: pass a parallelize_plan (a ParallelStyle, or a dict from module "
                         "paths to styles)")
    _apply_plan(module, device_mesh, parallelize_plan, src_data_rank)
    return module


def _apply_plan(module: nn.Module, mesh: DeviceMesh, plan: Plan, src_data_rank: int | None) -> None:
    if isinstance(plan, ParallelStyle):
        plan.src_data_rank = src_data_rank
        plan._apply(module, mesh)
        return
    _refuse_torch_style(plan, "")
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_module: a plan is a ParallelStyle or a dict from module paths to styles, "
                        f"got {type(plan).__name__}")
    for path, style in plan.items():
        _refuse_torch_style(style, f"plan entry {path!r}: ")
        if not isinstance(path, str) or not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_module: plan entry {path!r}: {style!r} must map a module path (str) to "
                            f"a ParallelStyle")
        matches = _resolve(module, path)
        if not matches:
            warnings.warn(f"parallelize_module: plan key {path!r} matches no submodule of {type(module).__name__} "
                          f"(its children: {[name for name, _ in module.named_children()]}); skipping this plan "
                          f"entry", stacklevel=3)
            continue
        for fqn, submodule in matches:
            style.src_data_rank = src_data_rank
            if _takes_fqn(type(style)):
                style._apply(submodule, mesh, fqn)
            else:           # torch's signature, _apply(module, device_mesh), as TorchTitan's styles override it
                style._apply(submodule, mesh)


def _refuse_torch_style(value: object, where: str) -> None:
    """TypeError for one of torch's own ParallelStyles (torchao's float8 styles subclass them)."""
    if torch_backend.is_torch_parallel_style(value):
        raise TypeError(f"parallelize_module: {where}{type(value).__name__} is one of torch's ParallelStyles, "
                        f"whose hooks make torch's DTensors: use spmd's styles (spmd.tensor.parallel: "
                        f"ColwiseParallel, RowwiseParallel, ...) or subclass spmd.tensor.parallel.ParallelStyle "
                        f"(torchao's float8 styles: spmd's ColwiseParallel and RowwiseParallel on the Float8Linear "
                        f"modules train the same)")


@functools.cache
def _takes_fqn(style: type[ParallelStyle]) -> bool:
    """Whether `style._apply` takes spmd's third argument, the module's name in the plan (for its messages)."""
    parameters = inspect.signature(style._apply).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) >= 4 or any(
        p.kind is p.VAR_POSITIONAL for p in parameters)


def _resolve(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """Every (full name, submodule) that `path` (parts may be fnmatch patterns) names under `module`."""
    found = [("", module)]
    if path == "":
        return found
    for token in path.split("."):
        found = [(f"{name}.{child_name}" if name else child_name, child)
                 for name, parent in found for child_name, child in parent.named_children()
                 if fnmatch.fnmatchcase(child_name, token)]
    return found
