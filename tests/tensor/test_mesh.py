"""DeviceMesh: construction, queries, slicing, flattening, group reuse, and the errors for bad meshes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed
import torch.distributed.device_mesh

import spmd
from spmd.comm.world import current_world
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.testing import run_ranks

TIMEOUT = 30


def test_2d_mesh_queries_and_slices() -> None:
    def body(rank: int, world_size: int) -> dict:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        both = mesh["dp", "tp"]
        with pytest.raises(ValueError, match="name the mesh dim"):
            mesh.get_group()
        return {
            "coord": mesh.get_coordinate(), "shape": mesh.shape, "ndim": mesh.ndim, "size": mesh.size(),
            "local": (mesh.get_local_rank("dp"), mesh.get_local_rank(1)),
            "groups": (mesh.get_group("dp").ranks, mesh.get_group("tp").ranks),
            "slices": (dp.mesh.tolist(), tp.mesh.tolist(), both.mesh.tolist(), dp.size(), tp.get_local_rank()),
            "same_groups": dp.get_group() is mesh.get_group(0) and tp.get_group() is mesh.get_group(1),
        }

    results = run_ranks(body, 4, timeout=TIMEOUT)
    assert [r["coord"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]   # tuples, as torch 2.13's
    assert all(r["shape"] == (2, 2) and r["ndim"] == 2 and r["size"] == 4 for r in results)
    assert [r["local"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["groups"] for r in results] == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]),
                                              ([1, 3], [2, 3])]
    assert results[3]["slices"] == ([1, 3], [2, 3], [[0, 1], [2, 3]], 2, 1)
    assert all(r["same_groups"] for r in results)


def test_groups_are_created_once_and_work() -> None:
    def body(rank: int, world_size: int) -> tuple[int, int, float, float]:
        world = current_world()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        after_first = len(world.groups)
        again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _ = again["tp"], again["dp"], mesh["dp", "tp"]
        assert again == mesh and hash(again) == hash(mesh)
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t, group=mesh.get_group("tp"))
        u = torch.tensor([float(rank)])
        spmd.all_reduce(u, group=mesh.get_group("dp"))
        return after_first, len(world.groups), t.item(), u.item()

    results = run_ranks(body, 4, timeout=TIMEOUT)
    # default group + 2 dp rows + 2 tp rows; building the same mesh again and slicing it adds none
    assert all(r[0] == 5 and r[1] == 5 for r in results)
    assert [r[2] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[3] for r in results] == [2.0, 4.0, 2.0, 4.0]


def test_flatten() -> None:
    def body(rank: int, world_size: int) -> tuple:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        groups = len(current_world().groups)
        assert mesh.existing_group() is current_world().default_group       # the whole world
        assert mesh["tp"].existing_group() is mesh.get_group("tp")          # one mesh dim
        assert mesh["dp", "tp"].existing_group() is None                    # none yet, and none created
        assert len(current_world().groups) == groups
        flat = mesh["dp", "tp"].flatten()
        assert mesh["dp", "tp"].existing_group() is flat.get_group()
        assert mesh["dp_tp"] is flat and mesh["dp", "tp"].flatten() is flat     # reachable and idempotent
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t, group=flat.get_group())
        whole = mesh.flatten("all")
        with pytest.raises(ValueError, match="already names"):
            mesh["pp", "dp"].flatten("all")
        return flat.mesh.tolist(), flat.get_local_rank(), t.item(), whole.size()

    results = run_ranks(body, 8, timeout=TIMEOUT)
    assert results[5] == ([4, 5, 6, 7], 1, 22.0, 8)
    assert results[0] == ([0, 1, 2, 3], 0, 6.0, 8)


def test_root_and_concatenate() -> None:
    def body(rank: int, world_size: int) -> tuple:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
        groups = len(current_world().groups)
        assert mesh._get_root_mesh() is mesh and mesh["tp"]._get_root_mesh() is mesh
        assert mesh["rep", "tp"]["tp"]._get_root_mesh() is mesh
        assert DeviceMesh._concatenate([mesh["rep", "shard"], mesh["tp"]]) is mesh     # they cover the root
        dp_tp = DeviceMesh._concatenate([mesh["rep"], mesh["tp"]])
        assert dp_tp is mesh["rep", "tp"] and dp_tp.get_group(1) is mesh.get_group("tp")
        assert len(current_world().groups) == groups                                   # no group made
        flat = mesh["rep", "shard"]._flatten("dp")                  # TorchTitan's flattened data-parallel mesh
        dp_tp = DeviceMesh._concatenate([flat, mesh["tp"]])
        assert dp_tp.mesh_dim_names == ("dp", "tp") and dp_tp.mesh.tolist() == [[0, 1], [2, 3]]
        assert dp_tp.get_group(0) is flat.get_group() and dp_tp.get_group(1) is mesh.get_group("tp")
        assert DeviceMesh._concatenate([flat, mesh["tp"]]) is dp_tp and dp_tp._get_root_mesh() is mesh
        with pytest.raises(ValueError, match="must span distinct dims"):
            DeviceMesh._concatenate([flat, mesh["shard"]])
        with pytest.raises(ValueError, match="must span distinct dims of the root mesh"):
            DeviceMesh._concatenate([mesh["tp"], mesh["rep"]])
        with pytest.raises(ValueError, match="must span distinct dims"):
            DeviceMesh._concatenate([mesh["rep", "tp"], mesh["tp"]])
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="not slices of one mesh"):
            DeviceMesh._concatenate([other["dp"], mesh["tp"]])
        return dp_tp.mesh.tolist(), dp_tp.get_coordinate()

    results = run_ranks(body, 4, timeout=TIMEOUT)
    assert results[3] == ([[0, 1], [2, 3]], (1, 1))
    assert results[0] == ([[0, 1], [2, 3]], (0, 0))


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")   # torch's, about its own future
def test_slices_name_flattened_dims_beside_root_dims_as_torchs_do() -> None:
    """TorchTitan slices its HSDP mesh as world_mesh["dp_replicate", "dp_shard_cp"]; torch's layouts (from its
    meshes in a fake world of 8) are the oracle."""
    def layouts(mesh: object) -> list:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        hsdp, dp_cp = mesh["dp_replicate", "dp_shard_cp"], mesh["dp", "cp"]
        return [hsdp.mesh.tolist(), tuple(hsdp.get_coordinate()), hsdp.mesh_dim_names, dp_cp.mesh.tolist(),
                tuple(dp_cp.get_coordinate())]

    names = ("dp_replicate", "dp_shard", "cp")
    expected = []
    for rank in range(8):
        torch.distributed.init_process_group("fake", rank=rank, world_size=8)
        try:
            expected.append(layouts(torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2, 2),
                                                                                    mesh_dim_names=names)))
        finally:
            torch.distributed.destroy_process_group()

    def body(rank: int, world_size: int) -> list:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
        found = layouts(mesh)
        hsdp = mesh["dp_replicate", "dp_shard_cp"]
        assert hsdp is mesh["dp_replicate", "dp_shard_cp"] and hsdp._get_root_mesh() is mesh
        assert hsdp.get_group(1) is mesh["dp_shard_cp"].get_group()
        assert hsdp.get_group(0) is mesh.get_group("dp_replicate")
        with pytest.raises(KeyError, match="in its order"):
            mesh["dp_shard_cp", "dp_replicate"]
        return found

    assert run_ranks(body, 8, timeout=TIMEOUT) == expected


def test_unflatten_builds_torchtitans_meshes_as_torchs_does() -> None:
    """TorchTitan 0.2 builds every mesh by unflattening a 1-d world mesh (a size-1 dim over the "fake" backend);
    torch's meshes in a fake world of 8 are the oracle."""
    def layouts(world: object) -> list:
        mesh = world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
        flat = mesh["dp", "tp"]._flatten("dp_tp")
        other = world._unflatten(0, (2, 1, 4), ("pp", "cp", "rest"), backend_override={"cp": "fake"})
        return [mesh.mesh.tolist(), tuple(mesh.get_coordinate()), mesh.mesh_dim_names, mesh["dp"].mesh.tolist(),
                mesh["pp", "tp"].mesh.tolist(), flat.mesh.tolist(), other["cp"].mesh.tolist(),
                other["rest"].mesh.tolist()]

    expected = []
    for rank in range(8):
        torch.distributed.init_process_group("fake", rank=rank, world_size=8)
        try:
            expected.append(layouts(torch.distributed.device_mesh.init_device_mesh("cpu", (8,),
                                                                                    mesh_dim_names=("world",))))
        finally:
            torch.distributed.destroy_process_group()

    def body(rank: int, world_size: int) -> list:
        world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        found = layouts(world)
        mesh = world._unflatten("world", (2, 2, 2), ("pp", "dp", "tp"))
        assert mesh._get_root_mesh() is mesh and mesh["tp"].get_group() is mesh.get_group("tp")
        with pytest.raises(ValueError, match="multiply to the 8 ranks"):
            world._unflatten(0, (2, 2), ("a", "b"))
        with pytest.raises(ValueError, match="not among the new dims"):
            world._unflatten(0, (2, 4), ("a", "b"), backend_override={"c": "fake"})
        return found

    assert run_ranks(body, 8, timeout=TIMEOUT) == expected


