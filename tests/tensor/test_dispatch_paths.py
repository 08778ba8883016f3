"""One dispatch path: ops whose registration adds a local kernel (mean, var_mean, embedding, the foreach ops, ...)
and ops with a plain rule share the cache key, the cache, the decision checks, the redistribution and the wrap.

Each test states what that buys: a wrong decision raises naming the op (it was truncated for kernel ops), a
kernel is built once per distinct call, numbers-by-type keys share decisions, an input passed twice moves
once, a written input is never moved behind the op's back, and kwarg-only DTensors reach the rule as specs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from spmd.device_mesh import DeviceMesh
from spmd.tensor import DTensor, Partial, Replicate, Shard
from spmd.tensor.dispatch import run as dispatch_run
from spmd.tensor.dispatch.decision import Path
from spmd.tensor.dispatch.keys import call_key
from spmd.tensor.rules import (
    OPTIONS,
    RULES,
    OpSchema,
    ShardingDecision,
    ShardingError,
    Strategy,
    register_strategy,
)
from tests.tensor.rule_checks import make_dtensor, on_meshes

aten = torch.ops.aten
TIMEOUT = 60.0

# A test-only op with a kwarg-only tensor argument (no aten op with a plain rule has one).
_LIB = torch.library.Library("spmd_dispatch_test", "DEF")
_LIB.define("scaled(Tensor x, *, Tensor scale) -> Tensor")
_LIB.impl("scaled", lambda x, *, scale: x * scale, "CPU")
_LIB.impl("scaled", lambda x, *, scale: torch.empty_like(x), "Meta")
_SCALED = torch.ops.spmd_dispatch_test.scaled.default
_SEEN_SCALE: list[type] = []


@register_strategy(_SCALED)
def _scaled(schema: OpSchema) -> list[Strategy]:
    _SEEN_SCALE.append(type(schema.kwargs["scale"]))
    return [Strategy((Replicate(), Replicate()), Replicate()), Strategy((Shard(0), Replicate()), Shard(0))]


def _on_two(body: Callable[[DeviceMesh], None]) -> None:
    on_meshes(body, [(2,)], timeout=TIMEOUT)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# -- the decision checks: the same for every op --------------------------------------------------------------

# (op, how to call it on DTensors made from `fulls`, its DTensor input count): kernel ops and plain-rule ops
_CALLS = {
    "mean (kernel)": (aten.mean.dim, lambda x, ids: x.mean(0), 1),
    "embedding (kernel)": (aten.embedding.default, lambda x, ids: F.embedding(ids, x), 2),
    "neg (rule)": (aten.neg.default, lambda x, ids: torch.neg(x), 1),
    "mm (rule)": (aten.mm.default, lambda x, ids: torch.mm(x, x.t()), 2),
}


def _inputs(mesh: DeviceMesh) -> tuple[DTensor, DTensor]:
    x = make_dtensor(_randn(4, 4), mesh, (Shard(0),))
    ids = make_dtensor(torch.tensor([[0, 3], [1, 2]]), mesh, (Replicate(),))
    return x, ids


@pytest.mark.parametrize("extra", [1, -1], ids=["one too many", "one too few"])
@pytest.mark.parametrize("name", list(_CALLS))
def test_wrong_number_of_input_placements_raises_naming_the_op(monkeypatch: pytest.MonkeyPatch, name: str,
                                                               extra: int) -> None:
    """A rule giving one input placement too many or too few is refused, naming the op and both counts (a
    kernel op silently truncated or ignored the list before)."""
    op, call, count = _CALLS[name]
    given = count + extra
    monkeypatch.setitem(RULES, op, lambda schema: ShardingDecision((Replicate(),), [(Replicate(),)] * given))

    def body(mesh: DeviceMesh) -> None:
        x, ids = _inputs(mesh)
        with pytest.raises(ShardingError, match=rf"{op}.*the rule gave {given} input placements for {count} "
                                                rf"DTensor inputs"):
            call(x, ids)
    _on_two(body)


@pytest.mark.parametrize("op, call", [(aten.var_mean.correction, lambda x: torch.var_mean(x, 0)),
                                      (aten.max.dim, lambda x: torch.max(x, 0))], ids=["var_mean (kernel)",
                                                                                        "max.dim (rule)"])
def test_wrong_number_of_output_placements_raises_naming_the_op(monkeypatch: pytest.MonkeyPatch, op: object,
                                                                call: Callable) -> None:
    """Three per-output entries for an op with two outputs are refused (a kernel op dropped the third)."""
    monkeypatch.setitem(RULES, op, lambda schema: ShardingDecision([(Replicate(),)] * 3, [(Replicate(),)]))

    def body(mesh: DeviceMesh) -> None:
        x, _ = _inputs(mesh)
        with pytest.raises(ShardingError, match=rf"{op}.*the rule gave 3 output placements for 2 outputs"):
            call(x)
    _on_two(body)


def test_per_output_entries_for_a_single_output_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two per-output entries for mean's one output: refused by count, not read as one odd placements tuple."""
    monkeypatch.setitem(RULES, aten.mean.dim, lambda schema: ShardingDecision([(Replicate(),)] * 2))

    def body(mesh: DeviceMesh) -> None:
        x, _ = _inputs(mesh)
        with pytest.raises(ShardingError, match=r"aten\.mean\.dim.*the rule gave 2 output placements for 1 output"):
            x.mean(0)
    _on_two(body)


