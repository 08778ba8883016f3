"""PowerSGD gradient compression for DistributedDataParallel (Vogels et al., 2019), with error feedback:
per matrix of the bucket (powerSGD_hook), or of the whole bucket as one square matrix (batched_powerSGD_hook).

Layer: ddp.

Note: PowerSGD in one bucket
Each gradient with a 2-D view M (n x m) worth compressing is replaced by a rank-r approximation:
  P = M Q               (Q: m x r, identical on all ranks)     -> all-reduce P (sum over ranks)
  P <- orthonormalize(P)                                       (identical on all ranks: same input)
  Q = M^T P                                                    -> all-reduce Q
  M_avg ~ P Q^T / ranks
which sends r (n + m) numbers instead of n m. Vectors, and matrices too small to gain `min_compression_rate`,
are averaged exactly in one flat all-reduce. With error feedback, what the approximation lost on this rank
(its M minus the averaged approximation) is added to the next iteration's gradient, so nothing is lost for
good. With warm start, Q is kept between iterations (one power iteration per step refines it). When r is
min(n, m), P spans M's columns and the approximation is exact up to rounding.

Note: PowerSGD collective order
The Q all-reduce needs the P all-reduce's result, so it cannot be issued from the P all-reduce's completion
callback: that runs whenever the transport finishes, and other buckets' all-reduces may or may not have been
issued by then, so ranks could order collectives differently. Instead each bucket's hook issues its
uncompressed and P all-reduces, and the hook of the last bucket runs the second phase for every bucket in
bucket order. Every rank therefore issues [U0, P0, U1, P1, ..., Q0, Q1, ...]: P all-reduces overlap backward,
Q all-reduces happen at its end.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.ddp.bucket import GradBucket
from spmd.ddp.comm_hooks import allreduce_hook


@dataclasses.dataclass
class PowerSGDState:
    """Configuration and memory of powerSGD_hook (torch's PowerSGDState fields and defaults)."""

    process_group: ProcessGroup | None                # None: the DDP module's group
    matrix_approximation_rank: int = 1                # r: rank of the approximation (communication ~ r)
    start_powerSGD_iter: int = 1_000                  # plain all-reduce for this many iterations first
    min_compression_rate: float = 2.0                 # compress a matrix only if n m >= rate * r (n + m)
    use_error_feedback: bool = True                   # carry this rank's approximation error to the next step
    warm_start: bool = True                           # reuse Q from the previous iteration
    orthogonalization_epsilon: float = 0.0            # added to column norms, guarding against zero columns
    random_seed: int = 0                              # seeds the initial Q (same on every rank)
    # torch's next two are accepted: spmd logs no compression statistics, and compresses each matrix on its own
    # (torch's batching of same-shape matrices into one batched matmul computes the same products)
    compression_stats_logging_frequency: int = 10_000
    batch_tensors_with_same_shape: bool = False
    iter: int = 0                                     # iterations seen (counted at each last bucket)
    error_dict: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    q_memory: dict[int, list[Tensor]] = dataclasses.field(default_factory=dict)
    _generator: torch.Generator | None = None
    _pending: list[_Phase] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank must be >= 1, got "
                             f"{self.matrix_approximation_rank}")
        if self.start_powerSGD_iter < 1 and self.use_error_feedback:
            # torch's rule: error feedback needs one plain iteration to size its memory safely.
            raise ValueError("PowerSGDState: start_powerSGD_iter must be >= 1 when use_error_feedback=True")

    def random_q(self, rows: int, cols: int, like: Tensor) -> Tensor:
        """The next seeded (rows, cols) draw, on `like`'s device and dtype. Drawn on the CPU, as torch's PowerSGD
        does, so that every rank and every device type draws the same numbers."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.random_seed)
        return torch.randn(rows, cols, generator=self._generator, device="cpu").to(like.device, like.dtype)


@dataclasses.dataclass
class _Phase:
    """One bucket between its P all-reduce and its Q all-reduce."""

    bucket: GradBucket
    group: ProcessGroup
    flat: Tensor                    # what the matrices view: the bucket buffer, or batched's padded copy
    matrices: list[Tensor]          # views (n, m) into `flat` (this rank's M)
    ps: list[Tensor]                # views into p_flat
    qs: list[Tensor]
    p_flat: Tensor
    p_work: Work | None             # None when the bucket has no matrix worth compressing
    finish_uncompressed: Callable[[], None]
    input_copy: Tensor | None       # M with error feedback added, for the next error
    result: torch.futures.Future


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with rank-r PowerSGD compression (see Note: PowerSGD in one bucket)."""
    group = state.process_group if state.process_group is not None else bucket.process_group()
    if state.iter < state.start_powerSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return allreduce_hook(group, bucket)
    buffer, index, ranks = bucket.buffer(), bucket.index(), bucket.div_factor()
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        input_copy: Tensor | None = buffer.clone()
    else:
        input_copy = None
    compress, plain = _split(bucket.gradients(), state)
    finish_uncompressed = _reduce_flat(plain, group, ranks)
    matrices = [grad.view(grad.shape[0], -1) for grad in compress]
    qs = _initial_qs(state, index, matrices)
    p_flat = torch.empty(sum(m.shape[0] * q.shape[1] for m, q in zip(matrices, qs)), dtype=buffer.dtype,
                         device=buffer.device)
    ps = _split_flat(p_flat, [(m.shape[0], q.shape[1]) for m, q in zip(matrices, qs)])
    for matrix, q, p in zip(matrices, qs, ps):
        torch.matmul(matrix, q, out=p)
    p_work = all_reduce(p_flat, ReduceOp.SUM, group=group, async_op=True) if matrices else None
    phase = _Phase(bucket, group, buffer, matrices, ps, qs, p_flat, p_work, finish_uncompressed, input_copy,
                   torch.futures.Future())
    return _queue(state, phase)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """PowerSGD of the whole bucket at once: its gradient, zero-padded to a square s x s matrix (s the ceiling
    of the square root of its length), approximated at rank r; every tensor, vectors too, goes through the
    approximation (torch's batched_powerSGD_hook). Cheaper than powerSGD_hook, much less accurate above r = 1
    (the padded square has no low-rank structure to keep); error feedback and warm start as there."""
    group = state.process_group if state.process_group is not None else bucket.process_group()
    if state.iter < state.start_powerSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return allreduce_hook(group, bucket)
    buffer, index = bucket.buffer(), bucket.index()
    side = math.isqrt(buffer.numel() - 1) + 1 if buffer.numel() else 0
    padded = buffer.new_zeros(side * side)
    padded[:buffer.numel()] = buffer
    input_copy: Tensor | None = None
    if state.use_error_feedback:
        if index in state.error_dict:
            padded.add_(state.error_dict[index])
        input_copy = padded.clone()
    matrix = padded.view(side, side)
    qs = _initial_qs(state, index, [matrix])
    p = matrix @ qs[0]
    phase = _Phase(bucket, group, padded, [matrix], [p], qs, p.view(-1),
                   all_reduce(p, ReduceOp.SUM, group=group, async_op=True), lambda: None, input_copy,
                   torch.futures.Future())
    return _queue(state, phase)


