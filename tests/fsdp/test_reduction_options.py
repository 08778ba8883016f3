"""torch 2.13's FSDPModule setters for the gradient reduction, each against one process on the global batch:
HSDP accumulation without the replicas' all-reduce (set_requires_all_reduce), a user's own cross-replica
reduction (set_all_reduce_hook, with and without set_force_sum_reduction_for_comms), float16 reductions split
around the sum, zeros reduced where a rank's control flow skipped a group (set_reduce_scatter_unused_params), and
more reductions in flight (set_reduce_scatter_max_input_buffers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import MixedPrecisionPolicy, fully_shard
from spmd.fsdp.collectives import predivide_factor
from spmd.testing import run_ranks, seeded
from tests.fsdp.harness import TIMEOUT, assert_parity, blocks_of, fsdp_train, reference, shard_blocks_then_root
from tests.parity.models import build


def test_hsdp_accumulation_reduce_scatters_each_micro_batch_and_all_reduces_once() -> None:
    results = run_ranks(lambda rank, size: fsdp_train("gpt", rank, size, mesh_shape=(2, 2), micro_steps=3,
                                                      accumulate_with="set_requires_all_reduce"), 4, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4, micro_steps=3))
    groups = len(blocks_of(build("gpt"))) + 1
    for result in results:
        replicate, shard = result["counts"][0][0], result["counts"][0][1]
        assert shard["reduce_scatter"] == 3 * groups        # every micro-batch
        assert replicate["all_reduce"] == groups            # the last one only


@pytest.mark.parametrize("force_sum", [False, True])
def test_an_all_reduce_hook_reducing_over_replicas_itself_trains_like_one_process(force_sum: bool) -> None:
    """Manual HSDP, as torchft does it: FSDP over each replica's two ranks, and a hook that averages the reduced
    shards over the replicas. The hook sees the average within the replica (float32, sums not forced) or the
    sum (forced), as torch's collectives leave it."""
    def body(rank: int, size: int) -> dict:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        seen: list[float] = []

        def hook(output: torch.Tensor) -> None:
            spmd.all_reduce(output, op=spmd.ReduceOp.AVG, group=mesh.get_group("rep"))
            seen.append(float(output.abs().sum()))

        def shard(model: nn.Module, _mesh) -> None:
            shard_blocks_then_root(model, mesh["shard"])
            for module in model.modules():
                if isinstance(module, spmd.fsdp.FSDPModule):
                    module.set_all_reduce_hook(hook)
                    module.set_force_sum_reduction_for_comms(force_sum)

        def final_grad_size(model: nn.Module) -> float:
            return float(sum(p.grad._local_tensor.abs().sum() for p in model.parameters()))
        result = fsdp_train("gpt", rank, size, shard=shard, before_step=final_grad_size)
        result["seen"] = seen
        return result

    results = run_ranks(body, 4, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4))
    for result in results:
        steps = len(result["extras"])
        seen_per_step = torch.tensor(result["seen"]).view(steps, -1).sum(1)
        ratio = seen_per_step / torch.tensor(result["extras"])
        torch.testing.assert_close(ratio, torch.full((steps,), 2.0 if force_sum else 1.0), rtol=1e-5, atol=0)


def test_float16_reductions_divide_part_before_the_sum_so_it_does_not_overflow() -> None:
    assert [predivide_factor(torch.float16, f) for f in (1, 2, 4, 8, 16, 64)] == [1, 1, 2, 2, 4, 8]
    assert predivide_factor(torch.float32, 64) == predivide_factor(torch.bfloat16, 64) == 1

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).sum()

    def body(rank: int, size: int) -> torch.Tensor:
        model = Scaled()
        fully_shard(model, mesh=init_device_mesh("cpu", (size,)),
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
        model(torch.full((8,), 30000.0)).backward()      # four ranks' 3e4 sum to 1.2e5: past float16's 65504
        return model.w.grad.full_tensor()

    for grad in run_ranks(body, 4, timeout=TIMEOUT):
        assert torch.equal(grad, torch.full((8,), 30000.0))


def test_a_group_no_gradient_reached_on_one_rank_still_reduces_with_unused_params_on() -> None:
    class Gated(nn.Module):
        """Uses its weight only on rank 0; elsewhere its output depends on the input alone."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((3,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight if spmd.get_rank() == 0 else x * 1.0

    def build_gated() -> nn.Sequential:
        with seeded(0):
            return nn.Sequential(nn.Linear(3, 3), Gated())

    def body(rank: int, size: int) -> torch.Tensor:
        model = build_gated()
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)
        model(torch.ones(1, 3)).sum().backward()
        return model[1].weight.grad.full_tensor()

    with torch.no_grad():
        want = build_gated()[0](torch.ones(1, 3))[0] / 2    # rank 0's gradient, averaged with rank 1's zeros
    for grad in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(grad, want)


def test_more_reductions_stay_in_flight_when_allowed_and_the_result_is_the_same() -> None:
    def body(rank: int, size: int) -> dict:
        in_flight: list[int] = []

        def setup(model: nn.Module) -> None:
            model.set_reduce_scatter_max_input_buffers(3)
            root = model._fsdp_state()

            def record(grad: torch.Tensor) -> None:
                in_flight.append(len(root.reductions.in_flight))
            model.embed.register_forward_hook(lambda module, args, out: out.register_hook(record) and None)
        result = fsdp_train("gpt", rank, size, setup=setup)
        result["in_flight"] = in_flight
        return result

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    for result in results:    # the blocks' reductions, 2 of them, are still in flight when backward reaches embed
        assert result["in_flight"] and max(result["in_flight"]) == len(blocks_of(build("gpt")))


def test_max_input_buffers_must_be_a_positive_int() -> None:
    def body(rank: int, size: int) -> None:
        model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (size,)))
        with pytest.raises(TypeError, match="must be an int, got bool"):
            model.set_reduce_scatter_max_input_buffers(True)
        with pytest.raises(ValueError, match="must be at least 1, got 0"):
            model.set_reduce_scatter_max_input_buffers(0)
        if rank == 0:      # one thread: the warnings filters pytest.warns sets are process-wide
            with pytest.warns(FutureWarning, match="use set_gradient_divide_factor"):
                model.set_reduce_scatter_divide_factor(3.0)
            assert model._fsdp_state().group.divide_factor == 3.0

    run_ranks(body, 2, timeout=TIMEOUT)
