"""PowerSGD at low rank against its arithmetic done by hand in one process.

Two thread ranks train one Linear(8 -> 6) under DDP with powerSGD_hook at rank r = 2: one plain step first
(start_powerSGD_iter=1), then compressed steps with error feedback and warm start. The oracle replays the
algorithm of Vogels et al. on the same per-rank gradients, written independently of spmd.ddp.powersgd:
  M_r' = M_r + e_r                      (error feedback: what rank r's last approximation lost)
  P = orth(sum_r M_r' Q)                (orthonormal columns; QR here, Gram-Schmidt in the hook)
  Q = sum_r M_r'^T P                    (kept for the next step: warm start)
  M_avg = P Q^T / ranks,   e_r = M_r' - M_avg
The bias (a vector) is averaged exactly and keeps its error term too, as in torch's hook. QR and Gram-Schmidt
differ only in the signs of P's columns, which P Q^T does not see. The first Q is the hook's documented
draw: torch.randn(cols, r) from a generator seeded with `random_seed`, orthonormalized.

Tolerance: fp32, sums in rank order on both sides; the orthonormalization of a 6 x 2 matrix by two different
methods agrees to a few ulps, amplified by at most the condition of P: rtol 1e-4, atol 1e-6 (the gradient of
a wrong rank, a missing error term or a cold start differs in the first digit).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import spmd
from spmd.ddp import PowerSGDState, powerSGD_hook
from spmd.testing import run_ranks

RANK_R, STEPS, LR, SEED = 2, 5, 0.1, 7


def _model() -> nn.Linear:
    """The same Linear(8 -> 6) at every call, from its own generator: thread ranks share torch's global RNG, so a
    draw from it could interleave with the other rank's."""
    model = nn.Linear(8, 6)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
    return model


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 8, generator=generator), torch.randn(5, 6, generator=generator)


def _grads(model: nn.Linear, rank: int, step: int) -> tuple[Tensor, Tensor]:
    x, y = _batch(rank, step)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad.clone(), model.bias.grad.clone()


def _orth(matrix: Tensor) -> Tensor:
    return torch.linalg.qr(matrix).Q


def oracle(world_size: int) -> list[tuple[Tensor, Tensor]]:
    """The averaged (weight, bias) gradient PowerSGD must apply at each step."""
    model = _model()
    errors: list[tuple[Tensor, Tensor]] = [(torch.zeros(6, 8), torch.zeros(6))] * world_size
    q = _orth(torch.randn(8, RANK_R, generator=torch.Generator().manual_seed(SEED)))
    applied = []
    for step in range(STEPS):
        grads = [_grads(model, rank, step) for rank in range(world_size)]
        if step == 0:                               # before start_powerSGD_iter: a plain average, no error
            w_avg = sum(w for w, _ in grads) / world_size
            b_avg = sum(b for _, b in grads) / world_size
        else:
            fed = [(w + ew, b + eb) for (w, b), (ew, eb) in zip(grads, errors)]
            p = _orth(sum(w @ q for w, _ in fed))
            q = sum(w.t() @ p for w, _ in fed)
            w_avg = p @ q.t() / world_size
            b_avg = sum(b for _, b in fed) / world_size
            errors = [(w - w_avg, b - b_avg) for w, b in fed]
        applied.append((w_avg, b_avg))
        with torch.no_grad():
            model.weight -= LR * w_avg
            model.bias -= LR * b_avg
    return applied


def test_powersgd_low_rank_matches_the_arithmetic_by_hand() -> None:
    def body(rank: int, world_size: int) -> list[tuple[Tensor, Tensor]]:
        model = spmd.DistributedDataParallel(_model())
        state = PowerSGDState(None, matrix_approximation_rank=RANK_R, start_powerSGD_iter=1,
                              min_compression_rate=1.5, random_seed=SEED)
        model.register_comm_hook(state, powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        applied = []
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            applied.append((model.module.weight.grad.clone(), model.module.bias.grad.clone()))
            opt.step()
        assert state.q_memory, "the weight was not compressed: the test would not test PowerSGD"
        return applied

    want = oracle(2)
    for got in run_ranks(body, 2, timeout=60):
        for step, ((w, b), (w_want, b_want)) in enumerate(zip(got, want)):
            torch.testing.assert_close(w, w_want, rtol=1e-4, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")
            torch.testing.assert_close(b, b_want, rtol=1e-4, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")


def test_the_oracle_is_not_the_plain_average() -> None:
    """Rank 2 of a 6 x 8 sum of two rank-5 gradients loses information: the oracle must differ from DDP."""
    applied = oracle(2)
    model = _model()
    with torch.no_grad():                          # step 0 is a plain average on both sides
        model.weight -= LR * applied[0][0]
        model.bias -= LR * applied[0][1]
    plain_step1 = sum(_grads(model, rank, 1)[0] for rank in range(2)) / 2
    assert (applied[1][0] - plain_step1).abs().max() > 1e-3