def _queue(state: PowerSGDState, phase: _Phase) -> torch.futures.Future:
    """Keep `phase` for the second phase, which the last bucket runs for every bucket in bucket order (see Note:
    PowerSGD collective order); returns the bucket's future."""
    state._pending.append(phase)
    if phase.bucket.is_last():
        pending, state._pending = state._pending, []
        for earlier in pending:
            _second_phase(state, earlier)
        state.iter += 1
    return phase.result


def _split(grads: list[Tensor], state: PowerSGDState) -> tuple[list[Tensor], list[Tensor]]:
    compress, plain = [], []
    for grad in grads:
        if grad.dim() >= 2:
            rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
            rank = min(rows, cols, state.matrix_approximation_rank)
            if rows * cols >= state.min_compression_rate * rank * (rows + cols):
                compress.append(grad)
                continue
        plain.append(grad)
    return compress, plain


def _reduce_flat(tensors: list[Tensor], group: ProcessGroup, ranks: int) -> Callable[[], None]:
    """Start averaging `tensors` exactly in one flat all-reduce; returns the step that writes them back."""
    if not tensors:
        return lambda: None
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors]).div_(ranks)
    work = all_reduce(flat, ReduceOp.SUM, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        for tensor, piece in zip(tensors, _split_flat(flat, [tuple(t.shape) for t in tensors])):
            tensor.copy_(piece)

    return finish


def _initial_qs(state: PowerSGDState, index: int, matrices: list[Tensor]) -> list[Tensor]:
    shapes = [(m.shape[1], min(m.shape[0], m.shape[1], state.matrix_approximation_rank)) for m in matrices]
    memory = state.q_memory.get(index)
    if state.warm_start and memory is not None and [tuple(q.shape) for q in memory] == shapes:
        return memory
    qs = [state.random_q(cols, rank, like=m) for (cols, rank), m in zip(shapes, matrices)]
    for q in qs:
        _orthonormalize_(q, state.orthogonalization_epsilon)
    return qs


def _second_phase(state: PowerSGDState, phase: _Phase) -> None:
    """Orthonormalize the reduced P, compute and reduce Q, and complete the bucket's future when Q arrives."""
    if phase.p_work is None:
        _finish(state, phase, [])
        return
    try:
        phase.p_work.wait()
        for p in phase.ps:
            _orthonormalize_(p, state.orthogonalization_epsilon)
        q_flat = torch.empty(sum(q.numel() for q in phase.qs), dtype=phase.p_flat.dtype, device=phase.p_flat.device)
        new_qs = _split_flat(q_flat, [tuple(q.shape) for q in phase.qs])
        for matrix, p, q in zip(phase.matrices, phase.ps, new_qs):
            torch.matmul(matrix.t(), p, out=q)
        q_work = all_reduce(q_flat, ReduceOp.SUM, group=phase.group, async_op=True)
    except BaseException as error:   # the bucket's waiter re-raises it
        phase.result.set_exception(error)
        return
    state.q_memory[phase.bucket.index()] = new_qs

    def on_q_reduced(future: torch.futures.Future) -> None:
        try:
            future.value()
        except BaseException as error:   # the bucket's waiter re-raises it
            phase.result.set_exception(error)
            return
        _finish(state, phase, new_qs)

    q_work.get_future().then(on_q_reduced)


def _finish(state: PowerSGDState, phase: _Phase, qs: list[Tensor]) -> None:
    """M_avg ~ P Q^T / ranks into the bucket; plain tensors written back; error kept; the future completed."""
    try:
        ranks = phase.bucket.div_factor()
        for matrix, p, q in zip(phase.matrices, phase.ps, qs):
            torch.matmul(p, q.t(), out=matrix)
            matrix.div_(ranks)
        phase.finish_uncompressed()
        if phase.input_copy is not None:
            state.error_dict[phase.bucket.index()] = phase.input_copy.sub_(phase.flat)
        buffer = phase.bucket.buffer()
        if phase.flat is not buffer:                 # batched: the padding is dropped
            buffer.copy_(phase.flat[:buffer.numel()])
        phase.result.set_result(buffer)
    except BaseException as error:   # the bucket's waiter re-raises it
        phase.result.set_exception(error)


def _orthonormalize_(matrix: Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of `matrix`, in place."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        column.div_(column.norm() + epsilon if epsilon else column.norm().clamp_min(1e-30))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_(torch.outer(column, column @ rest))


def _split_flat(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    pieces, offset = [], 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        pieces.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return pieces
