"""Tensor-parallel plans and models for the tests: the example GPT (examples/gpt.py) and the Llama-style model
(examples/llama.py), each with plain TP, TP + sequence parallel, and the loss-parallel variant of each.

The Llama plans are torch's tensor-parallel tutorial's, verbatim but for the import prefix.
"""

from __future__ import annotations

import enum

from examples.gpt import GPT, GPTConfig
from examples.llama import ModelArgs, Transformer
from torch import nn

from spmd.device_mesh import DeviceMesh
from spmd.tensor import Replicate, Shard
from spmd.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, CONTEXT = 64, 16


class Layout(enum.Enum):
    TP = "tp"                          # Megatron: one all-reduce after attention and one after the MLP
    TP_SP = "tp+sp"                    # sequence parallel: norms on sequence shards, all-gather / reduce-scatter
    TP_LOSS = "tp+loss"                # TP with the logits left vocab-sharded for loss_parallel
    TP_SP_LOSS = "tp+sp+loss"

    @property
    def sequence_parallel(self) -> bool:
        return self in (Layout.TP_SP, Layout.TP_SP_LOSS)

    @property
    def loss_parallel(self) -> bool:
        return self in (Layout.TP_LOSS, Layout.TP_SP_LOSS)


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(vocab=VOCAB, context=CONTEXT, layers=2, width=32, heads=4))
    if kind == "llama":
        return Transformer(ModelArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, multiple_of=16,
                                     max_seq_len=CONTEXT))
    raise ValueError(kind)


def head_style(layout: Layout) -> ColwiseParallel:
    """The output head: vocab-sharded logits left as a DTensor for loss_parallel, else gathered."""
    source = Shard(1) if layout.sequence_parallel else Replicate()
    if layout.loss_parallel:
        return ColwiseParallel(input_layouts=source, use_local_output=False)
    return ColwiseParallel(input_layouts=source, output_layouts=Replicate())


def parallelize_gpt(model: GPT, mesh: DeviceMesh, layout: Layout) -> GPT:
    sp = layout.sequence_parallel
    residual = Shard(1) if sp else Replicate()
    block_plan = {
        "attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()) if sp else None,
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=residual),
        "up": ColwiseParallel(input_layouts=residual),
        "down": RowwiseParallel(output_layouts=residual),
        "ln1": SequenceParallel() if sp else None, "ln2": SequenceParallel() if sp else None,
    }
    for block in model.blocks:
        parallelize_module(block, mesh, {path: style for path, style in block_plan.items() if style is not None})
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual), "head": head_style(layout)}
    if sp:   # positions (S, H) -> this rank's sequence slice, added to the sequence-sharded token embeddings
        top["position"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        top["ln"] = SequenceParallel()
    return parallelize_module(model, mesh, top)


def parallelize_llama(model: Transformer, mesh: DeviceMesh, layout: Layout) -> Transformer:
    """torch's tutorial plan (with SequenceParallel on the norms for the sequence-parallel layouts)."""
    sp = layout.sequence_parallel
    residual = Shard(1) if sp else Replicate()
    for block in model.layers:
        layer_plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            layer_plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        attention = block.attention
        attention.n_heads //= mesh.size()
        attention.n_kv_heads //= mesh.size()
        parallelize_module(block, mesh, layer_plan)
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
           "output": head_style(layout)}
    if sp:
        top["norm"] = SequenceParallel()
    return parallelize_module(model, mesh, top)


def parallelize(kind: str, model: nn.Module, mesh: DeviceMesh, layout: Layout) -> nn.Module:
    return (parallelize_gpt if kind == "gpt" else parallelize_llama)(model, mesh, layout)
