"""ZeroRedundancyOptimizer trains as the plain optimizer does in one process, keeping 1/N of its state per rank.

DDP with ZeRO over 2 and 3 thread ranks (Adam and SGD with momentum, a learning-rate scheduler, parameters as
bucket views or not) matches one process's training to fp32 round-off; the partition and the consolidated
state dict are torch's own ZeroRedundancyOptimizer's (in real processes, torch's over the "spmd" backend); a
consolidated state reloads into a world of another size and training goes on as it would have; with
overlap_with_ddp=True, stepped inside DDP's backward by the ddp_zero_hook hooks (after the last bucket or bucket by
bucket), it trains as one process from the first step; bad arguments fail naming the rank.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from spmd.algorithms.join import Join
from spmd.ddp import allreduce_hook
from spmd.optim import ZeroRedundancyOptimizer, zero_redundancy_optimizer
from spmd.testing import run_ranks
from tests.parity.models import build
from tests.procpool import ProcPool

STEPS = 3
GLOBAL_BATCH = 12


def _model() -> nn.Module:
    return build("mlp", seed=0, dims=(7, 15, 13, 3))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 7, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 0.01}), "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def _one_process(name: str, steps: int = STEPS) -> tuple[dict[str, Tensor], dict]:
    model = _model()
    cls, defaults = OPTIMIZERS[name]
    opt = cls(model.parameters(), **defaults)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        _loss(model, *_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, opt.state_dict()


def _shard(x: Tensor, rank: int, size: int) -> Tensor:
    return x.chunk(size)[rank]


def _train(model: nn.Module, opt: torch.optim.Optimizer, scheduler: object, steps: range, rank: int,
           size: int) -> None:
    """The global batch of each step in `steps`, this rank's shard of it, one optimizer and scheduler step."""
    for step in steps:
        x, y = _batch(step)
        _loss(model, _shard(x, rank, size), _shard(y, rank, size)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copies", "bucket-view"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_with_zero_trains_as_one_process(ranks: int, name: str, bucket_view: bool) -> None:
    want_params, want_state = _one_process(name)

    def body(rank: int, size: int) -> tuple[dict[str, Tensor], dict | None, int, int]:
        model = spmd.DistributedDataParallel(_model())
        cls, defaults = OPTIMIZERS[name]
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, parameters_as_bucket_view=bucket_view,
                                      **defaults)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(model, opt, scheduler, range(STEPS), rank, size)
        opt.consolidate_state_dict(to=0)
        kept = sum(v.numel() for state in opt.optim.state.values() for v in state.values() if v.dim() > 0)
        owned = sum(p.numel() for group in opt.optim.param_groups for p in group["params"])
        return ({k: v.detach().clone() for k, v in model.module.named_parameters()},
                opt.state_dict() if rank == 0 else None, kept, owned)

    results = run_ranks(body, ranks, timeout=60)
    for params, _, _, _ in results:
        for key, value in want_params.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
    state = results[0][1]
    assert state["param_groups"] == want_state["param_groups"]
    assert state["state"].keys() == want_state["state"].keys()
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=(index, key))
    total = sum(p.numel() for p in _model().parameters())
    assert sum(owned for *_, owned in results) == total          # every parameter has exactly one owner
    per_element = 2 if name == "adam" else 1                    # exp_avg and exp_avg_sq, or the momentum buffer
    assert [kept for *_, kept, _ in results] == [per_element * owned for *_, owned in results]
    assert max(owned for *_, owned in results) < total * 0.75


def test_a_consolidated_state_reloads_into_another_world_size_and_training_goes_on() -> None:
    want_params, _ = _one_process("adam", steps=4)

    def first(rank: int, size: int) -> tuple[dict, dict | None]:
        model = spmd.DistributedDataParallel(_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(model, opt, scheduler, range(2), rank, size)
        opt.consolidate_state_dict(to=1)
        if rank != 1:
            with pytest.raises(RuntimeError, match=r"state_dict on rank 0: the state has not been consolidated on "
                                                   r"this rank; call consolidate_state_dict\(to=0\)"):
                opt.state_dict()
        return model.module.state_dict(), (opt.state_dict(), scheduler.state_dict()) if rank == 1 else None

    saved_model, saved = run_ranks(first, 2, timeout=60)[1]

    def second(rank: int, size: int) -> dict[str, Tensor]:
        inner = _model()
        inner.load_state_dict(saved_model)
        model = spmd.DistributedDataParallel(inner)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        opt.load_state_dict(copy.deepcopy(saved[0]))
        scheduler.load_state_dict(saved[1])
        _train(model, opt, scheduler, range(2, 4), rank, size)
        return {k: v.detach().clone() for k, v in model.module.named_parameters()}

    for params in run_ranks(second, 3, timeout=60):
        for key, value in want_params.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_more_ranks_than_parameters_and_a_param_group_added_later() -> None:
    def layers() -> tuple[nn.Linear, nn.Linear]:
        first, second = nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            first.weight.copy_(torch.tensor([[0.5, -0.25], [0.75, 0.125]]))
            second.weight.copy_(torch.tensor([[-0.5, 1.5]]))
        return first, second

    def body(rank: int, size: int) -> list[float]:
        first, second = layers()
        opt = ZeroRedundancyOptimizer(first.parameters(), optimizer_class=torch.optim.SGD, lr=0.5)
        opt.add_param_group({"params": second.parameters(), "lr": 0.25})
        second(first(torch.ones(1, 2))).sum().backward()
        opt.step()
        return first.weight.flatten().tolist() + second.weight.flatten().tolist()

    first, second = layers()
    plain = torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.25}], lr=0.5)
    second(first(torch.ones(1, 2))).sum().backward()
    plain.step()
    want = first.weight.flatten().tolist() + second.weight.flatten().tolist()
    for got in run_ranks(body, 4, timeout=60):
        assert got == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize("shard_buckets", [False, True], ids=["bucket-per-rank", "sharded-buckets"])
