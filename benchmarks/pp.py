"""Pipeline-parallel throughput: spmd.pipelining vs torch's pipelining on gloo, same model, same run; and the bubble
of recorded steps against the validator's prediction.

    python benchmarks/pp.py [--steps 10] [--repeats 2] [--schedules GPipe:4,1F1B:8] [--render timeline.svg]
    python benchmarks/pp.py --layers 2 --width 64 --steps 2 --repeats 1 --bubble-steps 1 \\
        --blocks 1,1 --zb-blocks 1,1,0,0   # smoke check

The GPT of examples/gpt.py (default: 4 layers, width 256, 4 heads, context 128, vocabulary 4096: 5.3 M
parameters), AdamW, cut into 2 stages on 2 ranks x 1 torch thread, a global batch of 8 sequences of 128 tokens.
The stages are cut for balance, the same for both libraries (--blocks): rank 0 holds the embeddings and 3 blocks,
rank 1 the last block, the final norm and the head, which with the loss over 4096 classes is about 1.5 blocks of
work.
  - throughput: for each schedule (name:microbatches), spmd's pipeline on its default transport ("auto": shared
    memory on one host) and torch's on gloo, both in the same two rank processes, steps alternating (A, B, B, A,
    ...), each started after a barrier and timed as the slowest rank's (schedule step and optimizer step); medians
    over all steps of all launches, the ratio per launch. One process with one thread training the whole model on
    the same batch is the reference.
  - bubble: spmd's schedules step with record_timeline set; each recorded step's measured_report gives the
    measured bubble (idle time within the makespan, per rank: timeline.py), and validate_program, given the
    per-action costs that step measured (its computations per stage, and the Python time of issuing each send and
    posting each receive), predicts it for the same program. Beside the schedules timed, ZBV zero-bubble (the
    same blocks cut into 4 stages, V-shaped: rank 0 holds stages 0 and 3; --zb-blocks 1,2,1,0, the head on stage
    3) and 1F1B at the same microbatch count, so the zero-bubble schedule's bubble is seen beside 1F1B's.
  - with --render PATH (.svg, .png or .txt): the last recorded 1F1B step, drawn like a schedule.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, machine_line, run_saving_processes

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
LABELS = {"spmd": "spmd (shm)", "torch": "torch (gloo)"}
ZERO_BUBBLE = "ZBVZeroBubble"


def _gpt(args: argparse.Namespace) -> nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=args.vocab, context=args.context, layers=args.layers, width=args.width,
                         heads=args.heads))


class _Part(nn.Module):
    """Blocks `blocks` of `model`, with its embeddings on the first stage and its norm and head on the last."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed, self.position = (model.embed, model.position) if first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.ln, self.head = (model.ln, model.head) if last else (None, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


class _Pipeline:
    """One library's pipeline of one schedule on this rank: its stages, schedule and optimizer."""

    def __init__(self, library: str, schedule: str, n_microbatches: int, blocks: list[int], rank: int,
                 world_size: int, args: argparse.Namespace) -> None:
        num_stages = len(blocks)
        if library == "spmd":
            import spmd
            from spmd import pipelining

            self.comm: Any = spmd
            stage_cls, schedule_cls = pipelining.PipelineStage, pipelining.get_schedule_class(schedule)
            placement = pipelining.stage_to_rank(world_size, num_stages, "v" if schedule == ZERO_BUBBLE else "loop")
        else:
            import torch.distributed as dist
            from torch.distributed import pipelining as torch_pipelining

            self.comm = dist
            stage_cls = torch_pipelining.PipelineStage
            schedule_cls = torch_pipelining.schedules.get_schedule_class(schedule)
            placement = {stage: stage % world_size for stage in range(num_stages)}
        model = copy.deepcopy(_gpt(args))
        starts = [sum(blocks[:stage]) for stage in range(num_stages + 1)]
        mine = [stage for stage in range(num_stages) if placement[stage] == rank]
        parts = [_Part(model, range(starts[s], starts[s + 1]), s == 0, s == num_stages - 1) for s in mine]
        stages = [stage_cls(part, s, num_stages, torch.device("cpu")) for part, s in zip(parts, mine, strict=True)]
        self.schedule = schedule_cls(stages if len(stages) > 1 else stages[0], n_microbatches, loss_fn=_loss)
        self.opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-4)
        self.first, self.last = 0 in mine, num_stages - 1 in mine
        self.inputs, self.targets = _batch(args)

    def step(self) -> float:
        """One training step started in step with the other rank: wall seconds."""
        self.comm.barrier()
        start = time.perf_counter()
        self.schedule.step(*((self.inputs,) if self.first else ()),
                           **({"target": self.targets, "losses": []} if self.last else {}))
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start

    def recorded_bubbles(self, steps: int) -> tuple[list[tuple[float, ...]], Any]:
        """`steps` recorded steps: (measured, predicted) bubble fraction of each, every rank's busy seconds and
        the makespan; and the last measured report."""
        from spmd.pipelining import validate_program

        self.schedule.record_timeline = True
        bubbles, report = [], None
        for _ in range(steps):
            self.step()
            report = self.schedule.measured_report()
            predicted = validate_program(self.schedule.pipeline_order_with_comms, report.num_microbatches,
                                         report.num_stages, report.placement, costs=report.costs,
                                         stage_costs=report.stage_costs)
            bubbles.append((report.bubble_fraction, predicted.bubble_fraction,
                            *(report.busy[r] for r in sorted(report.busy)), report.makespan))
        self.schedule.record_timeline = False
        return bubbles, report