def test_a_rule_returning_no_decision_raises_naming_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that returns its strategies instead of a decision (register_rule for register_strategy)."""
    monkeypatch.setitem(RULES, aten.mean.dim, lambda schema: [Strategy((Replicate(),), Replicate())])

    def body(mesh: DeviceMesh) -> None:
        x, _ = _inputs(mesh)
        with pytest.raises(ShardingError, match=r"aten\.mean\.dim.*returned a list, not a ShardingDecision"):
            x.mean(0)
    _on_two(body)


def test_local_args_must_hold_every_dtensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """local_args without a place for the DTensor would feed the local op the wrong tensors: refused."""
    monkeypatch.setitem(RULES, aten.view.default,
                        lambda schema: ShardingDecision((Shard(0),), local_args=([2, 4],)))

    def body(mesh: DeviceMesh) -> None:
        x, _ = _inputs(mesh)
        with pytest.raises(ShardingError, match=r"aten\.view\.default.*local_args/local_kwargs hold 0 DTensor"):
            x.view(4, 4)
    _on_two(body)


def test_a_kernel_op_never_moves_a_written_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """A foreach in-place op whose decision would redistribute `self` is refused like any in-place op (a kernel
    op used to add into a redistributed copy, leaving self unchanged)."""
    monkeypatch.setitem(RULES, aten._foreach_add_.List,
                        lambda schema: ShardingDecision(None, [(Replicate(),)] * len(schema.input_specs)))

    def body(mesh: DeviceMesh) -> None:
        xs = [make_dtensor(_randn(4, 2), mesh, (Shard(0),))]
        with pytest.raises(ShardingError, match=r"aten\._foreach_add_\.List.*writes input 0 in place"):
            torch._foreach_add_(xs, xs)
    _on_two(body)


# -- one cache, one key ------------------------------------------------------------------------------------

def test_a_kernel_is_built_once_per_distinct_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """mean's kernel factory runs once per (call shape, rank); repeats hit one cache entry on the fast path."""
    options = OPTIONS[aten.mean.dim]
    built: list[tuple[int, int]] = []
    lock = threading.Lock()

    def counting(plan: object) -> object:
        with lock:
            built.append((plan.schema.mesh.get_rank(), plan.schema.args[1][0]))
        return options.kernel(plan)

    monkeypatch.setitem(OPTIONS, aten.mean.dim, dataclasses.replace(options, kernel=counting))
    full = _randn(5, 3)

    def body(mesh: DeviceMesh) -> None:
        x = make_dtensor(full, mesh, (Shard(0),))
        for _ in range(3):
            torch.testing.assert_close(x.mean(0).full_tensor(), full.mean(0))
        torch.testing.assert_close(x.mean(1).full_tensor(), full.mean(1))
        assert sorted(dim for rank, dim in built if rank == mesh.get_rank()) == [0, 1]
        entries = [v for k, v in mesh.dispatch_cache.items() if k[0] is aten.mean.dim._op]
        assert len(entries) == 2
        key = call_key(aten.mean.dim, (x, [0]), {}, DTensor)[0]
        assert mesh.dispatch_cache[key].path is Path.DIRECT_ONE
    _on_two(body)


