"""The interpreter: run one rank's validated program on its stages. The only pipelining module that communicates
(itself, or through the data-parallel wrappers it drives: data_parallel.py).

Layer: pipelining. Each action of the program (actions.py) becomes a stage computation or a point-to-point
operation on the pipeline group (spmd.isend / spmd.irecv). Receives are posted when the program says and
waited on by the computation that consumes them; sends are waited on at the end of the step. That is the
semantics validate.validate_program proved the program against (see its Note: the simulated semantics).
UNSHARD, RESHARD and REDUCE_GRAD drive a data-parallel stage's wrapper (data_parallel.py, Note: data-parallel
stages) and do nothing for plain stages.

Collective: every rank of the pipeline group runs its own program of the same step together.

Note: shapes at the first step
Nobody declares the activations' shapes. The first time a stage sends activations in a mode (training, or
forward-only), the runtime first sends their metadata (count, then dtype, requires_grad and shape of each) on
a tag of its own; the receiving stage takes it at its first RECV_F in that mode, waiting there for it (so the
two ranks exchange their messages in the order the program lists them, which NCCL needs: programs.py, Note:
where receives go), allocates its receive buffers from it, and checks it against its `input_args` if it has
them. Gradients need no metadata: the gradient
of an activation has its shape and dtype, and flows only where the activation requires grad. Later microbatches
and steps must keep those shapes; the sender checks each output and names both stages when one doesn't.

Note: message tags
Every message between stages has its own tag, (microbatch * num_stages + sending stage) * 4 + channel (0
activations, 1 gradients, 2 and 3 metadata length and body), so matching doesn't depend on the order receives
are posted in, only on the (stage, direction, microbatch) the validator matched.

Note: recording a step's timeline
With `record` set, each action of the step is timed on the monotonic clock: when the rank reached it, when it
ended, and how long it waited for receives in between (a computation waiting for its input; the first step's
metadata included). That costs two clock reads per action and one per wait; without `record`, one test per
action. `gather_records` collects every rank's records of the last recorded step (collective); timeline.py
turns them into a report (its Note: the measured report).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spmd.comm.collectives import all_gather
from spmd.comm.group import ProcessGroup
from spmd.comm.p2p import irecv, isend
from spmd.comm.work import Work
from spmd.pipelining.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, ActionKind, B, F, I, W
from spmd.pipelining.data_parallel import DataParallel
from spmd.pipelining.stage import PipelineStage, PipeliningMetadataError, TensorMeta
from spmd.pipelining.timeline import Record

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_ACTIVATION, _GRADIENT, _META_LENGTH, _META_BODY = range(4)


def _encode(metas: tuple[TensorMeta, ...]) -> list[int]:
    words = [len(metas)]
    for meta in metas:
        if meta.dtype not in _DTYPES:
            raise PipeliningMetadataError(f"activations of dtype {meta.dtype} can't travel between stages; "
                                          f"supported: {', '.join(str(d) for d in _DTYPES)}")
        words += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    return words


def _decode(words: list[int]) -> tuple[TensorMeta, ...]:
    metas, at = [], 1
    for _ in range(words[0]):
        dtype, requires_grad, ndim = words[at:at + 3]
        metas.append(TensorMeta(tuple(words[at + 3:at + 3 + ndim]), _DTYPES[dtype], bool(requires_grad)))
        at += 3 + ndim
    return tuple(metas)


@dataclasses.dataclass
class StepInputs:
    """What one step runs on: the microbatches of this rank's inputs, and what to do at the last stage."""

    arg_mbs: list[tuple[Any, ...]]
    kwarg_mbs: list[dict[str, Any]]
    target_mbs: list[Any] | None
    loss_fn: Callable[..., Tensor] | None
    loss_scale: float                       # each microbatch's loss is multiplied by this before its backward
    has_backward: bool
    losses: dict[int, Tensor] = dataclasses.field(default_factory=dict)   # mb -> its loss, unscaled

    @property
    def num_microbatches(self) -> int:
        return len(self.kwarg_mbs)


@dataclasses.dataclass
class _Receive:
    """A posted receive (buffers and their Works), or one waiting for its stage's metadata (`buffers` None)."""

    buffers: list[Tensor] | None = None
    works: list[Work] = dataclasses.field(default_factory=list)


