"""FSDPParam: one parameter under FSDP, its two forms (sharded and unsharded) and the transitions between them.

Layer: fsdp. Nothing here communicates; the parameter group moves the bytes (collectives.py) and calls these.

Note: FSDP tensors
A parameter of global shape S, sharded on tensor dim d over the group_size ranks of the shard mesh dim, exists as:
- the sharded parameter: an nn.Parameter DTensor with placements Shard(d) (Replicate() first on an HSDP mesh),
  whose local tensor is this rank's torch.chunk along d. It is what the optimizer steps and what state_dict saves.
- its padded piece: rows_pad = ceil(S[d] / group_size) rows along d (dim d moved to the front), this rank's
  local rows then padding, flattened: `padded_numel` elements. Every rank's piece has the same size, so the
  pieces of a group's parameters, laid end to end, make one all-gather input and one reduce-scatter output.
- the unsharded parameter: a plain nn.Parameter of shape S, a view of this parameter's segment of the group's
  unsharded buffer, where group_size padded pieces lie end to end (rank order): narrowing away the padding and
  moving dim d back gives the full parameter with no copy. The module holds it from the all-gather until the
  reshard, and autograd accumulates its gradient, which the reduce-scatter turns into the sharded gradient.
Under the composable `replicate` the mesh only replicates: the "shard" is the whole parameter, a Replicate()
DTensor (group_size 1, no padding), and the unsharded parameter is a Parameter over the shard's own storage (no
copy, no memory of its own), or, where forward wants another dtype (mixed precision) or device (CPU offload), its
copy as above.
The unsharded parameter object lives as long as the FSDPParam: freeing it frees its group's buffer storage
(resize to 0 bytes) and the next all-gather re-allocates and refills the same storage. So the tensors autograd
saved in forward, views of that storage, hold the right values again once backward's all-gather has run.
A parameter whose local tensor defines an all-gather extension has no segment in that buffer: its extension
makes its all-gather inputs and rebuilds its unsharded parameter (see Note: the extension protocol in
extension.py); the same freeing and refilling in place hold for it.

Note: FSDP over tensor parallelism
A parameter that is already a DTensor on a tensor-parallel mesh (`tp`, a slice of one or more dims of the same
root mesh as the FSDP mesh `dp`, e.g. both sliced from a (dp, tp) mesh, or experts on (ep, etp) of an
(efsdp, ep, etp) mesh) is sharded like a plain one, but what FSDP shards is its TP-LOCAL tensor (this tp
rank's piece): S above is the local shape, padding and pieces are as for a plain parameter. As in torch's FSDP2:
- the unsharded parameter the module sees is a DTensor on the tp mesh with the original TP placements, whose
  local tensor is the view of the group's buffer described above;
- the sharded parameter is a DTensor on the parent mesh (dp dims, then tp): placements (FSDP's, then TP's).
  When TP shards the FSDP shard dim d too (a colwise weight: TP Shard(0), FSDP Shard(0)), this rank holds the dp
  chunk of its tp chunk, which (Shard(d), Shard(d)) would describe the other way round: FSDP's placement is
  then _StridedShard(d, split_factor=number of tp pieces of d over all tp dims) (see Note: strided sharding in
  tensor/placement.py);
- the unsharded gradient arrives as a DTensor on the tp mesh; one whose placements differ from the parameter's
  (Partial for a Replicate weight that saw sequence-sharded activations) is redistributed to them first (a tp
  collective), then its local tensor is reduce-scattered over dp as usual; the sharded gradient is laid out
  like the sharded parameter.
Plain parameters in the same call stay sharded over dp alone (a DTensor on the dp mesh), as in torch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import torch
from torch import Tensor, nn

from spmd.device_mesh import DeviceMesh
from spmd.fsdp.extension import GatherExtension, has_extension
from spmd.fsdp.policy import MixedPrecisionPolicy
from spmd.tensor import DTensor
from spmd.tensor.placement import Placement, Replicate, Shard, _StridedShard
from spmd.tensor.spec import DTensorSpec, contiguous_stride


class ParamState(enum.Enum):
    SHARDED = enum.auto()     # the module holds the sharded DTensor parameter; no unsharded memory is needed
    UNSHARDED = enum.auto()   # the module holds the full parameter (a view of the group's unsharded buffer)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a parameter is registered: `module._parameters[name]` (a tied parameter has several slots)."""

    module: nn.Module
    name: str

    def get(self) -> Tensor | None:
        return self.module._parameters.get(self.name)

    def set(self, param: Tensor) -> None:
        self.module._parameters[self.name] = param


