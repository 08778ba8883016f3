"""FSDPParamGroup: the parameters of one `fully_shard` call, communicated together; unshard, reshard, reduce.

Layer: fsdp. The group's collectives run over the shard mesh dim (all-gather, reduce-scatter) and, on an HSDP
mesh, the replicate mesh dim (the gradient all-reduce); a group of the composable `replicate` only all-reduces
its gradients, which it starts as soon as its backward is over. Every method that communicates is collective: every rank
of those groups calls it in the same order, which FSDP's hooks guarantee by running the same model on every rank.

Note: when a group's backward is over
Post-backward reshards the group (frees the unsharded parameters) and reduces its gradients. It runs as soon as
every trainable parameter's gradient has accumulated: every backward node that read a trainable parameter has
run by then, since each contributes to its gradient. A frozen parameter (requires_grad=False, a LoRA base weight)
contributes no gradient, so a node reading it (the input gradient through the base weight) may still be
pending when the adapters' gradients are done. A group with frozen parameters therefore also waits for backward
to pass through its modules: each training forward hooks its inputs, and post-backward waits until every such
forward's input gradients are computed. A forward whose inputs need no gradient (the first layer), or one run
with grad disabled (reentrant activation checkpointing), gives no such signal: the group then waits for the end
of backward, as torch's FSDP2 does for every group.
The same signal lets a group with unused parameters reduced (set_reduce_scatter_unused_params) run post-backward
where no gradient arrives on this rank but does on others, at the same point of backward on every rank, so the
collectives stay in one order. (Autograd runs a ready AccumulateGrad before other ready nodes, so the gradients
that do come have accumulated by the time backward has passed the inputs.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._autograd import HookHandles, after_backward_through, on_grad_accumulated
from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.device_mesh import DeviceMesh
from spmd.fsdp.collectives import (
    AllGather,
    CustomReduce,
    ReduceScatter,
    ReplicaSum,
    add_reduced,
    finish_all_gather,
    predivide_factor,
    start_all_gather,
    start_byte_all_gather,
    start_reduce_scatter,
)
from spmd.fsdp.comm import AllGather as AllGatherComm
from spmd.fsdp.comm import DefaultAllGather, DefaultReduceScatter
from spmd.fsdp.comm import ReduceScatter as ReduceScatterComm
from spmd.fsdp.extension import GatherExtension
from spmd.fsdp.param import FSDPParam, ShardMesh
from spmd.fsdp.policy import MixedPrecisionPolicy
from spmd.fsdp.storage import alloc_storage, free_storage, holds_memory


class GroupState(enum.Enum):
    SHARDED = enum.auto()               # the modules hold the sharded parameters; no unsharded memory is held
    GATHERING = enum.auto()             # an all-gather into the unsharded buffer is in flight (prefetch, async)
    UNSHARDED = enum.auto()             # the modules hold the full parameters (views of the unsharded buffer)
    SHARDED_POST_FORWARD = enum.auto()  # the modules hold the shards; a copy sharded over the smaller post-forward
                                        # group is kept, so backward's all-gather stays within that group


class BackwardState(enum.Enum):
    IDLE = enum.auto()       # no backward has reached the group since its last post-backward
    COMPUTING = enum.auto()  # pre-backward ran: the parameters are unsharded and gradients are accumulating
    REDUCED = enum.auto()    # post-backward ran in this backward: gradients reduced (or held, without sync)


@dataclasses.dataclass(frozen=True)
class PostForwardMesh:
    """reshard_after_forward=int: the group of `size` ranks (consecutive along the shard mesh dim) that keeps the
    parameters sharded between forward and backward, and this rank's position in it."""

    group: ProcessGroup
    size: int
    position: int


@dataclasses.dataclass
class ReduceOptions:
    """How a group's gradients are reduced beyond the defaults: torch's FSDPModule setters (see finish_reduction
    and Note: when a group's backward is over)."""

    requires_all_reduce: bool = True        # HSDP: False keeps the shard group's sums for a later all-reduce
    all_reduce_hook: Callable[[Tensor], None] | None = None
    all_reduce_hook_stream: torch.Stream | None = None
    force_sum: bool = False                 # the hook sees sums, divided after it (else averages, as torch's)
    reduce_unused: bool = False             # reduce-scatter zeros where no gradient arrived on this rank
    in_flight: int = 1                      # reduce-scatters (each holding its input buffer) left in flight


