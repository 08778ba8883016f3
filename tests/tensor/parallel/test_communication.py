"""The collectives of a tensor-parallel step, pinned with CommDebugMode: per transformer block, Megatron's.

Plain TP: forward one all-reduce after attention and one after the MLP; backward the mirror image, one
all-reduce where each enters (q, k and v share one, see Note: one DTensor per shared input). Sequence
parallel: an all-gather before and a reduce-scatter after each instead, and backward the mirror image.
loss_parallel: the logits are never gathered; the loss adds three all-reduces of a few values per row forward
and one backward.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from spmd.device_mesh import init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.parallel import loss_parallel
from spmd.testing import run_ranks
from tests.tensor.parallel.plans import Layout, parallelize
from tests.tensor.parallel.test_parity import batch, fresh

LAYERS = 2
NAMES = {"gpt": ("GPT.blocks", "attn", "GPT.head"),
         "llama": ("Transformer.layers", "attention", "Transformer.output")}


def step_counts(kind: str, layout: Layout) -> tuple[dict, dict]:
    """(per-module counts, total counts) of one forward and backward on rank 0 of 2."""
    def body(rank: int, size: int) -> tuple[dict, dict]:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        model = parallelize(kind, fresh(kind), mesh["tp"], layout)
        tokens, targets = batch(0)
        with CommDebugMode() as mode:
            logits = model(tokens)
            if layout.loss_parallel:
                with loss_parallel():
                    F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()
            else:
                F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()
        per_module = {name: {direction: dict(counts) for direction, counts in info.items()}
                      for name, info in mode.get_per_module_info().items()}
        return per_module, dict(mode.get_comm_counts())
    return run_ranks(body, 2, timeout=60)[0]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_plain_tp_issues_megatrons_all_reduces(kind: str) -> None:
    per_module, _ = step_counts(kind, Layout.TP)
    blocks, attention, _ = NAMES[kind]
    for i in range(LAYERS):
        assert per_module[f"{blocks}.{i}"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
        assert per_module[f"{blocks}.{i}.{attention}"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_sequence_parallel_gathers_before_and_reduce_scatters_after(kind: str) -> None:
    per_module, _ = step_counts(kind, Layout.TP_SP)
    blocks, attention, _ = NAMES[kind]
    pair = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    for i in range(LAYERS):
        assert per_module[f"{blocks}.{i}"] == {"forward": {k: 2 for k in pair}, "backward": {k: 2 for k in pair}}
        assert per_module[f"{blocks}.{i}.{attention}"] == {"forward": pair, "backward": pair}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loss_parallel_gathers_no_logits(kind: str) -> None:
    per_module, total = step_counts(kind, Layout.TP_LOSS)
    _, _, head = NAMES[kind]
    assert per_module[head]["forward"] == {}                   # the vocab-sharded logits stay sharded
    assert per_module[head]["backward"] == {"all_reduce": 1}   # the head's input gradient, as any colwise layer
    blocks_and_embedding = 2 * LAYERS + 1
    assert total == {"all_reduce": 2 * blocks_and_embedding + 4}   # + the loss: 3 forward, 1 backward
    assert "all_gather_into_tensor" not in total