def _schedules(text: str) -> list[tuple[str, int]]:
    pairs = []
    for item in text.split(","):
        name, _, count = item.partition(":")
        pairs.append((name, int(count)))
    return pairs


def _worker(rank: int, world_size: int, args: argparse.Namespace, ports: tuple[int, int], out_file: str) -> None:
    """Both libraries' pipelines of every schedule in this process; steps interleaved (A, B, B, A, ...)."""
    import torch.distributed as dist

    import spmd

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)      # torch's pipelining's own notices
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]))
    spmd.init_process_group("auto", timeout=300, torch_default_group=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world_size)
    try:
        steps: dict[str, dict[str, list[float]]] = {}
        for schedule, n_microbatches in _schedules(args.schedules):
            pipelines = {library: _Pipeline(library, schedule, n_microbatches, args.blocks, rank, world_size, args)
                         for library in ("spmd", "torch")}
            for pipeline in pipelines.values():
                pipeline.step()                  # warm up: shapes, buffers, the optimizer state
                pipeline.step()
            order = list(pipelines)
            times: dict[str, list[float]] = {library: [] for library in order}
            for i in range(args.steps):
                for library in order if i % 2 == 0 else order[::-1]:
                    times[library].append(pipelines[library].step())
            steps[f"{schedule}:{n_microbatches}"] = times
        bubble_runs = [(name, count, tuple(args.blocks)) for name, count in _schedules(args.schedules)]
        bubble_runs += [("1F1B", args.zb_microbatches, tuple(args.blocks)),
                        (ZERO_BUBBLE, args.zb_microbatches, tuple(args.zb_blocks))]
        bubbles: dict[str, list[tuple[float, ...]]] = {}
        rendered = None
        for schedule, n_microbatches, blocks in dict.fromkeys(bubble_runs):
            pipeline = _Pipeline("spmd", schedule, n_microbatches, list(blocks), rank, world_size, args)
            pipeline.step()
            key = f"{schedule}:{n_microbatches} (blocks {'/'.join(map(str, blocks))})"
            bubbles[key], report = pipeline.recorded_bubbles(args.bubble_steps)
            if schedule == "1F1B":
                rendered = report
        text = ""
        if rank == 0 and rendered is not None:
            from spmd.pipelining import render, render_text

            text = render_text(rendered)
            if args.render:
                render(rendered, args.render)
        params = sum(p.numel() for p in _gpt(args).parameters())
        torch.save({"steps": steps, "bubbles": bubbles, "params": params, "timeline": text}, f"{out_file}.{rank}")
    finally:
        spmd.barrier()
        dist.barrier()          # gloo aborts a rank whose peer tears down while it still talks to it
        dist.destroy_process_group()
        spmd.destroy_process_group()


def _single(rank: int, args: argparse.Namespace, out_file: str) -> None:
    """The reference: one process, one thread, the whole model on the whole batch."""
    torch.set_num_threads(1)
    model = _gpt(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batch(args)
    times = []
    for i in range(args.steps + 2):
        start = time.perf_counter()
        _loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - start)
    torch.save({"steps": times}, f"{out_file}.{rank}")


def _slowest(per_rank: list[dict[str, Any]], key: str, library: str) -> list[float]:
    return [max(values) for values in zip(*(r["steps"][key][library] for r in per_rank), strict=True)]


