"""Activation-checkpoint wrappers and wrap policies (torch's checkpoint_wrapper and fsdp.wrap modules): the same
modules wrapped as torch's own functions wrap, the same outputs, gradients and names as the plain model, the
forward recomputed in backward, and FSDP over wrapped blocks matching one process."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_cw
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

from spmd.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from spmd.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from spmd.fsdp import fully_shard
from spmd.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from spmd.testing import run_ranks
from tests.fsdp.harness import TIMEOUT, assert_parity, fsdp_train, reference
from tests.parity.models import Block, batch, build, loss_fn


def _wrapped_paths(model: nn.Module, wrapper_type: type) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, wrapper_type)]


POLICIES = {   # name -> (spmd's apply kwargs, torch's apply kwargs)
    "check_fn": ({"check_fn": lambda m: isinstance(m, Block)}, {"check_fn": lambda m: isinstance(m, Block)}),
    "module_policy": ({"auto_wrap_policy": ModuleWrapPolicy({Block, nn.LayerNorm})},
                      {"auto_wrap_policy": torch_wrap.ModuleWrapPolicy({Block, nn.LayerNorm})}),
    "transformer": ({"auto_wrap_policy": functools.partial(transformer_auto_wrap_policy,
                                                           transformer_layer_cls={Block})},
                    {"auto_wrap_policy": functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                                           transformer_layer_cls={Block})}),
    "size_based": ({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=1000)},
                   {"auto_wrap_policy": functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                                          min_num_params=1000)}),
    "always": ({"auto_wrap_policy": always_wrap_policy}, {"auto_wrap_policy": torch_wrap.always_wrap_policy}),
    "custom": ({"auto_wrap_policy": CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features > 50)},
               {"auto_wrap_policy": torch_wrap.CustomPolicy(lambda m: isinstance(m, nn.Linear)
                                                           and m.out_features > 50)}),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_wrap_the_modules_torchs_wrap(policy: str) -> None:
    ours, theirs = POLICIES[policy]
    mine, torchs = build("gpt", seed=0), build("gpt", seed=0)
    apply_activation_checkpointing(mine, **ours)
    torch_cw.apply_activation_checkpointing(torchs, **theirs)
    paths = _wrapped_paths(mine, CheckpointWrapper)
    assert paths and paths == _wrapped_paths(torchs, torch_cw.CheckpointWrapper)
    assert not isinstance(mine, CheckpointWrapper)                      # the root is never wrapped
    assert list(mine.state_dict()) == list(torchs.state_dict())
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in torchs.named_parameters()]


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_wrapped_blocks_recompute_and_give_the_plain_models_outputs_and_gradients(impl: CheckpointImpl) -> None:
    plain, wrapped = build("gpt", seed=0), build("gpt", seed=0)
    apply_activation_checkpointing(wrapped, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                    checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, Block))
    forwards = []
    wrapped.blocks[0]._checkpoint_wrapped_module.register_forward_pre_hook(lambda *args: forwards.append(1))
    x, y = batch("gpt", 4)
    for model in (plain, wrapped):
        loss_fn("gpt", model(x), y).backward()
    assert len(forwards) == 2                                   # run forward, then again in backward
    for (name, p), (wrapped_name, q) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert wrapped_name.replace("_checkpoint_wrapped_module.", "") == name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_reentrant_wrapper_passes_keyword_arguments_and_offload_keeps_results() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0, shift: torch.Tensor | None = None):
            return self.linear(x) * scale + (0 if shift is None else shift)

    torch.manual_seed(0)
    module, shift = Scaled(), torch.randn(4)
    x = torch.randn(3, 4, requires_grad=True)
    module(x, scale=2.0, shift=shift).sum().backward()
    want = x.grad.clone(), module.linear.weight.grad.clone()
    for wrapper in (checkpoint_wrapper(module, CheckpointImpl.REENTRANT), offload_wrapper(module),
                    checkpoint_wrapper(module, checkpoint_fn=torch.utils.checkpoint.checkpoint, use_reentrant=False)):
        x.grad = module.linear.weight.grad = None
        got = wrapper(x, scale=2.0, shift=shift)
        torch.testing.assert_close(got, module(x, scale=2.0, shift=shift))
        got.sum().backward()                        # reentrant checkpointing supports .backward() only
        torch.testing.assert_close((x.grad, module.linear.weight.grad), want)
    with pytest.raises(TypeError, match="checkpoint_impl must be a CheckpointImpl"):
        checkpoint_wrapper(module, "reentrant")


def test_state_dicts_move_between_wrapped_and_plain_models_and_attributes_reach_the_module() -> None:
    plain, wrapped = build("gpt", seed=0), build("gpt", seed=1)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    wrapped.load_state_dict(plain.state_dict())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[key], value)
    other = build("gpt", seed=2)
    other.load_state_dict(wrapped.state_dict())                 # and back into a plain model
    torch.testing.assert_close(other.blocks[1].up.weight, plain.blocks[1].up.weight)
    assert wrapped.blocks[0].heads == plain.blocks[0].heads     # a wrapped module's attribute, through the wrapper
    sequential = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert isinstance(sequential[1], nn.ReLU)


def test_enable_wrap_and_bad_policies() -> None:
    linear = nn.Linear(2, 2)
    assert wrap(linear) is linear                               # outside enable_wrap: unchanged
    with enable_wrap(wrapper_cls=checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT):
        wrapped = wrap(linear, checkpoint_impl=CheckpointImpl.REENTRANT)
    assert isinstance(wrapped, CheckpointWrapper) and wrapped.checkpoint_impl is CheckpointImpl.REENTRANT
    with pytest.raises(TypeError, match="a wrap policy is a callable"):
        apply_activation_checkpointing(build("gpt"), auto_wrap_policy="blocks")
    with pytest.raises(ValueError, match="must return a bool or a dict"):
        apply_activation_checkpointing(build("gpt"), auto_wrap_policy=CustomPolicy(lambda m: "yes"))
    model = build("gpt")
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, auto_wrap_policy=CustomPolicy(
        lambda m: {"checkpoint_impl": CheckpointImpl.REENTRANT} if isinstance(m, Block) else False))
    assert {b.checkpoint_impl for b in model.blocks} == {CheckpointImpl.REENTRANT}


def _checkpointed_then_sharded(model: nn.Module, mesh) -> None:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_fsdp_over_checkpoint_wrapped_blocks_matches_one_process_and_keeps_plain_names() -> None:
    plain_names = list(build("gpt").state_dict())

    def body(rank: int, size: int) -> dict:
        result = fsdp_train("gpt", rank, size, shard=_checkpointed_then_sharded)
        model = result["model"]
        result["keys"] = list(get_model_state_dict(model))
        optim = torch.optim.Adam(model.parameters())
        model(batch("gpt", 2)[0]).sum().backward()
        optim.step()
        result["optim_keys"] = sorted(get_optimizer_state_dict(model, optim)["state"])
        return result

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    assert all(result["keys"] == plain_names for result in results)
    assert all(result["optim_keys"] == sorted(n for n, _ in build("gpt").named_parameters()) for result in results)