class Runtime:
    """Runs this rank's part of a program on its `stages` (stage index -> stage), placed on group ranks by
    `placement`: `programs[True]` for training steps, `programs[False]` for forward-only ones. Keeps the metadata
    of the first step in each mode (Note: shapes at the first step) from one step to the next."""

    def __init__(self, stages: dict[int, PipelineStage], programs: dict[bool, list[Action]],
                 placement: dict[int, int], group: ProcessGroup) -> None:
        self.stages, self.programs, self.placement, self.group = stages, programs, placement, group
        self.num_stages = len(placement)
        self._data_parallel = {index: DataParallel.of(stage.submod) for index, stage in stages.items()}
        self._meta_mode: dict[tuple[str, int], bool] = {}   # ("in"/"out", stage) -> has_backward when inferred
        self._meta_sent: dict[int, bool] = {}               # stage -> has_backward of the metadata it sent
        # the step in flight:
        self._step = StepInputs([], [], None, None, 1.0, False)
        self._receives: dict[Action, _Receive] = {}          # posted (or metadata-waiting) receives
        self._local: dict[tuple[ActionKind, int, int], tuple[Tensor | None, ...]] = {}   # (F/B, stage, mb) handed
        self._input_grads: dict[tuple[int, int], tuple[Tensor | None, ...]] = {}         # (stage, mb) -> SEND_B's
        self._sends: list[tuple[Work, Tensor]] = []          # sends in flight, with the tensor they read
        self._backwards: dict[int, int] = {}                 # stage -> weight-gradient backwards run so far
        # recording (see Note: recording a step's timeline):
        self.record = False
        self.records: list[Record] = []                      # the last recorded step's, in program order
        self.recorded_mode: bool | None = None               # has_backward of that step
        self._waited = 0.0                                   # seconds the current action has waited

    # -- one step -----------------------------------------------------------------------------------------------

    def run(self, step: StepInputs) -> None:
        """Run the whole program once. Collective over the pipeline group (see the module docstring)."""
        self._step = step
        self._receives, self._local, self._input_grads, self._sends = {}, {}, {}, []
        self._backwards = dict.fromkeys(self.stages, 0)
        for stage in self.stages.values():
            stage.clear_runtime_states()
        records: list[Record] = []
        for position, action in enumerate(self.programs[step.has_backward]):
            try:
                if self.record:
                    self._waited, reached = 0.0, time.monotonic()
                for single in action.computations:
                    self._perform(single)
                if self.record:
                    records.append((position, reached, time.monotonic(), self._waited))
            except Exception as error:
                error.add_note(f"(pipelining: rank {self.group.group_rank} at action {position} ({action}) of "
                               f"its program)")
                raise
        for work, _ in self._sends:                # the tensor stays referenced until its send is done
            work.wait(timeout=self.group.timeout)
        for data_parallel in self._data_parallel.values():
            data_parallel.reduce_grad()            # a program without REDUCE_GRAD leaves the wrappers as they were
        if self._receives:
            raise RuntimeError(f"pipelining: receives {sorted(map(str, self._receives))} were posted but never used")
        if self.record:
            self.records, self.recorded_mode = records, step.has_backward

    def gather_records(self) -> dict[int, list[Record]]:
        """Every rank's records of its last recorded step, by group rank. Collective over the pipeline group."""
        device = next(iter(self.stages.values())).device
        mine = torch.tensor(self.records, dtype=torch.float64, device=device).reshape(-1, 4)
        length = torch.tensor([len(self.records)], dtype=torch.int64, device=device)
        lengths = [torch.empty_like(length) for _ in range(self.group.size())]
        all_gather(lengths, length, group=self.group)
        longest = max(int(n.item()) for n in lengths)
        padded = torch.zeros(longest, 4, dtype=torch.float64, device=device)
        padded[:len(self.records)] = mine
        rows = [torch.empty_like(padded) for _ in range(self.group.size())]
        all_gather(rows, padded, group=self.group)
        return {rank: [(int(p), reached, end, wait) for p, reached, end, wait in table[:int(n.item())].tolist()]
                for rank, (table, n) in enumerate(zip(rows, lengths, strict=True))}

    def _perform(self, action: Action) -> None:
        kind, stage_index, mb = action.kind, action.stage, action.microbatch
        data_parallel = self._data_parallel[stage_index]
        if kind is ActionKind.UNSHARD:
            data_parallel.unshard()
        elif kind is ActionKind.RESHARD:
            data_parallel.reshard()
        elif kind is ActionKind.REDUCE_GRAD:
            data_parallel.reduce_grad()
        if mb is None:                             # the validator checked which kinds have a microbatch
            return
        stage = self.stages[stage_index]
        if kind in (F, B, I, W):
            data_parallel.wait_unsharded()
        if kind is F:
            with data_parallel.forward():
                self._forward(stage, mb)
        elif kind in (B, I, W):
            self._backward_action(stage, kind, mb, data_parallel)
        elif kind is SEND_F:
            self._send_activations(stage, mb)
        elif kind is SEND_B:
            self._send_gradients(stage, mb)
        elif kind in (RECV_F, RECV_B):
            self._receives[action] = self._post(action)

    # -- computations -------------------------------------------------------------------------------------------

    def _backward_action(self, stage: PipelineStage, kind: ActionKind, mb: int, data_parallel: DataParallel) -> None:
        """B, I or W, each between the stage's wrapper's hooks; B and W are told whether they are the stage's last
        weight-computing backward in the step (data_parallel.py, Note: data-parallel stages)."""
        if kind is I:
            data_parallel.before_input_backward()
            self._backward(stage, mb, full=False)
            return
        self._backwards[stage.stage_index] += 1
        last = self._backwards[stage.stage_index] == self._step.num_microbatches
        if kind is W:
            data_parallel.before_weight_backward(last)
            stage.backward_weight_one_chunk(mb)
            data_parallel.after_weight_backward(last)
        else:
            data_parallel.before_backward(last)
            self._backward(stage, mb, full=True)

    def _forward(self, stage: PipelineStage, mb: int) -> None:
        step = self._step
        if stage.is_first:
            args = step.arg_mbs[mb]
        elif (F, stage.stage_index, mb) in self._local:      # from the previous stage, on this rank
            args = self._local.pop((F, stage.stage_index, mb))
        else:
            received = self._wait(Action(stage.stage_index, RECV_F, mb))
            args = tuple(buffer.requires_grad_(meta.requires_grad and step.has_backward)
                         for buffer, meta in zip(received, self._known(stage, "in"), strict=True))
        output = stage.forward_one_chunk(mb, args, step.kwarg_mbs[mb])
        if stage.is_last:
            if step.loss_fn is not None:
                if step.target_mbs is None:
                    raise ValueError(f"stage {stage.stage_index} computes the loss: pass target= to step()")
                step.losses[mb] = step.loss_fn(output, step.target_mbs[mb])
            return
        activations = stage.activations(output)
        self._check_outputs(stage, mb, tuple(map(TensorMeta.of, activations)))
        if self.placement[stage.stage_index + 1] == self.group.group_rank:   # the next stage is here
            self._local[F, stage.stage_index + 1, mb] = tuple(t.detach().requires_grad_(t.requires_grad)
                                                              for t in activations)

    def _check_outputs(self, stage: PipelineStage, mb: int, metas: tuple[TensorMeta, ...]) -> None:
        """Record the outputs' metadata at the first step, check them against it later (Note: shapes at the
        first step)."""
        known = self._known(stage, "out")
        if not known:
            _check_expected(stage, "output_args", stage.expected_outputs, metas, f"microbatch {mb}'s output is")
            stage.outputs_meta = metas
            self._meta_mode["out", stage.stage_index] = self._step.has_backward
        elif len(metas) != len(known) or any(not a.same_data(b) for a, b in zip(metas, known, strict=False)):
            nxt = stage.stage_index + 1
            raise PipeliningMetadataError(
                f"stage {stage.stage_index} (rank {self.group.group_rank}) produced {_listing(metas)} for "
                f"microbatch {mb}, but stage {nxt} (rank {self._peer(nxt)}) was set up at the first step for "
                f"{_listing(known)}; every microbatch of every step must keep the shapes of the first")

    def _backward(self, stage: PipelineStage, mb: int, full: bool) -> None:
        s = stage.stage_index
        loss = output_grads = None
        if stage.is_last:
            loss = self._step.losses[mb] * self._step.loss_scale
            self._step.losses[mb] = self._step.losses[mb].detach()   # the graph goes once backward no longer needs it
        else:
            output_grads = self._local.pop((B, s, mb), None)
            if output_grads is None:
                received = iter(self._wait(Action(s, RECV_B, mb)))
                outputs_meta = self._known(stage, "out")
                output_grads = tuple(next(received) if meta.requires_grad else None for meta in outputs_meta)
        grads = stage.backward_one_chunk(mb, loss=loss, output_grads=output_grads, full_backward=full)
        if stage.is_first:
            return
        if self.placement[s - 1] == self.group.group_rank:
            self._local[B, s - 1, mb] = grads
        else:
            self._input_grads[s, mb] = grads

    # -- communication ------------------------------------------------------------------------------------------

    def _tag(self, sender: int, mb: int, channel: int) -> int:
        return (mb * self.num_stages + sender) * 4 + channel     # see Note: message tags

    def _peer(self, stage: int) -> int:
        return self.placement[stage]

    def _known(self, stage: PipelineStage, side: str) -> tuple[TensorMeta, ...]:
        """The stage's inputs' ("in") or outputs' ("out") metadata for this step's mode; () if not inferred yet."""
        metas = stage.inputs_meta if side == "in" else stage.outputs_meta
        if metas is None or self._meta_mode.get((side, stage.stage_index)) != self._step.has_backward:
            return ()
        return metas

    def _send_activations(self, stage: PipelineStage, mb: int) -> None:
        outputs, _ = stage.fwd_cache[mb]
        dst = self._peer(stage.stage_index + 1)
        if self._meta_sent.get(stage.stage_index) != self._step.has_backward:   # first send in this mode
            words = torch.tensor(_encode(self._known(stage, "out")), dtype=torch.int64, device=stage.device)
            length = torch.tensor([words.numel()], dtype=torch.int64, device=stage.device)
            for tensor, channel in ((length, _META_LENGTH), (words, _META_BODY)):
                self._sends.append((isend(tensor, group=self.group, group_dst=dst,
                                          tag=self._tag(stage.stage_index, 0, channel)), tensor))
            self._meta_sent[stage.stage_index] = self._step.has_backward
        for tensor in outputs:
            tensor = tensor.detach().contiguous()
            self._sends.append((isend(tensor, group=self.group, group_dst=dst,
                                      tag=self._tag(stage.stage_index, mb, _ACTIVATION)), tensor))

    def _send_gradients(self, stage: PipelineStage, mb: int) -> None:
        grads = self._input_grads.pop((stage.stage_index, mb))
        dst = self._peer(stage.stage_index - 1)
        for grad, meta in zip(grads, self._known(stage, "in"), strict=True):
            if not meta.requires_grad:
                continue
            tensor = (torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device) if grad is None
                      else grad.detach().contiguous())
            self._sends.append((isend(tensor, group=self.group, group_dst=dst,
                                      tag=self._tag(stage.stage_index, mb, _GRADIENT)), tensor))

    def _post(self, action: Action) -> _Receive:
        """Post the receive `action`, or leave it waiting for the metadata (Note: shapes at the first step)."""
        stage = self.stages[action.stage]
        if action.kind is RECV_F:
            if not self._known(stage, "in"):
                self._receive_metadata(stage)       # first, as the sender sent it (Note: shapes at the first step)
            metas = self._known(stage, "in")
            sender, channel = action.stage - 1, _ACTIVATION
        else:
            outputs = self._known(stage, "out")
            if not outputs:
                return _Receive()
            metas = tuple(m for m in outputs if m.requires_grad)
            sender, channel = action.stage + 1, _GRADIENT
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=stage.device) for m in metas]
        tag = self._tag(sender, action.microbatch or 0, channel)
        return _Receive(buffers, [irecv(b, group=self.group, group_src=self._peer(sender), tag=tag)
                                  for b in buffers])

    def _wait(self, action: Action) -> list[Tensor]:
        """The tensors of the receive `action`, once they are here."""
        waiting = time.monotonic() if self.record else 0.0
        receive = self._receives.pop(action)
        if receive.buffers is None:
            receive = self._post(action)
        for work in receive.works:
            work.wait(timeout=self.group.timeout)
        if self.record:
            self._waited += time.monotonic() - waiting
        assert receive.buffers is not None
        return receive.buffers

    def _receive_metadata(self, stage: PipelineStage) -> None:
        if self._known(stage, "in"):
            return
        src = self._peer(stage.stage_index - 1)
        length = torch.zeros(1, dtype=torch.int64, device=stage.device)
        irecv(length, group=self.group, group_src=src,
              tag=self._tag(stage.stage_index - 1, 0, _META_LENGTH)).wait(timeout=self.group.timeout)
        words = torch.zeros(int(length.item()), dtype=torch.int64, device=stage.device)
        irecv(words, group=self.group, group_src=src,
              tag=self._tag(stage.stage_index - 1, 0, _META_BODY)).wait(timeout=self.group.timeout)
        metas = _decode(words.tolist())
        _check_expected(stage, "input_args", stage.expected_inputs, metas,
                        f"stage {stage.stage_index - 1} (rank {src}) sends")
        stage.inputs_meta = metas
        self._meta_mode["in", stage.stage_index] = self._step.has_backward


def _listing(metas: tuple[TensorMeta, ...]) -> str:
    return ", ".join(f"[{i}] {m}" for i, m in enumerate(metas)) or "nothing"


def _check_expected(stage: PipelineStage, what: str, expected: tuple[TensorMeta, ...] | None,
                    found: tuple[TensorMeta, ...], source: str) -> None:
    if expected is None:
        return
    if len(expected) != len(found) or any(not a.same_data(b) for a, b in zip(expected, found, strict=False)):
        raise PipeliningMetadataError(
            f"stage {stage.stage_index} (rank {stage.group_rank}) was built with {what} {_listing(expected)}, "
            f"but {source} {_listing(found)}; fix {what} or the stage boundaries")
