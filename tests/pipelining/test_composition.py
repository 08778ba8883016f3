"""Pipeline parallelism composed with DDP, FSDP2 and tensor parallelism on 4 thread ranks as 2x2 meshes: the
example GPT in 2 stages (one block each), GPipe and 1F1B, three SGD steps with momentum, against one process on
the same global batch (losses and every parameter within 1e-5).

(pp, dp): data-parallel rank d trains on chunk d of the batch, split into the microbatches; its stage's module is
wrapped in DDP on the dp group, or its block and the stage module are fully sharded on mesh["dp"]. Gradients are
reduced once per step (counted: one all-reduce per DDP bucket, one reduce-scatter per FSDP group).
(pp, tp): both tp ranks of a stage run the same batch; each block is tensor parallel on mesh["tp"] (torch's plan:
q, k, v, up colwise, proj and down rowwise, plain tensors in and out), so what travels between stages is plain.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from spmd.comm.debug import Fingerprint
from spmd.comm.world import current_world
from spmd.ddp import DistributedDataParallel
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import fully_shard
from spmd.pipelining import (
    Action,
    ActionKind,
    PipelineStage,
    PipeliningMetadataError,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleZBVZeroBubble,
    read_csv,
    stage_to_rank,
    write_csv,
)
from spmd.pipelining.runtime import Runtime
from spmd.tensor import DTensor
from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import run_ranks
from tests.pipelining.test_runtime import ATOL, RTOL, STEPS, GPTPart, batch, gpt, loss_fn, reference

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

TIMEOUT = 60.0
N_MICROBATCHES = 2
_build_lock = threading.Lock()      # thread ranks share torch's global RNG

Wrap = Callable[[GPTPart, int, DeviceMesh], nn.Module]


def _ddp(part: GPTPart, pp: int, mesh: DeviceMesh) -> nn.Module:
    return DistributedDataParallel(part, process_group=mesh.get_group("dp"))


def _fsdp(part: GPTPart, pp: int, mesh: DeviceMesh) -> nn.Module:
    for block in part.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(part, mesh=mesh["dp"])


def _tp(part: GPTPart, pp: int, mesh: DeviceMesh) -> nn.Module:
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in part.blocks.values():
        parallelize_module(block, mesh["tp"], plan)
    return part


@contextlib.contextmanager
def counting_collectives() -> Iterator[collections.Counter[str]]:
    """The collectives this rank issues meanwhile, by kind ("all_reduce", "reduce_scatter", ...). (Not
    CommDebugMode: its module tracker's backward hooks can't run inside the I's autograd.grad.)"""
    counts: collections.Counter[str] = collections.Counter()

    def observe(_group: object, fingerprint: Fingerprint) -> None:
        counts[fingerprint.op] += 1

    observers = current_world().observers
    observers.add(observe)
    try:
        yield counts
    finally:
        observers.remove(observe)


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def train(cls: type, wrap: Wrap, other: str, per_rank: int = 1, style: str = "loop",
          edit: Callable[[Any, int], None] | None = None,
          ) -> list[tuple[list[float], dict[str, Tensor], list[dict[str, int]]]]:
    """Each rank's step losses (the last stage's mean over its microbatches), its parameters after the last step
    (full values, by the model's names) and the collectives of each step. `edit(schedule, rank)` runs before
    the first step."""
    num_stages = 2 * per_rank
    model = gpt(layers=num_stages)
    placement = stage_to_rank(2, num_stages, style)   # type: ignore[arg-type]

    def body(rank: int, world_size: int) -> tuple[list[float], dict[str, Tensor], list[dict[str, int]]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", other))
        pp = mesh.get_local_rank("pp")
        with _build_lock:
            local = copy.deepcopy(model)
        parts = {s: GPTPart(local, range(s, s + 1), s == 0, s == num_stages - 1) for s in range(num_stages)
                 if placement[s] == pp}
        stages = [PipelineStage(wrap(part, pp, mesh), s, num_stages, "cpu", group=mesh.get_group("pp"))
                  for s, part in parts.items()]
        owned = {id(p) for part in parts.values() for p in part.parameters()}
        schedule = cls(stages[0] if per_rank == 1 else stages, N_MICROBATCHES * per_rank, loss_fn=loss_fn)
        if edit is not None:
            edit(schedule, rank)
        opt = torch.optim.SGD([p for stage in stages for p in stage.submod.parameters()], lr=0.5, momentum=0.9)
        chunk = mesh.get_local_rank("dp") if other == "dp" else None
        has_first, has_last = 0 in parts, num_stages - 1 in parts
        step_losses, comms = [], []
        for step in range(STEPS):
            tokens, targets = batch(step)
            if chunk is not None:
                tokens, targets = tokens.chunk(2)[chunk], targets.chunk(2)[chunk]
            losses: list[Tensor] = []
            with counting_collectives() as counts:
                schedule.step(*((tokens,) if has_first else ()), target=targets if has_last else None,
                              losses=losses)
            comms.append(dict(counts))
            opt.step()
            opt.zero_grad()
            if has_last:
                step_losses.append(torch.stack(losses).mean().item())
        params = {name: _full(p).detach().clone() for name, p in local.named_parameters() if id(p) in owned}
        return step_losses, params, comms

    return run_ranks(body, world_size=4, timeout=TIMEOUT)


def _assert_matches_one_process(results: list, data_parallel: bool, layers: int = 2) -> None:
    want_losses, want_params = reference(layers)
    last = [losses for losses, _, _ in results if losses]        # the two ranks of the last stage's pp rank
    got_losses = torch.tensor(last).mean(0) if data_parallel else torch.tensor(last[0])
    torch.testing.assert_close(got_losses, torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    if not data_parallel:
        torch.testing.assert_close(torch.tensor(last[1]), torch.tensor(last[0]), rtol=RTOL, atol=ATOL)
    for first, second in (results[0:2], results[2:4]):            # the two dp (or tp) ranks of each stage
        assert sorted(first[1]) == sorted(second[1])
    assert sorted({**results[0][1], **results[2][1]}) == sorted(want_params)   # each parameter on one stage
    for rank, (_, params, _) in enumerate(results):
        for name, value in params.items():
            torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {name}")


SCHEDULES = [ScheduleGPipe, Schedule1F1B]


@pytest.mark.parametrize("cls", SCHEDULES, ids=[c.__name__ for c in SCHEDULES])
def test_pipeline_over_ddp_matches_one_process(cls: type) -> None:
    results = train(cls, _ddp, "dp")
    _assert_matches_one_process(results, data_parallel=True)
    for _, _, comms in results:
        assert [step["all_reduce"] for step in comms] == [1] * STEPS    # the stage's one bucket, once per step


@pytest.mark.parametrize("cls", SCHEDULES, ids=[c.__name__ for c in SCHEDULES])
def test_pipeline_over_fsdp_matches_one_process(cls: type) -> None:
    results = train(cls, _fsdp, "dp")
    _assert_matches_one_process(results, data_parallel=True)
    for _, _, comms in results:
        assert [step["reduce_scatter"] for step in comms] == [2] * STEPS   # the block's group, the stage's


@pytest.mark.parametrize("cls", SCHEDULES, ids=[c.__name__ for c in SCHEDULES])
def test_pipeline_over_tensor_parallel_matches_one_process(cls: type) -> None:
    results = train(cls, _tp, "tp")
    _assert_matches_one_process(results, data_parallel=False)
    for _, _, comms in results:
        assert all(step["all_reduce"] > 0 for step in comms)             # the blocks are tensor parallel


def test_a_stage_that_outputs_a_dtensor_is_refused() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pp = mesh.get_local_rank("pp")
        linear = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel(use_local_output=False))
        stage = PipelineStage(linear, pp, 2, "cpu", group=mesh.get_group("pp"))
        ScheduleGPipe(stage, 2).step(*((torch.ones(4, 4),) if pp == 0 else ()))

    with pytest.raises(PipeliningMetadataError, match=r"stage 0 returned a DTensor.*plain tensors"):
        run_ranks(body, world_size=4, timeout=TIMEOUT)


@pytest.mark.parametrize("wrap, reductions", [(_ddp, "all_reduce"), (_fsdp, "reduce_scatter")],
                         ids=["DDP", "FSDP"])
def test_zero_bubble_over_data_parallel_matches_one_process(wrap: Wrap, reductions: str) -> None:
    """ZB-V, two stages per rank: a DDP stage reduces in its last W, an FSDP stage after it (data_parallel.py,
    Note: data-parallel stages)."""
    results = train(ScheduleZBVZeroBubble, wrap, "dp", per_rank=2, style="v")
    _assert_matches_one_process(results, data_parallel=True, layers=4)
    # pp rank 0 holds stages 0 and 3, pp rank 1 stages 1 and 2: one DDP bucket per stage; one FSDP group per block
    # and one per stage module holding parameters of its own (embeddings on stage 0, norm and head on stage 3)
    want = [2, 2] if wrap is _ddp else [4, 2]
    for rank, (_, _, comms) in enumerate(results):
        assert [step[reductions] for step in comms] == [want[rank // 2]] * STEPS   # once per step


class _CountingMatmuls(TorchDispatchMode):
    """Counts the matrix products run meanwhile on this thread (the mode stack is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


def test_zero_bubble_splits_an_fsdp_stage_backward_between_i_and_w(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each I of an FSDP stage computes only the input half and its W the weight half: W runs matrix products,
    and every rank's I and W together run as many as one process's backwards of the same microbatches."""
    products: collections.Counter[ActionKind] = collections.Counter()
    lock = threading.Lock()
    backward_action = Runtime._backward_action

    def counted(self: Runtime, stage: PipelineStage, kind: ActionKind, mb: int, data_parallel: object) -> None:
        with _CountingMatmuls() as counter:
            backward_action(self, stage, kind, mb, data_parallel)
        with lock:
            products[kind] += counter.count

    monkeypatch.setattr(Runtime, "_backward_action", counted)
    results = train(ScheduleZBVZeroBubble, _fsdp, "dp", per_rank=2, style="v")
    _assert_matches_one_process(results, data_parallel=True, layers=4)

    model, (tokens, targets) = gpt(layers=4), batch(0)
    microbatch = 8 // 2 // (N_MICROBATCHES * 2)                # the batch, by dp chunk, by microbatch
    loss = loss_fn(model(tokens[:microbatch]), targets[:microbatch])
    with _CountingMatmuls() as one_backward:
        loss.backward()
    inputs, weights = products[ActionKind.BACKWARD_INPUT], products[ActionKind.BACKWARD_WEIGHT]
    assert inputs > 0 and weights > 0, products
    runs = STEPS * 2 * N_MICROBATCHES * 2                      # steps x dp ranks x microbatches per dp rank
    assert inputs + weights + products[ActionKind.FULL_BACKWARD] == runs * one_backward.count, products


def test_an_fsdp_stage_resharded_between_its_i_and_w_gathers_again_for_the_w(tmp_path: Path) -> None:
    """A program (here ZB-V's, edited through CSV as a user would) that frees a stage's parameters after each I:
    the W gathers them again, since the graph it runs saved the gathered parameters."""
    def reshard_after_each_input_half(schedule: Any, rank: int) -> None:
        path = tmp_path / f"rank{rank}.csv"
        schedule.dump_csv(path)
        program = read_csv(path)
        edited = {r: [step for action in actions for step in
                      ([action, Action(action.stage, ActionKind.RESHARD)]
                       if action is not None and action.kind is ActionKind.BACKWARD_INPUT else [action])]
                  for r, actions in program.items()}
        write_csv(edited, path)
        schedule.load_csv(path, format="compute_comms")

    results = train(ScheduleZBVZeroBubble, _fsdp, "dp", per_rank=2, style="v", edit=reshard_after_each_input_half)
    _assert_matches_one_process(results, data_parallel=True, layers=4)
