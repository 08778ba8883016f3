"""Train a GPT-style decoder on the Python standard library's source, under any mix of spmd's parallelisms.

    spmdrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200                     # DDP over 2
    spmdrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp-shard 2 --tp 2 --sequence-parallel
    spmdrun --standalone --nproc-per-node 4 examples/train_gpt.py --pp 2 --dp-shard 2 --pp-schedule GPipe
    python examples/train_gpt.py --steps 50          # one process, no launcher needed

The layout is one DeviceMesh ("pp", "dp_replicate", "dp_shard", "tp") whose sizes multiply to the world size
(default: every rank a data-parallel replica, i.e. DDP); parallelize.py lays the model out on it. Every
data-parallel rank (a (dp_replicate, dp_shard) coordinate) trains on its own slice of each global batch of
`--global-batch` sequences (default dp x batch-size x grad-accum); its TP and PP peers train on the same slice.
The global batch is drawn from a generator seeded by the step, so every layout of the same global batch trains
on the same tokens and, in fp32, to the same losses. With --checkpoint-dir the run saves in the background every
--checkpoint-every steps and at its end (examples/checkpointing.py), and --resume continues from the newest
complete checkpoint under any layout. Rank 0 prints a header (layout, predicted memory per rank, FLOPs per token,
the measured matmul peak), a progress line with the training loss (the mean over the global batch), tokens/s,
the FLOP/s fraction of the peak and peak RSS, the validation loss every --eval-every steps, a summary (measured
against predicted memory, compute against exposed communication) and finally a sample of generated text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import resource
import sys
import threading
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from checkpointing import Checkpointer
from data import Corpus, decode, encode
from estimates import MeasuredMemory, MiB, flops_per_token, measure_matmul_peak, predict_memory
from gpt import GPT, GPTConfig
from parallelize import PP_SCHEDULES, Layout, ParallelGPT, build_mesh, data_parallel_rank

import spmd
from spmd.comm.work import ExposedCommunication

_build_lock = threading.Lock()   # thread ranks (spmd.testing.run_ranks) share torch's global RNG


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--width", type=int, default=256)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--context", type=int, default=128)
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's length)")
    train.add_argument("--stop-after", type=int, default=0,
                       help="end this run after that many steps (0: --steps), checkpointing there: a job run in "
                            "pieces (time-limited allocations) resumes the same schedule with --resume")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank per micro-step")
    train.add_argument("--global-batch", type=int, default=0,
                       help="sequences per optimizer step over all ranks (0: dp x batch-size x grad-accum); sets "
                            "the batch size per data-parallel rank, so that layouts compare on one global batch")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    train.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument("--min-lr", type=float, default=2e-4, help="learning rate at the end of the cosine")
    train.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--corpus-mb", type=float, default=8.0, help="MB of standard-library source to use")
    train.add_argument("--mixed-precision", choices=("none", "bf16"), default="none",
                       help="bf16: FSDP's MixedPrecisionPolicy (bf16 parameters, fp32 reduction), else autocast")
    train.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    train.add_argument("--compile", action="store_true", help="torch.compile each block")
    layout = parser.add_argument_group("layout (the degrees multiply to the world size)")
    layout.add_argument("--dp-replicate", type=int, default=0, help="data-parallel replicas (0: the ranks left)")
    layout.add_argument("--dp-shard", type=int, default=1, help="ranks FSDP2 shards the parameters over")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    layout.add_argument("--sequence-parallel", action="store_true", help="norms on sequence shards under --tp")
    layout.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocab-sharded logits")
    layout.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1F1B")
    layout.add_argument("--microbatches", type=int, default=0, help="per pipeline step (0: 2 x --pp)")
    layout.add_argument("--parallel", choices=("ddp",), default=None,
                        help="deprecated: data parallelism is the default layout")
    run = parser.add_argument_group("run")
    run.add_argument("--backend", default="auto", help="spmd transport: auto (shm on one host), tcp, shm")
    run.add_argument("--simulate", type=int, default=0, metavar="N",
                     help="play one rank of an N-rank job in this process (backend 'fake': nothing is sent and "
                          "collectives give stand-in values), to see the layout's memory per rank at a size this "
                          "machine can't run; the losses are not the job's")
    run.add_argument("--simulate-rank", type=int, default=0, help="the rank --simulate plays")
    run.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    run.add_argument("--log-every", type=int, default=10, help="log every K steps, and at the end")
    run.add_argument("--eval-every", type=int, default=50,
                     help="validate every K steps (0: only at the end of the run)")
    run.add_argument("--eval-batches", type=int, default=8, help="validation batches (each one global batch)")
    run.add_argument("--sample-tokens", type=int, default=300, help="length of the final sample (0: none)")
    run.add_argument("--prompt", default="def ")
    run.add_argument("--metrics-file", default="",
                     help="rank 0 appends a JSON line per logged step and per validation (full precision)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", default="", help="where to save checkpoints (step-<N> directories)")
    ckpt.add_argument("--checkpoint-every", type=int, default=0,
                      help="save every K steps, in the background (0: only at the end of the run)")
    ckpt.add_argument("--keep-checkpoints", type=int, default=0,
                      help="keep only the newest K complete checkpoints, removing older ones once a newer one is "
                           "written (0: keep all)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest complete checkpoint in --checkpoint-dir, under any layout "
                           "(none there: start afresh, so a restarted job can pass the same flags)")
    args = parser.parse_args(argv)
    for flag, least in (("log_every", 1), ("eval_batches", 1), ("stop_after", 0), ("eval_every", 0),
                        ("checkpoint_every", 0), ("keep_checkpoints", 0), ("sample_tokens", 0), ("microbatches", 0)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.simulate < 0 or not 0 <= args.simulate_rank < max(1, args.simulate):
        parser.error(f"--simulate {args.simulate} --simulate-rank {args.simulate_rank}: the rank must be one of "
                     f"the N >= 1 simulated ones")
    if args.simulate and args.pp > 1:
        parser.error("--simulate can't run --pp: a stage learns its input's shape from the previous stage's real "
                     "messages; simulate the layout without pipelining")
    if args.simulate and args.checkpoint_dir:
        parser.error("--simulate writes no checkpoints (the other ranks' shards don't exist); drop --checkpoint-dir")
    if args.parallel is not None:
        warnings.warn("--parallel ddp is deprecated: data parallelism is the default layout; drop the flag",
                      FutureWarning, stacklevel=2)
    return args


def make_layout(args: argparse.Namespace, world_size: int) -> Layout:
    """The layout from the flags; --dp-replicate 0 takes the ranks the other degrees leave."""
    replicate = args.dp_replicate
    if replicate == 0:
        others = args.pp * args.dp_shard * args.tp
        if others < 1 or world_size % others:
            raise ValueError(f"--pp {args.pp} x --dp-shard {args.dp_shard} x --tp {args.tp} = {others} doesn't "
                             f"divide the world size {world_size}; choose degrees whose product divides it")
        replicate = world_size // others
    return Layout(pp=args.pp, dp_replicate=replicate, dp_shard=args.dp_shard, tp=args.tp,
                  sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                  pp_schedule=args.pp_schedule, microbatches=args.microbatches,
                  mixed_precision=args.mixed_precision, activation_checkpointing=args.activation_checkpointing,
                  compile=args.compile)


def dp_batch_size(args: argparse.Namespace, layout: Layout) -> int:
    """Sequences per data-parallel rank per micro-step."""
    if not args.global_batch:
        return args.batch_size
    if args.global_batch % (layout.dp * args.grad_accum):
        raise ValueError(f"--global-batch {args.global_batch} must be a multiple of dp ({layout.dp}) x --grad-accum "
                         f"({args.grad_accum})")
    return args.global_batch // (layout.dp * args.grad_accum)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr, then a cosine down to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def init_distributed(args: argparse.Namespace) -> None:
    """Join the job started by spmdrun; a plain `python train_gpt.py` becomes a one-rank world, and with
    --simulate one rank of a simulated one."""
    backend = args.backend
    if spmd.is_initialized():
        return   # already set up by the caller (spmd.testing.run_ranks, a notebook)
    if args.simulate:
        spmd.init_process_group("fake", rank=args.simulate_rank, world_size=args.simulate)
    elif "RANK" in os.environ:
        spmd.init_process_group(backend)
    else:
        spmd.init_process_group("threads", store=spmd.HashStore(), rank=0, world_size=1)


def configure_threads(requested: int) -> None:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(requested or max(1, (os.cpu_count() or 1) // local_ranks))


def build_model(config: GPTConfig, seed: int) -> GPT:
    """The same initial weights on every rank, whatever else draws from torch's RNG meanwhile."""
    with _build_lock, torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT(config)


