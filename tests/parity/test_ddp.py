"""DistributedDataParallel parity: DDP on N thread ranks must train exactly like one process on the global batch.

Start here when DDP gives wrong numbers. The reference runs every rank's shard through one model in one
process and averages the shard losses, which is exactly the gradient DDP must produce (and, for the CNN's
BatchNorm, it keeps per-shard batch statistics as DDP does). Losses are compared every step and all
parameters at the end; a collective counter pins the protocol (one all-reduce per bucket per step).

Tolerances: everything is fp32 on CPU. DDP divides each rank's gradient by the world size and sums; the
reference sums shard gradients scaled by 1/world inside autograd; only the order of additions differs, so
per-step losses agree to ~1e-7 relative and parameters after a few SGD steps to ~1e-6 absolute. We allow
rtol=1e-5 / atol=1e-6 (10x the observed noise), tight enough that a missing average (2x), a skipped bucket
or a stale gradient fails by orders of magnitude.
"""

from __future__ import annotations

import collections
import contextlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd._core.errors import GroupAbortedError, SpmdError
from spmd.comm.group import ProcessGroup
from spmd.ddp import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    powerSGD_hook,
)
from spmd.ddp.api import _device_ids
from spmd.ddp.bucket import GradBucket
from spmd.ddp.comm_hooks import _compress_wrapper
from spmd.ddp.powersgd import _split
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks, seeded
from tests.parity.models import MLP, batch, build, loss_fn
from tests.procpool import ProcPool

TIMEOUT = 60.0
STEPS = 3
LR = 0.1


def count_collectives(group: ProcessGroup) -> collections.Counter[str]:
    """Count the collectives this rank issues on `group` from now on, by op name."""
    counts: collections.Counter[str] = collections.Counter()
    run = group.run

    def counting_run(fingerprint, body, outputs, async_op, **options):
        counts[fingerprint.op] += 1
        return run(fingerprint, body, outputs, async_op, **options)

    group.run = counting_run   # instance attribute shadows the method for this rank only
    return counts


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(kind: str, world_size: int, steps: int = STEPS, micro_steps: int = 1, batch_size: int = 4,
              forward: Callable[[nn.Module, Tensor, int], Tensor] | None = None,
              build_kwargs: dict[str, Any] | None = None, active: Callable[[int, int], bool] | None = None,
              ) -> tuple[list[float], list[Tensor]]:
    """One process: each step averages the loss of every (rank, micro-step) shard of the global batch."""
    model = build(kind, seed=0, **(build_kwargs or {}))
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch(kind, batch_size * world_size, seed=step * micro_steps + micro)
            for rank, (xs, ys) in enumerate(zip(x.chunk(world_size), y.chunk(world_size))):
                if active is not None and not active(rank, step):
                    continue
                out = forward(model, xs, rank) if forward else model(xs)
                loss = loss_fn(kind, out, ys)
                (loss / (world_size * micro_steps)).backward()
                total += loss.item() / (world_size * micro_steps)
        opt.step()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()]


def ddp_train(kind: str, rank: int, world_size: int, steps: int = STEPS, micro_steps: int = 1,
              batch_size: int = 4, forward: Callable[[nn.Module, Tensor, int], Tensor] | None = None,
              build_kwargs: dict[str, Any] | None = None, setup: Callable[[Any], None] | None = None,
              **ddp_kwargs: Any) -> dict[str, Any]:
    """This rank's DDP training; starts from a rank-dependent init that construction must overwrite."""
    model = spmd.DistributedDataParallel(build(kind, seed=100 * rank, **(build_kwargs or {})), **ddp_kwargs)
    if setup is not None:
        setup(model)
    opt = optimizer(model.parameters())
    counts = count_collectives(model.process_group)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch(kind, batch_size * world_size, seed=step * micro_steps + micro)
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            sync = contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync()
            with sync:
                out = forward(model, xs, rank) if forward else model(xs)
                loss = loss_fn(kind, out, ys)
                (loss / micro_steps).backward()   # see STYLE Note: gradient averaging with accumulation
            total += loss.item() / micro_steps
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": [p.detach().clone() for p in model.module.parameters()],
            "counts": dict(counts), "buckets": len(model.reducer.buckets), "model": model}


