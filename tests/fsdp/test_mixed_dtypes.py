"""One fully_shard group may hold frozen parameters of other dtypes than its trainable ones (frozen bfloat16 base
weights beside float32 LoRA adapters, an integer table), as torch's FSDP2 allows: all are gathered in the group's
one all-gather (the other dtypes as bytes; see Note: the flat layouts in src/spmd/fsdp/collectives.py), and the
model trains like one process. Trainable parameters must still share a dtype (their gradients are reduced
together), as in torch."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import MixedPrecisionPolicy, fully_shard
from spmd.testing import run_ranks, seeded
from tests.fsdp.test_lora import TIMEOUT, LoRALinear, assert_matches, reference, train


class MixedLoRALinear(LoRALinear):
    """LoRALinear with its frozen base weight in bfloat16 and a frozen integer row table (the identity)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.base = nn.Parameter(self.base.detach().to(torch.bfloat16), requires_grad=False)
        self.rows = nn.Parameter(torch.arange(d_out), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x)[..., self.rows]


def build() -> nn.Sequential:
    with seeded(0):
        return nn.Sequential(MixedLoRALinear(7, 15), nn.Tanh(), MixedLoRALinear(15, 13), nn.Tanh(),
                             MixedLoRALinear(13, 3))


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_parameters_of_other_dtypes_share_the_group_and_train_like_one_process(world_size: int) -> None:
    losses, ref = reference(world_size, build())
    results = run_ranks(lambda rank, size: (train(rank, size, model=build()), train(rank, size)), world_size,
                        timeout=TIMEOUT)
    assert_matches([mixed for mixed, _ in results], losses, ref)
    for mixed, one_dtype in results:    # the other dtypes cost no collective of their own
        assert mixed["counts"] == one_dtype["counts"]


def test_mixed_precision_casts_only_the_floating_point_parameters() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

    def body(rank: int, size: int) -> dict[str, torch.dtype]:
        layer = train(rank, size, model=build(), mp_policy=policy)["model"][0]
        layer.unshard()
        dtypes = {name: p.dtype for name, p in layer.named_parameters()}
        assert torch.equal(layer.rows, torch.arange(15))
        layer.reshard()
        return dtypes

    for dtypes in run_ranks(body, 2, timeout=TIMEOUT):
        assert dtypes == {"base": torch.bfloat16, "a": torch.bfloat16, "b": torch.bfloat16, "rows": torch.int64}


def test_trainable_parameters_of_two_dtypes_or_a_post_forward_mesh_over_several_are_refused() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        layer = build()[0]
        layer.a.data = layer.a.data.double()
        with pytest.raises(ValueError, match=r"trainable parameters of one group must share a dtype, their "
                                             r"gradients being reduced together \(a: torch\.float64, b: "
                                             r"torch\.float32\)"):
            fully_shard(layer, mesh=mesh)
        with pytest.raises(ValueError, match=r"reshard_after_forward=int keeps one torch\.float32 copy sharded "
                                             r"over the smaller group, but base: torch\.bfloat16, rows: "
                                             r"torch\.int64 differ"):
            fully_shard(build()[0], mesh=mesh, reshard_after_forward=2)

    run_ranks(body, 4, timeout=TIMEOUT)
