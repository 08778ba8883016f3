"""torch 2.13's FSDPModule setters beyond the reduction ones (test_reduction_options.py): parameters backward
does not gather again (set_unshard_in_backward), a post-optimizer event, recovery after an exception mid-step
(reset_iter_state), custom all-gather and reduce-scatter objects (torch's Comm protocol), and reduce-scatters on
a group of their own. Each against one process on the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from spmd.fsdp.param_group import GroupState
from spmd.testing import run_ranks, seeded
from tests.fsdp.harness import TIMEOUT, assert_parity, blocks_of, fsdp_train, reference, shard_blocks_then_root
from tests.parity.models import build
from tests.parity.test_ddp import count_collectives


class _Embedded(nn.Module):
    """An embedding table (sharded on its own) feeding a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


def _embedded() -> _Embedded:
    with seeded(0):
        return _Embedded()


def _tokens(world_size: int, step: int) -> torch.Tensor:
    return torch.randint(0, 11, (2 * world_size, 5), generator=torch.Generator().manual_seed(step))


def test_an_embedding_not_gathered_in_backward_still_gets_its_gradient() -> None:
    ref = _embedded()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        torch.stack([ref(chunk).square().mean() for chunk in _tokens(2, step).chunk(2)]).mean().backward()
        opt.step()
        opt.zero_grad()

    def train(rank: int, size: int, unshard_in_backward: bool) -> tuple[dict, dict]:
        model = _embedded()
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model.embed, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.embed.set_unshard_in_backward(unshard_in_backward)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = count_collectives(mesh.get_group())
        for step in range(3):
            model(_tokens(size, step).chunk(size)[rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        gathered = dict(counts)
        return gathered, {name: p.full_tensor() for name, p in model.named_parameters()}

    def body(rank: int, size: int) -> tuple[dict, dict, dict]:
        counts, params = train(rank, size, unshard_in_backward=False)
        return counts, params, train(rank, size, unshard_in_backward=True)[0]

    for counts, params, default_counts in run_ranks(body, 2, timeout=TIMEOUT):
        assert counts["all_gather"] == default_counts["all_gather"] - 3    # the table is not gathered in backward
        assert counts["reduce_scatter"] == default_counts["reduce_scatter"] == 3 * 2
        for name, want in ref.named_parameters():
            torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_next_root_forward_waits_on_the_post_optimizer_event_once() -> None:
    class Event:
        def __init__(self) -> None:
            self.waits = 0

        def wait(self) -> None:
            self.waits += 1

    def body(rank: int, size: int) -> list[int]:
        events = []

        def setup(model: nn.Module) -> None:
            def set_event(module: nn.Module, args: tuple) -> None:     # runs after FSDP's own pre-forward hook
                events.append(Event())
                module.set_post_optim_event(events[-1])
            model.register_forward_pre_hook(set_event)
        fsdp_train("mlp", rank, size, setup=setup)
        return [event.waits for event in events]

    for waits in run_ranks(body, 2, timeout=TIMEOUT):
        assert waits == [1, 1, 0]      # each step's event is waited on by the next step's forward, once


class _Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception_mid_step_lets_training_go_on_as_if_it_never_ran(where: str) -> None:
    """Every rank fails the first step (after some all-gathers, or some reduce-scatters, are in flight), resets,
    then trains the reference's steps."""
    def body(rank: int, size: int) -> dict:
        def setup(model: nn.Module) -> None:
            blocks = blocks_of(model)
            failed = []

            def fail_forward(module: nn.Module, args: tuple) -> None:
                if not failed:
                    failed.append(True)
                    raise _Boom

            def fail_backward(grad: torch.Tensor) -> None:
                if not failed:
                    failed.append(True)
                    raise _Boom

            if where == "forward":
                handle = blocks[-1].register_forward_pre_hook(fail_forward)
            else:
                handle = blocks[0].register_forward_hook(lambda m, a, out: out.register_hook(fail_backward) and None)
            x = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(9))
            with pytest.raises(_Boom):
                model(x).sum().backward()
            handle.remove()
            model.reset_iter_state()
            states = [block._fsdp_state().group.state for block in blocks]
            assert states == [GroupState.SHARDED] * len(blocks)
            model.zero_grad()

        return fsdp_train("gpt", rank, size, setup=setup)

    assert_parity(run_ranks(body, 2, timeout=TIMEOUT), reference("gpt", 2))


def test_reset_iter_state_on_a_block_is_refused() -> None:
    def body(rank: int, size: int) -> None:
        model = build("mlp", seed=0)
        shard_blocks_then_root(model, init_device_mesh("cpu", (size,)))
        model(torch.randn(2, 7))
        with pytest.raises(RuntimeError, match="is not the root; call it on the root module"):
            blocks_of(model)[0].reset_iter_state()

    run_ranks(body, 2, timeout=TIMEOUT)


class _PersistentAllGather(AllGather):
    """Keeps one output buffer per size (as a memory pool would) and counts its calls."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        key = (tuple(size), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(*size, dtype=dtype, device=device)
        return self.buffers[key]

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return spmd.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _SyncReduceScatter(ReduceScatter):
    """Runs synchronously (returns no Work) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        assert op == spmd.ReduceOp.SUM
        spmd.reduce_scatter_tensor(output_tensor, input_tensor, op, group=group)
        return None


def test_custom_all_gather_and_reduce_scatter_objects_carry_the_collectives() -> None:
    def body(rank: int, size: int) -> tuple[dict, int, int]:
        gather, reduce = _PersistentAllGather(), _SyncReduceScatter()

        def setup(model: nn.Module) -> None:
            for module in (*blocks_of(model), model):
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
        return fsdp_train("gpt", rank, size, setup=setup), gather.calls, reduce.calls

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity([result for result, _, _ in results], reference("gpt", 2))
    groups = len(blocks_of(build("gpt"))) + 1
    for result, gathers, reduces in results:
        assert gathers == result["counts"][0][0]["all_gather"] * 3 and reduces == groups * 3


def test_reduce_scatters_on_a_group_of_their_own() -> None:
    def body(rank: int, size: int) -> dict:
        result = fsdp_train("gpt", rank, size, setup=lambda model: model.set_separate_reduce_scatter_group())
        groups = {state.group.reduce_scatter_group for state in result["model"]._fsdp_states(recurse=True)
                  if state.group is not None}
        result["groups"] = [(g.ranks, g is state_group) for g in groups
                            for state_group in [result["model"]._fsdp_state().group.shard_group]]
        return result

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    for result in results:
        assert result["groups"] == [([0, 1], False)]            # one new group, shared by every module
        assert "reduce_scatter" not in result["counts"][0][0]    # none left on the shard group


def test_buffers_come_from_the_process_groups_allocator_where_asked() -> None:
    """set_allocate_memory_from_process_group_for_comm: every group's collective buffers are asked of its process
    group, whose transport gives them where it has an allocator of its own (here a counting one stands in for
    NCCL's); training is unchanged. Refused beside a custom comm; symmetric memory is refused, named."""

    def body(rank: int, size: int) -> tuple[dict, int]:
        asked = []

        def setup(model: nn.Module) -> None:
            transport = model._fsdp_state().group.shard_group.transport

            def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                asked.append(numel)
                return torch.empty(numel, dtype=dtype, device=device)

            transport.allocate_tensor = allocate       # this rank's group object only
            for module in (*blocks_of(model), model):
                module.set_allocate_memory_from_process_group_for_comm(True)
            with pytest.raises(NotImplementedError, match="does not serve NCCL symmetric memory"):
                model.set_symm_mem_for_comm()

        result = fsdp_train("gpt", rank, size, setup=setup)
        block = blocks_of(result["model"])[0]
        block.set_custom_all_gather(_PersistentAllGather())
        with pytest.raises(ValueError, match="custom all-gather or reduce-scatter comm"):
            block.set_allocate_memory_from_process_group_for_comm(True)
        return result, len(asked)

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity([result for result, _ in results], reference("gpt", 2))
    for result, asked in results:
        collectives = sum(result["counts"][0][0].get(op, 0) for op in ("all_gather", "reduce_scatter"))
        assert asked >= collectives * 3 > 0     # every all-gather and reduce-scatter buffer, every step