def assert_parity(results: list[dict[str, Any]], ref: tuple[list[float], list[Tensor]],
                  rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref_losses, ref_params = ref
    mean_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses, dtype=torch.float64), rtol=rtol, atol=atol)
    for result in results:
        for got, want in zip(result["params"], ref_params, strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# -- parity with one process -------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_matches_one_process(kind: str, world_size: int) -> None:
    as_view = kind != "mlp"    # both gradient layouts: copied into buckets (mlp), buckets as .grad (cnn, gpt)
    results = run_ranks(lambda rank, size: ddp_train(kind, rank, size, bucket_cap_mb=0.001,
                                                     gradient_as_bucket_view=as_view), world_size, timeout=TIMEOUT)
    assert_parity(results, reference(kind, world_size))
    for result in results:
        assert result["buckets"] > 1                                            # 1 kB buckets: several
        expected = {"all_reduce": STEPS * result["buckets"]}                     # one all-reduce per bucket
        if kind == "cnn":   # BatchNorm's float32 stats and int64 counter: one broadcast per dtype per forward
            expected["broadcast"] = STEPS * 2
        assert result["counts"] == expected
        if as_view:
            model = result["model"]
            views = {id(v) for b in model.reducer.buckets for v in b.views}
            assert all(id(p.grad) in views for p in model.module.parameters())


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_matches_one_process_over_real_transports(backend: str) -> None:
    # The same protocol over the transports real jobs use (ranks are still threads): async bucket
    # all-reduces issued from autograd's hooks, completed by the group's executor thread.
    results = run_ranks(lambda rank, size: ddp_train("gpt", rank, size, bucket_cap_mb=0.01), 2, timeout=TIMEOUT,
                        backend=backend)
    assert_parity(results, reference("gpt", 2))
    assert all(result["counts"] == {"all_reduce": STEPS * result["buckets"]} for result in results)


def test_no_sync_accumulates_locally_then_syncs_once() -> None:
    results = run_ranks(lambda rank, size: ddp_train("gpt", rank, size, micro_steps=3), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2, micro_steps=3))
    for result in results:
        # only the last micro-step communicates: one all-reduce per bucket per optimizer step
        assert result["counts"] == {"all_reduce": STEPS * result["buckets"]}


def test_default_buckets_reverse_order_small_first() -> None:
    def body(rank: int, size: int) -> list[list[int]]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])    # 12 x 257 kB
        ddp = spmd.DistributedDataParallel(model)
        return [bucket.param_indices for bucket in ddp.reducer.buckets]

    buckets = run_ranks(body, 2, timeout=TIMEOUT)[0]
    # Bucket 0 holds the last layers and closes at 1 MiB (4 weights + biases); the rest fit in 25 MiB.
    assert buckets[0] == [23, 22, 21, 20, 19, 18, 17, 16]
    assert buckets[1] == list(range(15, -1, -1))


# -- unused parameters ---------------------------------------------------------------------------------------

def _branchy_forward(model: nn.Module, x: Tensor, rank: int) -> Tensor:
    return model(x, rank == 0)


@pytest.mark.parametrize("static_graph", [False, True])
def test_find_unused_parameters(static_graph: bool) -> None:
    results = run_ranks(lambda rank, size: ddp_train("branchy", rank, size, forward=_branchy_forward,
                                                     find_unused_parameters=not static_graph,
                                                     static_graph=static_graph), 2, timeout=TIMEOUT)
    assert_parity(results, reference("branchy", 2, forward=_branchy_forward))
    for result in results:
        model = result["model"].module
        assert model.never.weight.grad is None and model.never.bias.grad is None   # unused everywhere: untouched
        assert model.extra.weight.grad is not None                                  # averaged, zeros from rank 1
        buckets = result["buckets"]
        # find_unused: the buckets plus one used-map all-reduce per step; static_graph: the used map once.
        used_maps = 1 if static_graph else STEPS
        assert result["counts"] == {"all_reduce": STEPS * buckets + used_maps}


