"""Train a GPT-style decoder on the Python standard library's source, data-parallel over spmd ranks.

    spmdrun --standalone --nproc-per-node 2 examples/train_gpt.py --parallel ddp --steps 200
    python examples/train_gpt.py --steps 50          # one process, no launcher needed

Every rank builds the same model (DDP broadcasts rank 0's weights anyway), draws its own shard of each
global batch, and DDP averages gradients during backward, so the run trains like one process on the global
batch of `nproc x batch-size x grad-accum` sequences. Rank 0 prints a progress line with the training loss
and tokens/s, the validation loss every --eval-every steps, and finally a sample of generated text.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from data import Corpus, decode, encode
from gpt import GPT, GPTConfig, loss_of

import spmd

PARALLEL_CHOICES = ("ddp",)   # fsdp, tp, pp and their compositions come with their issues


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--width", type=int, default=256)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--context", type=int, default=128)
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (no_sync)")
    train.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument("--min-lr", type=float, default=2e-4, help="learning rate at the end of the cosine")
    train.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--corpus-mb", type=float, default=8.0, help="MB of standard-library source to use")
    run = parser.add_argument_group("run")
    run.add_argument("--parallel", choices=PARALLEL_CHOICES, default="ddp")
    run.add_argument("--backend", default="auto", help="spmd transport: auto (shm on one host), tcp, shm")
    run.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--eval-every", type=int, default=50)
    run.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank")
    run.add_argument("--sample-tokens", type=int, default=300, help="length of the final sample (0: none)")
    run.add_argument("--prompt", default="def ")
    return parser.parse_args(argv)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr, then a cosine down to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def init_distributed(backend: str) -> None:
    """Join the job started by spmdrun; a plain `python train_gpt.py` becomes a one-rank world."""
    if spmd.is_initialized():
        return   # already set up by the caller (spmd.testing.run_ranks, a notebook)
    if "RANK" in os.environ:
        spmd.init_process_group(backend)
    else:
        spmd.init_process_group("threads", store=spmd.HashStore(), rank=0, world_size=1)


def parallelize(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    if args.parallel == "ddp":
        return spmd.DistributedDataParallel(model)
    raise ValueError(f"--parallel {args.parallel} is not available yet; choose one of {PARALLEL_CHOICES}")


def configure_threads(requested: int) -> None:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(requested or max(1, (os.cpu_count() or 1) // local_ranks))


@torch.no_grad()
def validation_loss(model: nn.Module, corpus: Corpus, args: argparse.Namespace, rank: int, world_size: int) -> float:
    """Mean loss over every rank's --eval-batches validation batches (the same batches at every evaluation)."""
    generator = torch.Generator().manual_seed(10_000 + rank)
    total = torch.zeros(1)
    for _ in range(args.eval_batches):
        tokens, targets = corpus.batch("val", args.batch_size, args.context, generator)
        total += loss_of(model, tokens, targets)
    spmd.all_reduce(total)
    return total.item() / (args.eval_batches * world_size)


def progress_line(step: int, args: argparse.Namespace, loss: float, lr: float, tokens_per_s: float) -> str:
    done = round(20 * step / args.steps)
    return (f"[{'#' * done}{'.' * (20 - done)}] step {step:>5}/{args.steps}  loss {loss:6.3f}  lr {lr:.2e}  "
            f"{tokens_per_s:,.0f} tok/s")


def train(args: argparse.Namespace) -> dict[str, list[float]]:
    """Run the training; returns the logged training and validation losses (on every rank)."""
    rank, world_size = spmd.get_rank(), spmd.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    corpus = Corpus(int(args.corpus_mb * (1 << 20)))
    config = GPTConfig(vocab=256, context=args.context, layers=args.layers, width=args.width, heads=args.heads)
    raw = GPT(config)
    model = parallelize(raw, args)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    say(f"GPT {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters, {world_size} rank(s) of "
        f"{torch.get_num_threads()} thread(s), --parallel {args.parallel} over {spmd.get_backend()}; corpus "
        f"{len(corpus.splits['train']) / 1e6:.1f}M train bytes; global batch {world_size} x {args.batch_size} x "
        f"{args.grad_accum} x {args.context} tokens")
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    tokens_per_step = world_size * args.batch_size * args.grad_accum * args.context
    history: dict[str, list[float]] = {"train": [], "val": []}
    window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
    for step in range(args.steps):
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = 0.0
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                tokens, targets = corpus.batch("train", args.batch_size, args.context, generator)
                loss = loss_of(model, tokens, targets) / args.grad_accum
                loss.backward()
            step_loss += loss.item()
        if args.clip > 0:
            nn.utils.clip_grad_norm_(raw.parameters(), args.clip)   # gradients are already averaged: same on all
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1
        window_loss += step_loss
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - window_start
            mean_loss = window_loss / window_steps   # rank 0's shard; the validation loss covers all ranks
            history["train"].append(mean_loss)
            say(progress_line(step + 1, args, mean_loss, lr, tokens_per_step * window_steps / elapsed), flush=True)
            window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = validation_loss(raw, corpus, args, rank, world_size)
            history["val"].append(val)
            say(f"  validation loss {val:.3f} (perplexity {math.exp(val):.1f} per byte)", flush=True)
            window_start = time.perf_counter()   # don't count evaluation in tokens/s
    if args.sample_tokens and rank == 0:
        prompt = encode(args.prompt).unsqueeze(0)
        sample = raw.generate(prompt, args.sample_tokens, generator=torch.Generator().manual_seed(args.seed))
        say("--- sample ---\n" + decode(sample[0]) + "\n--------------", flush=True)
    return history


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    configure_threads(args.threads)
    owns_world = not spmd.is_initialized()
    init_distributed(args.backend)
    try:
        return train(args)
    finally:
        if owns_world:
            spmd.destroy_process_group()


if __name__ == "__main__":
    main()