@dataclasses.dataclass(frozen=True)
class GatherLayout:
    """How a group's parameters are gathered (see Note: the flat layouts in collectives.py): `buffered` into the
    group's unsharded buffer, in the group's dtype; `separate`, frozen parameters of another dtype, each into a
    buffer of its own; `extended` through their all-gather extension (extension.py); `aliased`, on a
    replicate-only mesh, not at all: the unsharded parameter is the whole shard itself, where forward needs no
    other dtype or device. Fixed at the group's first all-gather, once the shards are materialised and any
    extension methods patched on."""

    buffered: list[FSDPParam]
    separate: list[FSDPParam]
    extended: list[FSDPParam]
    aliased: list[FSDPParam]

    @property
    def gathers(self) -> bool:
        return bool(self.buffered or self.separate or self.extended)


class PendingReductions:
    """The reduce-scatters of one root's groups still in flight, finished in issue order (shared by the tree)."""

    def __init__(self) -> None:
        self.in_flight: list[tuple[FSDPParamGroup, ReduceScatter]] = []

    def push(self, group: FSDPParamGroup, reduction: ReduceScatter) -> None:
        self.in_flight.append((group, reduction))

    def finish_all(self) -> None:
        self.finish_beyond(0)

    def finish_beyond(self, limit: int) -> None:
        """Finish the oldest reductions until at most `limit` stay in flight."""
        while len(self.in_flight) > limit:
            group, reduction = self.in_flight.pop(0)
            group.finish_reduction(reduction)