def _report(args: argparse.Namespace, launches: list[list[dict[str, Any]]], single: list[float]) -> None:
    tokens = args.batch * args.context
    print(f"GPT {args.layers}x{args.width}, {args.heads} heads, context {args.context}, vocab {args.vocab}: "
          f"{launches[0][0]['params'] / 1e6:.1f} M parameters; AdamW; 2 stages on 2 ranks x 1 thread; batch "
          f"{args.batch} x {args.context}; {args.steps} timed steps x {args.repeats} launches; medians; "
          f"{machine_line()}")
    one = statistics.median(single)
    print(f"\n{'':30}{'step ms':>10}{'tokens/s':>10}{'x 1 proc':>10}")
    print(f"{'one process, 1 thread':30}{one * 1e3:>10.1f}{tokens / one:>10.0f}{1.0:>10.2f}")
    for key in launches[0][0]["steps"]:
        step = {lib: statistics.median(t for run in launches for t in _slowest(run, key, lib)) for lib in LABELS}
        for library, label in LABELS.items():
            print(f"{key + ' ' + label:30}{step[library] * 1e3:>10.1f}{tokens / step[library]:>10.0f}"
                  f"{one / step[library]:>10.2f}")
        ratios = [statistics.median(_slowest(run, key, "torch")) / statistics.median(_slowest(run, key, "spmd"))
                  for run in launches]
        print(f"{key}: spmd / torch tokens/s {step['torch'] / step['spmd']:.2f}x (launches: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print("\nspmd's bubble (idle share of ranks x makespan) in recorded steps: measured, and validate_program's "
          "prediction from the per-stage costs each step measured; medians over steps and launches")
    print("(busiest rank idle: the makespan less the busiest rank's work, over the makespan: what the schedule "
          "leaves idle beyond the stages' imbalance)")
    print(f"{'':34}{'measured':>10}{'predicted':>11}{'difference':>12}{'busy ms r0 / r1':>17}{'makespan':>10}"
          f"{'busiest idle':>14}")
    for key in launches[0][0]["bubbles"]:
        rows = [row for run in launches for row in run[0]["bubbles"][key]]
        measured, predicted = (statistics.median(row[k] for row in rows) for k in (0, 1))
        relative = statistics.median(abs(row[0] - row[1]) / row[1] for row in rows if row[1])
        busy = " / ".join(f"{statistics.median(row[k] for row in rows) * 1e3:.0f}" for k in range(2, len(rows[0]) - 1))
        makespan = statistics.median(row[-1] for row in rows)
        busiest = statistics.median(1 - max(row[2:-1]) / row[-1] for row in rows)
        print(f"{key:34}{measured:>10.1%}{predicted:>11.1%}{relative:>12.1%}{busy:>17}{makespan * 1e3:>10.0f}"
              f"{busiest:>14.1%}")
    print(f"\nThe last recorded 1F1B step (one launch's), as render_text draws it:\n{launches[-1][0]['timeline']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--schedules", default="GPipe:4,1F1B:8", help="name:microbatches, comma-separated")
    parser.add_argument("--zb-microbatches", type=int, default=8, help="microbatches of the 1F1B / ZBV comparison")
    parser.add_argument("--bubble-steps", type=int, default=3, help="recorded steps per schedule and launch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", default="3,1", help="blocks per stage of the 2-stage pipelines (the last stage "
                        "also holds the head, about 1.5 blocks of work)")
    parser.add_argument("--zb-blocks", default="1,2,1,0", help="blocks per stage of the 4-stage V-shaped one (rank 0 "
                        "holds stages 0 and 3)")
    parser.add_argument("--render", default=None, help="draw the last recorded 1F1B step to this .svg/.png/.txt")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    args.blocks, args.zb_blocks = ([int(n) for n in text.split(",")] for text in (args.blocks, args.zb_blocks))
    if len(args.blocks) != 2 or len(args.zb_blocks) != 4 or args.layers not in (sum(args.blocks), sum(args.zb_blocks)) \
            or sum(args.blocks) != sum(args.zb_blocks):
        parser.error(f"--blocks needs 2 and --zb-blocks 4 counts, each summing to --layers ({args.layers})")
    single = run_saving_processes(_single, 1, lambda rank, out: (rank, args, out), args.timeout, "one process")[0]
    launches = []
    for _ in range(args.repeats):
        ports = (free_port(), free_port())
        launches.append(run_saving_processes(_worker, 2, lambda rank, out, ports=ports: (rank, 2, args, ports, out),
                                             args.timeout, "pipelines"))
    _report(args, launches, single["steps"])


if __name__ == "__main__":
    main()