@pytest.mark.parametrize("shape", [(1,), (2,), (4,)])
def test_1d_meshes(shape: tuple[int, ...]) -> None:
    def body(rank: int, world_size: int) -> tuple:
        mesh = init_device_mesh("cpu", shape)
        return mesh.get_local_rank(), mesh.size(0), mesh.get_group().ranks

    results = run_ranks(body, shape[0], timeout=TIMEOUT)
    assert results == [(r, shape[0], list(range(shape[0]))) for r in range(shape[0])]


def test_mesh_over_some_ranks() -> None:
    def body(rank: int, world_size: int) -> tuple:
        mesh = DeviceMesh("cpu", [1, 3])      # every rank builds it; ranks 0 and 2 are outside
        coordinate = mesh.get_coordinate()
        if coordinate is not None:
            t = torch.tensor([float(rank)])
            spmd.all_reduce(t, group=mesh.get_group())
            return coordinate, t.item()
        with pytest.raises(ValueError, match="not in"):
            mesh.get_local_rank()
        return None, None

    assert run_ranks(body, 4, timeout=TIMEOUT) == [(None, None), ((0,), 4.0), (None, None), ((1,), 4.0)]


def test_bad_meshes_raise_clear_errors() -> None:
    def body(rank: int, world_size: int) -> None:
        with pytest.raises(ValueError, match="holds 6 ranks but the world has 4"):
            init_device_mesh("cpu", (2, 3))
        with pytest.raises(ValueError, match="mesh_dim_names"):
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="unique"):
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))
        with pytest.raises(ValueError, match="device index"):
            init_device_mesh("cpu:0", (4,))
        with pytest.raises(ValueError, match="twice"):
            DeviceMesh("cpu", [0, 0, 1, 2])
        with pytest.raises(ValueError, match="outside the world"):
            DeviceMesh("cpu", [0, 7])
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(KeyError, match="no mesh dim named 'cp'"):
            mesh["cp"]
        with pytest.raises(KeyError, match="mesh's order"):
            mesh["tp", "dp"]
        with pytest.raises(IndexError, match="out of range"):
            mesh.size(2)
        with pytest.raises(KeyError, match="needs mesh_dim_names"):
            init_device_mesh("cpu", (4,))["x"]

    run_ranks(body, 4, timeout=TIMEOUT)