@pytest.mark.parametrize("hook", [hook_with_zero_step, hook_with_zero_step_interleaved], ids=["after", "interleaved"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_stepped_in_ddps_backward_trains_as_one_process(name: str, hook: object, shard_buckets: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """overlap_with_ddp: the step runs in backward from the first iteration; zero.step() warns and does nothing.
    The warnings are recorded per rank by a stand-in for the module's `warnings`: pytest.warns on rank threads
    races (each one's exit restores the process's filters under the other, whose warning is then swallowed as
    already shown)."""
    want_params, want_state = _one_process(name)
    warned: list[tuple[int, str]] = []
    monkeypatch.setattr(zero_redundancy_optimizer, "warnings", types.SimpleNamespace(
        warn=lambda message, *args, **kwargs: warned.append((spmd.get_rank(), str(message)))))

    def body(rank: int, size: int) -> tuple[dict[str, Tensor], dict | None, list[bool], int]:
        model = spmd.DistributedDataParallel(_model(), bucket_cap_mb=100 / 2**20)    # a bucket per parameter
        cls, defaults = OPTIMIZERS[name]
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, overlap_with_ddp=True, **defaults)
        model.register_comm_hook(None, hook(allreduce_hook, model, opt, shard_buckets=shard_buckets))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        moved_in_backward = []
        for step in range(STEPS):
            before = [p.detach().clone() for p in model.parameters()]
            x, y = _batch(step)
            _loss(model, _shard(x, rank, size), _shard(y, rank, size)).backward()
            moved_in_backward.append(all(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
            opt.step()
            opt.zero_grad()
            scheduler.step()
        opt.consolidate_state_dict(to=0)
        owned = sum(p.numel() for group in opt.optim.param_groups for p in group["params"])
        return ({k: v.detach().clone() for k, v in model.module.named_parameters()},
                opt.state_dict() if rank == 0 else None, moved_in_backward, owned)

    results = run_ranks(body, 2, timeout=60)
    assert sorted(rank for rank, _ in warned) == [0] * STEPS + [1] * STEPS
    assert all("step() does nothing, the step runs in DDP's backward" in message for _, message in warned)
    for params, _, moved, _ in results:
        assert moved == [True] * STEPS
        for key, value in want_params.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
    state = results[0][1]
    assert state["param_groups"] == want_state["param_groups"]
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=(index, key))
    assert sum(owned for *_, owned in results) == sum(p.numel() for p in _model().parameters())
    assert all(owned > 0 for *_, owned in results)


def _hook_into_a_copy(state: object, bucket: object) -> torch.futures.Future:
    """An all-reduce whose result is another tensor than the bucket's buffer (as compression hooks return)."""
    copy_ = bucket.buffer().div(bucket.div_factor())  # type: ignore[attr-defined]
    work = spmd.all_reduce(copy_, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")   # no step(), as torch says
@pytest.mark.parametrize("hook", [hook_with_zero_step, hook_with_zero_step_interleaved], ids=["after", "interleaved"])
def test_overlap_steps_on_the_hooks_result_when_it_is_another_tensor(hook: object) -> None:
    want_params, _ = _one_process("adam")

    def body(rank: int, size: int) -> dict[str, Tensor]:
        model = spmd.DistributedDataParallel(_model(), bucket_cap_mb=100 / 2**20)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True,
                                      lr=0.01)
        model.register_comm_hook(None, hook(_hook_into_a_copy, model, opt))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(STEPS):
            x, y = _batch(step)
            _loss(model, _shard(x, rank, size), _shard(y, rank, size)).backward()
            opt.zero_grad()
            scheduler.step()
        return {k: v.detach().clone() for k, v in model.module.named_parameters()}

    for params in run_ranks(body, 2, timeout=60):
        for key, value in want_params.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_overlap_under_join_gives_the_weights_of_a_step_after_backward() -> None:
    """Rank 1 runs out of batches first: its DDP shadow iterations run the hook, which steps and broadcasts."""
    def train(overlap: object) -> list[list[Tensor]]:
        def body(rank: int, size: int) -> list[Tensor]:
            model = spmd.DistributedDataParallel(_model(), bucket_cap_mb=100 / 2**20)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                          overlap_with_ddp=overlap is not None, lr=0.01)
            if overlap is not None:
                model.register_comm_hook(None, overlap(allreduce_hook, model, opt))
            with Join([model, opt]):
                for step in range(3 if rank == 0 else 1):
                    x, y = _batch(step)
                    _loss(model, _shard(x, rank, size), _shard(y, rank, size)).backward()
                    if overlap is None:
                        opt.step()
                    opt.zero_grad()
            return [p.detach().clone() for p in model.parameters()]
        return run_ranks(body, 2, timeout=60)

    want = train(None)
    for hook in (hook_with_zero_step, hook_with_zero_step_interleaved):
        got = train(hook)
        for want_rank, got_rank in zip(want, got, strict=True):
            torch.testing.assert_close(got_rank, want_rank, rtol=1e-5, atol=1e-6)


def test_overlap_refuses_a_plain_optimizer_other_parameters_and_a_later_param_group() -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(_model())
        plain = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        with pytest.raises(ValueError, match=rf"rank {rank}: a hook that steps inside DDP's backward needs the "
                                             r"optimizer built with overlap_with_ddp=True"):
            hook_with_zero_step(allreduce_hook, model, plain)
        extra = nn.Parameter(torch.ones(3))
        opt = ZeroRedundancyOptimizer([*model.parameters(), extra], optimizer_class=torch.optim.SGD,
                                      overlap_with_ddp=True, lr=0.1)
        with pytest.raises(ValueError, match=rf"on rank {rank}: overlap_with_ddp needs the DDP module's parameters "
                                             r"exactly: 1 of the optimizer's parameters are not in its gradient "
                                             r"buckets"):
            hook_with_zero_step(allreduce_hook, model, opt)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True,
                                      lr=0.1)
        hook_with_zero_step(allreduce_hook, model, opt)
        with pytest.raises(RuntimeError, match=r"add_param_group on rank \d: with overlap_with_ddp=True the "
                                               r"parameters are the DDP module's"):
            opt.add_param_group({"params": [extra]})
        with pytest.raises(RuntimeError, match=r"already stepped by another DDP hook"):
            hook_with_zero_step_interleaved(allreduce_hook, model, opt)

    run_ranks(body, 2, timeout=60)


BAD = [
    (lambda: ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                     lr=1).consolidate_state_dict(),
     RuntimeError, r"consolidate_state_dict on rank 0: with overlap_with_ddp=True the parameters' owners are known "
                   r"once the DDP hook is built"),
    (lambda: ZeroRedundancyOptimizer([], torch.optim.SGD, lr=1), ValueError, r"empty parameter list"),
    (lambda: ZeroRedundancyOptimizer(torch.ones(2), torch.optim.SGD, lr=1), TypeError, r"got a torch.FloatTensor"),
    (lambda: ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2).double())],
                                     torch.optim.SGD, lr=1),
     ValueError, r"dense and of one type, got \['torch.DoubleTensor', 'torch.FloatTensor'\]"),
    (lambda: ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=1).consolidate_state_dict(5),
     ValueError, r"consolidate_state_dict on rank 0: to=5 is not a rank of the group \(0..1\)"),
]


