"""spmd.nn.SyncBatchNorm: a layer trained on every rank's slice of a batch gives what torch's BatchNorm gives on
the whole batch in one process: outputs, input gradients, the sum of the ranks' weight and bias gradients, and the
running statistics, with uneven and empty slices, any input rank, momentum or a cumulative average, half precision
and channels-last inputs, subgroups; convert_sync_batchnorm under DDP trains as one process; eval, one rank, no
world: plain batch norm."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd.nn import SyncBatchNorm
from spmd.testing import run_ranks

TIMEOUT = 60
CHANNELS = 3


def _batch(rows: int, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, CHANNELS, *shape, generator=generator) * 3 + 5     # a mean far from 0


def _slices(sizes: list[int]) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(start, start + size) for start, size in zip(starts, sizes)]


def _layer(cls: type, dims: int, **kwargs: object) -> nn.Module:
    """The same layer on every rank (its own generator: rank threads share torch's default one)."""
    layer = cls(CHANNELS, **kwargs) if cls is SyncBatchNorm else \
        {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](CHANNELS, **kwargs)
    if layer.weight is not None:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5, generator=generator)
            layer.bias.uniform_(-1, 1, generator=generator)
    return layer


def _run_one_process(layer: nn.Module, batches: list[Tensor], sizes: list[int]) -> list[dict[str, Tensor]]:
    """Per step: every rank's slice of the output and input gradient, and the layer's gradients and buffers, the
    loss summing each rank's slice weighted by that rank's weights."""
    steps = []
    for step, batch in enumerate(batches):
        x = batch.clone().requires_grad_()
        out = layer(x)
        loss = sum((out[s] * _weights(out[s], rank, step)).sum() for rank, s in enumerate(_slices(sizes)))
        loss.backward()
        steps.append({"out": out.detach(), "grad": x.grad, **_state(layer)})
        layer.zero_grad()
    return steps


def _weights(out: Tensor, rank: int, step: int) -> Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(100 * step + rank))