def test_output_left_out_of_the_loss_counts_as_unused() -> None:
    # `aux` is computed in forward but the loss ignores it: its parameters never get a gradient although the
    # graph reaches them. Detecting unused parameters at the end of backward (not by walking the graph after
    # forward) handles this, which torch's DDP reports as an error.
    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(7, 3)
            self.aux = nn.Linear(7, 2)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return self.body(x), self.aux(x)

    reference_model = WithAux()
    initial = {name: tensor.clone() for name, tensor in reference_model.state_dict().items()}

    def body(rank: int, size: int) -> list[Tensor | None]:
        local = WithAux()
        local.load_state_dict(initial)
        model = spmd.DistributedDataParallel(local, find_unused_parameters=True)
        x, y = batch("mlp", 8)
        out, _aux = model(x.chunk(size)[rank])
        loss_fn("mlp", out, y.chunk(size)[rank]).backward()
        return [p.grad for p in model.module.parameters()]

    results = run_ranks(body, 2, timeout=TIMEOUT)
    x, y = batch("mlp", 8)
    loss_fn("mlp", reference_model(x)[0], y).backward()
    for grads in results:
        assert grads[2] is None and grads[3] is None          # aux.weight, aux.bias: untouched
        torch.testing.assert_close(grads[:2], [reference_model.body.weight.grad, reference_model.body.bias.grad],
                                   rtol=1e-5, atol=1e-6)


def test_unused_parameters_without_flag_name_them() -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(MLP(unused_branch=True))
        model(torch.randn(4, 7)).sum().backward()

    with pytest.raises((SpmdError, GroupAbortedError), match=r"'skipped\.weight', 'skipped\.bias'.*"
                       r"find_unused_parameters=True"):
        run_ranks(body, 2, timeout=TIMEOUT)


def test_unused_on_one_rank_only_fails_fast_on_both() -> None:
    # Rank 1 skips `extra`, rank 0 uses it: rank 0's bucket holding it can never be matched by rank 1. Rank 1
    # names the parameter and aborts the group, so rank 0 stops waiting at once instead of at the timeout.
    class OnRankZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(7, 3)
            self.extra = nn.Linear(7, 3)

        def forward(self, x: Tensor, use_extra: bool) -> Tensor:
            return self.body(x) + self.extra(x) if use_extra else self.body(x)

    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(OnRankZero())
        model(torch.randn(2, 7), rank == 0).sum().backward()

    with pytest.raises((SpmdError, GroupAbortedError), match=r"on rank 1 .* no gradient in this backward: "
                                                             r"'extra\.weight', 'extra\.bias'"):
        run_ranks(body, 2, timeout=TIMEOUT, comm_timeout=300)


def test_peer_failing_before_backward_does_not_hang_the_others() -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(MLP())
        out = model(torch.randn(2, 7))
        if rank == 1:
            raise ValueError("rank 1 gave up before backward")
        out.sum().backward()    # rank 0 waits on its bucket until rank 1's failure aborts the group

    with pytest.raises(ValueError, match="rank 1 gave up"):
        run_ranks(body, 2, timeout=TIMEOUT, comm_timeout=300)


def test_static_graph_handles_reentrant_checkpointing() -> None:
    results = run_ranks(lambda rank, size: ddp_train("reentrant", rank, size, static_graph=True), 2,
                        timeout=TIMEOUT)
    assert_parity(results, reference("reentrant", 2))

    with pytest.raises((RuntimeError, GroupAbortedError), match=r"'shared\.(weight|bias)' got its gradient twice"):
        run_ranks(lambda rank, size: ddp_train("reentrant", rank, size), 2, timeout=TIMEOUT)


# -- communication hooks -------------------------------------------------------------------------------------

