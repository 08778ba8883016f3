"""FSDP2's all-gather extension: a parameter whose local tensor defines fsdp_pre_all_gather / fsdp_post_all_gather
(torchao's float8 weights, torchtune's NF4) is gathered through it, in the group's one all-gather, and trains like
one process. See Note: the extension protocol in src/spmd/fsdp/extension.py.

The models are the parity models (tests/parity/models.py) with their 2-d weights made SplitPrecisionWeights
(tests/fsdp/gather_extensions.py), which gather as bfloat16 + float32 and rebuild the exact weights, so the
reference is one process with plain weights, to the parity tolerance. Sizes shard unevenly on purpose.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import MixedPrecisionPolicy, fully_shard
from spmd.fsdp.state import state_of
from spmd.tensor import DTensor, Shard
from spmd.testing import run_ranks, seeded
from tests.fsdp.gather_extensions import SplitPrecisionWeight, split_precision_weights
from tests.fsdp.harness import TIMEOUT, assert_parity, fsdp_train, reference, shard_blocks_then_root
from tests.parity.models import build


def _train(kind: str, rank: int, size: int, **options) -> dict:
    def shard(model: nn.Module, mesh) -> None:
        shard_blocks_then_root(model, mesh, **options)
    result = fsdp_train(kind, rank, size, model=split_precision_weights(build(kind, seed=0)), shard=shard)
    result["kinds"] = {type(p._local_tensor).__name__ for p in result["model"].parameters()}
    result["plain_counts"] = fsdp_train(kind, rank, size, shard=shard)["counts"]
    return result


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("kind,world_size", [("gpt", 2), ("mlp", 4)])
def test_extension_weights_train_like_one_process(kind: str, world_size: int, reshard_after_forward: bool) -> None:
    calls = dict(SplitPrecisionWeight.calls)
    results = run_ranks(lambda rank, size: _train(kind, rank, size, reshard_after_forward=reshard_after_forward),
                        world_size, timeout=TIMEOUT)
    assert_parity(results, reference(kind, world_size))
    assert all(r["kinds"] == {"SplitPrecisionWeight", "Tensor"} for r in results)   # weights stay the subclass
    assert SplitPrecisionWeight.calls["pre"] > calls["pre"]
    assert SplitPrecisionWeight.calls["post_out"] > calls["post_out"]        # later gathers refill in place
    for result in results:   # mixed dtypes cost no second collective: as many as plain weights take
        assert result["counts"] == result["plain_counts"]


def _split_precision_tp_weights(model: nn.Module) -> None:
    """Make the TP-local tensor of every 2-d DTensor weight (and every plain 2-d weight) a SplitPrecisionWeight."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim != 2:
                continue
            if isinstance(param, DTensor):
                data = DTensor(SplitPrecisionWeight(param._local_tensor.detach().clone()), param._spec)
            else:
                data = SplitPrecisionWeight(param.detach().clone())
            setattr(module, name, nn.Parameter(data))


def test_extension_over_tensor_parallel_weights_trains_like_one_process() -> None:
    from tests.fsdp import test_tp

    def shard(model: nn.Module, dp) -> None:
        _split_precision_tp_weights(model)
        test_tp.shard_blocks_then_root(model, dp)

    initial = test_tp.build("lm")
    results = test_tp.run(lambda rank, size: test_tp.train("lm", copy.deepcopy(initial), shard=shard))
    test_tp.assert_parity(results, test_tp.reference("lm"))
    for result in results:
        kinds = {type(p._local_tensor).__name__ for n, p in result["model"].named_parameters() if n.endswith("weight")
                 and p.ndim == 2}
        assert kinds == {"SplitPrecisionWeight"}


# -- torch's TwoTensor, the older one-argument pre-gather, meta-device init ------------------------------------

def _two_tensor_pre_all_gather(self: TwoTensor, mesh) -> tuple[tuple[torch.Tensor, ...], None]:
    return (self.a, self.b), None