def test_numbers_by_type_share_one_decision() -> None:
    """The foreach ops and the pointwise ops are keyed by the type of their Python numbers (an optimizer's
    step-dependent scalars); masked_fill (whose rule asks whether the value is 0) and other ops by value. Each
    call still computes with its own numbers."""
    full = _randn(4, 2)
    mask = torch.tensor([True, False])

    def body(mesh: DeviceMesh) -> None:
        xs = [make_dtensor(full, mesh, (Shard(0),))]
        for scalar in (0.5, 0.25, 2.0):
            torch.testing.assert_close(torch._foreach_mul(xs, scalar)[0].full_tensor(), full * scalar)
            torch.testing.assert_close((xs[0] * scalar).full_tensor(), full * scalar)
            torch.testing.assert_close(xs[0].addcdiv(xs[0], xs[0], value=-scalar).full_tensor(), full - scalar)
        assert sum(1 for k in mesh.dispatch_cache if k[0] is aten._foreach_mul.Scalar._op) == 1
        assert sum(1 for k in mesh.dispatch_cache if k[0] is aten.mul.Tensor._op) == 1
        assert sum(1 for k in mesh.dispatch_cache if k[0] is aten.addcdiv.default._op) == 1
        replicated = make_dtensor(mask, mesh, (Replicate(),))
        for value in (0.0, 1.5, 2.5):
            torch.testing.assert_close(xs[0].masked_fill(replicated, value).full_tensor(),
                                       full.masked_fill(mask, value))
        assert sum(1 for k in mesh.dispatch_cache if k[0] is aten.masked_fill.Scalar._op) == 3
    _on_two(body)


# -- one redistribution step -------------------------------------------------------------------------------

def test_an_input_passed_twice_is_redistributed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """pow(p, p) of a Partial p reduces p once, not once per argument."""
    moves: list[object] = []
    original = dispatch_run.run_plan

    def counting(local: torch.Tensor, spec: object, target: object) -> torch.Tensor:
        moves.append(threading.get_ident())
        return original(local, spec, target)

    monkeypatch.setattr(dispatch_run, "run_plan", counting)
    full = torch.arange(1.0, 5.0)

    def body(mesh: DeviceMesh) -> None:
        p = make_dtensor(full, mesh, (Partial(),))
        torch.testing.assert_close(torch.pow(p, p).full_tensor(), full.pow(full))
    _on_two(body)
    assert len(moves) == 2          # one reduction of p per rank (full_tensor doesn't dispatch)


def test_an_operand_that_is_also_written_keeps_the_write() -> None:
    """_foreach_mul_([p], [p]) with Partial p: the read operand is reduced (and would adopt the reduced layout),
    but p is also the written self, so it keeps the product (the old kernel path replaced it by the
    reduced, unmultiplied operand)."""
    full = torch.arange(4.0)

    def body(mesh: DeviceMesh) -> None:
        p = make_dtensor(full, mesh, (Partial(),))
        torch._foreach_mul_([p], [p])
        torch.testing.assert_close(p.full_tensor(), full * full)
    _on_two(body)


def test_a_kwarg_only_dtensor_reaches_the_rule_as_a_spec() -> None:
    """A plain rule sees a kwarg-only DTensor argument as its DTensorSpec, like a positional one (the output
    shapes were computed on the DTensor itself before, which failed)."""
    full = torch.arange(4.0)

    def body(mesh: DeviceMesh) -> None:
        x = make_dtensor(full, mesh, (Shard(0),))
        scale = make_dtensor(torch.tensor(2.0), mesh, (Replicate(),))
        out = _SCALED(x, scale=scale)
        assert out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), full * 2)
    _on_two(body)
    assert _SEEN_SCALE and all(kind.__name__ == "DTensorSpec" for kind in _SEEN_SCALE)
