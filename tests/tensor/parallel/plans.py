"""Tensor-parallel plans and models for the tests: the example GPT (examples/gpt.py) and the Llama-style model
(examples/llama.py), each with plain TP, TP + sequence parallel, and the loss-parallel variant of each.

The Llama plans are torch's tensor-parallel tutorial's, verbatim but for the import prefix. Each plan is written
against `api`, the classes of the same names from spmd (SPMD, the default) or from torch (the oracle test builds
the identical plan with torch's classes).
"""

from __future__ import annotations

import enum
import importlib
import types

from examples.gpt import GPT, GPTConfig
from examples.llama import ModelArgs, Transformer
from torch import nn

from spmd.device_mesh import DeviceMesh
from spmd.tensor.parallel import ColwiseParallel

VOCAB, CONTEXT = 64, 16
_PLAN_NAMES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
               "parallelize_module")


def _api(package: str) -> types.SimpleNamespace:
    """The plan classes, parallelize_module, Replicate and Shard of `package` ("spmd" or "torch.distributed")."""
    parallel, tensor = (importlib.import_module(f"{package}.tensor{suffix}") for suffix in (".parallel", ""))
    return types.SimpleNamespace(**{name: getattr(parallel, name) for name in _PLAN_NAMES},
                                 Replicate=tensor.Replicate, Shard=tensor.Shard)


SPMD = _api("spmd")


def torch_api() -> types.SimpleNamespace:
    """The same names from torch.distributed.tensor (the oracle tests build the identical plans with them)."""
    return _api("torch.distributed")


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


def head_style(layout: Layout, api: types.SimpleNamespace = SPMD) -> ColwiseParallel:
    """The output head: vocab-sharded logits left as a DTensor for loss_parallel, else gathered."""
    source = api.Shard(1) if layout.sequence_parallel else api.Replicate()
    if layout.loss_parallel:
        return api.ColwiseParallel(input_layouts=source, use_local_output=False)
    return api.ColwiseParallel(input_layouts=source, output_layouts=api.Replicate())


def parallelize_gpt(model: GPT, mesh: DeviceMesh, layout: Layout, api: types.SimpleNamespace = SPMD) -> GPT:
    sp = layout.sequence_parallel
    residual = api.Shard(1) if sp else api.Replicate()
    block_plan = {
        "attn": api.PrepareModuleInput(input_layouts=api.Shard(1), desired_input_layouts=api.Replicate())
        if sp else None,
        "attn.q": api.ColwiseParallel(), "attn.k": api.ColwiseParallel(), "attn.v": api.ColwiseParallel(),
        "attn.proj": api.RowwiseParallel(output_layouts=residual),
        "up": api.ColwiseParallel(input_layouts=residual),
        "down": api.RowwiseParallel(output_layouts=residual),
        "ln1": api.SequenceParallel() if sp else None, "ln2": api.SequenceParallel() if sp else None,
    }
    for block in model.blocks:
        api.parallelize_module(block, mesh, {path: style for path, style in block_plan.items() if style is not None})
    top = {"embed": api.RowwiseParallel(input_layouts=api.Replicate(), output_layouts=residual),
           "head": head_style(layout, api)}
    if sp:   # positions (S, H) -> this rank's sequence slice, added to the sequence-sharded token embeddings
        top["position"] = api.PrepareModuleOutput(output_layouts=api.Replicate(), desired_output_layouts=api.Shard(0))
        top["ln"] = api.SequenceParallel()
    return api.parallelize_module(model, mesh, top)


def parallelize_llama(model: Transformer, mesh: DeviceMesh, layout: Layout,
                      api: types.SimpleNamespace = SPMD) -> Transformer:
    """torch's tutorial plan (with SequenceParallel on the norms for the sequence-parallel layouts)."""
    sp = layout.sequence_parallel
    residual = api.Shard(1) if sp else api.Replicate()
    for block in model.layers:
        layer_plan = {
            "attention.wq": api.ColwiseParallel(),
            "attention.wk": api.ColwiseParallel(),
            "attention.wv": api.ColwiseParallel(),
            "attention.wo": api.RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": api.ColwiseParallel(),
            "feed_forward.w2": api.RowwiseParallel(output_layouts=residual),
            "feed_forward.w3": api.ColwiseParallel(),
        }
        if sp:
            layer_plan.update({
                "attention_norm": api.SequenceParallel(),
                "attention": api.PrepareModuleInput(input_layouts=(api.Shard(1), None),
                                                    desired_input_layouts=(api.Replicate(), None)),
                "ffn_norm": api.SequenceParallel(),
                "feed_forward": api.PrepareModuleInput(input_layouts=(api.Shard(1),),
                                                       desired_input_layouts=(api.Replicate(),)),
            })
        attention = block.attention
        attention.n_heads //= mesh.size()
        attention.n_kv_heads //= mesh.size()
        api.parallelize_module(block, mesh, layer_plan)
    top = {"tok_embeddings": api.RowwiseParallel(input_layouts=api.Replicate(), output_layouts=residual),
           "output": head_style(layout, api)}
    if sp:
        top["norm"] = api.SequenceParallel()
    return api.parallelize_module(model, mesh, top)


def parallelize(kind: str, model: nn.Module, mesh: DeviceMesh, layout: Layout,
                api: types.SimpleNamespace = SPMD) -> nn.Module:
    return (parallelize_gpt if kind == "gpt" else parallelize_llama)(model, mesh, layout, api)