def _two_tensor_post_all_gather(self: TwoTensor, outputs: tuple[torch.Tensor, ...], metadata: None,
                                param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
    a, b = outputs
    if out is not None:     # the outputs are refilled where the unsharded TwoTensor already points
        assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        return None
    return TwoTensor(a, b), (a, b)


class _TwoTensorGathered(TwoTensor):
    """torch's TwoTensor with the one-argument (older) all-gather extension."""

    fsdp_pre_all_gather = _two_tensor_pre_all_gather
    fsdp_post_all_gather = _two_tensor_post_all_gather


def _mlp(bias: bool = False) -> nn.Sequential:
    with seeded(0):
        return nn.Sequential(nn.Linear(7, 15, bias=bias), nn.Tanh(), nn.Linear(15, 13, bias=bias), nn.Tanh(),
                             nn.Linear(13, 3, bias=bias))


def _steps(model: nn.Module, rank: int, size: int, steps: int = 3) -> list[float]:
    """SGD on rank `rank`'s chunk of each global batch; returns the losses (`.a` of a TwoTensor loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randn(2 * size, 7, generator=gen).chunk(size)[rank]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.a if isinstance(loss, TwoTensor) else loss))
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_tensor_weights_built_on_meta_train_like_one_process(reshard_after_forward: bool) -> None:
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 7, generator=gen)
        torch.stack([ref(chunk).square().mean() for chunk in x.chunk(4)]).mean().backward()
        opt.step()
        opt.zero_grad()

    def body(rank: int, size: int) -> list[torch.Tensor]:
        with torch.device("meta"):
            model = _mlp()
            for linear in model[::2]:
                linear.weight = nn.Parameter(_TwoTensorGathered(linear.weight, linear.weight.clone()))
        mesh = init_device_mesh("cpu", (size,))
        for linear in model[::2]:
            fully_shard(linear, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for linear, initial in zip(model[::2], _mlp()[::2], strict=True):
            assert type(linear.weight._local_tensor) is _TwoTensorGathered
            with torch.no_grad():
                rows = -(-initial.weight.shape[0] // size)
                linear.weight._local_tensor.copy_(initial.weight[rank * rows:(rank + 1) * rows])
        _steps(model, rank, size)
        # both halves of every shard; full_tensor() gathers the value TwoTensor's copy_ gives, a plain tensor
        return [(linear.weight._local_tensor.a, linear.weight._local_tensor.b, linear.weight.full_tensor())
                for linear in model[::2]]

    for rank, weights in enumerate(run_ranks(body, 4, timeout=TIMEOUT)):
        for (a, b, full), linear in zip(weights, ref[::2], strict=True):
            want = linear.weight.detach()
            rows = -(-want.shape[0] // 4)
            torch.testing.assert_close(a, want[rank * rows:(rank + 1) * rows], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b, want[rank * rows:(rank + 1) * rows], rtol=1e-5, atol=1e-6)
            assert type(full) is torch.Tensor
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6)


# -- methods patched onto plain local tensors, HSDP, mixed precision ------------------------------------------

def _patch_split_precision(local: torch.Tensor, calls: list[str]) -> None:
    """Give a plain local tensor SplitPrecisionWeight's extension as instance methods, the one-argument
    pre-gather form, checking it is handed the 1-d shard mesh."""
    def fsdp_pre_all_gather(mesh):
        assert mesh.ndim == 1 and mesh.size() == 2, mesh
        calls.append("pre")
        head = local.to(torch.bfloat16)
        return (head, local - head.float()), None

    def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None):
        head, rest = outputs
        with torch.no_grad():
            if out is not None:
                out.copy_((head.float() + rest)[: out.shape[0]])
                return None
            weight = (head.float() + rest).to(param_dtype)
        return weight, (weight,)

    local.fsdp_pre_all_gather = fsdp_pre_all_gather
    local.fsdp_post_all_gather = fsdp_post_all_gather


def test_patched_methods_on_hsdp_in_bf16_compute_exactly_what_plain_weights_do() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

    def body(rank: int, size: int) -> tuple[dict, dict, list[str]]:
        calls: list[str] = []

        def shard(model: nn.Module, mesh) -> None:
            shard_blocks_then_root(model, mesh, mp_policy=policy)

        def patch(model: nn.Module) -> None:
            for param in model.parameters():
                if param.ndim == 2:
                    _patch_split_precision(param._local_tensor, calls)

        plain_run = fsdp_train("gpt", rank, size, mesh_shape=(2, 2), shard=shard)
        patched = fsdp_train("gpt", rank, size, mesh_shape=(2, 2), shard=shard, setup=patch)
        return plain_run, patched, calls

    for plain_run, patched, calls in run_ranks(body, 4, timeout=TIMEOUT):
        assert calls and set(calls) == {"pre"}
        assert patched["losses"] == plain_run["losses"]
        for got, want in zip(patched["params"], plain_run["params"], strict=True):
            assert torch.equal(got, want)
        assert patched["counts"] == plain_run["counts"]


# -- memory and refusals -----------------------------------------------------------------------------------------

def test_resharding_frees_the_gather_outputs_and_what_post_gather_named() -> None:
    def body(rank: int, size: int) -> None:
        model = split_precision_weights(build("mlp", seed=0))
        mesh = init_device_mesh("cpu", (size,))
        shard_blocks_then_root(model, mesh)
        layer = model.layers[0]
        group = state_of(layer).group
        model(torch.randn(2, 7)).sum().backward()
        extended = group.layout.extended
        assert [param.fqn for param in extended] == ["layers.0.weight"]
        extension = extended[0].extension
        assert len(extension.outputs) == 2 and len(extension.inner) == 1
        assert all(t.untyped_storage().nbytes() == 0 for t in (*extension.outputs, *extension.inner))
        assert all(t.untyped_storage().nbytes() == 0 for t in group.held_tensors()["unsharded parameters"])
        layer.unshard()
        held = group.held_tensors()["unsharded parameters"]
        assert sum(t.untyped_storage().nbytes() for t in held) >= 15 * 7 * (2 + 4 + 4)   # bf16 + fp32 + weight
        assert torch.equal(layer.weight, build("mlp", seed=0).layers[0].weight)
        layer.reshard()

    run_ranks(body, 2, timeout=TIMEOUT)


class _PreOnly(SplitPrecisionWeight):
    """Defines only half the extension."""

    @property
    def fsdp_post_all_gather(self):   # hasattr() is False
        raise AttributeError("fsdp_post_all_gather")


def test_an_extension_fsdp_cannot_gather_is_refused_naming_the_parameter() -> None:
    def body(rank: int, size: int) -> list[str]:
        mesh = init_device_mesh("cpu", (size,))
        errors = []
        model = _mlp()
        model[0].weight = nn.Parameter(_PreOnly(model[0].weight.detach().clone()))
        with pytest.raises(ValueError, match=r"0\.weight's _PreOnly defines fsdp_pre_all_gather but not "
                                             r"fsdp_post_all_gather"):
            fully_shard(model, mesh=mesh)
        for options, match in [({"shard_placement_fn": lambda p: Shard(1)}, "sharded on dim 1; extensions are "
                                                                             "gathered along dim 0"),
                               ({"reshard_after_forward": 2}, "reshard_after_forward=int cannot")]:
            model = split_precision_weights(_mlp())
            fully_shard(model[0], mesh=mesh, **options)
            fully_shard(model, mesh=mesh)
            with pytest.raises(ValueError, match=match) as raised:
                model(torch.randn(2, 7))
            errors.append(str(raised.value))
        return errors

    for errors in run_ranks(body, 4, timeout=TIMEOUT):
        assert all("parameter 0.weight" in error for error in errors), errors


def test_inputs_that_change_shape_between_gathers_or_miss_the_padding_are_refused() -> None:
    def body(rank: int, size: int) -> str:
        model = split_precision_weights(_mlp())
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 7))
        model.reshard()
        local = model[0].weight._local_tensor      # 15 rows: 8 on rank 0, 7 on rank 1
        local.fsdp_pre_all_gather = lambda *args: ((local._data[:1].to(torch.bfloat16),), None)
        with pytest.raises((RuntimeError, ValueError)) as raised:
            model(torch.randn(2, 7))
        return str(raised.value)

    full, short = run_ranks(body, 2, timeout=TIMEOUT)
    assert "parameter 0.weight's fsdp_pre_all_gather returned inputs of shapes [(1, 7)] and dtypes " \
           "[torch.bfloat16], but [(8, 7), (8, 7)]" in full
    assert "must keep their shapes and dtypes" in full
    assert "parameter 0.weight is sharded unevenly (this rank's shard is (7, 7) of a (8, 7) piece)" in short


def test_frozen_extension_base_weights_beside_trainable_adapters_train_like_one_process() -> None:
    """QLoRA's layout: the frozen base weights gather through their extension (NF4 in torchtune), the float32
    adapters beside them in the same group."""
    from tests.fsdp import test_lora

    def build() -> nn.Module:
        model = test_lora.build()
        for layer in model[::2]:
            layer.base = nn.Parameter(SplitPrecisionWeight(layer.base.detach().clone()), requires_grad=False)
        return model

    losses, ref = test_lora.reference(4)
    results = run_ranks(lambda rank, size: test_lora.train(rank, size, model=build()), 4, timeout=TIMEOUT)
    test_lora.assert_matches(results, losses, ref)
    for result in results:
        assert all(type(layer.base._local_tensor) is SplitPrecisionWeight for layer in result["model"][::2])


def test_a_checkpoint_of_extension_weights_round_trips_into_extension_weights(tmp_path) -> None:
    """The state dict holds the weights' subclass: saving writes each shard's value, loading copies values back
    into the fresh model's subclass shards (through the subclass's own copy_)."""
    import spmd.checkpoint as dcp

    def body(rank: int, size: int) -> list[tuple[str, str, bool]]:
        mesh = init_device_mesh("cpu", (size,))
        model = split_precision_weights(build("mlp", seed=0))
        fully_shard(model, mesh=mesh)
        dcp.save(model.state_dict(), checkpoint_id=tmp_path)
        fresh = split_precision_weights(build("mlp", seed=1))
        fully_shard(fresh, mesh=mesh)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=tmp_path)
        fresh.load_state_dict(state)
        return [(name, type(b._local_tensor).__name__, torch.equal(a.full_tensor(), b.full_tensor()))
                for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True)]

    for rows in run_ranks(body, 2, timeout=TIMEOUT):
        assert all(equal for _, _, equal in rows)
        assert {kind for name, kind, _ in rows if name.endswith("weight")} == {"SplitPrecisionWeight"}
