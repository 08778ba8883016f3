"""spmd._tools.RuntimeEstimator on the CPU (torch's own needs CUDA for both modes, so it is no oracle here): the
roofline is max(FLOPs / peak, bytes / bandwidth) of each op with the measured peaks, the benchmark times ops for
real on tensors shaped as the fake ones, times go to the running modules forward and backward in their orders,
views, allocations, metadata queries and DTensor's meta-shape work are free, and a tensor-parallel rank's
estimate is its local compute (a quarter of the whole on 4 ranks of a simulated world)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd
from spmd._tools import RuntimeEstimator
from spmd._tools.runtime_estimator import _peaks
from spmd.device_mesh import init_device_mesh
from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BENCHMARK, COST_MODEL = "operator-level-benchmark", "operator-level-cost-model"


def _mlp(width: int = 256, hidden: int = 1024) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 16))


def _estimate(mode: str, build, batch: int = 128, width: int = 256, step: bool = True) -> RuntimeEstimator:
    estimator = RuntimeEstimator()
    with FakeTensorMode():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch, width)
        with estimator(mode):
            model(x).sum().backward()
            if step:
                optimizer.step()
    return estimator


def test_the_roofline_of_a_matmul_is_its_flops_or_its_bytes_over_the_measured_peaks() -> None:
    m, k, n = 256, 512, 128
    estimator = RuntimeEstimator()
    with FakeTensorMode():
        a, b = torch.randn(m, k), torch.randn(k, n)
        with estimator(COST_MODEL):
            out = torch.mm(a, b)
    assert out.shape == (m, n)
    peaks = _peaks(torch.device("cpu"))
    seconds = max(2 * m * k * n / peaks.flops(torch.float32), 4 * (m * k + k * n + m * n) / peaks.bandwidth)
    assert estimator.total_runtime == pytest.approx(seconds * 1e3)


@pytest.mark.parametrize("mode", [BENCHMARK, COST_MODEL])
def test_times_go_to_the_running_modules_forward_and_backward_in_their_order(mode: str) -> None:
    estimator = _estimate(mode, _mlp)
    assert estimator.mod_fw_pre_order == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    assert estimator.mod_fw_post_order == ["Sequential.0", "Sequential.1", "Sequential.2", "Sequential"]
    assert estimator.mod_bw_pre_order[0] == "Sequential.2" and estimator.mod_bw_post_order[-1] == "Sequential"
    runtimes = estimator.mod_runtimes
    for name in ("Sequential.0", "Sequential.2"):
        assert runtimes[name]["fw"] > 0 and runtimes[name]["bw"] > 0, (name, dict(runtimes[name]))
    for direction in ("fw", "bw"):
        children = sum(runtimes[f"Sequential.{i}"][direction] for i in range(3))
        assert runtimes["Sequential"][direction] == pytest.approx(children)
    # the optimizer step runs outside every module: the total holds it beside the model's forward and backward
    assert estimator.total_runtime > runtimes["Sequential"]["fw"] + runtimes["Sequential"]["bw"]


def test_the_benchmark_times_real_work_so_a_larger_layer_costs_more() -> None:
    small = _estimate(BENCHMARK, lambda: _mlp(16, 16), batch=8, width=16, step=False)
    large = _estimate(BENCHMARK, lambda: _mlp(1024, 4096), batch=512, width=1024, step=False)
    assert large.total_runtime > 20 * small.total_runtime > 0


def test_views_allocations_and_metadata_queries_are_free() -> None:
    estimator = RuntimeEstimator()
    with FakeTensorMode():
        x = torch.randn(64, 64)
        with estimator(COST_MODEL):
            x.view(16, 256).t().unsqueeze(0)
            torch.zeros_like(x)
            torch.empty(1024, 1024)
    assert estimator.total_runtime == 0.0


def test_a_tensor_parallel_rank_is_estimated_for_its_local_compute() -> None:
    spmd.init_process_group("fake", rank=1, world_size=4, torch_default_group=False)
    try:
        mesh = init_device_mesh("cpu", (4,))

        def tensor_parallel() -> nn.Sequential:
            return parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

        whole = _estimate(COST_MODEL, _mlp, step=False).total_runtime
        local = _estimate(COST_MODEL, tensor_parallel, step=False).total_runtime
    finally:
        spmd.destroy_process_group()
    assert 3.5 < whole / local < 4.5, (whole, local)


def test_bad_use_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="'operator-level-guess' not supported"):
        RuntimeEstimator()("operator-level-guess")
    with pytest.raises(RuntimeError, match="inside a FakeTensorMode"), RuntimeEstimator()(COST_MODEL):
        pass
    with FakeTensorMode(), pytest.raises(RuntimeError, match="pick a mode first"), RuntimeEstimator():
        pass
