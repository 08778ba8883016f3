"""DeviceMesh: an N-d array of global ranks with one process group per mesh dim, and init_device_mesh.

Layer: mesh. Imports only _core and comm.

Note: mesh groups are created once
`new_group` is collective over the WHOLE world: every rank must create every group, in the same order, members
or not. So a mesh creates, for each mesh dim in order, the group of every 1-d row along that dim (all other
coordinates fixed), in row-major order of the other coordinates; each rank keeps the row that contains it.
Groups are remembered per world by their rank list, so building the same mesh again, slicing it, or another
mesh that needs the same rows, creates no new group. A row that is the whole world in order reuses the
default group. All ranks must therefore build the same meshes in the same order (as with torch).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from spmd._core.compile import fx_name
from spmd._core.fake import on_real_tensors
from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.world import (
    AnyGroup,
    World,
    current_world,
    group_named,
    init_process_group,
    is_initialized,
    new_group,
    resolve_group,
)

# Note: mesh groups are created once. One registry per world (per rank), keyed by the group's rank list and
# the backend it was asked for (None: the world's).
_GROUP_REGISTRY: weakref.WeakKeyDictionary[World, dict[tuple[tuple[int, ...], str | None], AnyGroup]] = (
    weakref.WeakKeyDictionary())


def _group_for(ranks: tuple[int, ...], world: World, backend: str | None = None) -> AnyGroup:
    """The group of `ranks` (on `backend`, or the world's), created on first use. Collective over the world
    (see Note: mesh groups...)."""
    group = _existing_group(ranks, world, backend)
    if group is None:
        group = new_group(list(ranks), backend=backend)
        if not isinstance(group, NonMemberGroup) and list(group.ranks) != list(ranks):
            raise ValueError(f"DeviceMesh: a mesh row must list ranks in ascending order; got {list(ranks)}")
        _GROUP_REGISTRY.setdefault(world, {})[(ranks, backend)] = group
    return group


def _existing_group(ranks: tuple[int, ...], world: World, backend: str | None) -> AnyGroup | None:
    """The group of `ranks` if this world has it already (the default group for the whole world), else None."""
    group = _GROUP_REGISTRY.get(world, {}).get((ranks, backend))
    if group is None and ranks == tuple(range(world.world_size)) and backend is None:
        group = world.default_group
    return group


def _rows(mesh: torch.Tensor, mesh_dim: int) -> list[tuple[int, ...]]:
    """Every 1-d row of `mesh` along `mesh_dim`, in row-major order of the other coordinates."""
    moved = mesh.movedim(mesh_dim, -1).reshape(-1, mesh.shape[mesh_dim])
    return [tuple(int(r) for r in row) for row in moved.tolist()]


class DeviceMesh:
    """An N-d array of global ranks (`mesh`) on `device_type`, with one process group per mesh dim.

    Collective to build: every rank of the world constructs the same mesh (see Note: mesh groups are created
    once). A rank not in `mesh` gets `get_coordinate() is None` and no groups. Equal meshes (same ranks, names
    and device type on the same rank) compare equal and share their groups. `backend_override` names, per mesh
    dim, the backend of that dim's groups (None: the world's), as torch's does.
    """

    @on_real_tensors
    def __init__(self, device_type: str, mesh: torch.Tensor | Sequence[Any], *,
                 mesh_dim_names: tuple[str, ...] | None = None,
                 backend_override: tuple[str | None, ...] | None = None, _groups: list[AnyGroup] | None = None,
                 _root: DeviceMesh | None = None) -> None:
        if ":" in device_type:
            raise ValueError(f"DeviceMesh: device_type must not name a device index, got {device_type!r}; "
                             f"pass {device_type.split(':')[0]!r}")
        mesh_tensor = mesh.detach().cpu() if isinstance(mesh, torch.Tensor) else torch.tensor(mesh)
        self.mesh = mesh_tensor.to(torch.int64).contiguous()
        # Attributes, not properties: torch.compile reads a mesh's attributes at compile time but cannot call
        # the properties of an opaque value (Note: meshes in compiled graphs).
        self.ndim: int = self.mesh.ndim
        self.shape: tuple[int, ...] = tuple(self.mesh.shape)
        self.device_type = device_type
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        self._backends = tuple(backend_override) if backend_override is not None else (None,) * self.mesh.ndim
        self._check_names_and_ranks()
        self._world = current_world() if is_initialized() else None
        if self._world is None:
            raise RuntimeError("DeviceMesh: this rank has no process group; call spmd.init_process_group() first "
                               "(or use init_device_mesh, which does it from the environment)")
        flat = self.mesh.reshape(-1).tolist()
        if max(flat) >= self._world.world_size or min(flat) < 0:
            raise ValueError(f"DeviceMesh: mesh {self.mesh.tolist()} names ranks outside the world of size "
                             f"{self._world.world_size}")
        self._root = _root if _root is not None else self
        self._flattened: dict[str, DeviceMesh] = {}
        self._flattened_from: tuple[int, ...] | None = None     # the root dims a flattened mesh merges
        self._unflattened_from: DeviceMesh | None = None          # the mesh whose ranks _unflatten laid out anew
        self._submeshes: dict[tuple[str, ...], DeviceMesh] = {}
        self.dispatch_cache: dict[Any, Any] = {}    # owned by spmd.tensor.dispatch: decisions for this mesh
        rank = self._world.rank
        hits = (self.mesh == rank).nonzero()
        self._coordinate = tuple(int(c) for c in hits[0].tolist()) if len(hits) else None
        self._groups = _groups if _groups is not None else self._create_groups()
        self._key = (device_type, tuple(self.mesh.shape), tuple(flat), self.mesh_dim_names, self._backends,
                     id(self._world))
        self._hash = hash(self._key)

    def _check_names_and_ranks(self) -> None:
        flat = self.mesh.reshape(-1).tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh: mesh {self.mesh.tolist()} lists a rank twice")
        if self.mesh_dim_names is not None:
            if len(self.mesh_dim_names) != self.mesh.ndim:
                raise ValueError(f"DeviceMesh: {len(self.mesh_dim_names)} mesh_dim_names {self.mesh_dim_names} "
                                 f"for a {self.mesh.ndim}-d mesh of shape {tuple(self.mesh.shape)}")
            if len(set(self.mesh_dim_names)) != len(self.mesh_dim_names):
                raise ValueError(f"DeviceMesh: mesh_dim_names {self.mesh_dim_names} must be unique")
        if len(self._backends) != self.mesh.ndim:
            raise ValueError(f"DeviceMesh: backend_override {self._backends} must name one backend (or None) per "
                             f"dim of the {self.mesh.ndim}-d mesh")

    def _create_groups(self) -> list[AnyGroup]:
        """Collective over the world: one group per row of every mesh dim; keep this rank's row's group."""
        assert self._world is not None
        mine: list[AnyGroup] = []
        for mesh_dim in range(self.mesh.ndim):
            found: AnyGroup | None = None
            for row in _rows(self.mesh, mesh_dim):
                group = _group_for(row, self._world, self._backends[mesh_dim])
                if self._world.rank in row:
                    found = group
            mine.append(found if found is not None else NonMemberGroup(f"mesh_dim{mesh_dim}", [], self._world.rank))
        return mine

    @staticmethod
    @on_real_tensors
    def from_group(group: AnyGroup | Sequence[AnyGroup], device_type: str, mesh: torch.Tensor | Sequence[Any] | None
                   = None, *, mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A mesh over groups that exist already (torch's): one group makes the 1-d mesh of its ranks; a list makes
        the mesh `mesh` (required, with `mesh_dim_names`), whose dim i is group i's: this rank's row along dim i must
        be exactly group i's ranks. No group is created, so only the groups' members need to call it. A torch
        ProcessGroup standing for an spmd group (the "spmd" backend's) is taken as that group."""
        several = isinstance(group, (list, tuple))
        groups = [given if isinstance(given, NonMemberGroup) else resolve_group(given, "DeviceMesh.from_group")
                  for given in (group if several else [group])]
        if not groups:
            raise ValueError("DeviceMesh.from_group: pass at least one process group")
        if not several:
            ranks = list(groups[0].ranks)
            if mesh is not None and torch.as_tensor(mesh).tolist() != ranks:
                raise ValueError(f"DeviceMesh.from_group: mesh {torch.as_tensor(mesh).tolist()} is not the ranks "
                                 f"{ranks} of the group; leave mesh out for one group")
            return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _groups=groups)
        if mesh is None or mesh_dim_names is None:
            raise ValueError("DeviceMesh.from_group: several groups need mesh (the ranks' layout) and mesh_dim_names")
        made = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups=groups)
        if made.ndim != len(groups):
            raise ValueError(f"DeviceMesh.from_group: {len(groups)} groups for a {made.ndim}-d mesh {made.shape}")
        coordinate = made.get_coordinate()
        for dim, given in enumerate(groups):
            row = None if coordinate is None else made.mesh[(*coordinate[:dim], slice(None),
                                                             *coordinate[dim + 1:])].tolist()
            if isinstance(given, NonMemberGroup) != (row is None) or (row is not None and row != list(given.ranks)):
                raise ValueError(f"DeviceMesh.from_group on rank {made.get_rank()}: group {dim} has ranks "
                                 f"{list(getattr(given, 'ranks', []))}, but this rank's row along mesh dim "
                                 f"{mesh_dim_names[dim]!r} of {made.mesh.tolist()} is {row}")
        return made

    # -- identity -------------------------------------------------------------------------------------------

    def __hash__(self) -> int:
        return self._hash

    @on_real_tensors
    def __reduce__(self) -> tuple:
        """Pickled as its ranks, names and backends; unpickled with the groups its world already has (see
        _unpickled_mesh), as torch's mesh finds its groups by name."""
        return _unpickled_mesh, (self.device_type, self.mesh.tolist(), self.mesh_dim_names, self._backends)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """How a compiled graph's code names this mesh (see Note: meshes in compiled graphs)."""
        return fx_name(self)

    @on_real_tensors
    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    # -- queries --------------------------------------------------------------------------------------------

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Ranks along `mesh_dim` (index or name), or in the whole mesh with None."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        """This rank's global rank."""
        assert self._world is not None
        return self._world.rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh (a tuple, as torch's), or None for a rank outside it."""
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along `mesh_dim` (= its rank in that dim's group); mesh_dim may be omitted on 1-d."""
        index = self._dim_or_only(mesh_dim, "get_local_rank")
        if self._coordinate is None:
            raise ValueError(f"DeviceMesh.get_local_rank: rank {self.get_rank()} is not in {self}")
        return self._coordinate[index]

    def get_group(self, mesh_dim: int | str | None = None) -> AnyGroup:
        """The process group along `mesh_dim` that contains this rank; mesh_dim may be omitted on a 1-d mesh."""
        return self._groups[self._dim_or_only(mesh_dim, "get_group")]

    def get_all_groups(self) -> list[AnyGroup]:
        return list(self._groups)

    @on_real_tensors
    def existing_group(self) -> AnyGroup | None:
        """A process group of exactly this mesh's ranks that already exists, or None: the group of its only mesh
        dim of size > 1, the default group for a mesh over the whole world, or one `flatten` made. Never creates
        one (that is collective over the whole world), so only this mesh's ranks need to call it."""
        if self._coordinate is None:
            return None
        wide = [d for d in range(self.ndim) if self.mesh.shape[d] > 1]
        if len(wide) <= 1:
            return self._groups[wide[0] if wide else 0]
        assert self._world is not None
        ranks = tuple(sorted(self.mesh.reshape(-1).tolist()))
        if ranks == tuple(range(self._world.world_size)):
            return self._world.default_group
        return _GROUP_REGISTRY.get(self._world, {}).get((ranks, None))

    def _dim_or_only(self, mesh_dim: int | str | None, what: str) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"DeviceMesh.{what}: this mesh has {self.ndim} dims {self.shape}; name the mesh "
                                 f"dim (an index or one of {self.mesh_dim_names})")
            return 0
        return self._dim_index(mesh_dim)

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh: no mesh dim named {mesh_dim!r}; this mesh's dims are named "
                               f"{self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"DeviceMesh: mesh dim {mesh_dim} is out of range for a {self.ndim}-d mesh")
        return mesh_dim % self.ndim

    # -- slicing and flattening -----------------------------------------------------------------------------

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over the named dims that contains this rank (no new groups are created).

        Names must be in this mesh's dim order; a name made by `flatten` on the root mesh also works, alone or
        beside other dims (each flattened name standing where its merged dims are).
        """
        key = (names,) if isinstance(names, str) else tuple(names)
        cached = self._submeshes.get(key)
        if cached is not None:
            return cached
        if self.mesh_dim_names is None:
            raise KeyError("DeviceMesh: slicing needs mesh_dim_names; build the mesh with mesh_dim_names=(...)")
        flattened = self._root._flattened
        if len(key) == 1 and key[0] not in self.mesh_dim_names and key[0] in flattened:
            return flattened[key[0]]
        if any(name not in self.mesh_dim_names and name in flattened for name in key):
            # root dims beside flattened ones (TorchTitan's HSDP mesh: mesh["dp_replicate", "dp_shard_cp"])
            try:
                sub = DeviceMesh._concatenate([self[name] for name in key])
            except ValueError as error:
                raise KeyError(f"DeviceMesh: slice {key}: {error}") from None
            self._submeshes[key] = sub
            return sub
        for name in key:
            if name not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh: no mesh dim named {name!r}; this mesh's dims are {self.mesh_dim_names}"
                               f" (flattened: {sorted(self._root._flattened)})")
        dims = [self.mesh_dim_names.index(name) for name in key]
        if dims != sorted(dims) or len(set(dims)) != len(dims):
            raise KeyError(f"DeviceMesh: slice {key} must name distinct dims in the mesh's order {self.mesh_dim_names}")
        sub = self._sub_mesh(dims, key)
        self._submeshes[key] = sub
        return sub

    @on_real_tensors
    def _sub_mesh(self, dims: list[int], names: tuple[str, ...] | None) -> DeviceMesh:
        """The sub-mesh over `dims` (in order) that contains this rank, sharing this mesh's groups."""
        if self._coordinate is None:
            raise ValueError(f"DeviceMesh: rank {self.get_rank()} is not in {self}, so it has no sub-mesh over "
                             f"{names or dims}")
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        return DeviceMesh(self.device_type, self.mesh[index], mesh_dim_names=names,
                          backend_override=tuple(self._backends[d] for d in dims),
                          _groups=[self._groups[d] for d in dims], _root=self._root)

    @on_real_tensors
    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-d mesh over all of this (sub-)mesh's dims, named `mesh_dim_name` (default "a_b"); idempotent.

        Collective over the world: creates one group per flattened slice of the ROOT mesh (every rank takes
        part). The result is also reachable as `root[mesh_dim_name]`.
        """
        if not self.ndim:
            raise ValueError(f"DeviceMesh.flatten: {self} has no dims to flatten (a 0-d mesh is one rank)")
        name = mesh_dim_name or "_".join(self.mesh_dim_names or (f"dim{d}" for d in range(self.ndim)))
        existing = self._root._flattened.get(name)
        flat_ranks = self.mesh.reshape(-1)
        if existing is not None:
            if self._coordinate is not None and not torch.equal(existing.mesh, flat_ranks):
                raise ValueError(f"DeviceMesh.flatten: {name!r} already names a flattened mesh "
                                 f"{existing.mesh.tolist()}, not {flat_ranks.tolist()}")
            return existing
        root = self._root
        if root.mesh_dim_names is not None and self.mesh_dim_names is not None and root is not self:
            dims = [root.mesh_dim_names.index(n) for n in self.mesh_dim_names]
        else:
            dims = list(range(self.ndim))
        others = [d for d in range(root.ndim) if d not in dims]
        moved = root.mesh.permute(*others, *dims).reshape(-1, flat_ranks.numel())
        assert self._world is not None
        mine: AnyGroup | None = None
        for row in moved.tolist():
            group = _group_for(tuple(int(r) for r in row), self._world)
            if self._world.rank in row:
                mine = group
        flat = DeviceMesh(self.device_type, flat_ranks, mesh_dim_names=(name,),
                          _groups=[mine if mine is not None else NonMemberGroup(name, [], self._world.rank)],
                          _root=root)
        flat._flattened_from = tuple(dims)
        root._flattened[name] = flat
        return flat

    _flatten = flatten    # torch's spelling (DeviceMesh._flatten), for code ported from torch

    @on_real_tensors
    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: dict[str, str | None] | None = None) -> DeviceMesh:
        """This mesh with dim `dim` split, row-major, into dims of `mesh_sizes` named `mesh_dim_names` (their groups'
        backends from `backend_override`, by name): a new mesh over the same ranks, the root of its own slices, as
        torch's `_unflatten` (TorchTitan builds its meshes so from one 1-d world mesh). Collective over the world:
        it creates the new dims' groups (or reuses those of the same ranks)."""
        index = self._dim_index(dim)
        sizes, names = tuple(mesh_sizes), tuple(mesh_dim_names)
        if len(sizes) != len(names) or not sizes:
            raise ValueError(f"DeviceMesh._unflatten: {len(sizes)} mesh_sizes {sizes} for {len(names)} "
                             f"mesh_dim_names {names}; give one name per size")
        if any(not isinstance(size, int) or size < 1 for size in sizes) or math.prod(sizes) != self.shape[index]:
            raise ValueError(f"DeviceMesh._unflatten: mesh_sizes {sizes} must be positive and multiply to the "
                             f"{self.shape[index]} ranks of dim {dim!r} of {self}")
        if self.mesh_dim_names is None and self.ndim > 1:
            raise ValueError("DeviceMesh._unflatten: this mesh's other dims need names; build it with mesh_dim_names")
        overrides = dict(backend_override or {})
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"DeviceMesh._unflatten: backend_override names {unknown}, which are not among the new "
                             f"dims {names}")
        if any(backend is not None and not isinstance(backend, str) for backend in overrides.values()):
            raise TypeError(f"DeviceMesh._unflatten: backend_override values must be backend names, got "
                            f"{overrides}")
        old_names = self.mesh_dim_names or ("",)
        unflattened = DeviceMesh(self.device_type,
                                 self.mesh.reshape(self.shape[:index] + sizes + self.shape[index + 1:]),
                                 mesh_dim_names=old_names[:index] + names + old_names[index + 1:],
                                 backend_override=(*self._backends[:index], *(overrides.get(name) for name in names),
                                                   *self._backends[index + 1:]))
        unflattened._unflattened_from = self._unflattened_from or self
        return unflattened

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced or flattened from (itself for a mesh built directly); torch's name."""
        return self._root

    @staticmethod
    def _concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
        """The mesh over the dims of `meshes`, slices of one root mesh over distinct root dims in the root's order:
        e.g. `_concatenate([mesh["dp"], mesh["tp"]])` is `mesh["dp", "tp"]` (the root itself when they cover it).
        A flattened mesh (`mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`, TorchTitan's data-parallel mesh)
        stands for the root dims it merges, as one dim. No new groups. FSDP over tensor parallelism lays its
        parameters out on it; torch's name."""
        if not meshes:
            raise ValueError("DeviceMesh._concatenate: no meshes given")
        if len({id(mesh._root) for mesh in meshes}) > 1 and all(mesh._root._unflattened_from is not None
                                                                 for mesh in meshes):
            return DeviceMesh._across_unflattenings(meshes)
        root = meshes[0]._root
        names: list[str] = []
        dims: list[int] = []
        for mesh in meshes:
            if mesh._root is not root:
                raise ValueError(f"DeviceMesh._concatenate: {mesh} and {meshes[0]} are not slices of one mesh; "
                                 f"slice both from the same init_device_mesh(..., mesh_dim_names=...) mesh")
            if mesh._flattened_from is not None:
                dims.extend(mesh._flattened_from)
            elif mesh.mesh_dim_names is None or root.mesh_dim_names is None \
                    or not set(mesh.mesh_dim_names) <= set(root.mesh_dim_names):
                raise ValueError(f"DeviceMesh._concatenate: {mesh} is neither a slice of named dims of its root mesh "
                                 f"{root} nor flattened from it")
            else:
                dims.extend(root.mesh_dim_names.index(name) for name in mesh.mesh_dim_names)
            names.extend(mesh.mesh_dim_names or ())
        if len(set(dims)) != len(dims) or dims != sorted(dims):
            raise ValueError(f"DeviceMesh._concatenate: the meshes {names} must span distinct dims of the root mesh "
                             f"{root}, in its order {root.mesh_dim_names}")
        if all(mesh._flattened_from is None for mesh in meshes):
            return root if tuple(names) == root.mesh_dim_names else root[tuple(names)]
        key = ("_concatenate", *names)
        cached = root._submeshes.get(key)
        if cached is None:
            cached = root._submeshes[key] = root._merged(meshes, dims, tuple(names))
        return cached

    @staticmethod
    @on_real_tensors
    def _across_unflattenings(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
        """`_concatenate` of slices of different `_unflatten`s of one mesh (TorchTitan 0.2 takes its tp mesh from
        one and its fsdp mesh from another): each dim of each is a (size, stride) walk over the source mesh's ranks
        in row-major order, so the meshes' dims together lay out this rank's sub-mesh of the source, as torch's
        mesh layouts do; refused where they overlap. No new groups."""
        source = meshes[0]._root._unflattened_from
        assert source is not None
        walks: list[tuple[int, int]] = []      # (size, stride) per dim of the result
        coordinate: list[int] = []             # this rank's index along each
        for mesh in meshes:
            root = mesh._root
            if root._unflattened_from is not source or mesh._coordinate is None:
                raise ValueError(f"DeviceMesh._concatenate: {mesh} is not a slice of an unflattening of {source} "
                                 f"holding this rank")
            strides = [math.prod(root.shape[d + 1:]) for d in range(root.ndim)]
            dims = mesh._flattened_from if mesh._flattened_from is not None else tuple(
                root.mesh_dim_names.index(name) for name in mesh.mesh_dim_names or ())
            if mesh._flattened_from is not None:
                if any(strides[a] != strides[b] * root.shape[b] for a, b in itertools.pairwise(dims)):
                    raise ValueError(f"DeviceMesh._concatenate: {mesh} merges dims of {root} that are not "
                                     f"consecutive in its ranks' order")
                walks.append((mesh.mesh.numel(), strides[dims[-1]]))
            else:
                walks.extend((root.shape[d], strides[d]) for d in dims)
            coordinate.extend(mesh._coordinate)
        flat = source.mesh.reshape(-1)
        base = int((flat == source.get_rank()).nonzero()[0]) - sum(c * stride for c, (_, stride) in
                                                                     zip(coordinate, walks))
        index = torch.full((), base, dtype=torch.int64)
        for size, stride in walks:
            index = index.unsqueeze(-1) + torch.arange(size) * stride
        if index.min() < 0 or index.max() >= flat.numel() or index.unique().numel() != index.numel():
            raise ValueError(f"DeviceMesh._concatenate: the dims of {list(meshes)} overlap in {source}'s ranks")
        names = tuple(name for mesh in meshes for name in mesh.mesh_dim_names or ())
        return DeviceMesh(source.device_type, flat[index], mesh_dim_names=names,
                          backend_override=tuple(backend for mesh in meshes for backend in mesh._backends),
                          _groups=[group for mesh in meshes for group in mesh._groups])

    @on_real_tensors
    def _merged(self, meshes: Sequence[DeviceMesh], dims: list[int], names: tuple[str, ...]) -> DeviceMesh:
        """The root's sub-mesh over `dims` containing this rank, each of `meshes` one dim of it (a flattened one
        its merged dims), with the meshes' own groups."""
        if self._coordinate is None:
            raise ValueError(f"DeviceMesh._concatenate: rank {self.get_rank()} is not in {self}")
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        sizes = [size for mesh in meshes for size in mesh.mesh.shape]      # a flattened mesh is 1-d
        return DeviceMesh(self.device_type, self.mesh[index].reshape(sizes), mesh_dim_names=names,
                          backend_override=tuple(backend for mesh in meshes for backend in mesh._backends),
                          _groups=[group for mesh in meshes for group in mesh._groups], _root=self)

@on_real_tensors
def _unpickled_mesh(device_type: str, ranks: Any, mesh_dim_names: tuple[str, ...] | None,
                    backends: tuple[str | None, ...]) -> DeviceMesh:
    """A DeviceMesh unpickled (torch.load of DTensors) in this rank's world: its groups are the ones the world
    made for the same rows already, so nothing is collective; a row the world has no group for yet is an error
    saying to build the mesh first."""
    if not is_initialized():
        raise RuntimeError(f"torch.load: a DTensor's DeviceMesh({device_type!r}, {ranks}) needs this rank's spmd "
                           f"world: call spmd.init_process_group() and build the mesh before loading")
    world = current_world()
    mesh = torch.tensor(ranks, dtype=torch.int64)
    groups: list[AnyGroup] = []
    for mesh_dim in range(mesh.ndim):
        row = next((row for row in _rows(mesh, mesh_dim) if world.rank in row), None)
        if row is None:
            groups.append(NonMemberGroup(f"mesh_dim{mesh_dim}", [], world.rank))
            continue
        group = _existing_group(row, world, backends[mesh_dim])
        if group is None:
            raise RuntimeError(f"torch.load: a DTensor's DeviceMesh({device_type!r}, {ranks}"
                               f"{f', mesh_dim_names={mesh_dim_names}' if mesh_dim_names else ''}) has no process "
                               f"group for ranks {list(row)} in this world; build the mesh (init_device_mesh) before "
                               f"loading, on every rank, as before saving")
        groups.append(group)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, backend_override=backends, _groups=groups)


