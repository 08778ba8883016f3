"""Ring attention (spmd.tensor.ring_attention), the engine of context parallelism: the kernels in tensor ops
(for devices without fused ones) match torch's fused CPU kernels, forward and backward with the final
log-sum-exp; the ring and the gathered blocks give the same attention as one process in 16-bit inputs too;
which keys a query block sees at each step; a rank whose peer never arrives gets an error naming the ring."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd._core.errors import CommTimeoutError
from spmd.tensor import init_device_mesh
from spmd.tensor import ring_attention as ring
from spmd.testing import run_ranks
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
V = ring.Visibility


def _tensors(seq: int, heads: int = 4, kv_heads: int = 2, dtype: torch.dtype = torch.float64,
             seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, seq, 8, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads)]


@pytest.mark.parametrize("causal", [True, False])
def test_the_math_kernels_match_torchs_fused_cpu_kernels(causal: bool) -> None:
    query, key, value, grad = _tensors(12)
    fused, math = ring.kernels_for(torch.device("cpu")), ring.MATH_KERNELS
    out, lse = fused.forward(query, key, value, causal, 0.4)
    got_out, got_lse = math.forward(query, key, value, causal, 0.4)
    torch.testing.assert_close(got_out, out)
    torch.testing.assert_close(got_lse, lse)
    want = fused.backward(grad, query, key, value, out, lse, causal, 0.4)
    torch.testing.assert_close(math.backward(grad, query, key, value, out, lse, causal, 0.4), want)
    assert [g.shape for g in want] == [query.shape, key.shape, value.shape]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_kernels_calling_conventions_agree_with_the_math_kernels_on_meta(causal: bool,
                                                                                 dtype: torch.dtype) -> None:
    """torch's memory-efficient CUDA kernels, run on meta tensors (their shape functions): grouped-query heads
    expanded and summed back, the log-sum-exp cut from and padded back to whole 32-row blocks (40 query rows), the
    outputs, log-sum-exp and gradients of the math kernels' shapes and dtypes."""
    cuda, math = ring._CudaEfficient(), ring.MATH_KERNELS
    query, key, value = (torch.empty(2, heads, rows, 8, dtype=dtype, device="meta")
                         for heads, rows in ((4, 40), (2, 24), (2, 24)))
    out, lse = cuda.forward(query, key, value, causal, None)
    want_out, want_lse = math.forward(query, key, value, causal, None)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (want_out.shape, want_out.dtype, want_lse.shape,
                                                            want_lse.dtype)
    grads = cuda.backward(torch.empty_like(out), query, key, value, out, lse, causal, None)
    want = math.backward(torch.empty_like(out), query, key, value, out, lse, causal, None)
    assert [(g.shape, g.dtype) for g in grads] == [(g.shape, g.dtype) for g in want] == \
        [(t.shape, dtype) for t in (query, key, value)]


def test_what_a_query_block_sees_of_each_ranks_keys() -> None:
    assert ring.visibility(1, 0, is_causal=False, head_tail=True) is V.FULL
    assert ring.visibility(1, 1, is_causal=True, head_tail=True) is V.CAUSAL
    assert ring.visibility(2, 0, is_causal=True, head_tail=True) is V.FIRST_KEYS
    assert ring.visibility(0, 2, is_causal=True, head_tail=True) is V.LAST_QUERIES
    assert ring.visibility(2, 0, is_causal=True, head_tail=False) is V.FULL
    assert ring.visibility(0, 2, is_causal=True, head_tail=False) is V.NONE


def _whole(tensors: list[torch.Tensor], causal: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(tensors[3])
    return out.detach(), [leaf.grad for leaf in leaves]


def _ring(mesh, tensors: list[torch.Tensor], causal: bool, method: ring.RotateMethod):
    """This rank's plain slice (rank r holds the r-th) through ring attention, and its gradients."""
    rank, size = mesh.get_local_rank(), mesh.size()
    local = [t.chunk(size, dim=2)[rank].clone() for t in tensors]
    leaves = [t.requires_grad_() for t in local[:3]]
    layout = ring.RingLayout(mesh.get_group(), causal, head_tail=False, scale=None, method=method)
    out = ring.ring_attention(layout, *leaves)
    out.backward(local[3])
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("method", list(ring.RotateMethod))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_16_and_32_bit_inputs_match_one_process_within_their_precision(method: ring.RotateMethod,
                                                                       dtype: torch.dtype) -> None:
    tensors = _tensors(24, dtype=dtype)
    want_out, want_grads = _whole([t.double() for t in tensors], causal=True)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for rank, (out, grads) in enumerate(run_on_mesh((3,), lambda mesh: _ring(mesh, tensors, True, method),
                                                    timeout=TIMEOUT)):
        assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
        torch.testing.assert_close(out.double(), want_out.chunk(3, dim=2)[rank], **tolerance)
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got.double(), want.chunk(3, dim=2)[rank], **tolerance)


def test_the_ring_and_the_gathered_blocks_agree_bit_for_bit() -> None:
    tensors = _tensors(16)
    results = {method: run_on_mesh((4,), lambda mesh, m=method: _ring(mesh, tensors, True, m), timeout=TIMEOUT)
               for method in ring.RotateMethod}
    for gathered, passed in zip(results[ring.RotateMethod.ALL_GATHER], results[ring.RotateMethod.ALL_TO_ALL],
                                strict=True):
        assert torch.equal(gathered[0], passed[0])
        assert all(torch.equal(a, b) for a, b in zip(gathered[1], passed[1], strict=True))


def test_an_odd_slice_cannot_hold_two_head_tail_chunks() -> None:
    def body(mesh) -> None:
        layout = ring.RingLayout(mesh.get_group(), True, head_tail=True, scale=None,
                                 method=ring.RotateMethod.ALL_TO_ALL)
        q = torch.zeros(1, 1, 3, 2)
        with pytest.raises(ValueError, match="two equal chunks per rank, but this rank's slice has 3 positions"):
            layout.check(q, q, q, "test")
        with pytest.raises(ValueError, match="3 query heads do not group over 2"):
            layout.check(torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), "test")

    run_on_mesh((2,), body, timeout=TIMEOUT)


def test_a_rank_that_never_joins_the_ring_is_named_in_a_timeout() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (world_size,))
        if rank == 1:
            return                       # never calls the attention
        layout = ring.RingLayout(mesh.get_group(), True, head_tail=False, scale=None,
                                 method=ring.RotateMethod.ALL_TO_ALL)
        q = torch.zeros(1, 1, 4, 2)
        ring.ring_attention(layout, q, q, q)

    with pytest.raises(CommTimeoutError) as caught:
        run_ranks(body, 2, timeout=TIMEOUT, comm_timeout=1.0)
    assert "irecv 1->0" in str(caught.value)
    assert any("group rank 0 was passing a key/value block to group rank 1 and waiting for one from group rank 1"
               in note for note in caught.value.__notes__)