# Note: compression tolerance (spmd.ddp.comm_hooks). bf16 rounds each averaged gradient value to 2**-9
# relative, fp16 to 2**-12; three SGD steps with lr 0.1 move parameters by ~lr * |grad| per step, so the
# parameters differ by about 3 * 0.1 * |grad| * 2**-8 (bf16): atol 2e-3 for bf16 and 3e-4 for fp16 hold with
# a few-fold margin over what we measure (6e-4 and 7e-5), while a wrong average (off by 2x) is ~100x larger.
@pytest.mark.parametrize(("hook", "tolerance"), [
    (allreduce_hook, {"rtol": 1e-5, "atol": 1e-6}),
    (fp16_compress_hook, {"rtol": 0.0, "atol": 3e-4}),
    (bf16_compress_hook, {"rtol": 0.0, "atol": 2e-3}),
])
def test_comm_hooks(hook: Callable, tolerance: dict[str, float]) -> None:
    results = run_ranks(lambda rank, size: ddp_train(
        "gpt", rank, size, bucket_cap_mb=0.01, setup=lambda m: m.register_comm_hook(None, hook)), 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2), **tolerance)
    for result in results:
        assert result["counts"] == {"all_reduce": STEPS * result["buckets"]}


@pytest.mark.parametrize(("wrapper", "atol"), [(fp16_compress_wrapper, 3e-4), (bf16_compress_wrapper, 2e-3)])
def test_compress_wrappers_run_a_hook_on_a_low_precision_bucket(wrapper: Callable, atol: float) -> None:
    seen: list[torch.dtype] = []

    def spy(state: object, bucket: GradBucket) -> torch.futures.Future:
        seen.append(bucket.buffer().dtype)
        assert all(g.dtype == bucket.buffer().dtype for g in bucket.gradients())
        return allreduce_hook(state, bucket)

    results = run_ranks(lambda rank, size: ddp_train(
        "gpt", rank, size, bucket_cap_mb=0.01, setup=lambda m: m.register_comm_hook(None, wrapper(spy))), 2,
        timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2), rtol=0.0, atol=atol)
    assert set(seen) == {torch.float16 if wrapper is fp16_compress_wrapper else torch.bfloat16}


def test_a_wrapped_powersgd_sees_the_buckets_gradients_as_views_of_the_cast_copy() -> None:
    # Cast to the bucket's own dtype, the wrapper must change nothing: PowerSGD splits the bucket through
    # gradients(), so views of the wrong part of the copy would show as different weights.
    def train(hook: Callable) -> list[Tensor]:
        def setup(model: spmd.DistributedDataParallel) -> None:
            state = PowerSGDState(None, matrix_approximation_rank=2, min_compression_rate=0.0, start_powerSGD_iter=1)
            model.register_comm_hook(state, hook)

        return run_ranks(lambda rank, size: ddp_train("gpt", rank, size, steps=4, bucket_cap_mb=0.01, setup=setup),
                         2, timeout=TIMEOUT)[0]["params"]

    plain, wrapped = train(powerSGD_hook), train(_compress_wrapper(powerSGD_hook, torch.float32, "identity"))
    assert all(torch.equal(p, q) for p, q in zip(plain, wrapped, strict=True))


def test_powersgd_full_rank_is_exact() -> None:
    # With r = min(n, m), P spans every column of the summed gradient, so P P^T M = M: only the
    # orthonormalization's rounding remains (a few ulps amplified by the matrix condition: atol 2e-5).
    def setup(model: spmd.DistributedDataParallel) -> None:
        state = PowerSGDState(None, matrix_approximation_rank=1000, min_compression_rate=0.0, start_powerSGD_iter=1)
        model.register_comm_hook(state, powerSGD_hook)

    # A batch of 2 x 16 makes every weight gradient full rank; with a rank-deficient sum, P would have
    # numerically zero columns that Gram-Schmidt can't make orthogonal, and the projection would not be exact.
    results = run_ranks(lambda rank, size: ddp_train("mlp", rank, size, steps=4, batch_size=16, setup=setup), 2,
                        timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2, steps=4, batch_size=16), rtol=1e-4, atol=2e-5)


