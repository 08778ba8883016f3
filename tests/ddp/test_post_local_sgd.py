"""Post-local SGD: DDP with the post_localSGD_hook and a PostLocalSGDOptimizer over a model averager trains as
the same replicas simulated in one process (gradients averaged globally, then within subgroups or not at all;
parameters averaged on the averager's schedule), and as torch's own post-local SGD (real processes, torch's
DDP, hook and averager over the "spmd" backend). Hierarchical averaging, new_subgroups and bad arguments too."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from spmd.algorithms.model_averaging.averagers import PeriodicModelAverager
from spmd.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from spmd.algorithms.model_averaging.utils import average_parameters, get_params_to_average
from spmd.device_mesh import init_device_mesh
from spmd.optim import PostLocalSGDOptimizer
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks
from tests.parity.models import build
from tests.parity.test_ddp import count_collectives
from tests.procpool import ProcPool

STEPS = 7
BATCH_PER_RANK = 3
START_LOCAL = 2     # steps of global gradient averaging
PERIOD, WARMUP = 3, 2


def _model() -> nn.Module:
    return build("mlp", seed=0, dims=(7, 11, 3))


def _batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH_PER_RANK, 7, generator=generator), torch.randn(BATCH_PER_RANK, 3, generator=generator)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _mean_into(tensors: list[Tensor]) -> None:
    mean = torch.stack(tensors).mean(0)
    for t in tensors:
        t.copy_(mean)


def _simulated(world: int, local_groups: list[list[int]] | None) -> list[list[Tensor]]:
    """`world` replicas in one process: gradients averaged over all replicas for START_LOCAL steps, then within
    `local_groups` (None: not at all); parameters averaged over all every PERIOD steps from WARMUP on."""
    replicas = [_model() for _ in range(world)]
    opts = [_sgd(r.parameters()) for r in replicas]
    for step in range(STEPS):
        for rank, replica in enumerate(replicas):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(replica(x), y).backward()
        groups = [list(range(world))] if step < START_LOCAL else (local_groups or [])
        for members in groups:
            for params in zip(*(list(replicas[r].parameters()) for r in members), strict=True):
                _mean_into([p.grad for p in params])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step >= WARMUP and (step - WARMUP) % PERIOD == 0:
            with torch.no_grad():
                for params in zip(*(list(r.parameters()) for r in replicas), strict=True):
                    _mean_into(list(params))
    return [[p.detach().clone() for p in r.parameters()] for r in replicas]


def _post_local_training(rank: int, size: int, subgroup, gradient_allreduce: bool) -> dict:
    model = spmd.DistributedDataParallel(_model())
    state = PostLocalSGDState(None, subgroup, start_localSGD_iter=START_LOCAL,
                              post_local_gradient_allreduce=gradient_allreduce)
    model.register_comm_hook(state, post_localSGD_hook)
    opt = PostLocalSGDOptimizer(_sgd(model.parameters()), PeriodicModelAverager(PERIOD, warmup_steps=WARMUP))
    world_counts = count_collectives(model.process_group)
    per_step = []
    for step in range(STEPS):
        before = sum(world_counts.values())
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(sum(world_counts.values()) - before)
    return {"params": [p.detach().clone() for p in model.parameters()], "world_collectives": per_step,
            "state": opt.state_dict()}


@pytest.mark.parametrize("gradient_allreduce", [True, False], ids=["subgroup-allreduce", "no-allreduce"])
def test_post_local_sgd_trains_as_the_simulated_replicas(gradient_allreduce: bool) -> None:
    pairs = [[0, 1], [2, 3]]

    def body(rank: int, size: int) -> dict:
        mine, _ = spmd.new_subgroups_by_enumeration(pairs)
        return _post_local_training(rank, size, mine, gradient_allreduce)

    results = run_ranks(body, 4, timeout=60)
    want = _simulated(4, pairs if gradient_allreduce else None)
    for rank, result in enumerate(results):
        for got, expected in zip(result["params"], want[rank], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # world collectives per step: the gradient all-reduce while global, then only the parameter averaging
        averaged = [int(s >= WARMUP and (s - WARMUP) % PERIOD == 0) for s in range(STEPS)]
        assert result["world_collectives"] == [1 if s < START_LOCAL else averaged[s] for s in range(STEPS)]
        assert result["state"]["step"] == STEPS
    assert not torch.equal(results[0]["params"][0], results[2]["params"][0])   # the replicas did train apart


def _torch_post_local(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState as TorchState,
    )
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        post_localSGD_hook as torch_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchAverager
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchOptimizer

    spmd.init_process_group("tcp", timeout=60)       # torch's default group runs over the "spmd" backend
    try:
        ours = _post_local_training(rank, world_size, spmd.new_subgroups(1)[0], True)
        torch_subgroup, _ = dist.new_subgroups(group_size=1)
        model = torch.nn.parallel.DistributedDataParallel(_model())
        model.register_comm_hook(TorchState(None, torch_subgroup, START_LOCAL), torch_hook)
        opt = TorchOptimizer(_sgd(model.parameters()), TorchAverager(PERIOD, warmup_steps=WARMUP))
        for step in range(STEPS):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return {"ours": ours["params"], "torch": [p.detach().clone() for p in model.parameters()]}
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_post_local_sgd_matches_torchs(procpool: ProcPool) -> None:
    results = procpool.run(_torch_post_local, 2, timeout=90)
    for result in results:
        for got, want in zip(result["ours"], result["torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0]["torch"][0], results[1]["torch"][0])


def test_hierarchical_averaging_picks_the_group_of_the_largest_dividing_period() -> None:
    def body(rank: int, size: int) -> list[list[float]]:
        averager = HierarchicalModelAverager({2: 2, 4: 4}, warmup_steps=1)
        param = nn.Parameter(torch.zeros(1))
        param.grad = torch.zeros(1)
        seen = []
        for step in range(6):
            with torch.no_grad():
                param.add_(float(rank * 10 ** step))
            averager.average_parameters([param])
            seen.append(param.item())
        return seen

    results = run_ranks(body, 4, timeout=60)
    # step 0: warm-up; 1, 3, 5: no period divides; 2: pairs; 4: everyone
    values = [[float(r) for r in range(4)]]
    for step in range(1, 6):
        now = [v + r * 10 ** step for r, v in enumerate(values[-1])]
        if step == 2:
            now = [sum(now[:2]) / 2] * 2 + [sum(now[2:]) / 2] * 2
        elif step == 4:
            now = [sum(now) / 4] * 4
        values.append(now)
    for rank, seen in enumerate(results):
        assert seen == pytest.approx([v[rank] for v in values])


def test_average_parameters_skips_parameters_without_gradients_and_keeps_storage() -> None:
    def body(rank: int, size: int) -> tuple[float, float, bool]:
        trained, frozen = nn.Parameter(torch.full((2,), float(rank))), nn.Parameter(torch.full((2,), float(rank)))
        trained.grad = torch.zeros(2)
        storage = trained.data_ptr()
        average_parameters(iter(get_params_to_average([{"params": [trained, frozen]}])), None)
        return trained[0].item(), frozen[0].item(), trained.data_ptr() == storage

    assert run_ranks(body, 2, timeout=60) == [(0.5, 0.0, True), (0.5, 1.0, True)]


def test_averaging_tensor_parallel_parameters_averages_each_shard_over_its_replicas() -> None:
    """DDP x TP's parameters under post-local SGD: a DTensor sharded over "tp" is averaged over "dp", shard by
    shard, in place; its layout is unchanged."""
    def body(rank: int, size: int) -> tuple[list[float], tuple, bool]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        whole = torch.arange(4.0) + 10 * dp_rank             # the replicas on the two dp ranks differ
        param = nn.Parameter(distribute_tensor(whole, mesh["tp"], [Shard(0)]))
        storage = param._local_tensor.data_ptr()
        average_parameters(iter([param]), mesh.get_group("dp"))
        return param.full_tensor().tolist(), param.placements, param._local_tensor.data_ptr() == storage

    for values, placements, same_storage in run_ranks(body, 4, timeout=60):
        assert values == [5.0, 6.0, 7.0, 8.0] and placements == (Shard(0),) and same_storage


def test_new_subgroups_splits_a_group_and_defaults_to_the_hosts_ranks() -> None:
    def body(rank: int, size: int) -> tuple[list[int], list[int] | None, list[list[int]]]:
        host, _ = spmd.new_subgroups()                              # thread ranks share one host
        evens = spmd.new_group([0, 2])
        mine, halves = spmd.new_subgroups(1, group=evens)
        with pytest.raises(ValueError, match=r"group_size 3 must divide the group's size 4"):
            spmd.new_subgroups(3)
        return host.ranks, (mine.ranks if mine is not None else None), [g.ranks for g in halves]

    results = run_ranks(body, 4, timeout=60)
    assert [r[0] for r in results] == [[0, 1, 2, 3]] * 4
    assert [r[1] for r in results] == [[0], None, [2], None]
    assert all(r[2] == [[0], [2]] for r in results)


def test_bad_arguments_are_refused() -> None:
    def body(rank: int, size: int) -> None:
        with pytest.raises(ValueError, match="period must be >= 1"):
            PeriodicModelAverager(0)
        # pytest.warns on one rank thread only: its filters are process-wide, and two threads' would race
        with pytest.warns(UserWarning, match="use DDP alone") if rank == 0 else contextlib.nullcontext():
            PeriodicModelAverager(1)
        with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
            PeriodicModelAverager(2, warmup_steps=-1)
        with pytest.raises(ValueError, match=r"last group size \(1\) must be the size of process_group \(2\)"):
            HierarchicalModelAverager({2: 1})
        with pytest.raises(ValueError, match="must not be empty"):
            HierarchicalModelAverager({})
        with pytest.raises(TypeError, match="averager must be a model averager"):
            PostLocalSGDOptimizer(_sgd(_model().parameters()), object())
        with pytest.raises(ValueError, match="start_localSGD_iter must be >= 0"):
            PostLocalSGDState(None, spmd.group.WORLD, -1)
        opt = PostLocalSGDOptimizer(_sgd(_model().parameters()), PeriodicModelAverager(2))
        state = copy.deepcopy(opt.state_dict())
        del state["step"]
        with pytest.warns(UserWarning, match="no averager step count"):
            opt.load_state_dict(state)

    run_ranks(body, 2, timeout=60)


def test_noop_hook_leaves_each_ranks_own_gradient_and_sends_nothing() -> None:
    from spmd.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    def body(rank: int, size: int) -> bool:
        model = spmd.DistributedDataParallel(_model())
        model.register_comm_hook(None, noop_hook)
        counts = count_collectives(model.process_group)
        x, y = _batch(0, rank)
        nn.functional.mse_loss(model(x), y).backward()
        alone = _model()
        nn.functional.mse_loss(alone(x), y).backward()
        assert not counts
        return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), alone.parameters(), strict=True))

    assert run_ranks(body, 2, timeout=60) == [True, True]
