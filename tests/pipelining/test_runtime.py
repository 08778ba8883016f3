"""Pipelined training matches one process: the example GPT split into 2 and 4 stages (and 4 and 8 with two
stages per rank) on thread ranks, for every schedule, three SGD steps with momentum. Losses at every step and
every parameter after the last step agree to 1e-5: the pipeline sums each parameter's gradient over the
microbatches (scaled by 1/n) where one process sums over the whole batch at once, a few ulps apart in fp32.

Also: eval(), keyword inputs and chunk specs, shapes inferred and checked against input_args, and the bad
inputs that must fail with a clear error instead of a hang."""

from __future__ import annotations

import copy
import functools
import pathlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from examples.gpt import GPT, GPTConfig
from torch import Tensor, nn

import spmd
from spmd.pipelining import (
    PipelineStage,
    PipeliningMetadataError,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleError,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    TensorChunkSpec,
    get_schedule_class,
    render_text,
    schedules,
    stage_to_rank,
)
from spmd.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)
from spmd.testing import run_ranks, seeded
from tests.nccl_p2p import register_nccl_p2p_transport

RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 60.0
STEPS = 3
VOCAB, CONTEXT = 32, 8


class GPTPart(nn.Module):
    """The blocks `first..last` of `model` (and its embeddings on stage 0, its head on the last stage), keeping
    the model's parameter names."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed, self.position = (model.embed, model.position) if first else (None, None)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.ln, self.head = (model.ln, model.head) if last else (None, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.position(torch.arange(x.shape[1]))       # (B, S, H)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


def gpt(layers: int) -> GPT:
    with seeded(0):
        return GPT(GPTConfig(vocab=VOCAB, context=CONTEXT, layers=layers, width=16, heads=2))


def batch(step: int, size: int = 8) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@functools.cache
def reference(layers: int) -> tuple[list[float], dict[str, Tensor]]:
    """One process training gpt(layers) on the same batches, on one intra-op thread as the ranks run (with more,
    tiny ops on a loaded machine spend their time waking threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_one_process(gpt(layers))
    finally:
        torch.set_num_threads(threads)


def _train_one_process(model: GPT) -> tuple[list[float], dict[str, Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def build_stages(model: GPT, rank: int, num_ranks: int, per_rank: int, style: str) -> tuple[list[PipelineStage],
                                                                                         nn.Module]:
    """This rank's stages of a private copy of `model`, one block per stage; returns them and the copy."""
    local = copy.deepcopy(model)
    num_stages = num_ranks * per_rank
    placement = stage_to_rank(num_ranks, num_stages, style)   # type: ignore[arg-type]
    stages = [PipelineStage(GPTPart(local, range(s, s + 1), s == 0, s == num_stages - 1), s, num_stages, "cpu")
              for s in range(num_stages) if placement[s] == rank]
    return stages, local


BuildStages = Callable[[GPT, int, int, int, str], tuple[list[PipelineStage], nn.Module]]
SCHEDULES = [(ScheduleGPipe, 1, "loop"), (Schedule1F1B, 1, "loop"), (ScheduleInterleaved1F1B, 2, "loop"),
             (ScheduleLoopedBFS, 2, "loop"), (ScheduleInterleavedZeroBubble, 2, "loop"),
             (ScheduleZBVZeroBubble, 2, "v"), (ScheduleDualPipeV, 2, "v")]


def train_pipelined(cls: type[_PipelineSchedule], ranks: int, per_rank: int, style: str, model: GPT,
                    n_microbatches: int, backend: str = "threads",
                    build: BuildStages = build_stages) -> list[tuple[list[float], dict[str, Tensor]]]:
    def body(rank: int, world_size: int) -> tuple[list[float], dict[str, Tensor]]:
        stages, local = build(model, rank, world_size, per_rank, style)
        arg = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
        schedule = cls(arg, n_microbatches, loss_fn=loss_fn)   # type: ignore[arg-type]
        params = [p for stage in stages for p in stage.submod.parameters()]
        opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        has_first, has_last = stages[0].stage_index == 0 or any(s.is_first for s in stages), \
            any(s.is_last for s in stages)
        step_losses = []
        for step in range(STEPS):
            tokens, targets = batch(step)
            losses: list[Tensor] = []
            schedule.step(*((tokens,) if has_first else ()), target=targets if has_last else None, losses=losses)
            opt.step()
            opt.zero_grad()
            if has_last:
                assert len(losses) == n_microbatches
                step_losses.append(torch.stack(losses).mean().item())
        names = {id(p): k for k, p in local.named_parameters()}
        return step_losses, {names[id(p)]: p.detach().clone() for p in params}
    return run_ranks(body, world_size=ranks, timeout=TIMEOUT, backend=backend)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("cls, per_rank, style", SCHEDULES, ids=[c[0].__name__ for c in SCHEDULES])
def test_training_matches_one_process(cls: type[_PipelineSchedule], per_rank: int, style: str, ranks: int) -> None:
    model = gpt(layers=ranks * per_rank)
    want_losses, want_params = reference(ranks * per_rank)
    results = train_pipelined(cls, ranks, per_rank, style, model, n_microbatches=2 * ranks)
    losses = [r[0] for r in results if r[0]]
    assert len(losses) == 1   # the rank with the last stage
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    got = {name: value for _, params in results for name, value in params.items()}
    assert sorted(got) == sorted(want_params)   # every parameter lives on exactly one rank, under its name
    for name, value in got.items():
        torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("cls, per_rank, style", SCHEDULES, ids=[c[0].__name__ for c in SCHEDULES])
def test_training_matches_one_process_under_nccls_point_to_point_semantics(
        cls: type[_PipelineSchedule], per_rank: int, style: str, ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL ignores tags, pairs messages by their order and runs a rank's operations with a peer one after another
    (tests/nccl_p2p.py): a schedule whose two ranks of a pair issue their messages in different orders hangs the
    GPUs or pairs the wrong tensors (before the lowering placed receives at their senders' turn, all but GPipe and
    1F1B hung on 2 ranks, and interleaved 1F1B trained on the wrong activations on 4)."""
    register_nccl_p2p_transport(monkeypatch)
    want_losses, want_params = reference(ranks * per_rank)
    results = train_pipelined(cls, ranks, per_rank, style, gpt(layers=ranks * per_rank), 2 * ranks,
                              backend="nccl-p2p-threads")
    torch.testing.assert_close(torch.tensor(next(r[0] for r in results if r[0])), torch.tensor(want_losses),
                               rtol=RTOL, atol=ATOL)
    for name, value in {name: value for _, params in results for name, value in params.items()}.items():
        torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_a_program_whose_ranks_order_their_messages_apart_is_refused_over_nccl(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program with its communication, loaded from CSV, that runs where messages match by tag but would hang on
    NCCL: refused before anything is sent, naming the two ranks."""
    register_nccl_p2p_transport(monkeypatch)
    (tmp_path / "crossed.csv").write_text("0F0,0SEND_F0,0RECV_B0,0F1,0SEND_F1,0RECV_B1,0B0,0B1\n"
                                          "1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n")

    def body(rank: int, world_size: int) -> str:
        schedule = ScheduleGPipe(PipelineStage(Scaled(), rank, 2, "cpu"), 2, loss_fn=lambda y, t: (y * t).sum())
        with pytest.raises(ScheduleError) as refused:
            schedule.load_csv(tmp_path / "crossed.csv", format="compute_comms")
        return str(refused.value)

    assert all("ranks 0 and 1 differ at their message 1" in message
               for message in run_ranks(body, world_size=2, timeout=TIMEOUT, backend="nccl-p2p-threads"))


def test_eval_under_nccls_point_to_point_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward-only step sends its metadata again (a mode of its own): received in the sender's order too."""
    register_nccl_p2p_transport(monkeypatch)
    model = gpt(layers=4)
    tokens, _ = batch(0)
    with torch.no_grad():
        want = model(tokens)

    def body(rank: int, world_size: int) -> Tensor | None:
        stages, _ = build_stages(model, rank, world_size, 2, "loop")
        return ScheduleInterleaved1F1B(stages, 4, loss_fn=loss_fn).eval(*((tokens,) if rank == 0 else ()))

    torch.testing.assert_close(run_ranks(body, world_size=2, timeout=TIMEOUT, backend="nccl-p2p-threads")[1], want,
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_training_matches_one_process_over_real_transports(backend: str) -> None:
    """Activations and gradients as bytes through shared memory and sockets (thread ranks on a real transport)."""
    want_losses, want_params = reference(4)
    results = train_pipelined(ScheduleInterleaved1F1B, 2, 2, "loop", gpt(4), 4, backend)
    torch.testing.assert_close(torch.tensor(results[1][0]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    for name, value in {**results[0][1], **results[1][1]}.items():
        torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_a_stage_per_rank_with_uneven_parts_and_one_microbatch() -> None:
    model = gpt(layers=3)    # stage 0: embeddings and block 0; stage 1: blocks 1 and 2 and the head
    want_losses, _ = reference(3)

    def body(rank: int, world_size: int) -> list[float]:
        local = copy.deepcopy(model)
        blocks = range(0, 1) if rank == 0 else range(1, 3)
        stage = PipelineStage(GPTPart(local, blocks, rank == 0, rank == 1), rank, 2, "cpu")
        schedule = ScheduleGPipe(stage, 1, loss_fn=loss_fn)
        opt = torch.optim.SGD(local.parameters(), lr=0.5, momentum=0.9)
        out = []
        for step in range(STEPS):
            tokens, targets = batch(step)
            losses: list[Tensor] = []
            schedule.step(*((tokens,) if rank == 0 else ()), target=targets if rank == 1 else None, losses=losses)
            opt.step()
            opt.zero_grad()
            out += [loss.item() for loss in losses]
        return out

    assert run_ranks(body, world_size=2, timeout=TIMEOUT)[1] == pytest.approx(want_losses, rel=RTOL)


def test_eval_returns_the_models_outputs_and_losses() -> None:
    model = gpt(layers=4)
    tokens, targets = batch(0)
    with torch.no_grad():
        want = model(tokens)

    def body(rank: int, world_size: int) -> tuple[Tensor | None, list[Tensor]]:
        stages, _ = build_stages(model, rank, world_size, 2, "loop")
        schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=loss_fn)
        losses: list[Tensor] = []
        out = schedule.eval(*((tokens,) if rank == 0 else ()), target=targets if rank == 1 else None, losses=losses)
        assert all(p.grad is None for s in stages for p in s.submod.parameters())
        return out, losses

    results = run_ranks(body, world_size=2, timeout=TIMEOUT)
    assert results[0][0] is None
    torch.testing.assert_close(results[1][0], want, rtol=RTOL, atol=ATOL)
    want_losses = [loss_fn(want[i:i + 2], targets[i:i + 2]) for i in range(0, 8, 2)]
    torch.testing.assert_close(torch.stack(results[1][1]), torch.stack(want_losses), rtol=RTOL, atol=ATOL)


class Scaled(nn.Module):
    """y = x * scale + bias: keyword inputs reach every stage; `bias` splits along dim 1 (a custom chunk spec)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor, scale: float = 1.0, bias: Tensor | None = None) -> Tensor:
        y = x * self.weight * scale
        return y if bias is None else y + bias.t()


def test_keyword_inputs_and_chunk_specs_reach_every_stage() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    bias = torch.arange(12.0).reshape(3, 4)      # (features, batch): split along dim 1

    def body(rank: int, world_size: int) -> Tensor | None:
        stage = PipelineStage(Scaled(), rank, 2, "cpu")
        schedule = ScheduleGPipe(stage, 2, kwargs_chunk_spec={"scale": None, "bias": TensorChunkSpec(1)})
        return schedule.step(*((x,) if rank == 0 else ()), scale=2.0, bias=bias)

    out = run_ranks(body, world_size=2, timeout=TIMEOUT)[1]
    torch.testing.assert_close(out, (x * 2 + bias.t()) * 2 + bias.t())


def test_input_args_are_checked_against_what_the_previous_stage_sends() -> None:
    def body(rank: int, world_size: int) -> None:
        example = torch.empty(2, 5)     # the real activation is (2, 3)
        stage = PipelineStage(Scaled(), rank, 2, "cpu", input_args=example if rank == 1 else None)
        ScheduleGPipe(stage, 2).step(*((torch.ones(4, 3),) if rank == 0 else ()))

    with pytest.raises(PipeliningMetadataError, match=r"stage 1 \(rank 1\) was built with input_args \[0\] "
                                                      r"\(2, 5\) float32, but stage 0 \(rank 0\) sends \[0\] "
                                                      r"\(2, 3\) float32"):
        run_ranks(body, world_size=2, timeout=TIMEOUT)


def test_input_args_that_match_are_accepted() -> None:
    def body(rank: int, world_size: int) -> Tensor | None:
        stage = PipelineStage(Scaled(), rank, 2, "cpu", input_args=torch.empty(2, 3), output_args=torch.empty(2, 3))
        return ScheduleGPipe(stage, 2).step(*((torch.ones(4, 3),) if rank == 0 else ()))

    torch.testing.assert_close(run_ranks(body, world_size=2, timeout=TIMEOUT)[1], torch.ones(4, 3))


def test_a_later_shape_change_names_both_stages() -> None:
    def body(rank: int, world_size: int) -> None:
        schedule = ScheduleGPipe(PipelineStage(Scaled(), rank, 2, "cpu"), 2)
        for size in (4, 2):
            schedule.step(*((torch.ones(size, 3),) if rank == 0 else ()))

    with pytest.raises(PipeliningMetadataError, match=r"stage 0 \(rank 0\) produced \[0\] \(1, 3\) float32, "
                                                      r"requires_grad for microbatch 0, but stage 1 \(rank 1\) was "
                                                      r"set up at the first step for \[0\] \(2, 3\) float32"):
        run_ranks(body, world_size=2, timeout=TIMEOUT)


def test_a_batch_that_does_not_divide_into_the_microbatches_is_refused() -> None:
    def body(rank: int, world_size: int) -> None:
        schedule = ScheduleGPipe(PipelineStage(Scaled(), rank, 2, "cpu"), 4, loss_fn=F.mse_loss)
        schedule.step(*((torch.ones(6, 3),) if rank == 0 else ()), target=torch.ones(6, 3) if rank == 1 else None)

    with pytest.raises(ValueError, match=r"dim 0 of size 6 doesn't divide into 4 microbatches"):
        run_ranks(body, world_size=2, timeout=TIMEOUT)


@pytest.mark.parametrize("make, error, says", [
    (lambda: PipelineStage(Scaled(), 2, 2, "cpu"), ValueError, "stage_index 2 is out of range for 2 stages"),
    (lambda: PipelineStage(Scaled(), 0, 1, "cpu"), ValueError, "the pipeline group has 2 ranks but the model only 1"),
    (lambda: ScheduleGPipe(PipelineStage(Scaled(), 0, 4, "cpu"), 4), ValueError,
     "runs one stage per rank, but the model has 4 stages on 2 ranks"),
    (lambda: ScheduleDualPipeV([PipelineStage(Scaled(), s, 4, "cpu") for s in (0, 3)], 3), ScheduleError,
     "DualPipeV needs at least as many microbatches as stages: got 3 microbatches for 4 stages"),
    (lambda: ScheduleInterleaved1F1B([PipelineStage(Scaled(), s, 4, "cpu") for s in (0, 3)], 4), ValueError,
     "places stages [0, 2] on rank 0, but this rank built stages [0, 3]"),
    (lambda: Schedule1F1B(PipelineStage(Scaled(), 0, 2, "cpu"), 1), ScheduleError,
     "1F1B needs at least as many microbatches as stages"),
])
def test_bad_set_ups_fail_before_any_communication(make: object, error: type[Exception], says: str) -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 0:
            with pytest.raises(error) as caught:
                make()   # type: ignore[operator]
            assert says in str(caught.value)

    run_ranks(body, world_size=2, timeout=TIMEOUT)


def test_a_program_loaded_from_csv_runs_and_a_broken_one_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mine.csv").write_text("0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n")
    (tmp_path / "broken.csv").write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")   # rank 0 wants B0 before F1
    x = torch.arange(12.0).reshape(4, 3)

    def body(rank: int, world_size: int) -> Tensor | None:
        schedule = ScheduleGPipe(PipelineStage(Scaled(), rank, 2, "cpu"), 2, loss_fn=lambda y, t: (y * t).sum())
        with pytest.raises(ScheduleError, match=r"(?s)would hang.*rank 0 is blocked at action \d+ \(0B0\)"):
            schedule.load_csv(tmp_path / "broken.csv")
        schedule.load_csv(tmp_path / "mine.csv")
        drawn = render_text(schedule).splitlines()[1].split("  idle")[0].split()[2:]
        assert [cell for cell in drawn if cell[0].isdigit()] == ["0F0", "0F1", "0B1", "0B0"]   # what it runs
        assert " ".join(map(str, schedule.pipeline_order_with_comms[1])) == \
            "1RECV_F0 1UNSHARD 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD"
        schedule.step(*((x,) if rank == 0 else ()), target=torch.ones(4, 3) if rank == 1 else None)
        return schedule._stages[0].submod.weight.grad

    grads = run_ranks(body, world_size=2, timeout=TIMEOUT)
    # y = x * w0 * w1 (elementwise), loss = mean over 2 microbatches of sum(y): d/dw0 = sum_b x * w1 / 2
    torch.testing.assert_close(grads[0], x.sum(0) / 2)
    torch.testing.assert_close(grads[1], x.sum(0) / 2)


def test_torchs_runtime_schedule_runs_the_program_it_loads(tmp_path: pathlib.Path) -> None:
    """TorchTitan's pipeline_parallel_schedule_csv: _PipelineScheduleRuntime (or PipelineScheduleMulti) built
    without a program, then _load_csv; the same program as a named schedule's gives the same gradients."""
    x = torch.arange(24.0).reshape(8, 3)

    def body(rank: int, world_size: int) -> list[Tensor]:
        def stages() -> list[PipelineStage]:
            return [PipelineStage(Scaled(), s, 4, "cpu") for s in (rank, rank + 2)]

        def run(schedule: PipelineScheduleMulti) -> list[Tensor]:
            schedule.step(*((x,) if rank == 0 else ()), target=torch.ones(8, 3) if rank == 1 else None)
            return [stage.submod.weight.grad for stage in schedule._stages]

        named = ScheduleInterleaved1F1B(stages(), 4, loss_fn=lambda y, t: (y * t).sum())
        if rank == 0:
            named.dump_csv(tmp_path / "interleaved.csv", format="compute_only")
        expected = run(named)
        spmd.barrier()
        grads = []
        for cls in (_PipelineScheduleRuntime, PipelineScheduleMulti):
            schedule = cls(stages(), n_microbatches=4, loss_fn=lambda y, t: (y * t).sum(), scale_grads=True)
            with pytest.raises(RuntimeError, match=r"step\(\): this schedule has no program yet; load one with "
                                                   r"_load_csv\(path\)"):
                schedule.step(x)
            schedule._load_csv(str(tmp_path / "interleaved.csv"))
            assert schedule.pipeline_order == named.pipeline_order
            grads.append(run(schedule))
        assert all(torch.equal(a, b) for got in grads for a, b in zip(got, expected, strict=True))
        return expected

    run_ranks(body, world_size=2, timeout=TIMEOUT)


def test_torchs_module_level_names_for_actions() -> None:
    """TorchTitan's DualPipeV module imports torch's spellings: _Action with its field names, the computation
    types, and _wait_batch_p2p."""
    action = schedules._Action.from_str("(0F4;3B1)OVERLAP_F_B")
    assert action.computation_type is schedules.OVERLAP_F_B and action.sub_actions[1].is_compute_op
    forward, backward = action.sub_actions
    assert (forward.stage_index, forward.computation_type, forward.microbatch_index) == (0, schedules.F, 4)
    assert backward.computation_type is schedules.FULL_BACKWARD is schedules._ComputationType.FULL_BACKWARD
    assert issubclass(ScheduleZBVZeroBubble, schedules._PipelineScheduleRuntime)
    assert not issubclass(ScheduleGPipe, schedules._PipelineScheduleRuntime)

    def body(rank: int, world_size: int) -> Tensor:
        buffer = torch.full((2,), float(rank))
        works = [spmd.isend(buffer, 1 - rank), spmd.irecv(received := torch.empty(2), 1 - rank)]
        schedules._wait_batch_p2p(works)
        return received

    assert [r.tolist() for r in run_ranks(body, world_size=2, timeout=TIMEOUT)] == [[1.0, 1.0], [0.0, 0.0]]


def test_schedule_classes_are_found_by_torchs_names() -> None:
    assert get_schedule_class("1f1b") is Schedule1F1B
    assert get_schedule_class("ZBVZeroBubble") is ScheduleZBVZeroBubble
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        get_schedule_class("nope")
