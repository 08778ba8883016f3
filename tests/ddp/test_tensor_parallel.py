"""DDP over tensor parallelism (Megatron's TP x DP): parallelize_module over mesh["tp"], then
DistributedDataParallel(model, device_mesh=mesh["dp"]), on a 2 x 2 mesh of thread ranks; each dp rank trains on
its half of the batch. Training matches one process on the whole batch (tests/tensor/parallel/test_parity.py's
reference, rtol 1e-5), and in real processes matches torch's DDP over torch's tensor parallelism on gloo. The
parameters stay DTensors (see Note: DDP over DTensor parameters in spmd/ddp/dtensor_params.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import spmd
import spmd.checkpoint as dcp
from spmd import DistributedDataParallel
from spmd._composable import replicate
from spmd.ddp import allreduce_hook
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import fully_shard
from spmd.optim import ZeroRedundancyOptimizer
from spmd.tensor import DTensor, Shard
from spmd.tensor.parallel.ddp import _pre_dp_module_transform
from spmd.testing import run_ranks
from tests.procpool import ProcPool, free_port
from tests.tensor.parallel.plans import Layout, parallelize, torch_api
from tests.tensor.parallel.test_parity import ATOL, RTOL, STEPS, batch, fresh, full, reference, step_loss

TIMEOUT = 120.0
Result = tuple[list[float], dict[str, Tensor]]


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _train(model: nn.Module, mesh: DeviceMesh, use_loss_parallel: bool, micro_batches: int = 1,
           clip: float | None = None) -> Result:
    """STEPS SGD steps on this dp rank's half of each batch, in `micro_batches` pieces (all but the last under
    no_sync), the gradient clipped to `clip` before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    dp_rank, losses = mesh.get_coordinate()[0], []
    for step in range(STEPS):
        opt.zero_grad()
        tokens, targets = (t.chunk(2)[dp_rank] for t in batch(step))
        loss = 0.0
        for index, (micro_tokens, micro_targets) in enumerate(zip(tokens.chunk(micro_batches),
                                                                  targets.chunk(micro_batches))):
            last = index == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss += _scaled_loss(model, micro_tokens, micro_targets, use_loss_parallel, micro_batches)
        losses.append(loss)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return losses, {name: full(p.detach()) for name, p in inner.named_parameters()}


def _scaled_loss(model: nn.Module, tokens: Tensor, targets: Tensor, use_loss_parallel: bool, parts: int) -> float:
    if parts == 1:
        return step_loss(model, tokens, targets, use_loss_parallel).item()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)) / parts
    loss.backward()
    return loss.item()


def _one_process_clipped(kind: str, clip: float) -> Result:
    """test_parity's reference training, the gradient clipped before each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = fresh(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            losses.append(step_loss(model, *batch(step), use_loss_parallel=False).item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _check(results: list[Result], expected: Result) -> None:
    """Every rank's parameters equal the expected ones; the dp ranks' mean loss (tp rank 0) the expected loss."""
    ref_losses, ref_params = expected
    mean_losses = [(a + b) / 2 for a, b in zip(results[0][0], results[2][0])]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for _, params in results:
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize(("kind", "layout", "as_view"), [
    ("gpt", Layout.TP, False), ("gpt", Layout.TP_SP_LOSS, True),
    ("llama", Layout.TP, True), ("llama", Layout.TP_SP_LOSS, False)], ids=str)
def test_ddp_over_tensor_parallel_on_a_2x2_mesh_matches_one_process(kind: str, layout: Layout,
                                                                     as_view: bool) -> None:
    """Sequence parallelism leaves the norms' gradients Partial over tp (averaged over dp as they are); the
    vocab-sharded embedding's gradient comes out Replicate and is sliced to its shard."""
    def body(rank: int, size: int) -> tuple[Result, dict[str, tuple]]:
        mesh = _mesh()
        model = DistributedDataParallel(parallelize(kind, fresh(kind), mesh["tp"], layout), device_mesh=mesh["dp"],
                                        gradient_as_bucket_view=as_view, bucket_cap_mb=0.01)
        result = _train(model, mesh, layout.loss_parallel)
        grads = {name: (type(p.grad), p.grad._local_tensor.shape == p._local_tensor.shape)
                 for name, p in model.module.named_parameters() if isinstance(p, DTensor)}
        return result, grads

    results = run_ranks(body, 4, timeout=TIMEOUT)
    _check([result for result, _ in results], reference(kind))
    for _, grads in results:
        assert all(grad == (DTensor, True) for grad in grads.values()), grads


