"""The GPU check: spmd on CUDA tensors over torch's NCCL, one short run with a pass/fail table (under 5 minutes).

    python benchmarks/gpu_check.py [--timeout 240]
    python benchmarks/gpu_check.py --rehearse     # the same checks on CPU tensors, 2 ranks over "gloo"

On a machine without CUDA it says so and exits 0 (CI machines have no GPU). `--rehearse` runs every check but the
shared-GPU ones on the CPU (spmd's "gloo", 2 ranks), so the script itself is known to work before a GPU run
(the test suite runs it). With CUDA, one rank per GPU (at
least one) as spawned processes, backend "nccl" (spmd's torch:nccl transport), each rank on its own device:
  - collectives on CUDA tensors, every one checked against values computed on the host: all_reduce (SUM, AVG,
    MAX) in float32 and bfloat16, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
    send/recv around the ranks (with 2 or more), barrier; each timed;
  - a DDP step (spmd.DistributedDataParallel, device_ids=[rank]) and an FSDP2 step (spmd.fsdp.fully_shard) on a
    small MLP, each against the same training in one process on the same device: the parameters after one
    SGD step must match to 1e-5 (SGD: Adam's first step would blow reduction-order noise up); the same FSDP2 step
    with the collective buffers from NCCL's own allocator (set_allocate_memory_from_process_group_for_comm), with
    a frozen int64 table (the byte all-gather), and replicate on FSDP2's machinery;
  - a conv net's DDP step with synchronised batch norm against the whole batch in one process: spmd.nn's
    SyncBatchNorm, and torch.nn's over spmd's world (torch's default group on the "spmd" backend);
  - a tensor-parallel MLP block under torch.compile (inductor) over three sequence lengths against eager;
  - a 1F1B pipeline step (a stage per rank) against one process, and a distributed checkpoint of an FSDP2
    model with its AdamW state saved and loaded bit-exact;
  - causal attention on SDPA's CUDA kernels, tensor-parallel (heads over the ranks) and context-parallel (ring
    attention over the sequence, on torch's memory-efficient kernels), output and gradients against the whole
    attention in one process to 1e-4; the same ring attention reached TorchTitan's way, through sequence-sharded
    DTensors in bfloat16 (the flash or cuDNN op's rule), to 2e-2; and flex_attention's context parallelism (a
    document-causal BlockMask dealt by PTRR, made by the compiled create_block_mask on the device), output and
    q/k/v gradients likewise.
  - with one GPU only, also 2 ranks sharing it over spmd's shared-memory transport ("shm", which stages CUDA
    tensors through host memory): the collectives above, an async all_reduce issued on a side stream behind a
    sleeping kernel (the staged copies must wait for it), the two SyncBatchNorm checks and the two attention
    checks on 2 ranks.
Each row: name, PASS/FAIL, seconds, and the error's first line for a failure. Exit status 1 if any row failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import free_port, run_saving_processes

Row = tuple[str, bool, float, str]


def _check(rows: list[Row], name: str, fn: Callable[[], None]) -> None:
    start = time.perf_counter()
    try:
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        rows.append((name, True, time.perf_counter() - start, ""))
    except Exception as error:     # reported in the table, the run goes on
        rows.append((name, False, time.perf_counter() - start,
                     f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"))
        traceback.print_exc()


def _expect(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 0.0) -> None:
    got = actual.detach().float().cpu()
    want = expected.float()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=rtol):
        worst = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        raise AssertionError(f"{what}: shape {list(got.shape)} vs {list(want.shape)}, largest difference {worst:g}")


def _collectives(rows: list[Row], rank: int, world: int, device: torch.device) -> None:
    import spmd

    def value(r: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ((torch.arange(n) * 3 + r * 7) % 13).to(dtype)

    n = 1 << 20
    for dtype in (torch.float32, torch.bfloat16):
        for op, reduce in (("SUM", lambda xs: sum(xs)), ("AVG", lambda xs: sum(xs) / world),
                           ("MAX", lambda xs: torch.stack(xs).max(0).values)):
            def all_reduce(dtype: torch.dtype = dtype, op: str = op, reduce: Callable = reduce) -> None:
                t = value(rank, n, dtype).to(device)
                spmd.all_reduce(t, op=getattr(spmd.ReduceOp, op))
                _expect(t, reduce([value(r, n, dtype).float() for r in range(world)]), f"all_reduce {op}",
                        rtol=1e-2 if dtype is torch.bfloat16 else 0.0)
            _check(rows, f"all_reduce {op} {str(dtype).removeprefix('torch.')} 4 MiB", all_reduce)

    def broadcast() -> None:
        t = value(rank, n).to(device)
        spmd.broadcast(t, src=0)
        _expect(t, value(0, n), "broadcast")

    def all_gather() -> None:
        out = torch.empty(world * n, device=device)
        spmd.all_gather_into_tensor(out, value(rank, n).to(device))
        _expect(out, torch.cat([value(r, n) for r in range(world)]), "all_gather_into_tensor")

    def reduce_scatter() -> None:
        out = torch.empty(n, device=device)
        spmd.reduce_scatter_tensor(out, value(rank, world * n).to(device))
        _expect(out, sum(value(r, world * n) for r in range(world)).chunk(world)[rank], "reduce_scatter_tensor")

    def all_to_all() -> None:
        out = torch.empty(world * 1024, device=device)
        spmd.all_to_all_single(out, value(rank, world * 1024).to(device))
        _expect(out, torch.cat([value(r, world * 1024).chunk(world)[rank] for r in range(world)]), "all_to_all")

    def send_recv() -> None:
        if world < 2:
            return
        got = torch.empty(n, device=device)
        ops = [spmd.P2POp(spmd.isend, value(rank, n).to(device), (rank + 1) % world),
               spmd.P2POp(spmd.irecv, got, (rank - 1) % world)]
        for work in spmd.batch_isend_irecv(ops):
            work.wait()
        _expect(got, value((rank - 1) % world, n), "send/recv")

    for name, fn in (("broadcast 4 MiB", broadcast), ("all_gather_into_tensor", all_gather),
                     ("reduce_scatter_tensor", reduce_scatter), ("all_to_all_single", all_to_all),
                     ("send/recv ring (batch_isend_irecv)", send_recv), ("barrier", lambda: spmd.barrier())):
        _check(rows, name, fn)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _one_process_step(device: torch.device, world: int) -> list[torch.Tensor]:
    model = _mlp().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8 * world, 64, generator=torch.Generator().manual_seed(1)).to(device)
    model(x).square().mean().backward()
    optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


def _parallel_steps(rows: list[Row], rank: int, world: int, device: torch.device) -> None:
    import spmd
    from spmd._composable.replicate_with_fsdp import replicate
    from spmd.fsdp import fully_shard

    want = _one_process_step(device, world)
    x = torch.randn(8 * world, 64, generator=torch.Generator().manual_seed(1)).to(device)

    def ddp() -> None:
        model = spmd.DistributedDataParallel(_mlp().to(device),
                                             device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x.chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        for got, expected in zip(model.module.parameters(), want, strict=True):
            _expect(got, expected, "DDP parameter", rtol=1e-5)

    def fsdp(apply: Callable[..., Any] = fully_shard, group_buffers: bool = False) -> None:
        from spmd.device_mesh import init_device_mesh

        model = _mlp().to(device)
        mesh = init_device_mesh(device.type, (world,))
        apply(model, mesh=mesh)
        if group_buffers:          # NCCL's own allocator for the collective buffers
            model.set_allocate_memory_from_process_group_for_comm(True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x.chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        for got, expected in zip(model.parameters(), want, strict=True):
            _expect(got.full_tensor(), expected, "FSDP2 parameter", rtol=1e-5)

    def fsdp_mixed_dtypes() -> None:
        from spmd.device_mesh import init_device_mesh

        model = _mlp().to(device)        # a frozen int64 table beside float32 weights: the byte all-gather path
        model.register_parameter("table", torch.nn.Parameter(torch.arange(64, device=device), requires_grad=False))
        mesh = init_device_mesh(device.type, (world,))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(x.chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        params = [p for name, p in model.named_parameters() if name != "table"]
        for got, expected in zip(params, want, strict=True):
            _expect(got.full_tensor(), expected, "FSDP2 parameter", rtol=1e-5)
        _expect(model.table.full_tensor(), torch.arange(64), "frozen int64 table")

    _check(rows, "DDP step vs one process", ddp)
    _check(rows, "FSDP2 step vs one process", fsdp)
    _check(rows, "FSDP2 step, buffers from the group's allocator", lambda: fsdp(group_buffers=True))
    _check(rows, "replicate (FSDP2's machinery) step vs one process", lambda: fsdp(replicate))
    _check(rows, "FSDP2 step, frozen int64 beside float32 (byte all-gather)", fsdp_mixed_dtypes)


def _sync_batch_norm_checks(rows: list[Row], rank: int, world: int, device: torch.device) -> None:
    """A conv net's DDP step with its batch norm synchronised, against the whole batch in one process: spmd's
    SyncBatchNorm, and on CUDA torch's own over spmd's world (torch's default group, backend "spmd"; torch's
    runs on accelerators only)."""
    import spmd
    from spmd.nn import SyncBatchNorm

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4)).to(device)

    x = torch.randn(4 * world, 3, 8, 8, generator=torch.Generator().manual_seed(2)).to(device)
    reference = net()
    reference(x).square().mean().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    rtol = 2e-3 if device.type == "cuda" else 1e-5        # cuDNN's convolutions may pick TF32 per batch size

    def step(convert: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        model = spmd.DistributedDataParallel(convert(net()),
                                             device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x.chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        for got, expected in zip(model.module.parameters(), reference.parameters(), strict=True):
            _expect(got, expected.detach().cpu(), "parameter", rtol=rtol)
        _expect(model.module[1].running_var, reference[1].running_var.cpu(), "running variance", rtol=rtol)

    _check(rows, "spmd.nn.SyncBatchNorm DDP step vs one process", lambda: step(SyncBatchNorm.convert_sync_batchnorm))
    if device.type == "cuda":
        _check(rows, "torch.nn.SyncBatchNorm over spmd's world vs one process",
               lambda: step(torch.nn.SyncBatchNorm.convert_sync_batchnorm))


class _Attention(torch.nn.Module):
    """Causal self-attention over 4 heads, SDPA on the device's fused kernels: the gradients its backward gives
    the projections (another memory order on CUDA than on the CPU) go through TP's DTensors."""

    def __init__(self, heads: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def _attention(device: torch.device) -> _Attention:
    """The same weights on every call (drawn from a generator of its own, not the global one)."""
    model, generator = _Attention(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.to(device)


def _attention_checks(rows: list[Row], rank: int, world: int, device: torch.device) -> None:
    """A tensor-parallel attention step (heads over the ranks) and context-parallel attention (the sequence over
    the ranks, ring attention on the device's kernels), each against the whole attention in one process."""
    import spmd
    from spmd.device_mesh import init_device_mesh
    from spmd.tensor.experimental import context_parallel
    from spmd.tensor.experimental._attention import context_parallel_unshard
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(2)).to(device)
    whole = _attention(device)
    want_out = whole(x)
    want_out.square().mean().backward()
    want_grads = [p.grad.detach().cpu() for p in whole.parameters()]
    mesh = init_device_mesh(device.type, (world,))

    def tensor_parallel() -> None:
        from spmd.tensor.rules import record_fallbacks

        model = _attention(device)
        model.heads //= world
        parallelize_module(model, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                         "wo": RowwiseParallel()})
        with record_fallbacks() as fallbacks:       # the device's attention kernels have sharding rules
            out = model(x)
            out.square().mean().backward()
        if fallbacks:
            raise AssertionError(f"ops ran gathered (no sharding rule): {sorted(set(map(str, fallbacks)))}")
        _expect(out, want_out.detach().cpu(), "TP attention output", rtol=1e-4)
        for param, expected in zip(model.parameters(), want_grads, strict=True):
            _expect(param.grad.full_tensor(), expected, "TP attention gradient", rtol=1e-4)

    def context_parallel_attention() -> None:
        model = _attention(device)
        local = x.clone()
        with context_parallel(mesh, buffers=[local], buffer_seq_dims=[1], no_restore_buffers={local}):
            out = model(local)
            out.square().mean().backward()        # this rank's share of the mean over the whole sequence...
            out = context_parallel_unshard(mesh, [out.detach()], [1])[0]
        _expect(out, want_out.detach().cpu(), "CP attention output", rtol=1e-4)
        for param, expected in zip(model.parameters(), want_grads, strict=True):
            grad = param.grad.clone()
            spmd.all_reduce(grad, group=mesh.get_group())       # ...summed over the ranks: the whole one
            _expect(grad / world, expected, "CP attention gradient", rtol=1e-4)

    def context_parallel_through_dtensors() -> None:
        """TorchTitan's way: the attention call's q, k, v as sequence-sharded DTensors, ring attention from the
        dispatcher (on CUDA through the flash or cuDNN op's rule)."""
        from spmd.tensor.experimental._attention import (
            _context_parallel_shard,
            _ContextParallel,
            _disable_context_parallel_dispatcher,
            _enable_context_parallel_dispatcher,
            _HeadTailLoadBalancer,
        )
        from spmd.tensor.rules import record_fallbacks

        class Inner(torch.nn.Module):
            def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32     # bf16: the flash kernel on CUDA
        gen = torch.Generator().manual_seed(5)
        q, k, v, weights = (torch.randn(2, 4, 64, 32, generator=gen).to(device, dtype) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
        want.backward(weights)
        attention = parallelize_module(
            Inner(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
        balancer = _HeadTailLoadBalancer(64, world, device)
        _enable_context_parallel_dispatcher()
        try:
            local = _context_parallel_shard(mesh, [q, k, v, weights], [2] * 4, load_balancer=balancer)
            parts = [t.requires_grad_() for t in local[:3]]
            with record_fallbacks() as fallbacks:
                out = attention(*parts)
                out.backward(local[3])
        finally:
            _disable_context_parallel_dispatcher()
        if fallbacks:
            raise AssertionError(f"ops ran gathered (no sharding rule): {sorted(set(map(str, fallbacks)))}")
        got = context_parallel_unshard(mesh, [out.detach(), *(p.grad for p in parts)], [2] * 4, balancer)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for value, expected, what in zip(got, [want, *(t.grad for t in whole)], ["output", "dq", "dk", "dv"]):
            _expect(value, expected.detach().cpu(), f"CP through DTensors {what}", rtol=tolerance)

    _check(rows, "TP attention step vs one process", tensor_parallel)
    _check(rows, "CP ring attention vs one process", context_parallel_attention)
    _check(rows, "CP through DTensors (TorchTitan's) vs one process", context_parallel_through_dtensors)
    _check(rows, "CP flex attention (PTRR) vs one process", lambda: _flex_context_parallel(mesh, device))


def _compiled_tensor_parallel(rows: list[Row], world: int, device: torch.device) -> None:
    """A tensor-parallel MLP block under torch.compile (inductor), over three sequence lengths (the second
    recompiles with a symbolic length, the third reuses it), against the same block run eagerly: outputs and
    the gradients of every weight."""
    import copy

    from spmd.device_mesh import init_device_mesh
    from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def check() -> None:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 64)).to(device)
        mesh = init_device_mesh(device.type, (world,))
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
        eager = parallelize_module(copy.deepcopy(block), mesh, plan)
        compiled = parallelize_module(block, mesh, plan)
        run = torch.compile(compiled)
        for seq in (16, 24, 32):
            x = torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(seq)).to(device)
            want, got = eager(x), run(x)
            want.square().mean().backward()
            got.square().mean().backward()
            _expect(got, want.detach().cpu(), f"compiled TP output (sequence {seq})", rtol=1e-4)
        for name, param in compiled.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            other = eager.get_parameter(name).grad
            _expect(grad, (other.full_tensor() if hasattr(other, "full_tensor") else other).cpu(),
                    f"compiled TP gradient {name}", rtol=1e-4)

    _check(rows, "TP block torch.compile (inductor), 3 lengths", check)