class FSDPParamGroup:
    """The parameters of one fully_shard call and their two collectives."""

    def __init__(self, params: list[FSDPParam], shard_mesh: ShardMesh, gather_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, mp_policy: MixedPrecisionPolicy, post_forward_mesh: PostForwardMesh | None,
                 name: str) -> None:
        self.params = params
        self.mp_policy = mp_policy
        self.layout: GatherLayout | None = None               # fixed at the first all-gather
        self._extensions: list[GatherExtension] = []          # the layout's extended parameters', in order
        self._separate: list[Tensor] = []                     # the layout's separate parameters' unsharded buffers
        self.grad_params = [param for param in params if param.requires_grad]   # frozen ones take no reduction
        self.shard_mesh = shard_mesh
        self.device = shard_mesh.device
        mesh: DeviceMesh = shard_mesh.mesh
        # None for a replicate-only mesh: each rank holds whole parameters, a shard group of its own
        self.shard_group: ProcessGroup | None = (None if shard_mesh.shard_mesh_dim is None
                                                 else mesh.get_group(shard_mesh.shard_mesh_dim))
        self.replicate_group: ProcessGroup | None = mesh.get_group(0) if shard_mesh.has_replicas else None
        self.gather_dtype = gather_dtype
        self.reduce_dtype = reduce_dtype
        self.post_forward_mesh = post_forward_mesh
        self.name = name
        self.state = GroupState.SHARDED
        self.backward_state = BackwardState.IDLE
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.divide_factor: float = float(mesh.mesh.numel())   # average over every data-parallel rank
        self.reductions = PendingReductions()                  # replaced by the root's at lazy init
        self.custom_reduce: CustomReduce | None = None         # FSDP1's comm hook, in place of the collectives
        self.all_gather_comm: AllGatherComm = DefaultAllGather()
        self.reduce_scatter_comm: ReduceScatterComm = DefaultReduceScatter()
        self.reduce_scatter_group: ProcessGroup | None = self.shard_group   # or a group of its own, to overlap
        self.unshard_in_backward = True
        self.options = ReduceOptions()
        self._partial: Tensor | None = None                   # HSDP: reduce-scattered sums not yet all-reduced
        self._unsharded: Tensor | None = None                  # parameter-major buffer (see Note: the flat layouts)
        self._gather: AllGather | None = None
        self._post_forward_pieces: Tensor | None = None
        self._awaiting_grads: set[int] = set()
        # with frozen parameters or unused ones reduced (see Note: when a group's backward is over): forwards
        # whose module inputs were hooked, those whose inputs' gradients are still to come, and whether a
        # forward left no way to tell (then: the end of backward)
        self.has_frozen = len(self.grad_params) < len(params)
        self._inputs_seen = 0
        self._inputs_pending = 0
        self._inputs_untracked = False
        self._grad_hooks: HookHandles | None = None
        self._late_grads = False

    def held_tensors(self) -> dict[str, list[Tensor]]:
        """The tensors the group holds right now, by purpose: for memory accounting (spmd.testing.memory)."""
        comm = [] if self._gather is None else [self._gather.input, self._gather.output]
        comm += [t for group, reduction in self.reductions.in_flight if group is self
                 for t in (reduction.input, reduction.output)]
        if self._post_forward_pieces is not None:
            comm.append(self._post_forward_pieces)
        if self._partial is not None:
            comm.append(self._partial)
        unsharded = [] if self._unsharded is None else [self._unsharded]
        unsharded += [t for t in self._separate if holds_memory(t)]
        unsharded += [t for extension in self._extensions for t in extension.held()]
        return {"unsharded parameters": unsharded,
                "unsharded gradients": [g for g in (p.unsharded_grad() for p in self.grad_params) if g is not None],
                "communication buffers": comm}

    # -- unshard / reshard ----------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the full parameters (no-op when they are gathered or on their way). Collective."""
        if self.state is GroupState.SHARDED:
            layout = self._fix_layout()
            if not layout.gathers:
                self._gather = None
            elif layout.separate or layout.extended:
                inputs = [param.padded_piece(self.device) for param in layout.separate]
                inputs += [t for param in layout.extended for t in param.extension_inputs(self.device)]
                self._gather = start_byte_all_gather(layout.buffered, self.gather_dtype, inputs, self.device,
                                                     self.shard_group, self.all_gather_comm)
            else:
                self._gather = start_all_gather(layout.buffered, self.gather_dtype, self.device, self.shard_group,
                                                self.all_gather_comm)
        elif self.state is GroupState.SHARDED_POST_FORWARD:
            assert self._post_forward_pieces is not None and self.post_forward_mesh is not None
            size = self.shard_mesh.group_size // self.post_forward_mesh.size
            self._gather = start_all_gather(self.params, self.gather_dtype, self.device, self.post_forward_mesh.group,
                                            self.all_gather_comm, pieces=self._post_forward_pieces,
                                            piece_numels=[param.padded_numel * size for param in self.params])
            self._post_forward_pieces = None
        else:
            return
        self.state = GroupState.GATHERING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Make the modules hold the full parameters, gathering them first if no all-gather is in flight."""
        if self.state in (GroupState.SHARDED, GroupState.SHARDED_POST_FORWARD):
            self.unshard(async_op=True)
        if self.state is not GroupState.GATHERING:
            return
        if self._gather is not None:
            finish_all_gather(self._gather, self._gather_targets(self._gather))
            self._gather = None
        layout = self._fix_layout()
        for param in layout.extended:
            param.finish_extension_gather()
        # a list, not a generator: every aliased parameter must be (re)made, not only those up to the first new one
        if any([param.alias_shard() for param in layout.aliased]) and self._grad_hooks is not None:
            self._grad_hooks.remove()         # a new shard (to_empty, a load by assignment): hook its alias
            self._grad_hooks = None
        if self._grad_hooks is None:
            self._grad_hooks = on_grad_accumulated([param.unsharded_param for param in self.grad_params],
                                                   self._on_grad_accumulated)
        for param in self.params:
            param.to_unsharded()
        self.state = GroupState.UNSHARDED

    def _fix_layout(self) -> GatherLayout:
        """The group's gather layout, fixed at the first all-gather (see GatherLayout)."""
        if self.layout is None:
            for param in self.params:
                param.bind_extension(self.mp_policy, post_forward_resharding=self.post_forward_mesh is not None)
            aliased = [param for param in self.params if param.extension is None and param.can_alias_shard(self.device)]
            plain = [param for param in self.params if param.extension is None and param not in aliased]
            self.layout = GatherLayout(buffered=[p for p in plain if p.unsharded_dtype == self.gather_dtype],
                                       separate=[p for p in plain if p.unsharded_dtype != self.gather_dtype],
                                       extended=[p for p in self.params if p.extension is not None],
                                       aliased=aliased)
            self._extensions = [param.extension for param in self.params if param.extension is not None]
        return self.layout

    def _gather_targets(self, gather: AllGather) -> list[Tensor]:
        """Where each item of `gather` is copied: each buffered parameter's segment of the unsharded buffer, then
        (a byte gather) each separate parameter's buffer, each extension output and a scratch row for the padding
        (see Note: the flat layouts)."""
        layout = self._fix_layout()
        unsharded = self._allocate_unsharded()
        segments = unsharded.split([param.padded_numel * self.shard_mesh.group_size for param in layout.buffered])
        size = gather.group_size
        if not layout.separate and not layout.extended:
            return [segment.view(size, -1) for segment in segments]
        targets = [segment.view(torch.uint8).view(size, -1) for segment in segments]
        targets += [buffer.view(torch.uint8).view(size, -1) for buffer in self._allocate_separate(layout.separate)]
        for extension in self._extensions:
            targets += extension.output_targets(size, self.device)
        targets.append(torch.empty(size, gather.split_sizes[-1], dtype=torch.uint8, device=self.device))
        return targets

    def reshard(self) -> None:
        """Make the modules hold the shards again and free the unsharded buffer (and any post-forward copy)."""
        if self.state is GroupState.GATHERING:
            self.wait_for_unshard()
        if self.state is GroupState.UNSHARDED:
            for param in self.params:
                param.to_sharded()
            self._free_unsharded()
        self._post_forward_pieces = None
        self.state = GroupState.SHARDED

    def reshard_to_post_forward_mesh(self) -> None:
        """reshard_after_forward=int: keep this rank's piece of the parameters sharded over the smaller post-forward
        group, then free the unsharded buffer."""
        if self.state is GroupState.GATHERING:
            self.wait_for_unshard()
        if self.state is not GroupState.UNSHARDED:
            return
        assert self._unsharded is not None and self.post_forward_mesh is not None
        small = self.post_forward_mesh
        segments = self._unsharded.split([param.padded_numel * self.shard_mesh.group_size
                                          for param in self._fix_layout().buffered])
        with torch.no_grad():
            self._post_forward_pieces = torch.cat([segment.view(small.size, -1)[small.position]
                                                   for segment in segments])
        for param in self.params:
            param.to_sharded()
        self._free_unsharded()
        self.state = GroupState.SHARDED_POST_FORWARD

    def reshard_after_forward(self, policy: bool | int) -> None:
        if policy is True:
            self.reshard()
        elif policy is not False:
            self.reshard_to_post_forward_mesh()

    def _allocate_unsharded(self) -> Tensor:
        plain = self._fix_layout().buffered
        total = sum(param.padded_numel for param in plain) * self.shard_mesh.group_size
        if self._unsharded is None:
            self._unsharded = torch.empty(total, dtype=self.gather_dtype, device=self.device)
            sizes = [param.padded_numel * self.shard_mesh.group_size for param in plain]
            for param, segment in zip(plain, self._unsharded.split(sizes), strict=True):
                param.init_unsharded(segment)
        else:
            alloc_storage(self._unsharded)
        return self._unsharded

    def _allocate_separate(self, params: list[FSDPParam]) -> list[Tensor]:
        """The separate parameters' own unsharded buffers: made (and their parameters made views of them) at the
        first all-gather, their storage re-grown at the next."""
        if not self._separate:
            self._separate = [torch.empty(param.padded_numel * self.shard_mesh.group_size, dtype=param.unsharded_dtype,
                                          device=self.device) for param in params]
            for param, buffer in zip(params, self._separate, strict=True):
                param.init_unsharded(buffer)
        for buffer in self._separate:
            alloc_storage(buffer)
        return self._separate

    def _free_unsharded(self) -> None:
        for buffer in ([] if self._unsharded is None else [self._unsharded]) + self._separate:
            free_storage(buffer)
        for extension in self._extensions:
            extension.free()

    # -- backward -------------------------------------------------------------------------------------------

    def pre_backward(self) -> None:
        """A backward reached the group's outputs: gather the parameters (unless held, or not needed in backward:
        set_unshard_in_backward) and expect gradients."""
        if self.backward_state is BackwardState.IDLE:
            self._awaiting_grads = set(range(len(self.grad_params)))
            self.backward_state = BackwardState.COMPUTING
        if self.unshard_in_backward:
            self.wait_for_unshard()

    @property
    def watches_inputs(self) -> bool:
        """Whether post-backward also waits for backward to pass its modules' inputs (see Note: when a group's
        backward is over)."""
        return self.has_frozen or self.options.reduce_unused

    def expect_input_grads(self, inputs: list[Tensor]) -> None:
        """A training forward of the group's modules took `inputs`: with frozen parameters, post-backward also
        waits for backward to pass through it (see Note: when a group's backward is over)."""
        if not self.watches_inputs:
            return
        if not torch.is_grad_enabled() or after_backward_through(inputs, self._on_input_grads) is None:
            self._inputs_untracked = True
            return
        self._inputs_seen += 1
        self._inputs_pending += 1

    def _on_input_grads(self) -> None:
        self._inputs_pending -= 1
        self._post_backward_if_over()

    def _on_grad_accumulated(self, index: int) -> None:
        if self.backward_state is BackwardState.REDUCED:
            self._late_grads = True          # a nested (reentrant) backward reached a parameter again
            return
        self._awaiting_grads.discard(index)
        self._post_backward_if_over()

    def _post_backward_if_over(self) -> None:
        if self.backward_state is not BackwardState.COMPUTING:
            return
        grads_done = not self._awaiting_grads
        passed = self._inputs_seen > 0 and self._inputs_pending == 0 and not self._inputs_untracked
        if self.has_frozen:                  # frozen parameters may be read until backward has passed
            over = passed and (grads_done or self.options.reduce_unused)
        else:                                # unused parameters reduced: gradients that never come are zeros
            over = grads_done or (self.options.reduce_unused and passed)
        if over:
            self.post_backward()

    def post_backward(self, reduce: bool | None = None) -> None:
        """Every gradient of the group is accumulated: reduce-scatter them (one collective, finished later) if
        `reduce` (by default: unless gradient sync is off), then reshard. Collective when it reduces."""
        if reduce is None:
            reduce = self.requires_gradient_sync
        if self.reshard_after_backward:
            self.reshard()                   # first: the reduction needs the gradients, not the parameters
        if reduce and self.grad_params and (self.options.reduce_unused or
                                            any(param.unsharded_grad() is not None for param in self.grad_params)):
            # bounds memory: by default at most one group's reduction stays in flight
            self.reductions.finish_beyond(self.options.in_flight - 1)
            reduction = start_reduce_scatter(self.grad_params, self.reduce_dtype, self.device,
                                             self.reduce_scatter_group, self.reduce_scatter_comm, self.custom_reduce,
                                             predivide_factor(self.reduce_dtype, self.divide_factor))
            if self.shard_group is not None or reduction.reduced:
                self.reductions.push(self, reduction)
            else:       # nothing was scattered: start the replicas' all-reduce now, overlapping the rest of backward
                reduction.replicas = self._sum_over_replicas(reduction)
                if reduction.replicas is not None:
                    self.reductions.push(self, reduction)
        self._late_grads = False
        self.backward_state = BackwardState.REDUCED

    def finish_reduction(self, reduction: ReduceScatter) -> None:
        """Wait for `reduction`; sum it over the replicas (HSDP, replicate), or with all-reduce off keep adding it up
        for a later one; run the all-reduce hook; divide; add the pieces into the sharded gradients."""
        if reduction.work is not None:
            reduction.work.wait()
        output = reduction.output
        if reduction.reduced:
            add_reduced(reduction.params, output)
            return
        if reduction.replicas is None:
            reduction.replicas = self._sum_over_replicas(reduction)
            if reduction.replicas is None:
                return
        replicas = reduction.replicas
        if replicas.work is not None:
            replicas.work.wait()
        with torch.no_grad():
            hook = self.options.all_reduce_hook
            if hook is not None:
                with self.options.all_reduce_hook_stream or contextlib.nullcontext():
                    hook(output)
            if replicas.remaining != 1:
                output.div_(replicas.remaining)
        add_reduced(reduction.params, output)

    def _sum_over_replicas(self, reduction: ReduceScatter) -> ReplicaSum | None:
        """Start the all-reduce of `reduction`'s output over the replicas (when the mesh has them), after adding
        the sums held from backwards without it; None when all-reduce is off (set_requires_all_reduce(False)):
        the output is then held, to be added to the next one.

        The hook sees what torch's FSDP2 shows it: in float32 and bfloat16, unless sums are forced, torch's
        collectives average, so the output is divided before the all-reduce and the hook; otherwise after
        them."""
        output = reduction.output
        replicas = self.replicate_group is not None and self.replicate_group.size() > 1
        with torch.no_grad():
            if replicas and not self.options.requires_all_reduce:
                self._partial = output if self._partial is None else self._partial.add_(output)
                return None
            if self._partial is not None:
                output.add_(self._partial)
                self._partial = None
            remaining = self.divide_factor / reduction.pre_divided
            if self.options.all_reduce_hook is not None and not self.options.force_sum \
                    and output.dtype in (torch.float32, torch.bfloat16):
                output.div_(remaining)
                remaining = 1.0
            work = None
            if replicas:
                work = all_reduce(output, ReduceOp.SUM, group=self.replicate_group, async_op=True)
        return ReplicaSum(work, remaining)

    def reduce_accumulated(self) -> None:
        """Post-backward now, reducing even with gradient sync off: for gradients accumulated where no hook of
        FSDP's ran (a pipeline's weight half) or with sync off. Then expect the next backward. Collective when
        it reduces."""
        self.post_backward(reduce=True)
        self.reductions.finish_all()
        self.backward_state = BackwardState.IDLE

    def finish_backward(self) -> None:
        """The backward pass ended: reduce what no hook reduced (parameters it never reached, gradients a nested
        backward added late), reshard, and expect the next backward. Collective when it reduces."""
        if self.backward_state is BackwardState.COMPUTING or self._late_grads:
            self.post_backward()
        if self.reshard_after_backward:
            self.reshard()
        self.backward_state = BackwardState.IDLE
        self._inputs_seen = 0
        self._inputs_pending = 0
        self._inputs_untracked = False

    def abandon_iteration(self) -> None:
        """After an exception cut a forward or backward short: wait for this group's collectives in flight, hold
        the shards again, and forget the iteration (unreduced gradients, HSDP sums not all-reduced, backward
        progress). Reductions already added into the sharded gradients stay there."""
        if self._gather is not None and self._gather.work is not None:
            self._gather.work.wait()
        self._gather = None
        if self.state is GroupState.GATHERING:
            self.state = GroupState.SHARDED
            self._free_unsharded()
        self.reshard()
        for param in self.grad_params:
            if param.unsharded_param is not None:
                param.unsharded_param.grad = None
        self._partial = None
        self._awaiting_grads = set()
        self._late_grads = False
        self.backward_state = BackwardState.IDLE
        self._inputs_seen = 0
        self._inputs_pending = 0
        self._inputs_untracked = False

    def drop_post_forward_copy(self) -> None:
        """Forget the post-forward shards (a forward without backward left them; the optimizer may have stepped)."""
        if self.state is GroupState.SHARDED_POST_FORWARD:
            self.reshard()