def test_powersgd_low_rank_protocol_and_error_feedback() -> None:
    def body(rank: int, size: int) -> dict[str, Any]:
        state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.5)
        result = ddp_train("gpt", rank, size, steps=6, bucket_cap_mb=0.01,
                           setup=lambda m: m.register_comm_hook(state, powerSGD_hook))
        result["errors"] = len(state.error_dict)
        # Per compressed step and bucket: one flat all-reduce of the plain tensors, one of P, one of Q
        # (the first only if the bucket has a vector, the others only if it has a matrix worth compressing).
        splits = [_split(bucket.views, state) for bucket in result["model"].reducer.buckets]
        result["per_step"] = sum(2 * bool(matrices) + bool(plain) for matrices, plain in splits)
        return result

    results = run_ranks(body, 2, timeout=TIMEOUT)
    for result in results:
        buckets = result["buckets"]
        assert result["errors"] == buckets          # every bucket keeps its error-feedback memory
        assert result["counts"] == {"all_reduce": 2 * buckets + (6 - 2) * result["per_step"]}
        assert result["per_step"] > 2 * buckets     # most buckets hold both kinds
        assert result["losses"][-1] < result["losses"][0]
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)   # replicas agree


# -- uneven inputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_join_with_uneven_inputs(divide_by_initial_world_size: bool) -> None:
    world_size = 3
    steps_of = {0: 2, 1: 4, 2: 3}     # rank r trains steps_of[r] batches

    def body(rank: int, size: int) -> list[Tensor]:
        model = spmd.DistributedDataParallel(build("cnn", seed=100 * rank))
        opt = optimizer(model.parameters())
        with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(steps_of[rank]):
                x, y = batch("cnn", 4 * size, seed=step)
                opt.zero_grad()
                loss_fn("cnn", model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
                opt.step()
        return [p.detach().clone() for p in model.module.parameters()]

    results = run_ranks(body, world_size, timeout=TIMEOUT)

    model = build("cnn", seed=0)
    opt = optimizer(model.parameters())
    for step in range(max(steps_of.values())):
        active = [r for r in range(world_size) if step < steps_of[r]]
        divisor = world_size if divide_by_initial_world_size else len(active)
        x, y = batch("cnn", 4 * world_size, seed=step)
        opt.zero_grad()
        for rank in active:
            (loss_fn("cnn", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]) / divisor).backward()
        opt.step()
    for params in results:   # every rank ends with the model of the ranks that trained longest
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_join_throw_on_early_termination() -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(MLP())
        with model.join(throw_on_early_termination=True):
            for _ in range(1 + rank):
                model(torch.randn(2, 7)).sum().backward()

    with pytest.raises(RuntimeError, match="ran out of inputs"):
        run_ranks(body, 2, timeout=TIMEOUT)


# -- mixed precision and compilation ------------------------------------------------------------------------

