"""DTensor's experimental API (torch's `tensor.experimental`): implicit_replication, local_map and
register_sharding, each against the same computation on plain tensors, plus the errors for bad use."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dispatch import MixedTensorError, forget_decisions
from spmd.tensor.experimental import implicit_replication, local_map, register_sharding
from spmd.tensor.rules import OPTIONS, RULES, ShardingError, record_fallbacks
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
_gen = torch.Generator().manual_seed(0)
W, X = torch.randn(12, 8, generator=_gen), torch.randn(8, 16, generator=_gen)
FULL = torch.randn(8, 6, generator=_gen)


# -- implicit_replication -------------------------------------------------------------------------------------

def test_implicit_replication_takes_plain_tensors_as_replicas_only_inside_the_block() -> None:
    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        bias = torch.arange(6.0)
        with pytest.raises(MixedTensorError, match="implicit_replication"):
            x + bias
        with implicit_replication():
            y = x + bias
            z = torch.where(x > 0, x, torch.zeros(8, 6))
        assert isinstance(y, DTensor) and y.placements == (Shard(0),)
        torch.testing.assert_close(y.full_tensor(), FULL + bias)
        torch.testing.assert_close(z.full_tensor(), FULL.clamp(min=0))
        with pytest.raises(MixedTensorError):             # the block is over: ambiguous again
            x * bias

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_implicit_replication_is_per_rank_and_resets_after_an_exception() -> None:
    def body(mesh) -> bool:
        x = distribute_tensor(FULL, mesh, [Shard(1)])
        if mesh.get_rank() == 0:
            with pytest.raises(RuntimeError, match="inside"), implicit_replication():
                assert (x * torch.ones(8, 6)).placements == (Shard(1),)
                raise RuntimeError("inside")
        spmd.barrier()
        try:                                   # rank 1 never entered a block: rank 0's doesn't reach it
            x - torch.ones(8, 6)
        except MixedTensorError:
            return True
        return False

    assert run_on_mesh((2,), body, timeout=TIMEOUT) == [True, True]


# -- local_map ------------------------------------------------------------------------------------------------

def _mm_allreduce(mesh, w, x):
    partial = torch.mm(w, x)
    spmd.all_reduce(partial, group=mesh.get_group())
    return partial


def test_local_map_runs_torchs_mm_allreduce_example() -> None:
    def body(mesh) -> None:
        col, row = [Shard(1)], [Shard(0)]
        local_mm = local_map(_mm_allreduce, out_placements=[Replicate()], in_placements=(None, col, row),
                             device_mesh=mesh)
        w, x = distribute_tensor(W, mesh, col), distribute_tensor(X, mesh, row)
        with CommDebugMode() as comm:
            y = local_mm(mesh, w, x)
        assert isinstance(y, DTensor) and y.placements == (Replicate(),) and y.device_mesh is mesh
        assert comm.get_total_counts() == 1                  # the function's own all-reduce, nothing else
        torch.testing.assert_close(y.to_local(), W @ X)
        with pytest.raises(ValueError, match=r"argument 1 is placed \(Replicate\(\),\) but in_placements asks "
                                              r"for \(Shard\(1\),\).*redistribute_inputs=True"):
            local_mm(mesh, distribute_tensor(W, mesh, [Replicate()]), x)
        moved = local_map(_mm_allreduce, out_placements=[Replicate()], in_placements=(None, col, row),
                          redistribute_inputs=True)(mesh, distribute_tensor(W, mesh, [Replicate()]), x)
        torch.testing.assert_close(moved.full_tensor(), W @ X)

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_local_map_gradients_flow_through_local_shards() -> None:
    def body(mesh) -> None:
        @local_map(out_placements=([Shard(0)], None), in_placements=([Shard(0)], None))
        def scaled_sin(t, factor):
            return torch.sin(t) * factor, "tag"

        source = FULL.clone().requires_grad_()
        x = distribute_tensor(source.detach(), mesh, [Shard(0)]).requires_grad_()
        y, tag = scaled_sin(x, 3.0)
        assert tag == "tag" and y.placements == (Shard(0),)
        y.sum().backward()
        (torch.sin(source) * 3.0).sum().backward()
        torch.testing.assert_close(y.full_tensor(), torch.sin(FULL) * 3.0)
        torch.testing.assert_close(x.grad.full_tensor(), source.grad)
        assert scaled_sin(FULL, 3.0)[0].shape == FULL.shape         # no DTensor argument: plain in, plain out
        assert not isinstance(scaled_sin(FULL, 3.0)[0], DTensor)

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_local_map_in_grad_placements_mark_partial_local_gradients() -> None:
    def body(mesh) -> None:
        rank = mesh.get_rank()
        x = distribute_tensor(FULL, mesh, [Replicate()]).requires_grad_()
        weighted = local_map(lambda t: t * (rank + 1), out_placements=[Partial()], in_placements=([Replicate()],),
                             in_grad_placements=([Partial()],))
        weighted(x).to_local().sum().backward()
        assert x.grad.placements == (Partial(),)
        torch.testing.assert_close(x.grad.full_tensor(), torch.full_like(FULL, 3.0))    # 1 + 2

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_local_map_refuses_placements_that_do_not_fit_the_call() -> None:
    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"in_placements has 1 entries for 2 flattened positional"):
            local_map(torch.add, out_placements=[Shard(0)], in_placements=([Shard(0)],))(x, x)
        with pytest.raises(ValueError, match=r"argument 0 is a DTensor but in_placements\[0\] is None"):
            local_map(torch.neg, out_placements=[Shard(0)], in_placements=(None,))(x)
        with pytest.raises(ValueError, match=r"argument 1 is a float, not a tensor"):
            local_map(torch.mul, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))(x, 2.0)
        with pytest.raises(ValueError, match=r"out_placements has 1 entries but the function returned 2"):
            local_map(lambda t: (t, t), out_placements=[Shard(0)])(x)
        with pytest.raises(ValueError, match=r"output 0 is a tensor but out_placements gives it None"):
            local_map(torch.neg, out_placements=None)(x)
        with pytest.raises(TypeError, match=r"output 0 is already a DTensor"):
            local_map(lambda t: distribute_tensor(FULL, mesh, [Shard(0)]), out_placements=[Shard(0)])(x)
        with pytest.raises(ValueError, match=r"output 0 is a str, not a tensor"):
            local_map(lambda t: "x", out_placements=[Shard(0)])(x)

    run_on_mesh((2,), body, timeout=TIMEOUT)


# -- register_sharding ----------------------------------------------------------------------------------------

@torch.library.custom_op("spmd_test_experimental::row_softmax", mutates_args=())
def row_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


@row_softmax.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def custom_op_without_rule():
    """row_softmax with no sharding registered, before and after the test (registrations are process-wide)."""
    op = torch.ops.spmd_test_experimental.row_softmax.default
    RULES.pop(op, None)
    forget_decisions()
    yield op
    RULES.pop(op, None)
    forget_decisions()


@pytest.mark.filterwarnings("ignore:spmd DTensor.*row_softmax")
def test_register_sharding_gives_a_custom_op_a_rule_in_place_of_the_fallback(custom_op_without_rule) -> None:
    op = custom_op_without_rule

    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        with record_fallbacks() as fallbacks:
            before = row_softmax(x)
        assert fallbacks == [op] and before.placements == (Shard(0),)     # re-chunked like its input
        spmd.barrier()
        if mesh.get_rank() == 0:
            @register_sharding(op)
            def rows_apart(t):
                return [([Replicate()], [Replicate()]),
                        *[([Shard(d)], [Shard(d)]) for d in range(t.ndim - 1)]]
        spmd.barrier()
        with record_fallbacks() as fallbacks, CommDebugMode() as comm:
            y = row_softmax(x)
        assert fallbacks == [] and comm.get_total_counts() == 0 and y.placements == (Shard(0),)
        torch.testing.assert_close(y.full_tensor(), torch.softmax(FULL, dim=-1))
        columns = distribute_tensor(FULL, mesh, [Shard(1)])
        with CommDebugMode() as comm:       # rows must not be split: one all-to-all to Shard(0), the cheapest
            z = row_softmax(columns)
        assert comm.get_total_counts() == 1 and z.placements == (Shard(0),)
        torch.testing.assert_close(z.full_tensor(), torch.softmax(FULL, dim=-1))

    run_on_mesh((2,), body, timeout=TIMEOUT, expect_fallbacks=["spmd_test_experimental.row_softmax.default"])


def test_register_sharding_replaces_spmds_own_rule_for_an_aten_op() -> None:
    op = torch.ops.aten._softmax.default
    saved_rule, saved_options = RULES[op], OPTIONS.get(op)

    def only_replicate(x, dim, half_to_float):
        return [([Replicate()], [Replicate(), None, None])]

    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        assert torch.softmax(x, dim=1).placements == (Shard(0),)       # spmd's rule keeps rows sharded
        spmd.barrier()
        if mesh.get_rank() == 0:
            register_sharding(op)(only_replicate)
        spmd.barrier()
        y = torch.softmax(x, dim=1)
        assert y.placements == (Replicate(),)                          # the cached decision was dropped
        torch.testing.assert_close(y.to_local(), torch.softmax(FULL, dim=1))

    try:
        run_on_mesh((2,), body, timeout=TIMEOUT)
    finally:
        RULES[op] = saved_rule
        if saved_options is not None:
            OPTIONS[op] = saved_options
        forget_decisions()


def test_register_sharding_refuses_bad_registrations_and_malformed_shardings(custom_op_without_rule) -> None:
    with pytest.raises(TypeError, match="takes an OpOverload"):
        register_sharding(torch.softmax)
    with pytest.raises(ValueError, match="runs through a handler of spmd's own"):
        register_sharding(torch.ops.aten.normal_.default)(lambda *args: [])
    op = custom_op_without_rule

    def body(mesh) -> None:
        x = distribute_tensor(FULL, mesh, [Shard(0)])
        if mesh.get_rank() == 0:
            register_sharding(op)(lambda t: [([Shard(0)], [Shard(0), Shard(0)])])
        spmd.barrier()
        with pytest.raises(ShardingError, match=r"shardings\[0\] gives 2 input placements \(not None\) for 1 "
                                                r"DTensor inputs"):
            row_softmax(x)
        spmd.barrier()
        if mesh.get_rank() == 0:
            register_sharding([op])(lambda t: [[Shard(0)]])
        spmd.barrier()
        with pytest.raises(ShardingError, match=r"shardings\[0\] is \[Shard\(0\)\]; each must be a pair"):
            row_softmax(x)

    run_on_mesh((2,), body, timeout=TIMEOUT)
