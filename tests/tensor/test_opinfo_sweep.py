"""Every op of torch's OpInfo database on DTensors gives the numbers it gives on plain tensors (torch's own DTensor
test sweeps the same database): float32, the first sample of each op, its first tensor argument replicated and
sharded on dim 0, the other tensor arguments replicated, on 2 thread ranks; forward values, and the input's
gradient for ops with autograd. The few ops spmd refuses must refuse with a clear error (KNOWN_REFUSALS, each with
why), and an op on that list that starts to work fails the test, so the list stays true."""

from __future__ import annotations

import importlib.util
import sys
import types
import unittest
import warnings
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor import random as dtensor_random
from spmd.testing import run_ranks

# ops whose values are random or uninitialised, or nondeterministic for a seed: compared by shape only
BY_SHAPE = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "resize_",
            "resize_as_", "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "uniform",
            "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
            "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
            "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "pca_lowrank",
            "svd_lowrank", "randint_like", "rand_like", "randn_like", "torch._C._nn.rrelu"}

# op -> why spmd refuses it on these layouts (the error names it, with what to do instead)
KNOWN_REFUSALS = {
    "nn.functional.linear_cross_entropy.chunked_none": "its chunks write into a plain out= buffer",
    "nn.functional.fractional_max_pool2d": "it draws its random samples as a plain tensor",
    "nn.functional.fractional_max_pool3d": "it draws its random samples as a plain tensor",
    "nn.functional.scaled_dot_product_attention": "the CPU math path adds a plain causal mask to 3-d inputs",
    "svd_lowrank": "it draws a plain random projection",
    "pca_lowrank": "it draws a plain random projection",
    "resize_": "a sharded DTensor resizes only to its own size",
    "to_sparse": "a DTensor holds dense tensors",
    "__getitem__": "a Python list of indices becomes a plain index tensor",
    "tensor_split": "torch's C++ reads the data of a DTensor of split indices before dispatch sees the call (torch's "
                    "own DTensor fails alike); plain indices work",
}
RAISED_BY_TORCH = {"tensor_split"}      # torch's error, raised before spmd sees the call

Case = tuple[str, str]     # (op, layout)


def _ops() -> list[Any]:
    if importlib.util.find_spec("expecttest") is None:
        # torch's test utilities import expecttest for their TestCase base class, which the database doesn't use;
        # the package is not among this project's pinned dependencies (nor on its offline package mirror)
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase      # type: ignore[attr-defined]
        sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def _key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _first_sample(op: Any) -> Any | None:
    """What `op.sample_inputs(...)` yields first, the seed set as it sets it, without its wrapper, which walks the
    Python stack with inspect for a test method to name (four fifths of the sweep's time)."""
    from torch.testing._internal.common_utils import SEED, set_rng_seed

    set_rng_seed(SEED)
    try:
        return next(iter(op.sample_inputs_func(op, "cpu", torch.float32, op.supports_autograd)), None)
    except Exception:      # a sample generator that needs what this machine lacks
        return None


def _call(op: Any, sample: Any, convert: Any) -> Any:
    args = [convert(0, sample.input), *[convert(i + 1, a) for i, a in enumerate(sample.args)]]
    kwargs = {k: convert(-1, v) for k, v in sample.kwargs.items()}
    torch.manual_seed(42)
    return op(*args, **kwargs)


def _plain(op: Any, sample: Any) -> tuple[Any, Any] | None:
    """The plain outputs and the first input's gradient (None without autograd), or None if the op fails."""
    leaf = sample.input.detach().clone().requires_grad_(sample.input.requires_grad) \
        if isinstance(sample.input, torch.Tensor) else sample.input
    try:
        out = _call(op, sample, lambda i, v: leaf if i == 0 else v)
        return out, _grad(out, leaf)
    except Exception:
        return None


def _grad(out: Any, leaf: Any) -> Any:
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad or not tensors:
        return None
    total = sum((t.float() * _cotangent(t)).sum() for t in tensors)
    grad, = torch.autograd.grad(total, leaf, allow_unused=True)
    return grad