def _pipeline_and_checkpoint(rows: list[Row], rank: int, world: int, device: torch.device, out_file: str) -> None:
    """A pipeline step (1F1B, two layers per rank, one stage per rank, four microbatches) against the whole
    model's gradients in one process; and a distributed checkpoint of an FSDP2 model and its AdamW state, saved
    and loaded into a fresh model and optimizer, bit-exact."""
    import spmd
    import spmd.checkpoint as dcp
    from spmd.checkpoint.state_dict import get_state_dict, set_state_dict
    from spmd.device_mesh import init_device_mesh
    from spmd.fsdp import fully_shard
    from spmd.pipelining import PipelineStage, Schedule1F1B

    def layers() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                     for _ in range(2 * world))).to(device)

    def pipeline() -> None:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(device)
        y = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(device)
        whole = layers()
        torch.nn.functional.mse_loss(whole(x), y).backward()
        part = layers()[2 * rank:2 * rank + 2]
        stage = PipelineStage(part, rank, world, device)
        schedule = Schedule1F1B(stage, 4, loss_fn=torch.nn.functional.mse_loss)
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        for got, want in zip(part.parameters(), list(whole.parameters())[4 * rank:4 * rank + 4], strict=True):
            _expect(got.grad, want.grad.cpu(), "pipeline gradient", rtol=1e-5)

    def checkpoint() -> None:
        mesh = init_device_mesh(device.type, (world,))

        def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            model = layers()
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01)

        model, optimizer = sharded()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(device)).sum().backward()
        optimizer.step()
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
        dcp.save(state, checkpoint_id=f"{out_file}.checkpoint")
        fresh, fresh_optimizer = sharded()
        loaded = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_optimizer), strict=True))
        dcp.load(loaded, checkpoint_id=f"{out_file}.checkpoint")
        set_state_dict(fresh, fresh_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        spmd.barrier()
        for (name, got), want in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
            _expect(got.full_tensor(), want.full_tensor().cpu(), f"loaded parameter {name}")
        for got, want in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                _expect(got[key].full_tensor(), want[key].full_tensor().cpu(), f"loaded AdamW {key}")

    _check(rows, "pipeline 1F1B step vs one process", pipeline)
    _check(rows, "FSDP2 + AdamW checkpoint saved and loaded, bit-exact", checkpoint)


def _flex_context_parallel(mesh: Any, device: torch.device) -> None:
    """flex_attention over the sequence: keys and values gathered, a document-causal BlockMask dealt by PTRR;
    output and q/k/v gradients against the whole sequence in one process."""
    import torch.nn.attention.flex_attention as flex

    from spmd.tensor.experimental._context_parallel import (
        _context_parallel_shard,
        _ContextParallel,
        _PTRRLoadBalancer,
        context_parallel_unshard,
    )
    from spmd.tensor.parallel import parallelize_module

    seq, block = 512, 64
    document_of = torch.repeat_interleave(torch.arange(3), torch.tensor([128, 256, 128])).to(device)

    def documents(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (document_of[q] == document_of[kv]) & (q >= kv)

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
            return flex.flex_attention(q, k, v, block_mask=mask)

    if device.type == "cpu":      # rehearsing: CPU flex_attention refuses backward, though its eager path is math
        flex._validate_device = lambda query, key, value: None
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1, 2, seq, 32, generator=generator).to(device) for _ in range(4)]
    mask = flex.create_block_mask(documents, 1, 1, seq, seq, device=device.type, BLOCK_SIZE=block)
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    want = Attend()(*leaves, mask)
    want.backward(tensors[3])
    attend = parallelize_module(Attend(), mesh, _ContextParallel(seq_dim=2,
                                                                 attention_type=_ContextParallel.AttentionType.FLEX))
    balancer = _PTRRLoadBalancer(mask, mesh.size())
    *local, local_mask = _context_parallel_shard(mesh, [*tensors, mask], [2, 2, 2, 2, 0], balancer)
    q, k, v = (t.requires_grad_() for t in local[:3])
    out = attend(q, k, v, local_mask)
    out.backward(local[3])
    got = context_parallel_unshard(mesh, [out.detach(), q.grad, k.grad, v.grad], [2] * 4, balancer)
    for name, actual, expected in zip(("output", "q grad", "k grad", "v grad"), got,
                                      [want.detach(), *(leaf.grad for leaf in leaves)], strict=True):
        _expect(actual, expected.cpu(), f"CP flex attention {name}", rtol=1e-4)


