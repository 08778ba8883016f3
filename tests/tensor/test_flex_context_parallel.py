"""Context parallelism of flex_attention, TorchTitan's way (`_context_parallel_shard` of the inputs and the
BlockMask, `_ContextParallel(FLEX)` on the attention module): each rank attends with its slice of the queries
and the gathered keys and values, and matches one process, for causal, document-causal and sliding-window
masks, with no deal, the head-tail deal, the per-document deal and PTRR; forward and backward, and a
document-causal transformer trained this way matches training on the whole sequence, and the attention module
compiles whole (fullgraph) to the same forward; the load balancers deal as
torch's docstrings draw (PTRR's indices are torch's own); misuse raises before anything is sent.

torch's CPU flex_attention refuses to differentiate (its compiled CPU kernel has no backward); the eager path,
which is what runs uncompiled, is plain differentiable math, so these tests lift that check for the single
process and the parallel run alike (`differentiable_on_cpu`). Differentiating, eager flex_attention traces its
score_mod with torch.fx, whose tracer patches torch.nn.Module for every thread: rank threads would run into each
other's tracing, so the backward runs in real processes (tests/procpool.py) and the thread ranks check the
forward (no grad, no tracing)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.attention.flex_attention as flex
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.tensor import DTensor, Shard
from spmd.tensor.experimental._context_parallel import (
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
    context_parallel_unshard,
    flex_cp_allgather,
)
from spmd.tensor.experimental._context_parallel._attention import _create_cp_block_mask
from spmd.tensor.parallel import parallelize_module
from spmd.testing import seeded
from tests.procpool import ProcPool
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
FLEX = _ContextParallel.AttentionType.FLEX
SEQ, BLOCK = 64, 8
DOCS = [16, 32, 16]                     # document lengths, each divisible by 2 * 4 ranks


@contextlib.contextmanager
def differentiable_on_cpu() -> Iterator[None]:
    """flex_attention's eager CPU path differentiated (see the module docstring) and its eager-mode warning
    quiet."""
    saved = flex._validate_device
    flex._validate_device = lambda query, key, value: None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            yield
    finally:
        flex._validate_device = saved


@pytest.fixture(autouse=True)
def _flex_on_cpu() -> Iterator[None]:
    """Each test with `differentiable_on_cpu`, and the load-balance switch (every shard sets it) back to its
    default afterwards."""
    with differentiable_on_cpu():
        yield
    _cp_options.enable_load_balance = True


DOCUMENT_OF = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))   # position -> its document


def _document(position: torch.Tensor) -> torch.Tensor:
    """The document of a position, read from a buffer the mask_mod captures (flex_attention's usual way, which
    its compiled kernel takes too)."""
    return DOCUMENT_OF[position]


def causal(b, h, q, kv):
    return q >= kv


def document_causal(b, h, q, kv):
    return (_document(q) == _document(kv)) & (q >= kv)


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 12)


def _mask(mask_mod) -> flex.BlockMask:
    return flex.create_block_mask(mask_mod, 1, 1, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)


class _FlexAttention(nn.Module):
    """TorchTitan's inner attention module: nothing but the attention call, the block mask passed in."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: flex.BlockMask) -> torch.Tensor:
        return flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _balancer(name: str, size: int, mask: flex.BlockMask):
    return {"none": None, "head_tail": _HeadTailLoadBalancer(SEQ, size, "cpu"),
            "per_document": _PerDocumentHeadTailLoadBalancer([DOCS], size, "cpu"),
            "ptrr": _PTRRLoadBalancer(mask, size)}[name]


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, SEQ, 4, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4)]