def test_torchs_two_d_recipe_transform_then_ddp_over_the_dp_group_matches_one_process() -> None:
    """torch's TP x DDP recipe, ported by the import swap: _pre_dp_module_transform(model), then DDP over the mesh's
    dp process group (not its mesh dim)."""
    def body(rank: int, size: int) -> Result:
        mesh = _mesh()
        model = parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP)
        _pre_dp_module_transform(model)
        return _train(DistributedDataParallel(model, process_group=mesh.get_group(mesh_dim=0)), mesh,
                      use_loss_parallel=False)

    _check(run_ranks(body, 4, timeout=TIMEOUT), reference("gpt"))


def test_accumulation_clipping_and_comm_hooks_over_tensor_parallel() -> None:
    """Two micro-batches (the first under no_sync), clip_grad_norm_ over the DTensor gradients (the norm over
    every tp shard), a comm hook: the same training as one process clipping its whole-batch gradient."""
    clip = 0.5

    def body(rank: int, size: int) -> Result:
        mesh = _mesh()
        model = DistributedDataParallel(parallelize("llama", fresh("llama"), mesh["tp"], Layout.TP_SP),
                                        device_mesh=mesh["dp"])
        model.register_comm_hook(None, allreduce_hook)
        return _train(model, mesh, use_loss_parallel=False, micro_batches=2, clip=clip)

    _check(run_ranks(body, 4, timeout=TIMEOUT), _one_process_clipped("llama", clip))


@pytest.mark.parametrize("bucket_view", [False, True], ids=["per-parameter", "bucket-view"])
def test_zero_over_ddp_over_tensor_parallel_matches_one_process(bucket_view: bool) -> None:
    """ZeroRedundancyOptimizer over DDP's group: each DTensor parameter owned (and broadcast) as its local shard,
    whose replicas the dp ranks hold; the training equals one process's."""
    def body(rank: int, size: int) -> Result:
        mesh = _mesh()
        model = DistributedDataParallel(parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP_SP),
                                        device_mesh=mesh["dp"])
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=mesh.get_group("dp"),
                                            parameters_as_bucket_view=bucket_view, lr=0.5, momentum=0.9)
        dp_rank, losses = mesh.get_coordinate()[0], []
        for step in range(STEPS):
            optimizer.zero_grad()
            tokens, targets = (t.chunk(2)[dp_rank] for t in batch(step))
            losses.append(step_loss(model, tokens, targets, use_loss_parallel=False).item())
            optimizer.step()
        return losses, {name: full(p.detach()) for name, p in model.module.named_parameters()}

    _check(run_ranks(body, 4, timeout=TIMEOUT), reference("gpt"))


def test_composable_replicate_over_tensor_parallel_matches_one_process() -> None:
    def body(rank: int, size: int) -> Result:
        mesh = _mesh()
        model = replicate(parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP_SP), device_mesh=mesh["dp"])
        return _train(model, mesh, use_loss_parallel=False)

    _check(run_ranks(body, 4, timeout=TIMEOUT), reference("gpt"))


