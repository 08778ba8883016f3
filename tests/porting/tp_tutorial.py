# Tensor parallel as the tutorial writes it ("Large Scale Transformer model training with Tensor Parallel"):
# a Llama-style model, Colwise/Rowwise projections, SequenceParallel norms, PrepareModuleInput and a loss_parallel
# cross-entropy, on a CPU mesh; rank 0 saves the losses and the full trained weights to argv[1].
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

DIM, HEADS, VOCAB, SEQ = 16, 4, 32, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q, k, v = (w(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def main():
    dist.init_process_group(backend="gloo")
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Transformer()
    model = parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        layer_tp_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, layer_tp_plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)                  # every rank of the tp group takes the same batch
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1))
        pred = model(tokens[:, :-1])
        with loss_parallel():
            loss = F.cross_entropy(pred.flatten(0, 1), tokens[:, 1:].flatten(0, 1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    full = {name: param.full_tensor() for name, param in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": full}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