def _attend(tensors: list[torch.Tensor], mask: flex.BlockMask, grad: bool) -> list[torch.Tensor]:
    """One process: the output (and with `grad` the gradients of query, key and value) of the whole sequence."""
    leaves = [t.clone().requires_grad_(grad) for t in tensors[:3]]
    out = flex.flex_attention(*leaves, block_mask=mask, enable_gqa=True)
    if not grad:
        return [out]
    out.backward(tensors[3])
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _attend_in_slices(mesh, tensors: list[torch.Tensor], mask: flex.BlockMask, deal: str,
                      grad: bool) -> list[torch.Tensor]:
    """This rank's `_attend` with context parallelism, its results gathered back in sequence order."""
    attention = parallelize_module(_FlexAttention(), mesh, _ContextParallel(seq_dim=2, attention_type=FLEX))
    balancer = _balancer(deal, mesh.size(), mask)
    *local, local_mask = _context_parallel_shard(mesh, [*tensors, mask], [2, 2, 2, 2, 0], balancer)
    assert local_mask.seq_lengths == (SEQ // mesh.size(), SEQ) and local_mask.BLOCK_SIZE == (BLOCK, BLOCK)
    q, k, v = (t.requires_grad_(grad) for t in local[:3])
    out = attention(q, k, v, local_mask)
    assert type(out) is torch.Tensor and out.shape == (2, 4, SEQ // mesh.size(), 4)
    results = [out.detach()]
    if grad:
        out.backward(local[3])
        results += [q.grad, k.grad, v.grad]
    return context_parallel_unshard(mesh, results, [2] * len(results), balancer)


MASKS = {"causal": causal, "document_causal": document_causal, "sliding_window": sliding_window}
CASES = [("causal", "none", 2), ("causal", "head_tail", 4), ("document_causal", "per_document", 4),
         ("document_causal", "ptrr", 2), ("sliding_window", "ptrr", 4), ("sliding_window", "head_tail", 2)]


@pytest.mark.parametrize(("mask_name", "deal", "size"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_flex_attention_on_sequence_slices_matches_the_whole_sequence(mask_name: str, deal: str, size: int) -> None:
    tensors, mask = _tensors(), _mask(MASKS[mask_name])
    want = _attend(tensors, mask, grad=False)
    for got in run_on_mesh((size,), lambda mesh: _attend_in_slices(mesh, tensors, mask, deal, grad=False),
                           timeout=TIMEOUT):
        torch.testing.assert_close(got, want)


def test_per_row_deals_need_a_mask_per_row() -> None:
    """Two batch rows packed with different documents: a per-document deal for each row, one block mask."""
    rows = [[16, 32, 16], [32, 32]]
    starts = torch.tensor([[0, 16, 48, 64], [0, 32, 64, 64]])

    def row_documents(b, h, q, kv):
        return (torch.bucketize(q, starts[b], right=True) == torch.bucketize(kv, starts[b], right=True)) & (q >= kv)

    tensors = _tensors(seed=1)
    mask = flex.create_block_mask(row_documents, 2, 1, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    want = flex.flex_attention(*tensors[:3], block_mask=mask, enable_gqa=True)

    def body(mesh) -> list[torch.Tensor]:
        attention = parallelize_module(_FlexAttention(), mesh, _ContextParallel(seq_dim=2, attention_type=FLEX))
        balancer = _PerDocumentHeadTailLoadBalancer(rows, mesh.size(), "cpu")
        *local, local_mask = _context_parallel_shard(mesh, [*tensors[:3], mask], [2, 2, 2, 0], balancer)
        assert local_mask.kv_num_blocks.shape[0] == 2                        # a mask per batch row
        out = attention(*local, block_mask=local_mask)
        return context_parallel_unshard(mesh, [out], [2], balancer)

    for got in run_on_mesh((2,), body, timeout=TIMEOUT):
        torch.testing.assert_close(got[0], want)


class _Block(nn.Module):
    """A one-block document-causal transformer with TorchTitan's layout: positions and block mask passed in,
    attention in its own module."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(SEQ, dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.attention = _FlexAttention()
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: flex.BlockMask) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(positions)
        b, t, d = h.shape
        q, k, v = (x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for x in self.qkv(self.norm(h)).chunk(3, dim=-1))
        h = h + self.proj(self.attention(q, k, v, mask).transpose(1, 2).reshape(b, t, d))
        return self.head(h)


def _batch(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (2, SEQ + 1), generator=gen)
    return [tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(2, SEQ)]


def _train(model: nn.Module, shard) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three AdamW steps on document-causal batches, each dealt by `shard` first: the losses and parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mask, losses = _mask(document_causal), []
    for step in range(3):
        opt.zero_grad()
        inputs, labels, positions, block_mask = shard([*_batch(step), mask])
        loss = F.cross_entropy(model(inputs, positions, block_mask).flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def _initial_block() -> _Block:
    with seeded(0):
        return _Block()


BACKWARD_CASES = [("causal", "head_tail"), ("document_causal", "per_document"), ("sliding_window", "ptrr")]


def _in_processes(rank: int, world_size: int) -> dict[str, object]:
    """A pool worker's rank: the backward cases and a Titan-way training over shm."""
    from spmd.device_mesh import init_device_mesh

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    try:
        with differentiable_on_cpu():
            mesh = init_device_mesh("cpu", (world_size,))
            results: dict[str, object] = {
                f"{name}-{deal}": _attend_in_slices(mesh, _tensors(), _mask(MASKS[name]), deal, grad=True)
                for name, deal in BACKWARD_CASES}
            model = _initial_block()
            parallelize_module(model.attention, mesh, _ContextParallel(seq_dim=2, attention_type=FLEX))
            model = spmd.DistributedDataParallel(model, process_group=mesh.get_group())
            balancer = _PTRRLoadBalancer(_mask(document_causal), world_size)
            losses, params = _train(model, lambda batch: _context_parallel_shard(mesh, batch, (1, 1, 1, 0), balancer))
            for loss in losses:                  # each rank's loss is the mean over its tokens
                spmd.all_reduce(loss, group=mesh.get_group())
                loss /= world_size
            results["training"] = (losses, params)
            results["compiled"] = _compiled_forward(mesh)
            return results
    finally:
        spmd.destroy_process_group()


def _compiled_forward(mesh) -> dict[str, torch.Tensor]:
    """The FLEX attention module compiled whole (hook, key/value gather and flex_attention in one graph:
    fullgraph), forward only and in float32 (CPU's compiled flex_attention has no backward and no float64),
    gathered back in sequence order."""
    tensors, mask = [t.float() for t in _tensors()], _mask(document_causal)
    attention = parallelize_module(_FlexAttention(), mesh, _ContextParallel(seq_dim=2, attention_type=FLEX))
    balancer = _PTRRLoadBalancer(mask, mesh.size())
    *local, local_mask = _context_parallel_shard(mesh, [*tensors[:3], mask], [2, 2, 2, 0], balancer)
    outputs = {}
    with torch.no_grad():
        for backend in ("aot_eager",):          # inductor passes too, but its CPU flex kernel costs 20 s to build
            out = torch.compile(attention, backend=backend, fullgraph=True)(*local, local_mask)
            outputs[backend] = context_parallel_unshard(mesh, [out], [2], balancer)[0]
    return outputs


@pytest.mark.timeout(120)
def test_backward_and_training_in_processes_match_the_whole_sequence(procpool: ProcPool) -> None:
    per_rank = procpool.run(_in_processes, 2, timeout=100)
    want_losses, want_params = _train(_initial_block(), lambda batch: batch)
    for results in per_rank:
        for name, deal in BACKWARD_CASES:
            want = _attend(_tensors(), _mask(MASKS[name]), grad=True)
            torch.testing.assert_close(results[f"{name}-{deal}"], want)
        for backend, out in results["compiled"].items():
            torch.testing.assert_close(out, _attend([t.float() for t in _tensors()], _mask(document_causal),
                                                    grad=False)[0],
                                       msg=lambda message, backend=backend: f"compiled with {backend}: {message}")
        losses, params = results["training"]
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)


def test_flex_cp_allgather_gathers_and_scatters_the_gradient_back() -> None:
    def body(mesh) -> None:
        rank = mesh.get_local_rank()
        k = torch.full((1, 2, 3, 4), float(rank), requires_grad=True)
        v = torch.full((1, 2, 3, 2), 10.0 + rank, requires_grad=True)          # another head dim: two gathers
        whole_k, whole_v = flex_cp_allgather(k, v, -2, mesh.get_group().group_name)
        assert whole_k[0, 0, :, 0].tolist() == [0.0] * 3 + [1.0] * 3 and whole_v.shape == (1, 2, 6, 2)
        (whole_k.sum() * (rank + 1)).backward()                     # v unused: its gradient is zeros
        assert k.grad.unique().tolist() == [3.0] and v.grad.abs().sum() == 0
        with pytest.raises(ValueError, match="no group named 'nope'"):
            flex_cp_allgather(k, v, 2, "nope")
        with pytest.raises(ValueError, match="differ up to the sequence"):
            flex_cp_allgather(k, v[:, :, :2], 2, mesh)

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_the_load_balancers_deal_as_torch_draws_them() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer as torch_lb

    # torch's per-document docstring: documents of 4, 8 and 4 over 2 ranks
    dealt = _PerDocumentHeadTailLoadBalancer([[4, 8, 4]], 2, "cpu")._generate_indices()
    assert dealt.tolist() == [[0, 3, 4, 5, 10, 11, 12, 15, 1, 2, 6, 7, 8, 9, 13, 14]]
    restore = _PerDocumentHeadTailLoadBalancer([[4, 8, 4]], 2, "cpu")._generate_indices(restore=True)
    assert dealt[0][restore[0]].tolist() == list(range(16))
    # torch's PTRR docstring: the tasks and their groups, and the blocks of a document-causal mask
    times = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    groups = _PTRRLoadBalancer.ptrr_scheduling(times, 4)
    assert groups.tolist() == torch_lb._PTRRLoadBalancer.ptrr_scheduling(times, 4).tolist()
    assert [int(times[g].sum()) for g in groups] == [45, 45, 43, 47]

    def doc_causal(b, h, q, kv):
        starts = torch.tensor([0, 4, 12, 16])
        return (torch.bucketize(q, starts, right=True) == torch.bucketize(kv, starts, right=True)) & (q >= kv)

    mask = flex.create_block_mask(doc_causal, 1, 1, 16, 16, device="cpu", BLOCK_SIZE=1)
    ours = _PTRRLoadBalancer(mask, 2)._generate_indices()
    assert ours.tolist() == [[2, 3, 5, 6, 8, 11, 12, 13, 0, 1, 4, 7, 9, 10, 14, 15]]
    for size in (2, 4):
        blocks = flex.create_block_mask(document_causal, 1, 1, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
        for restore in (False, True):
            got = _PTRRLoadBalancer(blocks, size)._generate_indices(restore)
            assert got.tolist() == torch_lb._PTRRLoadBalancer(blocks, size)._generate_indices(restore).tolist()


def test_misuse_raises_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="document lengths divisible by 4; got \\[6\\]"):
        _PerDocumentHeadTailLoadBalancer([[6, 8]], 2, "cpu")
    with pytest.raises(ValueError, match="one mask for all heads"):
        _PTRRLoadBalancer(flex.create_block_mask(causal, 1, 2, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK), 2)
    with pytest.raises(ValueError, match="a sequence of 60 is not a whole number of 8-blocks"):
        _PTRRLoadBalancer(flex.create_block_mask(causal, 1, 1, 60, 60, device="cpu", BLOCK_SIZE=BLOCK), 2)

    def body(mesh) -> None:
        attention = parallelize_module(_FlexAttention(), mesh, _ContextParallel(seq_dim=2, attention_type=FLEX))
        q = torch.zeros(1, 1, 4, 2)
        with pytest.raises(TypeError, match="must take query, key and value tensors first"):
            attention(q, q, None, None)
        replicated = DTensor.from_local(q, mesh, [Shard(2)])
        with pytest.raises(TypeError, match="got a DTensor"):
            attention(replicated, replicated, replicated, None)
        with pytest.raises(ValueError, match="a query sequence of 5 does not divide over 2 ranks"):
            _create_cp_block_mask(causal, 1, 1, 5, 5, mesh)
        with pytest.raises(ValueError, match="deals one sequence to queries and keys alike"):
            _create_cp_block_mask(causal, 1, 1, 8, 16, mesh, _HeadTailLoadBalancer(8, 2, "cpu"))
        with pytest.raises(ValueError, match="deals 2 batch rows differently but the mask has B=3"):
            _create_cp_block_mask(causal, 3, 1, 16, 16, mesh, _PerDocumentHeadTailLoadBalancer([[16], [8, 8]], 2,
                                                                                                  "cpu"))

    run_on_mesh((2,), body, timeout=TIMEOUT)


    def two_d(mesh) -> None:
        with pytest.raises(ValueError, match="takes the 1-D context-parallel mesh; got 2-D"):
            _create_cp_block_mask(causal, 1, 1, 8, 8, mesh)
        with pytest.raises(ValueError, match=r"flex_cp_allgather: a 2-D DeviceMesh \(2, 2\) names no single group"):
            flex_cp_allgather(torch.zeros(1, 4), torch.zeros(1, 4), 1, mesh)
        whole_k, _ = flex_cp_allgather(torch.zeros(1, 4), torch.zeros(1, 4), 1, (mesh, 1))    # or (mesh, dim)
        assert whole_k.shape == (1, 8)

    run_on_mesh((2, 2), two_d, timeout=TIMEOUT)