def test_state_dicts_and_checkpoints_keep_the_tensor_parallel_layout(tmp_path: Any) -> None:
    """The wrapped model's state dict holds the DTensors themselves; a checkpoint saved under DDP x TP loads
    bit-exact into a fresh DDP x TP model."""
    def body(rank: int, size: int) -> None:
        mesh = _mesh()
        model = DistributedDataParallel(parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP), device_mesh=mesh["dp"])
        _train(model, mesh, use_loss_parallel=False)
        state = model.state_dict()
        for name, p in model.module.named_parameters():
            value = state[f"module.{name}"]
            assert isinstance(value, DTensor) == isinstance(p, DTensor), name
            assert getattr(value, "placements", None) == getattr(p, "placements", None), name
        assert state["module.blocks.0.attn.q.weight"].placements == (Shard(0),)
        dcp.save({"model": model.module.state_dict()}, checkpoint_id=str(tmp_path))
        fresh_model = DistributedDataParallel(parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP),
                                              device_mesh=mesh["dp"])
        loaded = {"model": fresh_model.module.state_dict()}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        for name, p in model.module.named_parameters():
            assert torch.equal(full(loaded["model"][name]), full(p)), name

    run_ranks(body, 4, timeout=TIMEOUT)


def test_parameters_sharded_across_ddps_group_are_refused_naming_them() -> None:
    def body(rank: int, size: int) -> None:
        mesh = _mesh()
        model = parallelize("gpt", fresh("gpt"), mesh["tp"], Layout.TP)
        with pytest.raises(ValueError, match=r"parameter 'embed\.weight' is laid out \[Shard\(0\)\] on DeviceMesh"
                                             r".*split along mesh dims \['tp'\] across ranks of DDP's group"):
            DistributedDataParallel(model, device_mesh=mesh["tp"])    # the tensor-parallel dim: shards differ
        sharded = fresh("gpt")
        fully_shard(sharded, mesh=mesh["dp"])
        with pytest.raises(ValueError, match=r"split along mesh dims \['dp'\].*leave sharded parameters to "
                                             r"fully_shard"):
            DistributedDataParallel(sharded, device_mesh=mesh["dp"])

    run_ranks(body, 4, timeout=TIMEOUT)


# -- against torch's DDP over torch's tensor parallelism -------------------------------------------------------

def _both_libraries(rank: int, world_size: int, gloo_port: int) -> dict[str, Result]:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    try:
        ours = _mesh()
        theirs = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        spmd_model = DistributedDataParallel(parallelize("llama", fresh("llama"), ours["tp"], Layout.TP_SP),
                                             device_mesh=ours["dp"])
        torch_model = TorchDDP(parallelize("llama", fresh("llama"), theirs["tp"], Layout.TP_SP, torch_api()),
                               device_mesh=theirs["dp"])
        return {"spmd": _train(spmd_model, ours, use_loss_parallel=False),
                "torch": _train_torch(torch_model, rank)}
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()


def _train_torch(model: nn.Module, rank: int) -> Result:
    """_train for torch's DDP, which swaps the DTensor parameters for their local tensors (and, after the first
    forward, leaves the module without them: they are rebuilt from the local tensors each forward); the full
    values are read from the local tensors it trains and the layouts it noted on them."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    trained = dict(model.module.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    dp_rank, losses = rank // 2, []
    for step in range(STEPS):
        opt.zero_grad()
        tokens, targets = (t.chunk(2)[dp_rank] for t in batch(step))
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    params = {}
    for name, local in trained.items():
        spec = getattr(local, "_st_info", None)
        params[name] = local.detach() if spec is None else TorchDTensor.from_local(
            local.detach(), spec.mesh, spec.placements, run_check=False, shape=spec.shape,
            stride=spec.stride).full_tensor()
    return losses, params


@pytest.mark.timeout(180)
def test_matches_torch_ddp_over_torch_tensor_parallel_on_gloo(procpool: ProcPool) -> None:
    per_rank = procpool.run(_both_libraries, 4, timeout=150, args=(free_port(),))
    for results in per_rank:
        ours, theirs = results["spmd"], results["torch"]
        torch.testing.assert_close(ours[0], theirs[0], rtol=RTOL, atol=ATOL)
        assert ours[1].keys() == theirs[1].keys()
        for name, value in ours[1].items():
            torch.testing.assert_close(value, theirs[1][name], rtol=RTOL, atol=ATOL, msg=name)
    _check([results["spmd"] for results in per_rank], reference("llama"))