def test_autocast_and_grad_scaler() -> None:
    # bf16 autocast: both runs do the same bf16 matmuls on the same shards, so they agree as the fp32 runs do
    # except where bf16 sums of per-rank products round differently: atol 1e-4.
    def train(model: nn.Module, shards: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        opt = optimizer(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for _ in range(STEPS):
            opt.zero_grad()
            for x, y in shards:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn("gpt", model(x), y) / len(shards)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in (model.module if hasattr(model, "module") else model).parameters()]

    x, y = batch("gpt", 8)
    want = train(build("gpt"), list(zip(x.chunk(2), y.chunk(2))))
    results = run_ranks(lambda rank, size: train(spmd.DistributedDataParallel(build("gpt", seed=rank)),
                                                 [(x.chunk(2)[rank], y.chunk(2)[rank])]), 2, timeout=TIMEOUT)
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_compiled_module() -> None:
    compiled = [torch.compile(build("mlp", seed=0), backend="aot_eager") for _ in range(2)]
    x, _y = batch("mlp", 8)
    compiled[0](x)   # compile once on this thread; the rank threads reuse the cached graph

    def body(rank: int, size: int) -> list[Tensor]:
        model = spmd.DistributedDataParallel(compiled[rank])
        opt = optimizer(model.parameters())
        for step in range(STEPS):
            xs, ys = batch("mlp", 8, seed=step)
            opt.zero_grad()
            loss_fn("mlp", model(xs.chunk(size)[rank]), ys.chunk(size)[rank]).backward()
            opt.step()
        return [p.detach().clone() for p in model.module.parameters()]

    results = run_ranks(body, 2, timeout=TIMEOUT)
    _, want = reference("mlp", 2, batch_size=4)
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- errors --------------------------------------------------------------------------------------------------

def test_bad_use_gives_clear_errors() -> None:
    def body(rank: int, size: int) -> None:
        frozen = MLP()
        frozen.requires_grad_(False)
        with pytest.raises(ValueError, match="MLP has no parameter that requires grad"):
            spmd.DistributedDataParallel(frozen)

        tensor_parallel = MLP()
        tensor_parallel.layers[0].weight = nn.Parameter(distribute_tensor(
            tensor_parallel.layers[0].weight.detach(), init_device_mesh("cpu", (size,)), [Shard(0)]))
        with pytest.raises(ValueError, match=r"parameter 'layers\.0\.weight' is laid out \[Shard\(0\)\].*split "
                                             r"along mesh dims \[0\] across ranks of DDP's group \[0, 1\]"):
            spmd.DistributedDataParallel(tensor_parallel)    # sharded over DDP's own ranks

        group = spmd.new_group([0])
        if rank == 1:
            with pytest.raises(ValueError, match="rank 1 is not in group"):
                spmd.DistributedDataParallel(MLP(), process_group=group)

        with pytest.raises(ValueError, match=r"rank 1 vs rank 0: layers\.1\.weight \(14, 13\) torch\.float32 vs "
                                             r"layers\.1\.weight \(15, 13\)"):
            spmd.DistributedDataParallel(MLP((7, 13, 15 - rank, 3)))

        model = spmd.DistributedDataParallel(MLP())
        model.module.layers[0].weight.requires_grad_(False)
        with pytest.raises(RuntimeError, match=r"changed after wrapping.*removed or frozen: \['layers\.0\.weight'\]"):
            model(torch.randn(2, 7))
        model.module.layers[0].weight.requires_grad_(True)
        model.module.extra = nn.Linear(3, 3)
        with pytest.raises(RuntimeError, match=r"added or newly trainable: \['extra\.weight', 'extra\.bias'\]"):
            model(torch.randn(2, 7))

        model = spmd.DistributedDataParallel(MLP())
        model.register_comm_hook(None, allreduce_hook)
        with pytest.raises(RuntimeError, match="already registered"):
            model.register_comm_hook(None, allreduce_hook)

    run_ranks(body, 2, timeout=TIMEOUT)


def test_buffers_follow_rank_zero_each_training_forward() -> None:
    def body(rank: int, size: int) -> tuple[float, float]:
        model = spmd.DistributedDataParallel(build("cnn"))
        model.eval()                                   # BatchNorm reads, not updates, its running stats
        model.module.norm.running_mean.fill_(float(rank + 1))
        with torch.no_grad():
            model(torch.randn(2, 3, 9, 9))             # no grad: no broadcast (rank 0 may evaluate alone)
        before = model.module.norm.running_mean[0].item()
        model(torch.randn(2, 3, 9, 9)).sum().backward()
        return before, model.module.norm.running_mean[0].item()

    assert run_ranks(body, 2, timeout=TIMEOUT) == [(1.0, 1.0), (2.0, 1.0)]


# -- against torch's own DDP -------------------------------------------------------------------------------

def _train_wrapped(rank: int, world_size: int, wrap: Callable[[nn.Module], nn.Module]) -> dict[str, Any]:
    """Train `wrap`'s data-parallel form of a GPT (each rank initialised differently: construction syncs them),
    small buckets; the losses and the parameters by name, without a wrapper's `module.` prefix."""
    model = wrap(build("gpt", seed=100 * rank))
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch("gpt", 4 * world_size, seed=step)
        opt.zero_grad()
        loss = loss_fn("gpt", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {name.removeprefix("module."): p.detach().clone()
                                         for name, p in model.named_parameters()}}


def _torch_ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    # The gloo group is left for the pool to discard with the process (it replaces a worker that leaves
    # torch.distributed initialized): gloo's teardown here, at destroy or at interpreter exit, hung or aborted
    # one run in a few ("terminate called without an active exception").
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return {"ddp": _train_wrapped(rank, world_size,
                                  lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)),
            "replicate": _train_wrapped(rank, world_size, lambda m: replicate(m, bucket_cap_mb=0.01))}


