"""The 8-bit DDP hooks (quantization_pertensor_hook, quantization_perchannel_hook) against torch's own hooks on
torch's DDP, trained side by side; the mean they send stays within quantization error of the exact one; and
DDPCommHookType / register_ddp_comm_hook register each named hook as its direct registration does."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook
from spmd.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from spmd.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from spmd.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from spmd.algorithms.ddp_comm_hooks.quantization_hooks import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)
from spmd.testing import run_ranks
from tests.procpool import ProcPool

STEPS = 3


def _model(single_parameter: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if single_parameter:
        return nn.Sequential(nn.Linear(8, 3, bias=False), nn.Tanh())
    return nn.Sequential(nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 3))


def _batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)


def _train(model: nn.Module) -> list[Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = spmd.get_rank()
    for step in range(STEPS):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


class _NestedGatherFutures:
    """torch.distributed as torch's quantization hooks expect it: an all_gather whose future holds the outputs
    stacked in a list. They index it so (`fut.wait()[0][rank, 0, :]`), but torch 2.13's futures hold the
    outputs as a flat list, over gloo as over the spmd backend, and the hooks raise there (IndexError,
    TypeError); this adapts the container, not the numbers."""

    def __init__(self, dist: types.ModuleType) -> None:
        self._dist = dist

    def __getattr__(self, name: str) -> object:
        return getattr(self._dist, name)

    def all_gather(self, outputs: list[Tensor], tensor: Tensor, group=None, async_op: bool = False):
        self._dist.all_gather(outputs, tensor, group=group)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([torch.stack(outputs)])
        return types.SimpleNamespace(get_future=lambda: future)


def _both_sides(rank: int, world_size: int, per_channel: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_hooks

    spmd.init_process_group("tcp", timeout=60)       # torch's default group runs over the "spmd" backend
    torch_hooks.dist = _NestedGatherFutures(dist)
    try:
        # One parameter for the per-channel hook: its channels are runs of the bucket's flat buffer, and torch's
        # first-iteration bucket lays parameters out in forward order (reversed once it rebuilds the buckets),
        # spmd's in the reverse order from the start, so with several parameters the channels of step 1 differ.
        initial = _model(single_parameter=per_channel)
        ours = spmd.DistributedDataParallel(copy.deepcopy(initial), bucket_cap_mb=0.001)
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(initial), bucket_cap_mb=0.001)
        if per_channel:
            ours.register_comm_hook(None, lambda state, bucket: quantization_perchannel_hook(state, bucket, 16))
            theirs.register_comm_hook(None, lambda state, bucket: torch_hooks.quantization_perchannel_hook(
                state, bucket, 16))
        else:
            ours.register_comm_hook(None, quantization_pertensor_hook)
            theirs.register_comm_hook(None, torch_hooks.quantization_pertensor_hook)
        return {"ours": _train(ours), "torch": _train(theirs)}
    finally:
        torch_hooks.dist = dist
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantized_training_matches_torchs_hooks(procpool: ProcPool, per_channel: bool) -> None:
    for result in procpool.run(_both_sides, 2, timeout=90, args=(per_channel,)):
        for got, want in zip(result["ours"], result["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hook", [quantization_pertensor_hook, quantization_perchannel_hook])
def test_the_quantized_mean_is_within_a_quantization_step_of_the_exact_one(hook) -> None:
    grads = [torch.linspace(-1, 1, 1000) * (rank + 1) + 0.1 * rank for rank in range(3)]

    def body(rank: int, size: int) -> Tensor:
        model = spmd.DistributedDataParallel(nn.Linear(1000, 1, bias=False))
        model.register_comm_hook(None, hook)
        model(grads[rank].unsqueeze(0)).sum().backward()       # this rank's weight gradient: grads[rank]
        return model.module.weight.grad.squeeze().clone()

    exact = torch.stack(grads).mean(0)
    step = max(float(g.max() - g.min()) for g in grads) / 255      # the coarsest rank's quantization step
    for got in run_ranks(body, 3, timeout=60):
        assert (got - exact).abs().max() <= step
        assert not torch.equal(got, exact)


def _grads_after_one_step(register) -> list[Tensor]:
    initial = _model()       # built here, not in the ranks: torch.manual_seed is global, and thread ranks race on it

    def body(rank: int, size: int) -> list[Tensor]:
        model = spmd.DistributedDataParallel(copy.deepcopy(initial))
        register(model)
        x, y = _batch(0, rank)
        for _ in range(2):       # a second step: a hook's state (PowerSGD's error feedback) comes into play
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    return run_ranks(body, 2, timeout=60)


@pytest.mark.parametrize(("member", "register"), [
    (DDPCommHookType.ALLREDUCE, lambda m: m.register_comm_hook(None, allreduce_hook)),
    (DDPCommHookType.FP16_COMPRESS, lambda m: m.register_comm_hook(None, fp16_compress_hook)),
    (DDPCommHookType.BF16_COMPRESS, lambda m: m.register_comm_hook(None, bf16_compress_hook)),
    (DDPCommHookType.QUANTIZE_PER_TENSOR, lambda m: m.register_comm_hook(None, quantization_pertensor_hook)),
    (DDPCommHookType.QUANTIZE_PER_CHANNEL, lambda m: m.register_comm_hook(None, quantization_perchannel_hook)),
    (DDPCommHookType.POWER_SGD, lambda m: m.register_comm_hook(
        PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1_000), powerSGD_hook)),
    (DDPCommHookType.BATCHED_POWER_SGD_RANK2, lambda m: m.register_comm_hook(
        PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1_000), batched_powerSGD_hook)),
    (DDPCommHookType.NOOP, lambda m: m.register_comm_hook(None, noop_hook)),
])
def test_each_named_hook_registers_what_its_direct_registration_does(member, register) -> None:
    want = _grads_after_one_step(register)
    got = _grads_after_one_step(lambda model: register_ddp_comm_hook(member, model))
    for got_rank, want_rank in zip(got, want, strict=True):
        torch.testing.assert_close(got_rank, want_rank, rtol=0, atol=0)


def test_the_powersgd_members_build_torchs_state() -> None:
    class Recorder:
        def register_comm_hook(self, state, hook) -> None:
            self.state, self.hook = state, hook

    expected = {"POWER_SGD": (powerSGD_hook, 1), "POWER_SGD_RANK2": (powerSGD_hook, 2),
                "BATCHED_POWER_SGD": (batched_powerSGD_hook, 1), "BATCHED_POWER_SGD_RANK2": (batched_powerSGD_hook, 2)}
    for name, (hook, rank) in expected.items():
        recorder = Recorder()
        DDPCommHookType[name].value(model=recorder, state=None)
        assert recorder.hook is hook
        assert (recorder.state.matrix_approximation_rank, recorder.state.start_powerSGD_iter) == (rank, 1_000)
    assert [member.name for member in DDPCommHookType] == [member.name for member in _torch_hook_types()]


def _torch_hook_types():
    from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType as TorchTypes

    return list(TorchTypes)