@pytest.mark.parametrize("make, error, says", BAD, ids=["overlap-before-hook", "empty", "tensor", "mixed-types", "to"])
def test_bad_arguments_are_refused(make: object, error: type[Exception], says: str) -> None:
    def body(rank: int, size: int) -> None:
        if rank == 0:
            with pytest.raises(error, match=says):
                make()  # type: ignore[operator]

    run_ranks(body, 2, timeout=60)


def _against_torchs(rank: int, world_size: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    spmd.init_process_group("tcp", timeout=60)       # torch's default group runs over the "spmd" backend
    try:
        ours_model, torchs_model = _model(), _model()
        torch.manual_seed(1)
        big = nn.Linear(15, 40)                        # uneven sizes: the greedy order matters
        ours_model.add_module("extra", copy.deepcopy(big))
        torchs_model.add_module("extra", copy.deepcopy(big))
        ours = ZeroRedundancyOptimizer(ours_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        torchs = TorchZero(torchs_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for model, opt in ((ours_model, ours), (torchs_model, torchs)):
            for step in range(2):
                _loss(model, *_batch(step)).backward()    # the same gradients on every rank: no DDP needed
                opt.step()
                opt.zero_grad()
            opt.consolidate_state_dict(to=0)
        index = {p: i for i, p in enumerate(ours_model.parameters())}
        torch_index = {p: i for i, p in enumerate(torchs_model.parameters())}
        return {"owners": sorted((index[p], r) for p, r in ours._owners.items()),
                "torch_owners": sorted((torch_index[p], r) for p, r in torchs._param_to_rank.items()),
                "state": ours.state_dict() if rank == 0 else None,
                "torch_state": torchs.state_dict() if rank == 0 else None}
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_partition_and_the_state_dict_are_torchs(procpool: ProcPool) -> None:
    results = procpool.run(_against_torchs, 2, timeout=90)
    for result in results:
        assert result["owners"] == result["torch_owners"]
    ours, torchs = results[0]["state"], results[0]["torch_state"]
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for index, entry in torchs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-6, atol=1e-7, msg=(index, key))