def test_from_group_builds_a_mesh_over_existing_groups_as_torchs_does() -> None:
    """torch's DeviceMesh.from_group: one group (spmd's, or the torch ProcessGroup standing for it) makes the 1-d
    mesh of its ranks; a list, with mesh and names, the mesh whose dims are those groups. No group is created
    (only members call it for a subgroup), DTensors and FSDP2 run on it, and mismatches are named."""
    from spmd.comm import torch_backend
    from spmd.fsdp import fully_shard
    from spmd.tensor import Shard, distribute_tensor

    def body(rank: int, world_size: int) -> dict:
        rows = [spmd.new_group(list(r)) for r in ([0, 1], [2, 3])]
        cols = [spmd.new_group(list(c)) for c in ([0, 2], [1, 3])]
        row, col = rows[rank // 2], cols[rank % 2]
        one = DeviceMesh.from_group(row, "cpu")
        torch_view = DeviceMesh.from_group(torch_backend._group_class_ready()(row), "cpu", mesh_dim_names=("tp",))
        two = DeviceMesh.from_group([col, row], "cpu", mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        full = torch.arange(24.0).reshape(6, 4)
        sharded = distribute_tensor(full, two, [Shard(0), Shard(1)])
        model = torch.nn.Linear(4, 4)
        fully_shard(model, mesh=two["dp"])
        errors = []
        for call in (lambda: DeviceMesh.from_group(row, "cpu", mesh=[0, 2]),
                     lambda: DeviceMesh.from_group([col, row], "cpu", mesh=[[0, 1], [2, 3]]),
                     lambda: DeviceMesh.from_group([row, col], "cpu", mesh=[[0, 1], [2, 3]],
                                                   mesh_dim_names=("dp", "tp"))):
            with pytest.raises(ValueError) as raised:
                call()
            errors.append(str(raised.value))
        return {"one": (one.mesh.tolist(), one.get_group() is row), "view": torch_view.get_group() is row,
                "two": (two.get_group("dp") is col, two.get_group("tp") is row, two.get_coordinate()),
                "full": torch.equal(sharded.full_tensor(), full), "fsdp": model.weight.device_mesh == two["dp"],
                "errors": errors}

    for rank, out in enumerate(run_ranks(body, world_size=4, timeout=TIMEOUT)):
        assert out["one"] == ([0, 1] if rank < 2 else [2, 3], True) and out["view"]
        assert out["two"] == (True, True, (rank // 2, rank % 2)) and out["full"] and out["fsdp"]
        assert "is not the ranks" in out["errors"][0] and "need mesh" in out["errors"][1]
        assert "this rank's row along mesh dim 'dp'" in out["errors"][2]