def _state(layer: nn.Module) -> dict[str, Tensor]:
    found = {f"{name}.grad": p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    found.update({name: b.clone() for name, b in layer.named_buffers()})
    return found


def _close(got: Tensor, want: Tensor, what: str, tolerance: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=what)


@pytest.mark.parametrize("dims", [0, 1, 2, 3], ids=["(N,C)", "(N,C,L)", "(N,C,H,W)", "(N,C,D,H,W)"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_ranks_slices_train_as_the_whole_batch_in_one_process(dims: int, momentum: float | None,
                                                              affine: bool) -> None:
    sizes = [3, 1, 4]
    shape = (4, 5, 3, 2)[:dims] if dims != 3 else (2, 3, 2)
    batches = [_batch(sum(sizes), shape, seed) for seed in range(2)]
    want = _run_one_process(_layer(nn.BatchNorm1d, dims, momentum=momentum, affine=affine), batches, sizes)

    def body(rank: int, size: int) -> list[dict[str, Tensor]]:
        layer = _layer(SyncBatchNorm, dims, momentum=momentum, affine=affine)
        mine = _slices(sizes)[rank]
        steps = []
        for step, batch in enumerate(batches):
            x = batch[mine].clone().requires_grad_()
            out = layer(x)
            (out * _weights(out, rank, step)).sum().backward()
            grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
            for grad in grads.values():
                spmd.all_reduce(grad)          # the ranks' local gradients sum to the whole batch's
            steps.append({"out": out.detach(), "grad": x.grad,
                          **{f"{k}.grad": v for k, v in grads.items()},
                          **{name: b.clone() for name, b in layer.named_buffers()}})
            layer.zero_grad()
        return steps

    for rank, steps in enumerate(run_ranks(body, len(sizes), timeout=TIMEOUT)):
        mine = _slices(sizes)[rank]
        for step, (got, expected) in enumerate(zip(steps, want)):
            _close(got["out"], expected["out"][mine], f"rank {rank} step {step} output")
            _close(got["grad"], expected["grad"][mine], f"rank {rank} step {step} input gradient")
            assert got.keys() == expected.keys()
            for key in got.keys() - {"out", "grad"}:
                _close(got[key].double(), expected[key].double(), f"rank {rank} step {step} {key}")


def test_a_rank_with_an_empty_batch_counts_for_nothing() -> None:
    sizes = [4, 0, 2]
    batch = _batch(sum(sizes), (5,))
    want = _run_one_process(_layer(nn.BatchNorm1d, 1), [batch], sizes)[0]

    def body(rank: int, size: int) -> dict[str, Tensor]:
        layer = _layer(SyncBatchNorm, 1)
        x = batch[_slices(sizes)[rank]].clone().requires_grad_()
        out = layer(x)
        (out * _weights(out, rank, 0)).sum().backward()
        return {"out": out.detach(), "grad": x.grad, "running_mean": layer.running_mean,
                "running_var": layer.running_var}

    for rank, got in enumerate(run_ranks(body, 3, timeout=TIMEOUT)):
        mine = _slices(sizes)[rank]
        _close(got["out"], want["out"][mine], f"rank {rank} output")
        _close(got["grad"], want["grad"][mine], f"rank {rank} input gradient")
        _close(got["running_mean"], want["running_mean"], "running mean")
        _close(got["running_var"], want["running_var"], "running var")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_keep_float32_statistics(dtype: torch.dtype) -> None:
    sizes = [4, 4]
    batch = _batch(8, (6,)).to(dtype)
    want = _run_one_process(_layer(nn.BatchNorm1d, 1), [batch.float()], sizes)[0]

    def body(rank: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        layer = _layer(SyncBatchNorm, 1)
        x = batch[_slices(sizes)[rank]].clone().requires_grad_()
        out = layer(x)
        (out.float() * _weights(out, rank, 0)).sum().backward()
        return out.detach(), x.grad, layer.running_var

    for rank, (out, grad, running_var) in enumerate(run_ranks(body, 2, timeout=TIMEOUT)):
        mine = _slices(sizes)[rank]
        assert out.dtype == grad.dtype == dtype and running_var.dtype == torch.float32
        _close(out.float(), want["out"][mine], "output", tolerance=3e-2)
        _close(grad.float(), want["grad"][mine], "input gradient", tolerance=3e-2)
        _close(running_var, want["running_var"], "running var", tolerance=1e-3)


def test_channels_last_inputs_give_the_contiguous_numbers() -> None:
    batch = _batch(6, (4, 5))

    def body(rank: int, size: int) -> tuple[Tensor, Tensor, bool]:
        results = []
        for memory_format in (torch.contiguous_format, torch.channels_last):
            layer = _layer(SyncBatchNorm, 2)
            x = batch[3 * rank:3 * rank + 3].contiguous(memory_format=memory_format).requires_grad_()
            out = layer(x)
            (out * _weights(out, rank, 0)).sum().backward()
            results.append((out.detach(), x.grad))
        (out, grad), (out_last, grad_last) = results
        return out - out_last, grad - grad_last, out_last.is_contiguous(memory_format=torch.channels_last)

    for out_gap, grad_gap, kept_format in run_ranks(body, 2, timeout=TIMEOUT):
        assert out_gap.abs().max() < 1e-5 and grad_gap.abs().max() < 1e-5
        assert kept_format


def test_statistics_stay_inside_each_subgroup() -> None:
    sizes = [2, 3, 4, 1]
    batch = _batch(sum(sizes), (5,))
    halves = [batch[:5], batch[5:]]
    want = [_run_one_process(_layer(nn.BatchNorm1d, 1), [half], pair)[0] for half, pair in zip(halves, [sizes[:2],
                                                                                                        sizes[2:]])]

    def body(rank: int, size: int) -> Tensor:
        groups = [spmd.new_group([0, 1]), spmd.new_group([2, 3])]
        layer = _layer(SyncBatchNorm, 1, process_group=groups[rank // 2])
        out = layer(batch[_slices(sizes)[rank]])
        return out.detach()

    for rank, out in enumerate(run_ranks(body, 4, timeout=TIMEOUT)):
        _close(out, want[rank // 2]["out"][_slices(sizes[2 * (rank // 2):2 * (rank // 2) + 2])[rank % 2]],
               f"rank {rank}")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, CHANNELS, 3, padding=1)
        self.norm = nn.BatchNorm2d(CHANNELS)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(CHANNELS * 16, 8), nn.BatchNorm1d(8, momentum=None),
                                  nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.conv(x)).relu())


def test_converted_model_under_ddp_trains_as_one_process() -> None:
    torch.manual_seed(0)
    reference = _Net()
    inputs = torch.randn(3, 8, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    targets = torch.randn(3, 8, 1, generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in zip(inputs, targets):
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(0)
    initial = _Net().state_dict()
    want = {**reference.state_dict()}

    def body(rank: int, size: int) -> tuple[dict[str, Tensor], list[str]]:
        net = _Net()
        net.load_state_dict(initial)
        net.norm.qconfig = "kept"
        converted = SyncBatchNorm.convert_sync_batchnorm(net)
        assert converted.norm.qconfig == "kept" and converted.norm.weight is net.norm.weight
        model = spmd.DistributedDataParallel(converted)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in zip(inputs, targets):
            nn.functional.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
        kinds = [type(m).__name__ for m in converted.modules() if "Norm" in type(m).__name__]
        return converted.state_dict(), kinds

    for state, kinds in run_ranks(body, 2, timeout=TIMEOUT):
        assert kinds == ["SyncBatchNorm", "SyncBatchNorm"]
        assert state.keys() == want.keys()
        for key, value in want.items():
            _close(state[key].double(), value.double(), key)


def test_eval_one_rank_and_no_world_are_plain_batch_norm() -> None:
    batch = _batch(6, (5,))
    plain = _layer(nn.BatchNorm1d, 1)
    want_train = plain(batch)
    plain.eval()
    want_eval = plain(batch)
    layer = _layer(SyncBatchNorm, 1)
    _close(layer(batch), want_train, "training without a world")      # no spmd world: nothing to synchronise
    layer.eval()
    _close(layer(batch), want_eval, "eval without a world")

    def body(rank: int, size: int) -> tuple[Tensor, Tensor]:
        alone = _layer(SyncBatchNorm, 1, process_group=spmd.new_group([rank]) if size > 1 else None)
        trained = alone(batch)
        alone.eval()
        return trained.detach(), alone(batch).detach()

    for world in (1, 2):
        for trained, evaluated in run_ranks(body, world, timeout=TIMEOUT):
            _close(trained, want_train, f"training on a one-rank group (world {world})")
            _close(evaluated, want_eval, f"eval (world {world})")


def test_bad_inputs_are_refused_naming_the_layer() -> None:
    layer = SyncBatchNorm(CHANNELS)
    with pytest.raises(ValueError, match=r"spmd.nn.SyncBatchNorm: expected at least 2D input \(got 1D input\)"):
        layer(torch.ones(CHANNELS))
    with pytest.raises(ValueError, match=r"spmd.nn.SyncBatchNorm: the input has no channels"):
        SyncBatchNorm(0)(torch.ones(4, 0))