class StepTimes:
    """This rank's timed steps: how many, their wall time, and the part of it blocked on communication."""

    def __init__(self) -> None:
        self.steps, self.seconds, self.exposed = 0, 0.0, 0.0

    def add(self, seconds: float, exposed: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.exposed += exposed


class Trainer:
    """The training loop: data slicing, the learning-rate schedule, checkpoints and resuming, logging with the
    memory and FLOP/s accounting, validation, the final summary and sample."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, world_size = spmd.get_rank(), spmd.get_world_size()
        simulated = spmd.get_backend() == "fake"
        self.say = print if self.rank == 0 or simulated else (lambda *a, **k: None)
        self.layout = make_layout(args, world_size)
        self.batch = dp_batch_size(args, self.layout)
        self.config = GPTConfig(vocab=256, context=args.context, layers=args.layers, width=args.width,
                                heads=args.heads)
        self.layout.check(world_size, self.config, self.batch * args.grad_accum)
        self.corpus = Corpus(int(args.corpus_mb * (1 << 20)))
        model = build_model(self.config, args.seed)
        parameters = sum(p.numel() for p in model.parameters())
        self.mesh = build_mesh(self.layout)
        self.dp_rank = data_parallel_rank(self.mesh)
        self.model = ParallelGPT(model, self.mesh, self.layout)
        self.optimizer = torch.optim.AdamW(self.model.optimizer_groups(), lr=args.lr, betas=(0.9, 0.95),
                                           weight_decay=args.weight_decay)
        self.global_batch = self.layout.dp * self.batch * args.grad_accum
        self.checkpointer = (Checkpointer(args.checkpoint_dir, args.checkpoint_every, self.model.state_module,
                                          self.optimizer, self.layout.describe(), self.global_batch,
                                          keep=args.keep_checkpoints)
                             if args.checkpoint_dir else None)
        self.tokens_per_step = self.global_batch * args.context
        self.flops_per_token = flops_per_token(self.config)
        peak = torch.tensor([measure_matmul_peak()], dtype=torch.float64)
        spmd.all_reduce(peak)
        self.peak_flops = peak.item()
        microbatch = (self.batch * args.grad_accum // self.layout.n_microbatches if self.layout.pp > 1
                      else self.batch)
        self.predicted_memory = predict_memory(self.model.parts, self.config, self.layout, microbatch,
                                               self.mesh.get_local_rank("pp"), self.corpus.splits.values())
        self.measured_memory: MeasuredMemory | None = None
        self.times = StepTimes()
        self.history: dict[str, list[float]] = {"train": [], "val": [], "grad_norm": [], "step": [],
                                                "memory": []}   # memory: [predicted, measured peak] bytes
        self.say(f"GPT {parameters / 1e6:.2f}M parameters, {world_size} rank(s) of {torch.get_num_threads()} "
                 f"thread(s), {self.layout.describe()} over {spmd.get_backend()}; corpus "
                 f"{len(self.corpus.splits['train']) / 1e6:.1f}M train bytes; global batch {self.layout.dp} x "
                 f"{self.batch} x {args.grad_accum} x {args.context} tokens"
                 + (f"; simulated: this process is rank {self.rank} (collectives give stand-in values, so the "
                    f"losses and speeds are not the job's)" if simulated else "") + "\n"
                 f"predicted memory (rank {self.rank}): {self.predicted_memory.describe()}\n"
                 f"{self.flops_per_token / 1e6:.1f} MFLOP per token; matmul peak {self.peak_flops / 1e9:.1f} "
                 f"GFLOP/s over the {world_size} rank(s)", flush=True)

    def micro_batches(self, split: str, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's slice of `count` micro-batches of one global batch: all of them drawn from
        one generator seeded by `seed`, laid out (micro-step, dp rank, sequence), so the tokens each global
        micro-step holds don't depend on the layout."""
        generator = torch.Generator().manual_seed(seed)
        starts = self.corpus.starts(split, count * self.layout.dp * self.batch, self.args.context, generator)
        mine = starts.view(count, self.layout.dp, self.batch)[:, self.dp_rank]
        return [self.corpus.windows(split, row, self.args.context) for row in mine]

    def train(self) -> dict[str, list[float]]:
        """Run the training; returns, on every rank, the logged steps, their training losses (means over the
        global batch) and gradient norms before clipping, the validation losses, and this rank's predicted and
        measured peak memory."""
        args = self.args
        history = self.history
        first_step = self.resume() if args.resume else 0
        window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
        last = min(args.steps, args.stop_after or args.steps)
        for step in range(first_step, last):
            loss, grad_norm, lr = self.timed_step(step, measure_memory=step == min(first_step + 1, last - 1))
            window_loss += loss
            window_steps += 1
            if (step + 1) % args.log_every == 0 or step + 1 == last:
                mean_loss = self.model.mean_over_data_parallel(window_loss / window_steps)
                tokens_per_s = self.tokens_per_step * window_steps / (time.perf_counter() - window_start)
                history["train"].append(mean_loss)
                history["grad_norm"].append(grad_norm)
                history["step"].append(step + 1)
                rss = self.peak_rss()
                self.say(self.progress_line(step + 1, mean_loss, grad_norm, lr, tokens_per_s, rss), flush=True)
                self.record(step=step + 1, loss=mean_loss, grad_norm=grad_norm, lr=lr, tokens_per_s=tokens_per_s,
                            flops_fraction=self.flops_fraction(tokens_per_s), peak_rss_bytes=rss)
                window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
            if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == last:
                val = self.validation_loss()
                history["val"].append(val)
                self.say(f"  validation loss {val:.3f} (perplexity {math.exp(val):.1f} per byte)", flush=True)
                self.record(step=step + 1, val=val)
                window_start = time.perf_counter()   # don't count evaluation in tokens/s
            if self.checkpointer is not None and self.checkpointer.due(step + 1, last):
                self.checkpointer.save(step + 1)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.summary()
        self.sample()
        return history

    def timed_step(self, step: int, measure_memory: bool) -> tuple[float, float, float]:
        """One optimizer step (the data, forward and backward, clipping, the update), timed, with the time
        blocked on communication apart; the second step of a run (the first with the optimizer's state) measures
        the peak tensor memory instead (its time, slowed by the tracking, is left out). Returns this rank's loss,
        the gradient norm and the learning rate."""
        args = self.args
        memory = (MeasuredMemory(self.model.parameters(), self.optimizer, self.corpus.splits.values())
                  if measure_memory and not args.compile else contextlib.nullcontext())
        started = time.perf_counter()
        with ExposedCommunication() as exposed, memory:
            lr = learning_rate(step, args)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batches = self.micro_batches("train", args.seed * 1_000_003 + step, args.grad_accum)
            loss = self.model.train_step(batches)
            grad_norm = self.model.clip_grad_norm_(args.clip) if args.clip > 0 else math.nan
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if isinstance(memory, MeasuredMemory):
            self.measured_memory = memory
            self.history["memory"] = [float(self.predicted_memory.total), float(memory.peak)]
        else:
            self.times.add(time.perf_counter() - started, exposed.seconds)
        return loss, grad_norm, lr

    def flops_fraction(self, tokens_per_s: float) -> float:
        """The model FLOP/s achieved at `tokens_per_s`, as a fraction of the machine's measured matmul peak."""
        return tokens_per_s * self.flops_per_token / self.peak_flops

    @staticmethod
    def peak_rss() -> int:
        """The largest peak resident set size over the ranks' processes, in bytes (collective)."""
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
        spmd.all_reduce(peak, op=spmd.ReduceOp.MAX)
        return int(peak.item())

    def summary(self) -> None:
        """Rank 0's account of the run: memory predicted against measured, and where the steps' time went."""
        lines = ["--- summary ---", f"memory, predicted: {self.predicted_memory.describe()}"]
        if self.measured_memory is not None:
            lines.append(f"memory, measured (peak live tensors, rank {self.rank}, second step): "
                         f"{self.measured_memory.describe()}; "
                         f"{self.measured_memory.peak / max(1, self.predicted_memory.total):.2f}x the prediction")
        lines.append(f"peak RSS {self.peak_rss() / MiB:.0f} MiB per process")
        times = self.times
        if times.steps:
            tokens_per_s = self.tokens_per_step * times.steps / times.seconds
            lines.append(f"time (rank {self.rank}, {times.steps} timed steps, {times.seconds:.1f} s): compute "
                         f"{times.seconds - times.exposed:.1f} s ({1 - times.exposed / times.seconds:.0%}), exposed "
                         f"communication {times.exposed:.1f} s ({times.exposed / times.seconds:.0%}); "
                         f"{tokens_per_s:,.0f} tok/s, {self.flops_fraction(tokens_per_s):.1%} of the matmul peak")
        self.say("\n".join(lines), flush=True)

    def record(self, **metrics: float) -> None:
        """Rank 0 appends `metrics` as one JSON line to --metrics-file (a restarted run appends after the
        lines of the attempt before it)."""
        if self.args.metrics_file and self.rank == 0:
            with open(self.args.metrics_file, "a") as out:
                out.write(json.dumps(metrics) + "\n")

    def resume(self) -> int:
        """Restore the newest complete checkpoint; the steps it had done (0 when there is none)."""
        assert self.checkpointer is not None
        restored = self.checkpointer.resume()
        if restored is None:
            self.say(f"no checkpoint in {self.args.checkpoint_dir} yet: starting afresh", flush=True)
            return 0
        self.say(f"resumed from {self.args.checkpoint_dir} at step {restored['step']} (saved under "
                 f"{restored['layout']})", flush=True)
        if restored["global_batch"] != self.global_batch:
            self.say(f"note: the checkpoint was saved with a global batch of {restored['global_batch']} sequences, "
                     f"this run has {self.global_batch}: it continues the schedule, but not as the saved run "
                     f"would have (pass --global-batch {restored['global_batch']} for that)", flush=True)
        return restored["step"]

    def validation_loss(self) -> float:
        """Mean loss over --eval-batches global validation batches (the same ones at every evaluation and under
        every layout), each data-parallel rank running its slice of each through the parallel model."""
        total = 0.0
        for index in range(self.args.eval_batches):   # a step's worth of sequences per rank: a pipeline splits it
            batches = self.micro_batches("val", 10_000 + index, self.args.grad_accum)
            tokens, targets = torch.cat([t for t, _ in batches]), torch.cat([t for _, t in batches])
            total += self.model.eval_loss(tokens, targets)
        return self.model.mean_over_data_parallel(total / self.args.eval_batches)

    def sample(self) -> None:
        """Rank 0 prints --sample-tokens generated from --prompt by the whole model (gathered from all ranks)."""
        if not self.args.sample_tokens:
            return
        full = self.model.full_model()
        if full is not None:
            prompt = encode(self.args.prompt).unsqueeze(0)
            sample = full.generate(prompt, self.args.sample_tokens,
                                   generator=torch.Generator().manual_seed(self.args.seed))
            self.say("--- sample ---\n" + decode(sample[0]) + "\n--------------", flush=True)

    def progress_line(self, step: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float,
                      rss: int) -> str:
        done = round(20 * step / self.args.steps)
        return (f"[{'#' * done}{'.' * (20 - done)}] step {step:>5}/{self.args.steps}  loss {loss:6.3f}  "
                f"grad norm {grad_norm:5.2f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s  "
                f"{self.flops_fraction(tokens_per_s):.1%} of peak  RSS {rss / MiB:,.0f} MiB")


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    configure_threads(args.threads)
    owns_world = not spmd.is_initialized()
    init_distributed(args)
    try:
        return Trainer(args).train()
    finally:
        if owns_world:
            spmd.destroy_process_group()


if __name__ == "__main__":
    main()