torch.serialization.add_safe_globals([_unpickled_mesh])   # torch.load(weights_only=True) of DTensors rebuilds meshes


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                     mesh_dim_names: tuple[str, ...] | None = None,
                     backend_override: dict[int | str, str] | None = None) -> DeviceMesh:
    """Build a DeviceMesh over all ranks of the world, laid out row-major (rank r at the r-th position).

    Collective over the world. Initializes the default process group from the environment first if needed.
    `backend_override` maps mesh dims (by index or name) to the backend of their groups, as torch's does.

    >>> from spmd.testing import run_ranks
    >>> def body(rank, world_size):
    ...     mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ...     return mesh["tp"].size(), mesh.get_local_rank("dp")
    >>> run_ranks(body, world_size=4)
    [(2, 0), (2, 0), (2, 1), (2, 1)]
    """
    shape = tuple(mesh_shape)
    if any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"init_device_mesh: mesh_shape must be positive ints, got {mesh_shape}")
    if not is_initialized():
        init_process_group()
    world = current_world()
    numel = 1
    for size in shape:
        numel *= size
    if numel != world.world_size:
        raise ValueError(f"init_device_mesh: mesh_shape {shape} holds {numel} ranks but the world has "
                         f"{world.world_size} (rank {world.rank}); the mesh must cover every rank")
    return DeviceMesh(device_type, torch.arange(numel).reshape(shape), mesh_dim_names=mesh_dim_names,
                      backend_override=_backend_per_dim(backend_override, len(shape), mesh_dim_names))