def _cotangent(output: torch.Tensor) -> torch.Tensor:
    """Fixed weights for an output (not all ones: a softmax's sum is constant), replicated for a DTensor's."""
    weights = torch.linspace(-1, 1, output.numel()).view(output.shape)
    if isinstance(output, DTensor):
        return distribute_tensor(weights, output.device_mesh, [Replicate()] * output.device_mesh.ndim)
    return weights


def _full(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, value)


def _mismatch(name: str, got: Any, want: Any) -> str | None:
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs, expected {len(want_leaves)}"
    for g, w in zip(got_leaves, want_leaves):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return f"got {type(g).__name__} {getattr(g, 'shape', '')}, expected {w.dtype} {tuple(w.shape)}"
        if name.split(".")[0] in BY_SHAPE or name in BY_SHAPE:
            continue
        try:
            torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-4, atol=1e-5, equal_nan=True)
        except AssertionError as error:
            return str(error).splitlines()[0] + " " + str(error).splitlines()[-1]
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.filterwarnings("ignore")         # the database's samples call deprecated ops, and ops warn about them
def test_every_opinfo_op_matches_plain_tensors_on_dtensors() -> None:
    cases = []
    for op in _ops():
        sample = _first_sample(op)
        if sample is None or not isinstance(sample.input, torch.Tensor) or sample.input.is_complex() \
                or sample.input.layout != torch.strided:
            continue
        plain = _plain(op, sample)
        if plain is not None:
            cases.append((op, sample, plain))
    assert len(cases) > 450, len(cases)

    def body(rank: int, size: int) -> dict[Case, str]:
        mesh = init_device_mesh("cpu", (size,))
        outcomes: dict[Case, str] = {}
        for op, sample, (want, want_grad) in cases:
            name = _key(op)
            layouts = {"Replicate": [Replicate()]}
            if sample.input.dim() and sample.input.shape[0] >= size:
                layouts["Shard(0)"] = [Shard(0)]
            for layout, placements in layouts.items():
                first = distribute_tensor(sample.input.detach().clone(), mesh, placements, src_data_rank=None)
                first.requires_grad_(sample.input.requires_grad)

                def convert(index: int, value: Any, first: DTensor = first) -> Any:
                    if index == 0:
                        return first
                    return pytree.tree_map(lambda t: distribute_tensor(t.detach().clone(), mesh, [Replicate()],
                                                                       src_data_rank=None)
                                           if isinstance(t, torch.Tensor) and t.dim() else t, value)

                dtensor_random.manual_seed(42, mesh)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = _call(op, sample, convert)
                        problem = _mismatch(name, _full(out), want)
                        if problem is None and want_grad is not None:
                            grad = _grad(out, first)
                            problem = _mismatch(name, None if grad is None else _full(grad), want_grad)
                            problem = problem and f"gradient: {problem}"
                    outcomes[name, layout] = problem or "ok"
                except Exception as error:
                    outcomes[name, layout] = f"raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return outcomes

    outcomes = run_ranks(body, 2, timeout=850, comm_timeout=60)[0]
    wrong = {case: what for case, what in outcomes.items() if what != "ok" and not what.startswith("raised")}
    assert not wrong, "DTensor results differ from plain tensors:\n" + "\n".join(f"{c}: {w}" for c, w in wrong.items())
    refused = {case: what for case, what in outcomes.items() if what.startswith("raised")}
    unexpected = {case: what for case, what in refused.items() if case[0] not in KNOWN_REFUSALS}
    assert not unexpected, "refused:\n" + "\n".join(f"{c}: {w}" for c, w in unexpected.items())
    unclear = {case: what for case, what in refused.items() if case[0] not in RAISED_BY_TORCH
               and not any(kind in what for kind in ("ShardingError", "MixedTensorError", "spmd"))}
    assert not unclear, "refused without saying why:\n" + "\n".join(f"{c}: {w}" for c, w in unclear.items())
    working = sorted(name for name in KNOWN_REFUSALS if (name, "Replicate") in outcomes
                     and all(w == "ok" for (n, _), w in outcomes.items() if n == name))
    assert not working, f"ops on KNOWN_REFUSALS now work: take them off the list: {working}"