def _nccl_rank(rank: int, world: int, port: int, out_file: str, backend: str = "nccl") -> None:
    """One rank of the main checks: on its own GPU over `backend` ("nccl"), or on the CPU over "gloo" when
    rehearsing."""
    import spmd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows: list[Row] = []
    try:
        spmd.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=120)
    except Exception as error:
        rows.append((f"init_process_group({backend!r})", False, 0.0, f"{type(error).__name__}: {error}"))
        torch.save(rows, f"{out_file}.{rank}")
        return
    try:
        _collectives(rows, rank, world, device)
        _parallel_steps(rows, rank, world, device)
        _sync_batch_norm_checks(rows, rank, world, device)
        _attention_checks(rows, rank, world, device)
        _compiled_tensor_parallel(rows, world, device)
        _pipeline_and_checkpoint(rows, rank, world, device, out_file)
    finally:
        spmd.destroy_process_group()
    torch.save(rows, f"{out_file}.{rank}")


def _shared_gpu_rank(rank: int, world: int, port: int, out_file: str) -> None:
    import spmd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rows: list[Row] = []
    spmd.init_process_group("shm", timeout=60)
    try:
        _collectives(rows, rank, world, torch.device("cuda", 0))

        def async_on_a_side_stream() -> None:
            side, n = torch.cuda.Stream(), 1 << 16
            t = torch.zeros(n, device="cuda")
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000_000)          # the fill below lands well after the call returns
                t.fill_(rank + 1)
                work = spmd.all_reduce(t, async_op=True)
            work.wait()                                 # the default stream now waits for the op
            _expect(t, torch.full((n,), float(world * (world + 1) // 2)), "async all_reduce on a side stream")
        _check(rows, "async all_reduce on a side stream", async_on_a_side_stream)
        _sync_batch_norm_checks(rows, rank, world, torch.device("cuda", 0))
        _attention_checks(rows, rank, world, torch.device("cuda", 0))
    finally:
        spmd.destroy_process_group()
    torch.save(rows, f"{out_file}.{rank}")


def _print(rows_per_rank: list[list[Row]]) -> bool:
    """The table, a row per check, the slowest rank's time; True if every rank passed every row."""
    ok = True
    names = [row[0] for row in rows_per_rank[0]]
    width = max(len(name) for name in ["check", *names])
    print(f"{'check':{width}} {'result':6} {'seconds':>8}  error")
    for index, name in enumerate(names):
        rows = [ranks[index] for ranks in rows_per_rank if index < len(ranks)]
        passed = all(row[1] for row in rows) and len(rows) == len(rows_per_rank)
        ok &= passed
        error = next((row[3] for row in rows if row[3]), "")
        print(f"{name:{width}} {'PASS' if passed else 'FAIL':6} {max(row[2] for row in rows):8.3f}  {error}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per launch")
    parser.add_argument("--rehearse", action="store_true", help="run the checks on CPU tensors, 2 ranks over gloo")
    args = parser.parse_args()
    if args.rehearse:
        port = free_port()
        rows = run_saving_processes(_nccl_rank, 2, lambda rank, out: (rank, 2, port, out, "gloo"), args.timeout,
                                    "the rehearsal")
        print("gpu_check --rehearse: the checks on CPU tensors, 2 ranks over spmd's gloo")
        sys.exit(0 if _print(rows) else 1)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check")
        return
    gpus = torch.cuda.device_count()
    print(f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    results: list[list[Any]] = []
    port = free_port()
    results.append(run_saving_processes(_nccl_rank, gpus, lambda rank, out: (rank, gpus, port, out), args.timeout,
                                        "the NCCL checks"))
    print(f"\n## {gpus} rank(s) over NCCL, one per GPU")
    ok = _print(results[-1])
    if gpus == 1:
        port = free_port()
        try:
            shared = run_saving_processes(_shared_gpu_rank, 2, lambda rank, out: (rank, 2, port, out), args.timeout,
                                          "2 ranks on one GPU")
        except RuntimeError as error:
            shared = [[("2 ranks on 1 GPU over shm", False, 0.0, str(error))]] * 2
        print("\n## 2 ranks sharing the GPU over spmd's shm transport")
        ok &= _print(shared)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