def _backend_per_dim(backend_override: dict[int | str, str] | None, ndim: int,
                     mesh_dim_names: tuple[str, ...] | None) -> tuple[str | None, ...] | None:
    """init_device_mesh's `backend_override` (keys: dim indices or names) as one backend or None per dim."""
    if backend_override is None:
        return None
    left = dict(backend_override)
    names = tuple(mesh_dim_names or ())
    per_dim: list[str | None] = []
    for dim in range(ndim):
        name = names[dim] if dim < len(names) else None
        if name is not None and name in left and dim in left:
            raise ValueError(f"init_device_mesh: backend_override names dim {dim} twice (as {dim} and {name!r})")
        backend = left.pop(name) if name is not None and name in left else left.pop(dim, None)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"init_device_mesh: backend_override values must be backend names, got "
                            f"{type(backend).__name__} for dim {dim}")
        per_dim.append(backend)
    if left:
        raise ValueError(f"init_device_mesh: backend_override keys {list(left)} are not dims of the mesh: expected "
                         f"integers in [0, {ndim}) or one of {names}")
    return tuple(per_dim)


def group_of(group: ProcessGroup | DeviceMesh | tuple[DeviceMesh, int] | str, op: str) -> ProcessGroup:
    """The group that torch's group arguments name: a group, a 1-D mesh, (mesh, mesh_dim) or a group's name
    (torch's functional collectives and context-parallel ops take each). `op` starts the error messages."""
    if isinstance(group, ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{op}: a {group.ndim}-D DeviceMesh {tuple(group.shape)} names no single group; pass "
                             f"(mesh, mesh_dim)")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, str):
        return group_named(group, op)
    raise TypeError(f"{op}: group must be a ProcessGroup, a DeviceMesh, (mesh, mesh_dim) or a group name, got "
                    f"{group!r}")


# Note: meshes in compiled graphs
# torch.compile records a DTensor's conversions (from_local, redistribute, to_local) as calls in its graph, and
# their mesh argument must be a value the graph can hold. A mesh is registered with torch as an opaque VALUE: the
# graph bakes it in as a constant (a compiled function specializes on its meshes, guarded by __eq__, as on its
# placements), its queries are answered at compile time, and the graph's generated code names it as
# spmd._core.compile names every such object (Note: objects in compiled graphs).

register_opaque_type(DeviceMesh, typ="value", members={
    name: MemberType.USE_REAL for name in (
        "__eq__", "__hash__", "__getitem__", "device_type", "mesh", "mesh_dim_names", "ndim", "shape", "size",
        "get_rank", "get_coordinate", "get_local_rank", "get_group", "get_all_groups", "flatten",
        "_get_root_mesh")})

class _MeshResources:
    """torch's process-wide `_mesh_resources` registry, for code that asks it for a mesh's root (TorchTitan's
    SimpleFSDP): spmd's meshes know their root themselves."""

    @staticmethod
    def get_root_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
        return device_mesh._get_root_mesh()


_mesh_resources = _MeshResources()

__all__ = ["DeviceMesh", "init_device_mesh"]