@dataclasses.dataclass(frozen=True)
class ShardMesh:
    """The mesh FSDP shards over: parameters are sharded along its last dim; on a 2-d (replicate, shard) mesh
    (HSDP) they are replicated along the first, and gradients are all-reduced over it. `replicate_only` (the
    composable `replicate`, DDP on FSDP's machinery): a 1-d mesh of replicas, each holding whole parameters, so
    nothing is gathered or scattered and gradients are all-reduced over the mesh."""

    mesh: DeviceMesh
    device: torch.device
    replicate_only: bool = False

    @property
    def shard_mesh_dim(self) -> int | None:
        return None if self.replicate_only else self.mesh.ndim - 1

    @property
    def group_size(self) -> int:
        return 1 if self.replicate_only else self.mesh.size(self.mesh.ndim - 1)

    @property
    def group_rank(self) -> int:
        return 0 if self.replicate_only else self.mesh.get_local_rank(self.mesh.ndim - 1)

    @property
    def is_hybrid(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def has_replicas(self) -> bool:
        """Whether gradients are summed over a replicate mesh dim (HSDP's first dim, or the whole mesh)."""
        return self.is_hybrid or self.replicate_only

    @functools.cached_property
    def dim_mesh(self) -> DeviceMesh:
        """The 1-d mesh of the shard dim that contains this rank (the mesh itself when it is 1-d)."""
        if not self.is_hybrid:
            return self.mesh
        if self.mesh.mesh_dim_names is not None:
            return self.mesh[self.mesh.mesh_dim_names[-1]]
        return self.mesh._sub_mesh([self.mesh.ndim - 1], None)

    def placements(self, shard_dim: int, split_factor: int = 1) -> tuple[Placement, ...]:
        """The placements on this mesh of a parameter sharded on `shard_dim`: a _StridedShard when tensor
        parallelism already split that dim into `split_factor` pieces (see Note: FSDP over tensor parallelism)."""
        if self.replicate_only:
            return (Replicate(),)
        shard = Shard(shard_dim) if split_factor == 1 else _StridedShard(shard_dim, split_factor=split_factor)
        return (Replicate(), shard) if self.is_hybrid else (shard,)


def sharded_spec(shard_mesh: ShardMesh, shard_dim: int, param: Tensor) -> DTensorSpec:
    """The layout of `param`'s sharded form: over the FSDP mesh, or for a tensor-parallel DTensor over the parent
    mesh of the FSDP and tp meshes (see Note: FSDP over tensor parallelism)."""
    if not isinstance(param, DTensor):
        return DTensorSpec(shard_mesh.mesh, shard_mesh.placements(shard_dim), param.shape,
                           contiguous_stride(param.shape), param.dtype)
    tp = param._spec
    mesh = DeviceMesh._concatenate([shard_mesh.mesh, tp.mesh])
    placements = (*shard_mesh.placements(shard_dim, tp.num_shards(shard_dim)), *tp.placements)
    return DTensorSpec(mesh, placements, tp.shape, contiguous_stride(tp.shape), tp.dtype)


class FSDPParam:
    """One managed parameter (see Note: FSDP tensors). `fqn` names it in every error."""

    sharded_param: nn.Parameter
    unsharded_param: nn.Parameter | None

    def __init__(self, param: nn.Parameter, slots: list[Slot], fqn: str, shard_mesh: ShardMesh, shard_dim: int,
                 param_dtype: torch.dtype | None, shard_device: torch.device, pin_memory: bool) -> None:
        self.fqn = fqn
        self.slots = slots
        self.shard_mesh = shard_mesh
        self.shard_dim = shard_dim
        self.shape = param.shape                 # global
        self.orig_dtype = param.dtype
        # mixed precision casts floating-point parameters only, as torch's
        self.unsharded_dtype = param_dtype if param_dtype is not None and param.dtype.is_floating_point else param.dtype
        self.requires_grad = param.requires_grad
        self.shard_device = shard_device
        self.pin_memory = pin_memory
        # a tensor-parallel parameter: its layout on the tp mesh, as the module sees it unsharded
        self.tp_spec: DTensorSpec | None = None
        data: Tensor = param
        if isinstance(param, DTensor):
            self.tp_spec = DTensorSpec(param._spec.mesh, param._spec.placements, param.shape,
                                       contiguous_stride(param.shape), self.unsharded_dtype)
            data = param._local_tensor
        self.unsharded_shape = data.shape        # what FSDP shards and all-gathers (the TP-local shape)
        group_size = shard_mesh.group_size
        self.rows_full = data.shape[shard_dim]
        self.moved_rest = tuple(s for i, s in enumerate(data.shape) if i != shard_dim)   # shape without dim d
        self.rows_pad = -(-self.rows_full // group_size)
        self.padded_numel = self.rows_pad * math.prod(self.moved_rest)
        self.rows_local = max(0, min(self.rows_pad, self.rows_full - self.rows_pad * shard_mesh.group_rank))
        self.spec = sharded_spec(shard_mesh, shard_dim, param)
        self.sharded_param = nn.Parameter(DTensor(self._local_shard_of(data), self.spec),
                                          requires_grad=param.requires_grad)
        self.unsharded_param = None
        self.extension: GatherExtension | None = None
        self.state = ParamState.SHARDED
        for slot in slots:
            slot.set(self.sharded_param)

    # -- the sharded form -----------------------------------------------------------------------------------

    def _local_shard_of(self, param: Tensor) -> Tensor:
        """This rank's rows of `param` (the TP-local tensor of a tensor-parallel parameter) along the shard dim, as
        a new tensor on the shard device (meta stays meta). A tensor subclass (an all-gather extension's, say)
        stays one: its shard is made by its own new_zeros and copy_, as torch's FSDP2 makes it."""
        local_shape = list(self.unsharded_shape)
        local_shape[self.shard_dim] = self.rows_local
        data = param.detach()
        is_subclass = type(data) is not Tensor
        device = data.device if data.device.type == "meta" else self.shard_device
        if is_subclass:
            local = data.new_zeros(local_shape, device=device)
        elif device.type == "meta":
            return torch.empty(local_shape, dtype=param.dtype, device="meta")
        else:
            local = torch.empty(local_shape, dtype=param.dtype, device=device, pin_memory=self.pin_memory)
        if device.type == "meta" or not self.rows_local:
            return local
        if is_subclass:     # its rows through torch.chunk (aten.split), the op quantized weights serve (NF4: no slice)
            local.copy_(torch.chunk(data, self.shard_mesh.group_size, dim=self.shard_dim)[self.shard_mesh.group_rank])
        else:
            start = self.rows_pad * self.shard_mesh.group_rank
            local.copy_(data.narrow(self.shard_dim, min(start, self.rows_full), self.rows_local))
        return local

    @property
    def local_shard(self) -> Tensor:
        return self.sharded_param._local_tensor

    def copy_shard_into(self, piece: Tensor) -> None:
        """Write this rank's rows into `piece`, its padded piece of an all-gather input (padding left as is)."""
        if self.rows_local:
            piece.view(self.rows_pad, *self.moved_rest)[: self.rows_local].copy_(
                self.local_shard.movedim(self.shard_dim, 0), non_blocking=True)

    def padded_piece(self, device: torch.device) -> Tensor:
        """This rank's padded piece as a new flat tensor in the unsharded dtype (padding left unset), for a
        parameter gathered outside the group's buffer."""
        piece = torch.empty(self.padded_numel, dtype=self.unsharded_dtype, device=device)
        self.copy_shard_into(piece)
        return piece

    def reset_sharded_param(self) -> None:
        """Adopt the tensor now in the first slot as the sharded parameter (after `module._apply`, e.g. to_empty,
        or `load_state_dict(assign=True)` replaced it), re-registering it in every slot so tied weights stay tied."""
        current = self.slots[0].get()
        if current is self.sharded_param:
            return
        if not isinstance(current, DTensor) or current._spec.placements != self.spec.placements \
                or current.shape != self.shape or current.device_mesh != self.spec.mesh:
            found = (f"a {type(current).__name__} of shape {tuple(current.shape)}" if current is not None
                     else "nothing")
            raise RuntimeError(f"fully_shard: parameter {self.fqn} should be a {list(self.spec.placements)} DTensor "
                               f"of shape {tuple(self.shape)} on {self.spec.mesh}, but the module holds {found}"
                               f"{'' if not isinstance(current, DTensor) else f' {list(current.placements)}'}; "
                               f"replace parameters "
                               f"before fully_shard, or load sharded DTensors with the same placements")
        if current.dtype != self.orig_dtype:
            raise RuntimeError(f"fully_shard: parameter {self.fqn} changed dtype from {self.orig_dtype} to "
                               f"{current.dtype} after sharding; change dtypes before fully_shard (or use "
                               f"MixedPrecisionPolicy)")
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.requires_grad)
        self.sharded_param = current
        for slot in self.slots:
            slot.set(current)

    # -- the all-gather extension (see Note: the extension protocol in extension.py) --------------------------

    def bind_extension(self, mp_policy: MixedPrecisionPolicy, post_forward_resharding: bool) -> None:
        """Look for an all-gather extension on the local shard (at the first forward, once the shards are
        materialised and any methods patched on); a ValueError for a layout FSDP cannot gather it in."""
        if self.extension is not None or not has_extension(self.local_shard, self.fqn):
            return
        if self.shard_mesh.replicate_only:
            raise ValueError(f"replicate: parameter {self.fqn} has an all-gather extension, which replicate does not "
                             f"run (it gathers nothing); use fully_shard for it")
        if self.shard_dim != 0:
            raise ValueError(f"fully_shard: parameter {self.fqn} has an all-gather extension and is sharded on "
                             f"dim {self.shard_dim}; extensions are gathered along dim 0 (return Shard(0) from "
                             f"shard_placement_fn for it)")
        if post_forward_resharding:
            raise ValueError(f"fully_shard: parameter {self.fqn} has an all-gather extension, which "
                             f"reshard_after_forward=int cannot keep sharded over the smaller group; pass True "
                             f"or False")
        self.extension = GatherExtension(self.fqn, self.slots[0].module, mp_policy)

    def extension_inputs(self, device: torch.device) -> list[Tensor]:
        """The flat all-gather inputs the extension makes of this rank's shard."""
        assert self.extension is not None
        padded = torch.Size((self.rows_pad, *self.moved_rest))
        return self.extension.inputs(self.local_shard, self.shard_mesh.dim_mesh, self.unsharded_shape, padded, device)

    def finish_extension_gather(self) -> None:
        """Build the unsharded parameter from the gathered outputs (the first time) or refill it in place."""
        extension = self.extension
        assert extension is not None
        if self.unsharded_param is not None:
            extension.unsharded(self.local_shard, self.unsharded_dtype, out=self.unsharded_param)
            return
        tensor = extension.unsharded(self.local_shard, self.unsharded_dtype, out=None)
        assert tensor is not None
        full = torch.as_strided(tensor, self.unsharded_shape, contiguous_stride(self.unsharded_shape), 0)
        if self.tp_spec is not None:
            tp = self.tp_spec
            full = DTensor(full, DTensorSpec(tp.mesh, tp.placements, tp.shape, tp.stride, full.dtype))
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)

    # -- the unsharded form ---------------------------------------------------------------------------------

    def init_unsharded(self, segment: Tensor) -> None:
        """Make the unsharded parameter a view of `segment`, this parameter's group_size padded pieces in the
        group's unsharded buffer (see Note: FSDP tensors). Once per FSDPParam."""
        full = segment.view(self.rows_pad * self.shard_mesh.group_size, *self.moved_rest)[: self.rows_full]
        full = full.movedim(0, self.shard_dim)
        if self.tp_spec is not None:      # the TP-local tensor of the DTensor the module sees
            full = DTensor(full, self.tp_spec)
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)

    def can_alias_shard(self, device: torch.device) -> bool:
        """Whether the unsharded parameter may be the shard itself: on a replicate-only mesh, where forward wants
        the shard's dtype and device."""
        return (self.shard_mesh.replicate_only and self.unsharded_dtype == self.orig_dtype
                and self.local_shard.device == device)

    def alias_shard(self) -> bool:
        """Make the unsharded parameter a Parameter over the shard's own storage (see can_alias_shard), unless it
        already is; True when it made a new one."""
        current = self.unsharded_param
        if isinstance(current, DTensor):
            current = current._local_tensor
        if current is not None and current.data_ptr() == self.local_shard.data_ptr():
            return False
        data: Tensor = self.local_shard.detach()
        if self.tp_spec is not None:
            data = DTensor(data, self.tp_spec)
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
        return True

    def to_unsharded(self) -> None:
        self._expect(ParamState.SHARDED)
        assert self.unsharded_param is not None
        self.check_slots_hold(self.sharded_param)
        for slot in self.slots:
            slot.set(self.unsharded_param)
        self.state = ParamState.UNSHARDED

    def to_sharded(self) -> None:
        self._expect(ParamState.UNSHARDED)
        for slot in self.slots:
            slot.set(self.sharded_param)
        self.state = ParamState.SHARDED

    def check_slots_hold(self, expected: Tensor) -> None:
        """Raise when user code replaced the parameter on its module after fully_shard."""
        for slot in self.slots:
            if slot.get() is not expected:
                raise RuntimeError(f"fully_shard: parameter {self.fqn} was replaced on its module "
                                   f"({type(slot.module).__name__}.{slot.name}) after fully_shard; FSDP would "
                                   f"all-gather the old one. Assign parameters before fully_shard, or change "
                                   f"values in place (param.copy_ under torch.no_grad())")

    # -- gradients ------------------------------------------------------------------------------------------

    def unsharded_grad(self) -> Tensor | None:
        """The gradient autograd accumulated on the unsharded parameter (a tp-mesh DTensor for a tensor-parallel
        parameter), or None."""
        return None if self.unsharded_param is None else self.unsharded_param.grad

    def local_unsharded_grad(self) -> Tensor | None:
        """The unsharded gradient as the tensor to reduce-scatter: a tensor-parallel parameter's, redistributed
        to the parameter's TP placements first (collective over the tp mesh when they differ), then its local
        tensor (see Note: FSDP over tensor parallelism)."""
        grad = self.unsharded_grad()
        tp = self.tp_spec
        if grad is None or tp is None:
            return grad
        if not isinstance(grad, DTensor) or grad.device_mesh != tp.mesh:
            found = (f"a DTensor on {grad.device_mesh}" if isinstance(grad, DTensor) else
                     f"a plain {type(grad).__name__}")
            raise RuntimeError(f"fully_shard: the gradient of tensor-parallel parameter {self.fqn} should be a "
                               f"DTensor on {tp.mesh}, like the parameter, but is {found}")
        if grad.placements != tp.placements:
            grad = grad.redistribute(placements=tp.placements)
        return grad._local_tensor

    def copy_grad_into(self, rows: Tensor) -> None:
        """Write the unsharded gradient into `rows`, a (group_size, padded_numel) view of a reduce-scatter input:
        row r gets rank r's padded piece, padding zeroed. A parameter without a gradient contributes zeros."""
        grad = self.local_unsharded_grad()
        pieces = rows.view(rows.shape[0], self.rows_pad, *self.moved_rest)
        if grad is None:
            pieces.zero_()
            return
        moved = grad.movedim(self.shard_dim, 0)                      # (S[d], *rest)
        full_pieces, tail = divmod(self.rows_full, self.rows_pad)
        pieces[:full_pieces].copy_(moved[: full_pieces * self.rows_pad].view(full_pieces, self.rows_pad,
                                                                             *self.moved_rest))
        if full_pieces < pieces.shape[0]:
            pieces[full_pieces:].zero_()
            if tail:
                pieces[full_pieces, :tail].copy_(moved[full_pieces * self.rows_pad:])

    def accumulate_sharded_grad(self, piece: Tensor) -> None:
        """Add this rank's reduced padded piece (flat, any dtype) into the sharded gradient (or set it), then run
        the sharded parameter's post-accumulate-grad hooks."""
        local = piece.view(self.rows_pad, *self.moved_rest)[: self.rows_local].movedim(0, self.shard_dim)
        local = local.contiguous().to(device=self.shard_device, dtype=self.orig_dtype)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = DTensor(local, self.spec)
        else:
            grad._local_tensor.add_(local)
        # the sharded parameter is not in autograd's graph: run its post-accumulate-grad hooks here, once its
        # gradient is reduced, as torch's FSDP2 does (an optimizer stepped in backward, torchtune's way)
        for hook in (getattr(self.sharded_param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(self.sharded_param)

    def _expect(self, *allowed: ParamState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"FSDP parameter {self.fqn}: expected state {[s.name for s in allowed]}, found "
                               f"{self.state.name}")