def test_matches_torch_ddp_and_its_composable_replicate(procpool: ProcPool) -> None:
    # torch's ranks run in the worker pool's processes, not as threads: two gloo groups in one process hung once,
    # beyond pytest-timeout's reach.
    from spmd._composable import replicate

    ours = run_ranks(lambda rank, size: {
        "ddp": _train_wrapped(rank, size, lambda m: spmd.DistributedDataParallel(m, bucket_cap_mb=0.01)),
        "replicate": _train_wrapped(rank, size, lambda m: replicate(m, bucket_cap_mb=0.01))}, 2, timeout=TIMEOUT)
    theirs = procpool.run(_torch_ddp_worker, 2, timeout=TIMEOUT)
    for rank in range(2):
        for kind in ("ddp", "replicate"):
            torch.testing.assert_close(torch.tensor(ours[rank][kind]["losses"]),
                                       torch.tensor(theirs[rank][kind]["losses"]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours[rank][kind]["params"], theirs[rank][kind]["params"], rtol=1e-5,
                                       atol=1e-6)


# -- lifetime ------------------------------------------------------------------------------------------------

def test_discarded_wrapper_releases_its_hooks_and_buckets() -> None:
    # Wrapping a module again (after changing it, as the "changed after wrapping" error advises) must not leave
    # the first wrapper's hooks copying every gradient into buckets nobody reads.
    def body(rank: int, size: int) -> list[Tensor]:
        module = MLP()
        first = spmd.DistributedDataParallel(module)
        reducer = weakref.ref(first.reducer)
        del first
        assert reducer() is None
        assert all(not param._post_accumulate_grad_hooks for param in module.parameters())
        second = spmd.DistributedDataParallel(module)
        counts = count_collectives(second.process_group)
        x, _ = batch("mlp", 4 * size, seed=0)
        second(x.chunk(size)[rank]).sum().backward()
        assert dict(counts) == {"all_reduce": len(second.reducer.buckets)}
        return [param.grad.clone() for param in module.parameters()]

    first, second = run_ranks(body, 2, timeout=TIMEOUT)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


# -- torch-compatibility arguments --------------------------------------------------------------------------

def test_device_ids_and_output_device_follow_torchs_rules() -> None:
    def body(rank: int, size: int) -> None:
        model = spmd.DistributedDataParallel(MLP(), device_ids=None, output_device=None, dim=0)
        assert (model.device, model.device_ids, model.output_device, model.dim) == (torch.device("cpu"), None,
                                                                                    None, 0)
        with pytest.raises(ValueError, match=r"leave them None for CPU and multi-device modules \(got device_ids "
                                             r"\[0\], output_device None, module parameters on \['cpu'\]\)"):
            spmd.DistributedDataParallel(MLP(), device_ids=[0])
        with pytest.raises(ValueError, match="leave them None"):
            spmd.DistributedDataParallel(MLP(), output_device=0)
        with pytest.raises(ValueError, match="device_ids can only be None or contain a single element"):
            spmd.DistributedDataParallel(MLP(), device_ids=[0, 1])

    run_ranks(body, 2, timeout=TIMEOUT)


def test_device_ids_on_an_accelerator_module() -> None:
    # The rules alone (no accelerator needed): they read only each parameter's device.
    on = [types.SimpleNamespace(device=torch.device("cuda", 1))]
    assert _device_ids([1], None, on) == ([1], 1)
    assert _device_ids([torch.device("cuda", 1)], 0, on) == ([1], 0)
    assert _device_ids(None, None, on) == (None, None)
    with pytest.raises(ValueError, match=r"names a device other than the module's cuda:1; pass device_ids=\[1\]"):
        _device_ids([0], None, on)
    two = [*on, types.SimpleNamespace(device=torch.device("cuda", 0))]
    with pytest.raises(ValueError, match=r"module parameters on \['cuda:0', 'cuda:1'\]"):
        _device_ids([1], None, two)


def test_join_blocks_do_not_nest_and_end_cleanly() -> None:
    def body(rank: int, size: int) -> int:
        model = spmd.DistributedDataParallel(MLP())
        with model.join():
            with pytest.raises(RuntimeError, match="already inside a join context"), model.join():
                pass
            model(torch.randn(2, 7)).sum().backward()
        with model.join(enable=False):
            model(torch.randn(2, 7)).sum().backward()
        with model.join():   # a second block after the first ended
            for _ in range(rank):
                model(torch.randn(2, 7)).sum().backward()
        return model.reducer.div_factor

    assert run_ranks(body, 2, timeout=TIMEOUT) == [2, 2]


def test_parameters_and_buffers_set_to_be_ignored_are_neither_broadcast_nor_reduced() -> None:
    """torch's DistributedDataParallel._set_params_and_buffers_to_ignore_for_model: a parameter another
    parallelism owns keeps each rank's own values and local gradient; an ignored buffer is not broadcast."""
    class Model(nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.shared = nn.Linear(3, 2)
            self.local = nn.Parameter(torch.full((2,), float(rank + 1)))
            self.register_buffer("steps", torch.tensor(float(rank)))
            self.register_buffer("mine", torch.tensor(float(rank)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(x) * self.local

    def body(rank: int, size: int) -> dict:
        with seeded(rank):            # different initial values on each rank
            model = Model(rank)
        spmd.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["local", "mine"])
        ddp = spmd.DistributedDataParallel(model)
        after_init = {"local": model.local.detach().clone(), "shared": model.shared.weight.detach().clone(),
                      "steps": model.steps.clone(), "mine": model.mine.clone()}
        ddp(torch.ones(1, 3) * (rank + 1)).sum().backward()
        return {**after_init, "local_grad": model.local.grad.clone(), "shared_grad": model.shared.weight.grad.clone()}

    r0, r1 = run_ranks(body, 2, timeout=30)
    assert torch.equal(r0["shared"], r1["shared"]) and torch.equal(r0["steps"], r1["steps"])      # rank 0's
    assert r0["local"].tolist() == [1.0, 1.0] and r1["local"].tolist() == [2.0, 2.0]              # their own
    assert r0["mine"].item() == 0.0 and r1["mine"].item() == 1.0
    assert torch.equal(r0["shared_grad"], r1["shared_grad"])                                       # averaged
    assert not torch.equal(r0["local_grad"], r1["local_grad"])                                     # local


@pytest.mark.parametrize("how", ["apply_in_backward", "fused", "apply_in_backward, bucket view"])
def test_optimizers_applied_in_backward_step_on_the_averaged_gradients(how: str) -> None:
    """torch's _apply_optimizer_in_backward under DDP, and DDP's _register_fused_optim: each parameter's optimizer
    steps once its bucket's average is written back (not on the local gradient), then its gradient is freed; the
    same training as an ordinary optimizer stepped after backward."""
    from spmd.optim import _apply_optimizer_in_backward, _get_in_backward_optimizers

    def train(rank: int, size: int, in_backward: bool) -> tuple[list[float], list[torch.Tensor], bool]:
        model = build("mlp", seed=0)
        if in_backward and how != "fused":
            _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR, "momentum": 0.9})
        ddp = spmd.DistributedDataParallel(model, gradient_as_bucket_view=how.endswith("bucket view"))
        if in_backward and how == "fused":
            ddp._register_fused_optim(torch.optim.SGD, LR, momentum=0.9)
            with pytest.raises(RuntimeError, match="an optimizer is already registered on this wrapper"):
                ddp._register_fused_optim(torch.optim.SGD, LR)
        opt = None if in_backward else optimizer(ddp.parameters())
        losses = []
        for step in range(3):
            x, y = batch("mlp", 2 * size, seed=step)
            loss = loss_fn("mlp", ddp(x.chunk(size)[rank]), y.chunk(size)[rank])
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        freed = all(p.grad is None for p in model.parameters())
        assert len(_get_in_backward_optimizers(model)) == (len(list(model.parameters())) if in_backward else 0)
        return losses, [p.detach().clone() for p in model.parameters()], freed

    for (losses, params, freed), (want_losses, want_params, _) in run_ranks(
            lambda rank, size: (train(rank, size, True), train(rank, size, False)), 2, timeout=30):
        assert freed
        torch.testing.assert_close(losses, want_losses)
        for got, want in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, want)
